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

For a :class:`~tracinfunc.loss.ModuleLoss` a faster mode skips vmap in the forward too: the
model's own batched forward (:mod:`tracinfunc.grads.factorized_forward`).

The first batch proves the modes, fastest first: the rows of its first examples must equal
the vmapped path's (relative difference at most 1e-3 in float32, 1e-6 in float64). A mode that
fails (an operation autograd cannot differentiate outside torch.func, a model that refuses a
real batch) or disagrees (examples that interact in a batched forward) is dropped for this
plan, with a :class:`BatchedPathWarning` giving the reason; the vmapped path is the last
resort.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor
from torch.func import vmap
from torch.utils._pytree import tree_leaves, tree_map

from tracinfunc._attention import vmap_attention
from tracinfunc.batches import batch_leaves
from tracinfunc.grads.factorized_forward import forward_sides
from tracinfunc.grads.layer_rules import (
    layer_rule,
    rule_sides,
    tapped_loss,
)
from tracinfunc.grads.shared_inputs import input_product
from tracinfunc.types import Batch, LossFn, Params

__all__ = ["BatchedPathWarning", "LossFormWarning", "batched_or_vmapped", "batched_rows",
           "proof_tolerance", "tell_vmapped_forward"]

_CHECKED_EXAMPLES = 4  # rows of a proved call (spread over it) compared with the vmapped path
BatchLoss = Callable[[Params, Batch], Tensor]


class BatchedPathWarning(UserWarning):
    """A faster mode of the factorised path does not apply to a loss; a slower one with the
    same rows is used (the message says why)."""


class LossFormWarning(UserWarning):
    """A plain ``loss(params, example)`` keeps the factorised path's forward under ``vmap``; a
    :class:`~tracinfunc.loss.ModuleLoss` would run one batched forward (said once per loss)."""


_TOLD: set = set()  # the code of each plain loss already told about (once per process)


def tell_vmapped_forward(loss: LossFn) -> None:
    """Say once per loss code which loss form gets one batched forward, and why this one
    does not (a plain callable's per-example semantics are known only example by example)."""
    code = getattr(getattr(loss, "__func__", loss), "__code__", type(loss))
    if code in _TOLD:
        return
    _TOLD.add(code)
    warnings.warn(
        "projected_grads: kind='kronecker' runs this plain loss(params, example) under "
        "vmap(loss) over the batch (one backward, but a vmapped forward: ~25% slower on "
        "GPT-2), because only a ModuleLoss says how one batched forward of the model gives "
        "each example's loss. For the fast mode pass a ModuleLoss: "
        "tif.causal_lm_loss(model) for next-token losses (the same value as "
        "functional_call(model, params, kwargs={'input_ids': ids[None], 'labels': "
        "ids[None]}).loss on unpadded sequences), tif.sequence_classification_loss(model), "
        "or tif.loss_from_model(model, criterion=...). The rows are the same either way; "
        "this is said once per loss.", LossFormWarning, stacklevel=6)


def batched_rows(plan, loss: LossFn, params: Params, batch: Batch, order, shapes,
                 batch_loss: BatchLoss | None = None) -> Tensor:
    """``[b, k]`` rows of ``batch`` from one backward of its summed loss.

    Args:
        plan: The factorised path's plan for this layout (weights, factors, projector).
        loss: ``loss(params, example)``, one example.
        params: The differentiated parameters (the plan's layout).
        batch: Examples with a leading batch dimension ``b``.
        order, shapes: The layer calls and their output shapes for one example.
        batch_loss: ``batch_loss(params, batch) -> [b]`` from one batched forward (no
            vmap; see :mod:`~tracinfunc.grads.factorized_forward`), or ``None``: the
            forward is ``vmap(loss)``.
    """
    if batch_loss is not None:
        return _project(plan, *forward_sides(plan, batch_loss, params, batch, order, shapes))
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
        return tapped_loss(loss, {**consts, **shifted}, example, ids, taps, order, modules)

    with torch.enable_grad(), vmap_attention():
        values, inputs = vmap(one_loss)(taps, shifts, batch)  # [b], per call [b, *in_shape]
        grads = torch.autograd.grad(values.sum(), [*taps, *shifts.values()],
                                    allow_unused=True, materialize_grads=True)
    deltas, rest_grads = grads[:len(taps)], dict(zip(shifts, grads[len(taps):], strict=True))
    return _project(plan, modules, inputs, deltas, rest_grads)


def _project(plan, modules, inputs, deltas, rest_grads: Params) -> Tensor:
    """``[b, k]``: each example's row from its layers' inputs and output gradients."""

    with torch.no_grad():
        vectors = plan.batched_vectors(rest_grads)  # [b, k] or None
        if not modules and vectors is not None and plan.rest is None and plan.offset is None:
            return vectors  # nothing but biases and norms selected: the vector block is all
        rows = _linear_rows(plan, modules, inputs, deltas)
        if rows is not None:  # the vmap below, written batched: its fixed cost saved
            return rows if vectors is None else rows.add_(vectors)

        def one_row(inputs: list[Tensor], deltas: list[Tensor], rest_grads: Params) -> Tensor:
            sides = [(index, layer_rule(module),
                      *rule_sides(layer_rule(module), module, x, delta))
                     for (index, module), x, delta in zip(modules, inputs, deltas, strict=True)]
            return plan.combine(rest_grads, sides, vectors=vectors is None)

        rows = vmap(one_row)([x.detach() for x in inputs], list(deltas), rest_grads)
        if vectors is None:
            return rows
        # vmap's own output, in place (one [b, k] allocation fewer); an output vmap expanded
        # from one unbatched row shares its memory and is added out of place.
        return rows.add_(vectors) if rows.is_contiguous() else rows + vectors


def _linear_rows(plan, modules, inputs, deltas) -> Tensor | None:
    """``[b, k]`` rows (without the vector block) where every factorised call is an
    ``nn.Linear`` seen once per example and nothing else enters a row (no preconditioner, no
    generic block, no offset); else ``None``.

    The operations of :meth:`~tracinfunc.grads.factorized._Plan.combine` in the form vmap
    gives them (``[b, r] @ P_r``, ``[b, c] @ P_c``, a pointwise outer product, ``addcmul``
    for a layer's later calls), so the same values, without vmap's fixed cost per call (a
    few ms, most of a small model's projection)."""
    if plan.precondition is not None or plan.rest is not None or plan.offset is not None \
            or not modules:
        return None
    b = inputs[0].shape[0]
    sides = []
    for (index, module), x, delta in zip(modules, inputs, deltas, strict=True):
        if layer_rule(module) != "linear" or x[0].numel() != module.in_features \
                or delta[0].numel() != module.out_features:
            return None  # a layer seen more than once per example (a sequence): vmap
        dtype = plan.factors[index][0].dtype  # a loss's own autocast: bfloat16 gradients
        sides.append((index, delta.reshape(b, -1).to(dtype), x.detach().reshape(b, -1).to(dtype)))
    total = None
    for index, left, right in sides:
        p_rows, p_cols = plan.factors[index]
        # [b, k_r], [b, k_c]; a first layer's input side is every checkpoint's
        left, right = left @ p_rows, input_product(right, p_cols)
        if total is None:
            total = (left[:, :, None] * (right * plan.scale)[:, None, :]).reshape(b, -1)
        else:
            total = torch.addcmul(total.reshape(b, left.shape[1], right.shape[1]),
                                  left[:, :, None], right[:, None, :],
                                  value=plan.scale).reshape(b, -1)
    return total


def batched_or_vmapped(plan, loss: LossFn, params: Params, batch: Batch, order, shapes, *,
                       vmapped: Callable[[Batch], Tensor], chunk_size: int | None,
                       batch_loss: BatchLoss | None = None) -> Tensor:
    """``[b, k]`` by the batched path once the first batch proved it, else by ``vmapped``.

    The first batch tries one batched forward (``batch_loss``, where it applies), then
    ``vmap(loss)``, and keeps the first whose rows equal ``vmapped``'s. ``plan.batched``
    records the outcome (``None`` until the first batch; ``"forward"``, ``"vmap"`` or
    ``False``), ``plan.fallback_reason`` why a faster one was not kept. A call that runs more
    examples together than the proof did (``plan.proved_size``: a first call of one example,
    or of copies of one, shows no interaction) is proved again, as a model may mix the
    examples of a batch (normalise over it) in a way only more distinct examples reveal.
    """
    if plan.batched is None or (plan.batched and _together(batch, chunk_size) > plan.proved_size):
        return _prove(plan, loss, params, batch, order, shapes, vmapped, chunk_size,
                      batch_loss)
    if plan.batched is False:
        return vmapped(batch)
    direct = batch_loss if plan.batched == "forward" else None
    return _chunked(plan, loss, params, batch, order, shapes, chunk_size, direct)


def _chunked(plan, loss, params, batch, order, shapes, chunk_size: int | None,
             batch_loss: BatchLoss | None) -> Tensor:
    b = tree_leaves(batch)[0].shape[0]
    step = b if chunk_size is None else chunk_size
    parts = [batched_rows(plan, loss, params, _rows(batch, start, start + step), order, shapes,
                          batch_loss) for start in range(0, b, step)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _prove(plan, loss, params, batch, order, shapes, vmapped, chunk_size, batch_loss) -> Tensor:
    b = tree_leaves(batch)[0].shape[0]
    # the first, the last and evenly between: a model may mix only some rows of a batch
    checked = torch.linspace(0, b - 1, min(b, _CHECKED_EXAMPLES)).round().long().unique()
    expected = vmapped(tree_map(lambda leaf: leaf[checked], batch))
    reasons = []
    forward_applies = batch_loss is not None and all(shape[:1] == (1,) for shape, _ in shapes)
    for mode in ("forward", "vmap") if forward_applies else ("vmap",):
        direct = batch_loss if mode == "forward" else None
        try:
            rows = _chunked(plan, loss, params, batch, order, shapes, chunk_size, direct)
        except _CAUGHT[mode] as error:
            reasons.append(f"{_NAMES[mode]} failed ({error})")
            continue
        error = float(((rows[checked.to(rows.device)] - expected).norm(dim=1)
                       / expected.norm(dim=1).clamp_min(1e-30)).max())
        allowed = proof_tolerance(rows.dtype)
        if error <= allowed:
            plan.batched = mode
            plan.proved_size = _together(batch, chunk_size) if _distinct_examples(batch) else 1
            _say(plan, reasons, "uses one backward of vmap(loss) over the batch")
            return rows
        reasons.append(f"{_NAMES[mode]} gives rows that differ from the per-example ones on "
                       f"the first batch (relative difference {error:.3g}, allowed {allowed})")
    plan.batched = False
    _say(plan, reasons, "uses the per-example (vmapped) backward")
    return vmapped(batch)


def proof_tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance of a proof that a batched path gives the per-example values,
    for values of ``dtype``: 1e-6 in float64, 1e-3 in float32, four units of the last place
    in lower precision (bfloat16: 0.031; a batched and a per-example run round apart by a
    unit, which 1e-3 took for interacting examples). Shared by the factorised projection and
    K-FAC's batched capture."""
    if dtype == torch.float64:
        return 1e-6
    if dtype == torch.float32 or not dtype.is_floating_point:
        return 1e-3
    return max(1e-3, 4 * torch.finfo(dtype).eps)


# A model may refuse a real batch in many ways (the vmap modes then say what is wrong).
_CAUGHT = {"forward": Exception, "vmap": RuntimeError}
_NAMES = {"forward": "one batched forward of the module (examples may interact: a "
                     "cross-example layer, or outputs without a batch dimension)",
          "vmap": "the batched backward"}


def _say(plan, reasons: list[str], instead: str) -> None:
    if not reasons:
        return
    plan.fallback_reason = "; ".join(reasons)
    warnings.warn(
        f"projected_grads: kind='kronecker' {instead} for this loss because "
        f"{plan.fallback_reason}. The rows are the same; only the speed differs.",
        BatchedPathWarning, stacklevel=6)


def _together(batch: Batch, chunk_size: int | None) -> int:
    """Examples one batched run of ``batch`` holds: the batch, or a chunk of it."""
    b = batch_leaves(batch)[0].shape[0]  # (not torch's pytree: ~50 us every call)
    return b if chunk_size is None else min(b, chunk_size)


def _distinct_examples(batch: Batch) -> bool:
    """Whether the batch holds two examples that differ (in any leaf): copies of one example
    cannot show that a batched forward mixes examples (``x - x.mean(0)`` is then 0 both
    ways)."""
    for leaf in tree_leaves(batch):
        if isinstance(leaf, Tensor) and leaf.dim() and leaf.shape[0] > 1 and \
                not bool((leaf[1:] == leaf[:1]).all()):
            return True
    return False


def _rows(batch: Batch, start: int, stop: int) -> Batch:
    return tree_map(lambda leaf: leaf[start:stop], batch)
