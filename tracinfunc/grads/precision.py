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

from tracinfunc._validate import current_caller
from tracinfunc.errors import InvalidTypeError, UnsupportedPrecisionError

__all__ = ["autocast_supported", "check_mixed_precision", "mixed_precision_context",
           "with_mixed_precision"]


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
        with torch.autocast(device.type, dtype=mixed_precision):
            return fn(*args)

    return autocast_fn
