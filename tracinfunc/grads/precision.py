"""Mixed precision: the forward under ``torch.autocast``, gradients and sums in float32.

Autocast runs matmuls and convolutions in a 16-bit dtype while parameters stay float32, so
per-example gradients come out in the parameters' dtype and projection and accumulation stay
in float32. Only the forward runs under autocast; the backward (``torch.func.grad``/``vjp``)
runs outside it, as PyTorch recommends. Whether a device supports a dtype is asked of torch
itself (see :func:`autocast_supported`), never assumed: in torch 2.13 CPU autocast accepts
bfloat16 and float16, CUDA accepts float16 and bfloat16 where the GPU has it.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import grad
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from tracinfunc._validate import current_caller
from tracinfunc.batches import has_no_examples
from tracinfunc.errors import InvalidTypeError, UnsupportedPrecisionError

__all__ = ["NormsInFloat32", "autocast_supported", "check_mixed_precision", "loss_scale",
           "loss_scaled_grad", "loss_scaled_rows", "mixed_precision_context",
           "with_mixed_precision"]

# float16 flushes backward signals below 2**-24 to zero: an example with a loss near 0 gets
# an all-zero gradient (measured: max relative error 1 on confident, correctly classified
# examples). Each example's loss is scaled by 2**e, e = clamp(floor(-log2 |loss|), 0, 14),
# so its logit gradients stay near those of a loss-1 example; a static scale cannot serve
# both ends (measured: 2**10 still flushes some, 2**12 overflows wrong confident examples).
# Not above 14: CUDA's log-softmax backward holds the loss's cotangent (the scale) in float16,
# so a cap of 2**24 (tried first) became inf there and every signal NaN (first GPU run,
# 2026-11-26; the CPU kernel keeps it in float32 and hid this). The price: a loss that reads
# exactly 0 in float32 (a cross-entropy margin above ~17) keeps gradients under 1e-8 that
# float16 flushes to zero; bfloat16 keeps float32's range for those.
_MAX_LOSS_SCALE_EXPONENT = 14
# The third attempt scales a large loss down to ~1 (its gradient above 65504 otherwise
# overflows the float16 backward); 2**-24 covers losses up to ~1.7e7 (float16 itself
# stops at 65504, so a loss that large comes from a float32 criterion). 2**-24 is float16's
# smallest subnormal: a cotangent held in float16 (CUDA, above) still holds it exactly.
_MIN_DOWN_SCALE_EXPONENT = 24

# Normalisation layers whose per-example backward fails when autocast hands them 16-bit
# inputs with float32 weights ("expected scalar type Half but found Float"; LayerNorm and
# BatchNorm, CPU and CUDA). Autocast's own policy computes norms in float32 on CUDA.
_NORMS = frozenset(getattr(F, name) for name in (
    "layer_norm", "batch_norm", "group_norm", "instance_norm", "rms_norm", "local_response_norm")
    if hasattr(F, name))


def check_mixed_precision(mixed_precision: Any) -> torch.dtype | None:
    """Validate the ``mixed_precision`` option: ``None`` or a floating ``torch.dtype``.

    Device support is checked later, when the device is known (:func:`mixed_precision_context`).
    """
    if mixed_precision is None:
        return None
    if not isinstance(mixed_precision, torch.dtype) or not mixed_precision.is_floating_point:
        raise InvalidTypeError(
            f"{current_caller()}: mixed_precision must be None, torch.bfloat16 or torch.float16, "
            f"got {mixed_precision!r}; e.g. mixed_precision=torch.bfloat16."
        )
    return mixed_precision


@functools.cache
def autocast_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.autocast(device_type, dtype=dtype)`` really enables autocast here.

    Torch answers unsupported combinations by warning and disabling autocast (CPU) or by
    raising (CUDA without bfloat16); both count as unsupported. The probe is cached: the
    answer depends only on the torch build and the device.
    """
    is_available = getattr(torch.amp, "is_autocast_available", None)
    if is_available is not None and not is_available(device_type):
        return False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autocast(device_type, dtype=dtype):
                enabled = torch.is_autocast_enabled(device_type)
        except (RuntimeError, ValueError):
            return False
    disabled = any("not supported" in str(w.message) for w in caught)
    return bool(enabled) and not disabled


def mixed_precision_context(
    mixed_precision: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``device`` in ``mixed_precision`` (a no-op context for ``None``).

    Raises:
        UnsupportedPrecisionError: autocast on ``device`` does not support the dtype.
    """
    if mixed_precision is None:
        return contextlib.nullcontext()
    if not autocast_supported(device.type, mixed_precision):
        supported = [str(d) for d in (torch.bfloat16, torch.float16)
                     if autocast_supported(device.type, d)]
        raise UnsupportedPrecisionError(
            f"{current_caller()}: autocast on device {device.type!r} does not support "
            f"mixed_precision={mixed_precision} in torch {torch.__version__}; this device "
            f"supports {supported or 'no autocast dtype'}. Pass one of those, or "
            "mixed_precision=None for full precision."
        )
    return torch.autocast(device.type, dtype=mixed_precision)


def with_mixed_precision(
    fn: Callable[..., Any], mixed_precision: torch.dtype | None, device: torch.device
) -> Callable[..., Any]:
    """``fn`` whose body runs under autocast, so a ``grad`` of it differentiates outside it."""
    if mixed_precision is None:
        return fn
    mixed_precision_context(mixed_precision, device)  # fail now, not inside vmap

    def autocast_fn(*args: Any) -> Any:
        # A fresh context per call: torch.autocast objects keep state and are not re-entrant.
        with torch.autocast(device.type, dtype=mixed_precision), NormsInFloat32(device.type):
            return fn(*args)

    return autocast_fn


class NormsInFloat32(TorchFunctionMode):
    """Run normalisation layers (``F.layer_norm``, ``F.batch_norm``, ...) in float32 under
    autocast: their floating inputs are upcast and autocast is off inside, so the output
    is float32 as autocast's float32 policy gives it, and the next matmul casts it down."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self._device_type = device_type

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func not in _NORMS:
            return func(*args, **kwargs)
        args = [_float32(a) for a in args]
        kwargs = {key: _float32(value) for key, value in kwargs.items()}
        with torch.autocast(self._device_type, enabled=False):
            return func(*args, **kwargs)


def _float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    return value


def loss_scaled_grad(fn: Callable[..., Any], *, has_aux: bool,
                     mixed_precision: torch.dtype | None, scaling: str = "up"
                     ) -> Callable[..., Any]:
    """``torch.func.grad(fn, has_aux=has_aux)``, with per-example loss scaling in float16.

    The loss is multiplied by a power of two before the backward and the gradients divided
    by it after, both exact in float32, so only the float16 backward sees other magnitudes.
    ``scaling`` picks the power (:func:`loss_scale`): ``"up"`` (the first attempt),
    ``"none"`` or ``"down"`` (the retries of :func:`loss_scaled_rows`).
    """
    if mixed_precision != torch.float16 or scaling == "none":
        return grad(fn, has_aux=has_aux)

    def scaled_loss(*args: Any) -> Any:
        out = fn(*args)
        loss, aux = out if has_aux else (out, ())
        scale = loss_scale(loss.detach(), scaling)
        return loss.float() * scale, (scale, aux)

    scaled_grad = grad(scaled_loss, has_aux=True)

    def unscaled(*args: Any) -> Any:
        grads, (scale, aux) = scaled_grad(*args)
        grads = tree_map(lambda g: g / scale.to(g.dtype), grads)
        return (grads, aux) if has_aux else grads

    return unscaled


def loss_scaled_rows(run: Callable[[Any, str], Any], batch: Any, *,
                     mixed_precision: torch.dtype | None, has_aux: bool) -> Any:
    """``run(batch, scaling)`` with float16 loss scaling and up to two retries per example.

    1. ``"up"``: every loss scaled by ``2**e``, ``e = clamp(floor(-log2 |loss|), 0, 14)``;
    2. examples whose rows are not finite (a loss near 0 with an O(1) gradient overflows
       the scaled backward, e.g. a signed residual): again with ``"none"``, the plain
       float16 backward;
    3. examples still not finite (a gradient above float16's 65504, from a large loss):
       again with ``"down"``, ``e = clamp(floor(-log2 |loss|), -24, 0)``, so the float16
       backward sees ``loss * 2**e ~ 1`` and the gradient is scaled back in float32.

    Rows finite at one step are never recomputed, so they do not depend on their
    neighbours. Rows still not finite after step 3 (a NaN input, a loss that overflows in
    the forward) are left so: the caller's own checks name them. Other dtypes, and an empty
    batch, run once without scaling.

    Args:
        run: ``run(examples, scaling) -> rows`` (see :func:`_retry_rows`).
        batch: The examples, every tensor leaf ``[b, ...]``.
    """
    if mixed_precision != torch.float16 or has_no_examples(batch):
        return run(batch, "none")  # vmap cannot return the scale's aux over 0 examples
    result = run(batch, "up")
    for scaling in ("none", "down"):
        result = _retry_rows(result, functools.partial(run, scaling=scaling), batch,
                             has_aux=has_aux)
    return result


def _retry_rows(result: Any, recompute: Callable[[Any], Any], batch: Any, *,
                has_aux: bool) -> Any:
    """``result`` with its non-finite examples recomputed by ``recompute(sub_batch)``.

    One step of :func:`loss_scaled_rows`: one check per batch; the recomputation runs only
    when some row is not finite.

    Args:
        result: ``[b, k]`` rows, or ``{name: [b, *shape]}``; with ``has_aux``, ``(that, aux)``
            (aux is kept from the first pass: the forward does not depend on the scale).
        recompute: The same batched computation with another scaling, on a sub-batch.
        batch: The examples, every tensor leaf ``[b, ...]``.
    """
    rows, aux = result if has_aux else (result, None)
    leaves = list(rows.values()) if isinstance(rows, dict) else [rows]
    finite = torch.stack([torch.isfinite(leaf.reshape(leaf.shape[0], -1)).all(1)
                          for leaf in leaves]).all(0)  # [b]
    if bool(finite.all()):
        return result
    index = (~finite).nonzero().squeeze(1)  # [n_bad]
    sub_batch = tree_map(lambda leaf: leaf[index.to(leaf.device)]
                         if isinstance(leaf, torch.Tensor) else leaf, batch)
    again = recompute(sub_batch)
    again = again[0] if has_aux else again
    if isinstance(rows, dict):
        rows = {name: value.index_copy(0, index.to(value.device), again[name])
                for name, value in rows.items()}
    else:
        rows = rows.index_copy(0, index.to(rows.device), again)
    return (rows, aux) if has_aux else rows


def loss_scale(loss: torch.Tensor, scaling: str) -> torch.Tensor:
    """The power of two each loss is multiplied by, float32, ``loss``'s shape.

    ``"up"``: ``2**clamp(floor(-log2 |loss|), 0, 14)`` (small losses, whose float16
    backward signals would flush to zero); ``"down"``: ``2**clamp(floor(-log2 |loss|),
    -24, 0)`` (large losses, whose gradients may exceed float16's range; 1 for a NaN loss).
    """
    magnitude = loss.float().abs()
    if scaling == "down":
        exponent = torch.floor(-torch.log2(magnitude)).nan_to_num(nan=0.0)
        return torch.exp2(exponent.clamp(-_MIN_DOWN_SCALE_EXPONENT, 0))
    tiny = 2.0 ** -_MAX_LOSS_SCALE_EXPONENT
    exponent = torch.floor(-torch.log2(magnitude.clamp_min(tiny)))
    return torch.exp2(exponent.clamp(0, _MAX_LOSS_SCALE_EXPONENT))
