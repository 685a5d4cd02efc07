"""The batched factorised path: one backward of the batch's summed loss, weights frozen.

The vmapped path (:mod:`tracinfunc.grads.factorized`) runs ``vmap(grad(...))``: a
per-example backward under torch.func. Since a batch's per-example losses are independent
(the loss takes one example), the output gradient of every layer call for every example is
also the gradient of the *sum* of the batch's losses, so one ordinary autograd backward of
``vmap(loss)(batch).sum()`` gives them all at once, as a training step's backward does but
without weight gradients: the factorised weights are constants (no ``requires_grad``), and
autograd differentiates only with respect to zero "taps" ``[b, *out_shape]`` added to each
layer's output and zero shifts ``[b, *shape]`` of the other parameters (biases, norms: their
gradient per example is the shift's). The layers' inputs come out of the vmapped forward;
each example's row is then projected exactly as on the vmapped path (same code,
:meth:`_Plan.combine`), batched over examples.

The first batch proves the path: the rows of its first examples must equal the vmapped
path's (relative difference at most 1e-3 in float32, 1e-6 in float64), and a batched
backward that fails (an operation autograd cannot differentiate outside torch.func) or
disagrees makes this plan use the vmapped path from then on, with a
:class:`BatchedPathWarning` giving the reason.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor
from torch.func import vmap
from torch.utils._pytree import tree_leaves, tree_map

from tracinfunc.errors import LossFunctionError
from tracinfunc.grads.layer_rules import layer_rule, rule_sides, tapping
from tracinfunc.types import Batch, LossFn, Params

__all__ = ["BatchedPathWarning", "batched_or_vmapped", "batched_rows"]

_CHECKED_EXAMPLES = 4  # of the first batch, compared with the vmapped path


class BatchedPathWarning(UserWarning):
    """The batched factorised path does not apply to a loss; the vmapped path is used."""


def batched_rows(plan, loss: LossFn, params: Params, batch: Batch, order, shapes) -> Tensor:
    """``[b, k]`` rows of ``batch`` from one backward of its summed loss.

    Args:
        plan: The factorised path's plan for this layout (weights, factors, projector).
        loss: ``loss(params, example)``, one example.
        params: The differentiated parameters (the plan's layout).
        batch: Examples with a leading batch dimension ``b``.
        order, shapes: The layer calls and their output shapes for one example.
    """
    b = tree_leaves(batch)[0].shape[0]
    consts = {name: params[name].detach() for name in plan.weights}  # views, no copy
    rest = {name: value.detach() for name, value in params.items() if name not in consts}
    ids = {id(consts[name]): i for i, name in enumerate(plan.weights)}
    taps = [torch.zeros((b, *shape), dtype=dtype, device=plan.device, requires_grad=True)
            for shape, dtype in shapes]
    shifts = {name: torch.zeros((b, *value.shape), dtype=value.dtype, device=value.device,
                                requires_grad=True) for name, value in rest.items()}
    modules: list = []  # (weight index, module) per call, in call order

    def one_loss(taps: list[Tensor], shifts: Params, example) -> tuple[Tensor, list[Tensor]]:
        shifted = {name: rest[name] + shift for name, shift in shifts.items()}
        with tapping(ids, taps, order) as seen:
            value = loss({**consts, **shifted}, example)
        if len(seen) != len(order):
            raise LossFunctionError(
                f"projected_grads: {len(seen)} layer calls, {len(order)} on the first "
                "example; the factorised kind='kronecker' path needs the same layer calls "
                "for every example. Use kind='sjlt' or 'rademacher'."
            )
        modules[:] = [(index, module) for index, module, _, _ in seen]
        return value, [x for _, _, x, _ in seen]

    with torch.enable_grad():
        values, inputs = vmap(one_loss)(taps, shifts, batch)  # [b], per call [b, *in_shape]
        grads = torch.autograd.grad(values.sum(), [*taps, *shifts.values()],
                                    allow_unused=True, materialize_grads=True)
    deltas, rest_grads = grads[:len(taps)], dict(zip(shifts, grads[len(taps):], strict=True))

    def one_row(inputs: list[Tensor], deltas: list[Tensor], rest_grads: Params) -> Tensor:
        sides = [(index, layer_rule(module), *rule_sides(layer_rule(module), module, x, delta))
                 for (index, module), x, delta in zip(modules, inputs, deltas, strict=True)]
        return plan.combine(rest_grads, sides)

    with torch.no_grad():
        return vmap(one_row)([x.detach() for x in inputs], list(deltas), rest_grads)


def batched_or_vmapped(plan, loss: LossFn, params: Params, batch: Batch, order, shapes, *,
                       vmapped: Callable[[Batch], Tensor], chunk_size: int | None) -> Tensor:
    """``[b, k]`` by the batched path once the first batch proved it, else by ``vmapped``.

    ``plan.batched`` records the outcome (``None`` until the first batch), and
    ``plan.fallback_reason`` why the vmapped path is used.
    """
    if plan.batched is False:
        return vmapped(batch)
    if plan.batched is None:
        return _prove(plan, loss, params, batch, order, shapes, vmapped, chunk_size)
    return _chunked(plan, loss, params, batch, order, shapes, chunk_size)


def _chunked(plan, loss, params, batch, order, shapes, chunk_size: int | None) -> Tensor:
    b = tree_leaves(batch)[0].shape[0]
    step = b if chunk_size is None else chunk_size
    parts = [batched_rows(plan, loss, params, _rows(batch, start, start + step), order, shapes)
             for start in range(0, b, step)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _prove(plan, loss, params, batch, order, shapes, vmapped, chunk_size) -> Tensor:
    try:
        rows = _chunked(plan, loss, params, batch, order, shapes, chunk_size)
    except RuntimeError as error:
        return _fall_back(plan, f"its backward failed ({error})", vmapped, batch)
    head = min(rows.shape[0], _CHECKED_EXAMPLES)
    expected = vmapped(_rows(batch, 0, head))
    error = float(((rows[:head] - expected).norm(dim=1)
                   / expected.norm(dim=1).clamp_min(1e-30)).max())
    allowed = 1e-6 if rows.dtype == torch.float64 else 1e-3
    if not error <= allowed:
        return _fall_back(plan, f"its rows differ from the vmapped path's on the first batch "
                          f"(relative difference {error:.3g}, allowed {allowed})", vmapped, batch)
    plan.batched = True
    return rows


def _fall_back(plan, reason: str, vmapped, batch: Batch) -> Tensor:
    plan.batched, plan.fallback_reason = False, reason
    warnings.warn(
        f"projected_grads: kind='kronecker' uses the per-example (vmapped) backward for this "
        f"loss, not one batched backward, because {reason}. The rows are the same; only the "
        "speed differs.", BatchedPathWarning, stacklevel=5)
    return vmapped(batch)


def _rows(batch: Batch, start: int, stop: int) -> Batch:
    return tree_map(lambda leaf: leaf[start:stop], batch)
