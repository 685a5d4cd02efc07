"""Attention through PyTorch's math kernel, in the calling thread only.

Under ``vmap`` the fused kernels of ``scaled_dot_product_attention`` (CPU flash, CUDA
flash / memory-efficient / cuDNN) have no batching rule: functorch warns on every call and
runs them example by example. The math kernel is composite (matmuls and a softmax), so it
batches. ``torch.nn.attention.sdpa_kernel([SDPBackend.MATH])`` would choose it by setting
*process-global* flags: while it is active every other thread's attention takes the math
kernel too (slower, and ``[T, T]`` scores in memory on a GPU), and two overlapping uses in two
threads restore each other's saved flags out of order, which leaves the fused kernels off for
the rest of the process. :func:`math_attention` touches no flag: a ``TorchFunctionMode``
(its stack is thread-local) sends this thread's calls to the operator the math backend runs,
``aten::_scaled_dot_product_attention_math``, with a boolean mask turned into an additive one
as ``scaled_dot_product_attention`` does first: the same values, bit for bit.

Two exceptions: a mode is off while its handler runs a function, so the attention call inside
``F.multi_head_attention_forward`` (``nn.MultiheadAttention`` with ``need_weights=False``, as
``nn.TransformerEncoderLayer`` calls it), a Python function, cannot be redirected; and a
tensor subclass among the arguments (``torch.nn.attention.bias.CausalBias``, a nested tensor)
has its own meaning that the plain math operator would ignore. Such a call alone runs under
``sdpa_kernel([SDPBackend.MATH])``, entered by the first such call in the process and left by
the last one still running (a lock and a count), so overlapping calls never restore each
other's flags; while it runs, other threads see the math kernel chosen.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends, _sdpa_kernel
from torch.overrides import TorchFunctionMode

__all__ = ["math_attention"]

_FUSED = F.scaled_dot_product_attention  # the public entry point every caller goes through
_MATH = torch.ops.aten._scaled_dot_product_attention_math.default
_MULTI_HEAD = F.multi_head_attention_forward  # Python: its inner SDPA call escapes the mode
_SHARED = threading.Lock()
_HOLDERS: list = []  # [count, flags before, flags set] while a multi-head call runs


def _math_sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> Tensor:
    """``scaled_dot_product_attention`` as its math backend computes it, `[..., L, Ev]`."""
    device = query.device.type
    if torch.is_autocast_enabled(device):  # SDPA is on autocast's lower-precision list
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t.to(dtype) if t.is_floating_point() else t
                             for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(dtype)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # True: take part
        # zeros_like, as torch's own conversion: batched under vmap as the mask is
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(
            attn_mask.logical_not(), float("-inf"))
    # enable_gqa only when asked: the operator has no such argument before torch 2.5 (the
    # library supports 2.4), where no caller can pass it either
    extra = {"enable_gqa": True} if enable_gqa else {}
    return _MATH(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **extra)[0]


class _MathAttention(TorchFunctionMode):
    """Every other function passes through unchanged (the mode is off inside the handler)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _FUSED and _plain_tensors(args, kwargs):
            return _math_sdpa(*args, **kwargs)
        if func is _FUSED or func is _MULTI_HEAD:  # a subclass's own handling (CausalBias)
            with _process_math_kernel():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _plain_tensors(args: tuple, kwargs: dict) -> bool:
    """No tensor subclass (``CausalBias``, nested tensors) that handles attention itself."""
    return all(type(x) is Tensor and not x.is_nested
               for x in (*args, *kwargs.values()) if isinstance(x, Tensor))


@contextlib.contextmanager
def _process_math_kernel() -> Iterator[None]:
    """The math kernel through the global SDPA flags, shared by overlapping callers in any
    thread: the first entry sets them, the last exit restores what was there before, unless
    someone changed them meanwhile (a user's own ``sdpa_kernel`` left in between, or an
    ``enable_*_sdp`` call): then their setting stays. A change to a value the window had set
    already (e.g. flash off) cannot be told apart, and is undone (docs/language-models.md)."""
    with _SHARED:
        if not _HOLDERS:
            before = _cur_sdpa_kernel_backends()
            _sdpa_kernel([SDPBackend.MATH])
            _HOLDERS.extend([0, before, _cur_sdpa_kernel_backends()])
        _HOLDERS[0] += 1
    try:
        yield
    finally:
        with _SHARED:
            _HOLDERS[0] -= 1
            if _HOLDERS[0] == 0:
                _, before, ours = _HOLDERS
                if set(_cur_sdpa_kernel_backends()) == set(ours):
                    _sdpa_kernel(before)
                _HOLDERS.clear()


def math_attention() -> TorchFunctionMode:
    """A context in which this thread's ``scaled_dot_product_attention`` takes the math
    kernel (which has batching rules); other threads and the global SDPA flags are untouched.

    Example:
        >>> with math_attention():
        ...     out = torch.func.vmap(model_loss)(batch)  # no per-example fallback
    """
    return _MathAttention()
