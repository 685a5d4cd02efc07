"""Per-example gradients stage by stage: functional gradient checkpointing under vmap.

``torch.utils.checkpoint`` and ``save_on_cpu`` rely on saved-tensor hooks, which
``torch.func.grad``/``vjp`` refuse. Here checkpointing is written with the transforms
themselves, and the stage loop runs *outside* vmap, on ordinary batched tensors:

1. forward the batch once without autograd, keeping only the input of every differentiated
   stage (the stage boundaries; optionally offloaded, see :mod:`tracinfunc.grads.offload`). Stages
   before the first selected parameter (a frozen prefix) run here and are never revisited;
2. per-example gradients of the criterion with respect to the model output;
3. for each stage from the last: ``vmap`` over examples (with ``chunk_size``) of
   ``torch.func.vjp`` of the stage, which recomputes the stage's forward for that example and
   returns its parameter gradients and the gradient with respect to its input. The parameter
   gradients go through ``transform`` (a projection) inside the vmap, so only one stage's
   per-example gradients, for one chunk, exist at a time.

Every boundary activation is dropped as soon as its stage is done, and nothing refers to
activations after the call returns: no manual cleanup is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.func import grad, vjp, vmap
from torch.utils._pytree import tree_map

from tracinfunc._attention import vmap_attention
from tracinfunc._validate import current_caller
from tracinfunc.errors import ParameterSelectionError
from tracinfunc.grads.offload import ActivationStash
from tracinfunc.grads.precision import loss_scale, mixed_precision_context, with_mixed_precision
from tracinfunc.grads.stages import Stage, Stages, split_batch, stage_params
from tracinfunc.types import Batch, Params

__all__ = ["largest_stage_size", "stage_selection", "staged_grads"]

StageTransform = Callable[[int, dict[str, Tensor]], Any]
"""``transform(stage_index, {name: [*shape]}) -> pytree``, applied per example inside vmap."""


def stage_selection(stages: Stages, names: Sequence[str]) -> list[list[str]]:
    """For each stage, the selected parameter names it owns (in ``names`` order).

    Raises:
        ParameterSelectionError: a selected parameter belongs to no stage.
    """
    per_stage: list[list[str]] = [[] for _ in stages.stages]
    orphans = []
    for name in names:
        owners = stages.owners(name)
        if not owners:
            orphans.append(name)
        for owner in owners:  # a tied weight is differentiated in every stage using it
            per_stage[owner].append(name)
    if orphans:
        raise ParameterSelectionError(
            f"{current_caller()}: parameters {orphans[:6]} are differentiated but belong to no "
            "stage; add them to a Stage's param_names, or leave them out with select=."
        )
    return per_stage


def largest_stage_size(per_stage: list[list[str]], params: Params) -> int:
    """The most parameter entries any one stage differentiates (what a chunk must hold)."""
    return max(sum(params[name].numel() for name in names) for names in per_stage)


def staged_grads(
    stages: Stages,
    params: Params,
    batch: Batch,
    *,
    per_stage: list[list[str]],
    transform: StageTransform,
    chunk_size: int | None,
    mixed_precision: torch.dtype | None,
    offload: bool,
    scaling: str = "none") -> list[tuple[int, Any]]:
    """Run the three phases (module docstring); returns ``[(stage_index, transformed)]``.

    ``transformed`` is ``transform(index, grads)`` batched over examples, ``[b, ...]``, for
    each stage with selected parameters, last stage first. With float16 and ``scaling``
    other than ``"none"`` (see :func:`~tracinfunc.grads.precision.loss_scaled_rows`), each
    example's criterion is multiplied by its :func:`~tracinfunc.grads.precision.loss_scale`:
    the backward is linear in the output cotangent, so every stage's backward carries the
    scaled signal and each example's parameter gradients are divided by its scale, in their
    own dtype, before ``transform``.
    """
    first = next(i for i, names in enumerate(per_stage) if names)
    inputs, targets = split_batch(batch)
    device = next(iter(params.values())).device
    stash = ActivationStash(device, offload=offload)
    with torch.no_grad(), mixed_precision_context(mixed_precision, device):
        h = inputs
        for index, stage in enumerate(stages.stages):
            if index >= first:
                # The batch input is held by the caller anyway: offloading it saves nothing.
                stash.put(index, h, offload=index > 0)
            h = stage.fn(stage_params(stage, params), h)
    scaling = scaling if mixed_precision == torch.float16 else "none"
    cotangent, scales = _output_grads(stages, h, targets, chunk_size, mixed_precision, device,
                                      scaling)
    del h
    results = []
    for index in range(len(stages.stages) - 1, first - 1, -1):
        activation = stash.pop(index)
        if index - 1 >= first:
            stash.prefetch(index - 1)  # overlaps the copy back with this stage's backward
        out, cotangent = _stage_backward(
            stages.stages[index], index, params, per_stage[index], activation, cotangent,
            scales, need_input=index > first, transform=transform, chunk_size=chunk_size,
            mixed_precision=mixed_precision, device=device)
        del activation
        if out is not None:
            results.append((index, out))
    return _sum_tied(results, stages.tied)


def _sum_tied(results: list[tuple[int, Any]], tied: frozenset[str]) -> list[tuple[int, Any]]:
    """Give every stage's dict output the total of a tied weight's per-stage gradients.

    Callers merge per-stage dicts by name, so each must hold the sum; tensor outputs (the
    projections) are summed by the callers, which is right for a linear projection.
    """
    totals: dict[str, Tensor] = {}
    for _, out in results:
        if isinstance(out, dict):
            for name in tied & out.keys():
                totals[name] = out[name] if name not in totals else totals[name] + out[name]
    if not totals:
        return results
    return [(index, {**out, **{n: totals[n] for n in totals if n in out}}
             if isinstance(out, dict) else out) for index, out in results]


def _output_grads(stages: Stages, outputs: Tensor, targets: Tensor, chunk_size: int | None,
                  mixed_precision, device, scaling: str) -> tuple[Tensor, Tensor | None]:
    """``([b, *out], [b] or None)``: per-example gradients of the criterion (times its loss
    scale) with respect to the outputs, and the scales (``None`` when not scaled)."""

    def criterion(output: Tensor, target: Tensor) -> Tensor:
        return stages.criterion(output.unsqueeze(0), target.unsqueeze(0))

    criterion = with_mixed_precision(criterion, mixed_precision, device)
    if scaling == "none":
        return vmap(grad(criterion), chunk_size=chunk_size)(outputs, targets), None

    def scaled(output: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        loss = criterion(output, target)
        scale = loss_scale(loss.detach(), scaling)
        return loss.float() * scale, scale

    return vmap(grad(scaled, has_aux=True), chunk_size=chunk_size)(outputs, targets)


def _stage_backward(
    stage: Stage, index: int, params: Params, names: list[str], activation: Any,
    cotangent: Tensor, scales: Tensor | None, *, need_input: bool, transform: StageTransform,
    chunk_size: int | None, mixed_precision, device) -> tuple[Any, Tensor | None]:
    """One stage's vjp per example: ``(transform(param grads) or None, input grads or None)``."""
    own = stage_params(stage, params)
    frozen = {name: value for name, value in own.items() if name not in names}
    selected = {name: own[name] for name in names}

    def stage_one(selected: Params, h: Any) -> Tensor:
        batched = tree_map(lambda leaf: leaf.unsqueeze(0), h)
        return stage.fn({**frozen, **selected}, batched)[0]

    stage_one = with_mixed_precision(stage_one, mixed_precision, device)

    def one_example(selected: Params, h: Any, g: Tensor, scale: Tensor | None) -> tuple:
        if need_input:
            out, vjp_fn = vjp(stage_one, selected, h)
            param_grads, input_grads = vjp_fn(g.to(out.dtype))
        else:
            out, vjp_fn = vjp(lambda selected: stage_one(selected, h), selected)
            (param_grads,), input_grads = vjp_fn(g.to(out.dtype)), None
        if scale is not None:  # the input gradients stay scaled for the stage before
            param_grads = {name: v / scale.to(v.dtype) for name, v in param_grads.items()}
        parts = (transform(index, param_grads) if names else None, input_grads)
        return tuple(part for part in parts if part is not None)

    mapped = vmap(one_example, in_dims=(None, 0, 0, None if scales is None else 0),
                  chunk_size=chunk_size)
    with vmap_attention():
        parts = list(mapped(selected, activation, cotangent, scales))
    out = parts.pop(0) if names else None
    return out, (parts.pop(0) if need_input else None)
