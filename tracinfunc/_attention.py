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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["math_attention"]

_FUSED = F.scaled_dot_product_attention  # the public entry point every caller goes through
_MATH = torch.ops.aten._scaled_dot_product_attention_math.default


def _math_sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> Tensor:
    """``scaled_dot_product_attention`` as its math backend computes it, `[..., L, Ev]`."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # True: take part
        # zeros_like, as torch's own conversion: batched under vmap as the mask is
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(
            attn_mask.logical_not(), float("-inf"))
    return _MATH(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                 enable_gqa=enable_gqa)[0]


class _MathAttention(TorchFunctionMode):
    """Every other function passes through unchanged (the mode is off inside the handler)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _FUSED:
            return _math_sdpa(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def math_attention() -> TorchFunctionMode:
    """A context in which this thread's ``scaled_dot_product_attention`` takes the math
    kernel (which has batching rules); other threads and the global SDPA flags are untouched.

    Example:
        >>> with math_attention():
        ...     out = torch.func.vmap(model_loss)(batch)  # no per-example fallback
    """
    return _MathAttention()
