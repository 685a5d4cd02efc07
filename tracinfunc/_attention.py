"""Attention under tracinfunc's ``vmap``s, in the calling thread only: a fused kernel on the
folded batch where only ``vmap`` is active, else PyTorch's math kernel.

Under ``vmap`` the fused kernels of ``scaled_dot_product_attention`` (CPU flash, CUDA
flash / memory-efficient / cuDNN) have no batching rule: functorch warns on every call and
runs them example by example. Attention treats every leading index independently, so where
every active transform is a ``vmap`` (``vmap(loss)`` followed by one ordinary backward, as the
batched kronecker path runs a hand-written loss) the call is made once on ``[B * N, H, L, E]``
by the fused kernel a batched forward would use (:class:`_FoldedAttention`, a ``vmap`` rule
for ``autograd.Function``); ordinary autograd then records the kernel's own backward. Under
``grad`` or ``jvp`` inside the ``vmap`` (``vmap(grad(loss))``), with dropout, or for inputs
that are not 4-D, the math kernel runs instead: it is composite (matmuls and a softmax), so it
batches. ``torch.nn.attention.sdpa_kernel([SDPBackend.MATH])`` would choose the math kernel by
setting *process-global* flags: while it is active every other thread's attention takes the math
kernel too (slower, and ``[T, T]`` scores in memory on a GPU), and two overlapping uses in two
threads restore each other's saved flags out of order, which leaves the fused kernels off for
the rest of the process. :func:`vmap_attention` touches no flag: a ``TorchFunctionMode``
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
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends, _sdpa_kernel
from torch.overrides import TorchFunctionMode

__all__ = ["vmap_attention"]

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


class _VmapAttention(TorchFunctionMode):
    """Every other function passes through unchanged (the mode is off inside the handler)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _FUSED and _plain_tensors(args, kwargs):
            folded = _folded_sdpa(*args, **kwargs)
            return _math_sdpa(*args, **kwargs) if folded is None else folded
        if func is _FUSED or func is _MULTI_HEAD:  # a subclass's own handling (CausalBias)
            with _process_math_kernel():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _only_vmap_levels() -> bool:
    """Every active functorch transform is a ``vmap`` and there is at least one: the
    gradients are taken by ordinary autograd outside (``vmap(loss)`` then one backward), so a
    fused kernel's own backward runs on the folded batch. Under ``grad``/``jvp`` the math
    kernel stays (the transform would differentiate through the vmap rule)."""
    interpreters = retrieve_all_functorch_interpreters()
    return bool(interpreters) and all(i.key() == TransformType.Vmap for i in interpreters)


def _folded_sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False) -> Tensor | None:
    """``scaled_dot_product_attention`` under ``vmap`` by the fused kernel on the folded batch,
    or ``None`` where that does not apply (then the math kernel runs).

    Attention treats every leading index independently, so ``vmap``'s batch of ``B`` examples
    of ``[N, H, L, E]`` is one call on ``[B * N, H, L, E]``: the kernel a batched forward
    uses, not the math kernel's ``[L, S]`` scores per head (a hand-written ``functional_call``
    loss on GPT-2 4 x 128 at 8 x 512 tokens: 1.45-1.49x -> 1.05-1.18x the training step,
    benchmarks/RESULTS.md). Only 4-D inputs with one ``N`` (a ``[1, ...]`` key broadcast over
    the queries' ``N`` would not broadcast once folded), without dropout (which would draw
    one mask for the folded batch, where vmap's ``randomness`` setting must decide), under
    ``vmap`` levels alone."""
    if dropout_p != 0.0 or query.dim() != 4 or key.dim() != 4 or value.dim() != 4 \
            or not query.shape[0] == key.shape[0] == value.shape[0] \
            or (attn_mask is not None and attn_mask.dim() > 4) or not _only_vmap_levels():
        return None
    return _FoldedAttention.apply(query, key, value, attn_mask, is_causal, scale, enable_gqa)


def _fused(query, key, value, attn_mask, is_causal, scale, enable_gqa) -> Tensor:
    extra = {"enable_gqa": True} if enable_gqa else {}
    return _FUSED(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                  **extra)


class _FoldedAttention(torch.autograd.Function):
    """The fused attention with a ``vmap`` rule that folds the vmapped dimension into the
    batch dimension. ``forward``/``backward`` run only where no ``vmap`` is left to fold (the
    rule calls the kernel itself, so ordinary autograd records the kernel's own backward)."""

    generate_vmap_rule = False

    @staticmethod
    def forward(query, key, value, attn_mask, is_causal, scale, enable_gqa):
        return _fused(query, key, value, attn_mask, is_causal, scale, enable_gqa)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:4])
        ctx.options = inputs[4:]

    @staticmethod
    def backward(ctx, grad_out):
        inputs = [x.detach().requires_grad_(need) if x is not None else None
                  for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[:4], strict=True)]
        with torch.enable_grad():
            out = _fused(*inputs, *ctx.options)
        wanted = [x for x in inputs if x is not None and x.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad_out))
        return (*(next(grads) if x is not None and x.requires_grad else None for x in inputs),
                None, None, None)

    @staticmethod
    def vmap(info, in_dims, query, key, value, attn_mask, is_causal, scale, enable_gqa):
        size = info.batch_size
        q, k, v = (_fold(x, dim, size)
                   for x, dim in zip((query, key, value), in_dims[:3], strict=True))
        mask = _fold_mask(attn_mask, in_dims[3], size, q.shape[0] // size)
        if _only_vmap_levels():  # an outer vmap: fold again through this rule
            out = _FoldedAttention.apply(q, k, v, mask, is_causal, scale, enable_gqa)
        else:  # ordinary autograd records the kernel and its backward
            out = _fused(q, k, v, mask, is_causal, scale, enable_gqa)
        return out.unflatten(0, (size, -1)), 0


def _fold(x: Tensor, dim: int | None, size: int) -> Tensor:
    """``[B * N, H, L, E]`` from ``x`` (``[N, H, L, E]`` batched at ``dim``, or unbatched)."""
    x = x.expand(size, *x.shape) if dim is None else x.movedim(dim, 0)
    return x.flatten(0, 1)


def _fold_mask(mask: Tensor | None, dim: int | None, size: int, n: int) -> Tensor | None:
    """The mask for the folded batch: an unbatched one whose leading dimension broadcasts
    (absent or 1) as it is; otherwise ``[B * N, ...]``."""
    if mask is None:
        return None
    if dim is None:
        if mask.dim() < 4 or mask.shape[0] == 1:
            return mask
        return mask.expand(size, *mask.shape).flatten(0, 1)
    mask = mask.movedim(dim, 0)
    mask = mask.reshape(size, *([1] * (5 - mask.dim())), *mask.shape[1:])  # [B, n?, h, L, S]
    return mask.expand(size, n, *mask.shape[2:]).flatten(0, 1)


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


def vmap_attention() -> TorchFunctionMode:
    """A context in which this thread's ``scaled_dot_product_attention`` batches under
    ``vmap``: the fused kernel on the folded batch where only ``vmap`` is active, else the
    math kernel (which has batching rules); other threads and the global SDPA flags are
    untouched. Every ``vmap`` over a user's loss runs inside it.

    Example:
        >>> with vmap_attention():
        ...     out = torch.func.vmap(model_loss)(batch)  # no per-example fallback
    """
    return _VmapAttention()
