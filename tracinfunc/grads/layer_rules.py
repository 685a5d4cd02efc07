"""The per-layer rules of the factorised kronecker path, shared by the vmapped and the batched
path: which layers factorise, the two sides ``(left, right)`` of a layer's weight gradient
``G = left.T @ right`` (see :mod:`tracinfunc.grads.factorized`), and the forward hook that finds
those layers while any loss runs.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tracinfunc._hooks import register_thread_forward_hook
from tracinfunc.errors import LossFunctionError
from tracinfunc.types import LossFn, Params

__all__ = ["dense_grad", "differentiable", "layer_rule", "project_left", "rule_sides", "tapping"]


def layer_rule(module: nn.Module) -> str | None:
    """``"linear"``, ``"conv1d"``, ``"conv2d"``, ``"embedding"`` or ``None`` (not factorised).

    Exact types only: subclasses may use their weight without calling the parent's forward
    (``nn.MultiheadAttention.out_proj``). HF ``Conv1D`` is recognised without importing
    transformers.
    """
    kind = type(module)
    if kind is nn.Linear:
        return "linear"
    if kind is nn.Conv2d and module.groups == 1 and module.padding_mode == "zeros" \
            and not isinstance(module.padding, str):
        return "conv2d"
    if kind is nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq:
        return "embedding"
    if kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers"):
        return "conv1d"
    return None


def rule_sides(rule: str, module: nn.Module, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
    """``(left, right)`` with ``G = left.T @ right``; for embeddings ``left`` is token ids
    ``[T]`` with ``-1`` where the gradient is zero (``padding_idx``).

    Both float sides come in one dtype: under a loss's own ``torch.autocast`` a float32 layer
    reads float32 inputs but returns (and is differentiated through) a bfloat16 output; the
    products with the factors cast to the factors' dtype (``_Plan.combine``)."""
    if x.is_floating_point() and x.dtype != delta.dtype:
        dtype = torch.promote_types(x.dtype, delta.dtype)
        x, delta = x.to(dtype), delta.to(dtype)
    if rule == "linear":
        return delta.reshape(-1, module.out_features), x.reshape(-1, module.in_features)
    if rule == "conv1d":
        return x.reshape(-1, x.shape[-1]), delta.reshape(-1, module.nf)
    if rule == "conv2d":
        columns = F.unfold(x, module.kernel_size, module.dilation, module.padding,
                           module.stride)  # [1, C_in * kh * kw, L]
        return delta.reshape(module.out_channels, -1).T, columns[0].T
    ids = x.reshape(-1)
    if module.padding_idx is not None:
        ids = torch.where(ids == module.padding_idx, -1, ids)
    return ids, delta.reshape(ids.shape[0], -1)


def project_left(rule: str, left: Tensor, p_rows: Tensor) -> Tensor:
    """``left @ P_r`` ``[T, k_r]``: a row gather for embeddings (zero for ``-1`` ids)."""
    if rule != "embedding":
        return left @ p_rows
    rows = p_rows[left.clamp_min(0)]  # [T, k_r]
    return rows * (left >= 0).unsqueeze(-1).to(rows.dtype)


def dense_grad(rule: str, left: Tensor, right: Tensor, rows: int) -> Tensor:
    """``G [r, c]`` of one call (the one-example check only)."""
    if rule != "embedding":
        return left.T @ right
    keep = (left >= 0).unsqueeze(-1).to(right.dtype)
    zeros = right.new_zeros(rows, right.shape[-1])
    return zeros.index_add(0, left.clamp_min(0), right * keep)


def differentiable(output: Tensor, batch: int | None) -> tuple[Tensor, Tensor]:
    """``(output to return, tensor to differentiate)`` for one backward giving each of
    ``batch`` examples' output gradient: the output itself where it requires grad and has a
    leading batch dimension (no tap to allocate and add); else a zero tap ``[batch, ...]``
    added to it (an output shared by the batch, ``[1, ...]`` like GPT-2's position embeddings,
    or one that needs no gradient, like the first embedding's)."""
    if output.shape[:1] == (batch,) and output.requires_grad:
        return output, output
    tap = output.new_zeros((batch, *output.shape[1:]), requires_grad=True)
    return output + tap, tap


@contextmanager
def tapping(weight_ids: dict[int, int], taps: list[Tensor] | str | None, order: list | None,
            batch: int | None = None):
    """A global forward hook recording calls of layers whose weight is in ``weight_ids``.

    Yields a list that fills with ``(weight index, module, input, output)`` per call;
    ``taps[i]`` is added to the ``i``-th call's output (``None``: record only; ``"outputs"``:
    the recorded tensor is the one to differentiate, see :func:`differentiable`, for ``batch``
    examples).
    ``order`` (when given) is the call order found on the first example; a different order is
    refused.
    """
    seen: list[tuple[int, nn.Module, Tensor, Tensor]] = []

    def hook(module, inputs, output):
        index = weight_ids.get(id(getattr(module, "weight", None)))
        if index is None or layer_rule(module) is None:
            return None
        call = len(seen)
        if order is not None and (call >= len(order) or order[call] != (index, id(module))):
            raise LossFunctionError(
                "projected_grads: layers were called in another order (or number of times) "
                "than on the first example; the factorised kind='kronecker' path needs the "
                "same layer calls for every example of a batch. Use kind='sjlt' or "
                "'rademacher' for data-dependent control flow."
            )
        if taps is None:
            seen.append((index, module, inputs[0], output))
            return None
        if taps == "outputs":  # differentiate the output itself where it can be
            output, target = differentiable(output, batch)
            seen.append((index, module, inputs[0], target))
            return output
        seen.append((index, module, inputs[0], output))
        return output + taps[call]

    handle = register_thread_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def tapped_loss(loss: LossFn, params: Params, example, ids, taps: list[Tensor], order,
                modules: list) -> tuple[Tensor, list[Tensor]]:
    """``loss(params, example)`` with a tap on each factorised layer's output: ``(value,
    layer inputs)``; ``modules`` is refilled with the layers called, in call order."""
    with tapping(ids, taps, order) as seen:
        value = loss(params, example)
    if len(seen) != len(order):
        raise LossFunctionError(
            f"projected_grads: {len(seen)} layer calls, {len(order)} on the first "
            "example; the factorised kind='kronecker' path needs the same layer calls "
            "for every example. Use kind='sjlt' or 'rademacher'."
        )
    modules[:] = [(index, module) for index, module, _, _ in seen]
    return value, [x for _, _, x, _ in seen]
