"""Factorised (LoGra-style) projected gradients: weight gradients never materialised.

For one example, a layer that applies a weight ``W [r, c]`` (as stored) has the gradient
``G = left.T @ right``, a sum over tokens (or conv positions) ``T`` of outer products:

- ``nn.Linear`` (``W [out, in]``): ``left = delta [T, out]``, ``right = x [T, in]``;
- Hugging Face ``Conv1D`` (``W [in, out]``, GPT-2): ``left = x [T, in]``, ``right = delta``;
- ``nn.Conv2d``: ``left = delta [L, C_out]``, ``right = F.unfold(x).T [L, C_in * kh * kw]``;
- ``nn.Embedding`` (``W [V, d]``): ``left`` = one-hot token ids ``[T, V]`` (never formed),
  ``right = delta [T, d]``;

with ``x`` the layer's input and ``delta`` the loss gradient at its output. The
``kind="kronecker"`` block ``P_r.T @ G @ P_c = (left @ P_r).T @ (right @ P_c)`` is ``[k_r, k_c]``
from two thin products (for an embedding, ``left @ P_r`` is a gather of rows of ``P_r``), so
masked or padded tokens, which have ``delta = 0``, drop out exactly. A weight applied by
several layers (a tied LM head) sums their blocks.

The layers are found while the loss runs, from any loss that calls modules (through
``functional_call`` or not): a global forward hook sees every module call whose weight is one
of the tensors in ``params``. Under ``vmap`` over examples, ``grad`` differentiates the loss
with respect to zero "taps" added to those layers' outputs (which gives ``delta``) and to the
other parameters (biases, norms: projected by the generic projector in the same call). A
one-example check confirms ``G = sum of left.T @ right`` per weight (it fails when a weight is
also read outside a layer's forward); any weight that fails takes the generic path. A loss
that calls no module falls back entirely to the generic path: the numbers are always those of
:func:`~tracinfunc.projection.make_projector` applied to materialised gradients, up to float
rounding.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import grad, vmap
from torch.utils._pytree import tree_leaves, tree_map

from tracinfunc._attention import vmap_attention
from tracinfunc._validate import entry_point
from tracinfunc.errors import InvalidTypeError, LossFunctionError
from tracinfunc.grads.factorized_batched import (
    batched_or_vmapped,
    proof_tolerance,
    tell_vmapped_forward,
)
from tracinfunc.grads.factorized_vectors import (
    KroneckerVectors,
    VectorBlocks,
    split_vectors,
    vector_blocks,
)
from tracinfunc.grads.layer_rules import (
    dense_grad,
    layer_rule,
    project_left,
    rule_sides,
    tapped_loss,
    tapping,
)
from tracinfunc.grads.plan_cache import cached_plan
from tracinfunc.grads.selection import Selection, check_select, selected_names
from tracinfunc.loss import ModuleLoss
from tracinfunc.precondition.factored import preconditioned_sides
from tracinfunc.precondition.optimizer import Preconditioner
from tracinfunc.projection import (
    Projection,
    Projector,
    canonical_layout,
    kronecker_factors,
    make_projector,
)
from tracinfunc.types import Batch, Example, LossFn, Params

__all__ = ["factorized_projected_grads", "factorized_weights"]


class _Plan:
    """Everything fixed for one parameter layout, device and dtype: weights, factors."""

    def __init__(self, projection: Projection, params: Params,
                 precondition: Preconditioner | None = None) -> None:
        first = next(iter(params.values()))
        self.device, self.dtype = first.device, first.dtype
        self.projection = projection
        self.scale = 1 / math.sqrt(projection.dim)
        self.weights: list[str] = []
        self.shapes: dict[tuple, tuple[list, list]] = {}
        self.checked = False
        self.batched: bool | None = None  # batched path proven (None: not yet tried)
        # examples run together in the proof (1 where they were copies of one example): a
        # larger run is proved again, as examples may interact only in larger ones
        self.proved_size = 0
        self.fallback_reason: str | None = None
        self.precondition = precondition  # factored: folded into the factors
        self._finish(params)

    def _finish(self, params: Params) -> None:
        self.shapes.clear()
        self.factors = [kronecker_factors(self.projection, name, params[name].shape,
                                          device=self.device, dtype=self.dtype)
                        for name in self.weights]
        self.offset = None  # a row every example shares (Adam's first moment), or None
        if self.precondition is not None:
            self._precondition_factors()
        rest = {name: value for name, value in params.items() if name not in self.weights}
        vectors, others = split_vectors(self.projection, rest)
        filled = [name for name in others if rest[name].numel() > 0]
        if filled or vectors or self.weights:  # an empty parameter adds nothing to a row
            others = filled
        self.vectors: VectorBlocks | KroneckerVectors | None = None  # biases, norms
        if vectors:
            self.vectors = vector_blocks(self.projection, {n: rest[n] for n in vectors},
                                         device=self.device, dtype=self.dtype)
        self.rest: Projector | None = None
        if others:
            self.rest = make_projector(self.projection,
                                       canonical_layout({n: rest[n] for n in others}),
                                       device=self.device, dtype=self.dtype)

    def _precondition_factors(self) -> None:
        like = torch.empty(0, device=self.device, dtype=self.dtype)
        for index, name in enumerate(self.weights):
            terms = self.precondition.factored_terms(name, like)
            *sides, row = preconditioned_sides(terms, *self.factors[index], self.scale)
            self.factors[index] = tuple(sides)
            if row is not None:
                self.offset = row if self.offset is None else self.offset + row

    def _ids(self, params: Params) -> dict[int, int]:
        return {id(params[name]): i for i, name in enumerate(self.weights)}

    def discover(self, loss: LossFn, params: Params, example: Example) -> None:
        """Find the matrix parameters applied by factorisable layers (one no-grad call)."""
        # A matrix the preconditioner keeps exact (an embedding table) needs its per-element
        # second moment, so its per-example gradient is materialised (the generic projector).
        keep = self.precondition
        # An empty weight (a layer with a side of 0) adds nothing to a row: never factorised
        candidates = sorted(n for n, v in params.items() if v.dim() >= 2 and v.numel() > 0
                            and (keep is None or keep.factorises(n)))
        ids = {id(params[name]): i for i, name in enumerate(candidates)}
        with torch.no_grad(), vmap_attention(), tapping(ids, None, None) as seen:
            loss(params, example)
        found = {index for index, *_ in seen}
        self.weights = [name for i, name in enumerate(candidates) if i in found]
        self._finish(params)

    def tap_shapes(self, loss: LossFn, params: Params, example: Example):
        """Call order and output shapes/dtypes of the layers for examples shaped like this one."""
        key = tuple((leaf.shape, leaf.dtype) for leaf in tree_leaves(example))
        if key not in self.shapes:
            with torch.no_grad(), vmap_attention(), tapping(self._ids(params), None, None) as seen:
                loss(params, example)
            self.shapes[key] = ([(i, id(m)) for i, m, _, _ in seen],
                                [(out.shape, out.dtype) for *_, out in seen])
        return self.shapes[key]

    def same_layer_calls(self, loss: LossFn, params: Params, example: Example) -> bool:
        """Whether ``loss`` calls the same layers, in the same order and with the same output
        shapes, as when this plan was made (one no-grad forward; a shared plan's re-check)."""
        key = tuple((leaf.shape, leaf.dtype) for leaf in tree_leaves(example))
        known = self.shapes.get(key)  # read only: other functions may share this plan
        with torch.no_grad(), vmap_attention(), tapping(self._ids(params), None, None) as seen:
            loss(params, example)
        order = [(i, id(m)) for i, m, _, _ in seen]
        if known is None:  # a new example shape: the same layer objects, in the same order
            return any(order == recorded for recorded, _ in list(self.shapes.values()))
        return known == (order, [(out.shape, out.dtype) for *_, out in seen])

    def layer_sides(self, loss: LossFn, params: Params, example: Example, order, shapes):
        """``(rest grads, [(weight index, rule, left, right)])`` for one example (vmappable)."""
        consts = {name: params[name] for name in self.weights}
        rest = {n: v for n, v in params.items() if n not in consts}
        taps = [torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in shapes]
        ids = self._ids(params)
        modules: list[tuple[int, nn.Module]] = []  # not tensors: kept out of grad's aux

        def inner(rest: Params, taps: list[Tensor]):
            return tapped_loss(loss, {**consts, **rest}, example, ids, taps, order, modules)

        (rest_grads, tap_grads), inputs = grad(inner, argnums=(0, 1), has_aux=True)(rest, taps)
        sides = [(index, layer_rule(module), *rule_sides(layer_rule(module), module, x, delta))
                 for (index, module), x, delta in zip(modules, inputs, tap_grads, strict=True)]
        return rest_grads, sides

    def project(self, loss: LossFn, params: Params, example: Example, order, shapes) -> Tensor:
        rest_grads, sides = self.layer_sides(loss, params, example, order, shapes)
        return self.combine(rest_grads, sides)

    def combine(self, rest_grads: Params, sides: list, *, vectors: bool = True) -> Tensor:
        """One example's row ``[k]`` from its generic gradients and layer sides (without the
        vector block's part when ``vectors=False``: see :meth:`batched_vectors`)."""
        if self.precondition is not None and rest_grads:
            rest_grads = self.precondition.apply(rest_grads)
        total = self.offset
        if self.vectors is not None and vectors:
            part = self.vectors(rest_grads) * self.scale
            total = part if total is None else total + part
        if self.rest is not None:
            part = self.rest({name: rest_grads[name] for name, _ in self.rest.layout})
            total = part if total is None else total + part
        # Calls seen over several rows (tokens, positions) with the same (k_r, k_c): their
        # projected sides stacked along the rows, so sum_l L_l.T @ R_l is one product
        # instead of a product, a reshape, a scaling and an addition per call (under vmap
        # each is a batched operation: a GPU launches each). The projected sides are small
        # ([T, k_r] and [T, k_c] a call), held until the product and copied once by the cat.
        stacked: dict[tuple[int, int], tuple[list[Tensor], list[Tensor]]] = {}
        for index, rule, left, right in sides:
            p_rows, p_cols = self.factors[index]
            if left.is_floating_point():  # a loss's own autocast: half-precision sides
                left = left.to(p_rows.dtype)
            left, right = project_left(rule, left, p_rows), right.to(p_cols.dtype) @ p_cols
            if left.shape[0] == 1:  # seen once: as _linear_rows computes it, bit for bit
                total = _add_block(total, left, right, self.scale)
            else:
                lefts, rights = stacked.setdefault((left.shape[1], right.shape[1]), ([], []))
                lefts.append(left)
                rights.append(right)
        for lefts, rights in stacked.values():
            left = lefts[0] if len(lefts) == 1 else torch.cat(lefts)
            right = rights[0] if len(rights) == 1 else torch.cat(rights)
            total = _add_block(total, left, right, self.scale)
        return total

    def batched_vectors(self, rest_grads: Params) -> Tensor | None:
        """``[b, k]``: the vector block's part of a batch's rows from ``{name: [b, *shape]}``,
        outside ``vmap`` (then :meth:`combine` runs with ``vectors=False``); ``None`` when
        there is no block or a preconditioner applies to the gradients first."""
        if self.vectors is None or self.precondition is not None:
            return None
        # The product is a new tensor: scaled in place, one [b, k] allocation fewer (on a
        # CPU a fresh block of a few MiB is paid again in page faults), same values.
        return self.vectors.batched(rest_grads).mul_(self.scale)

    def check(self, loss: LossFn, params: Params, example: Example) -> None:
        """Drop weights whose gradient is not the sum of their layers' ``left.T @ right``."""
        self.checked = True
        if not self.weights:
            return
        with vmap_attention():  # the kernel the vmapped rows use (a loss may differentiate it)
            exact = grad(loss)(params, example)
            try:
                order, shapes = self.tap_shapes(loss, params, example)
                _, sides = self.layer_sides(loss, params, example, order, shapes)
            except (RuntimeError, LossFunctionError) as error:  # the loss alone ran above
                self._materialise_all(params, error)
                return
        # A layer run in half precision (the loss's own autocast) has its gradient rounded
        # there: compared to that rounding, as the batched proof compares rows
        rounding: dict[int, float] = {}
        for (index, _), (_, dtype) in zip(order, shapes, strict=True):
            if dtype.is_floating_point and torch.finfo(dtype).bits < 32:
                rounding[index] = max(rounding.get(index, 0.0), proof_tolerance(dtype))
        bad = []
        for index, name in enumerate(self.weights):
            expected = exact[name].reshape(exact[name].shape[0], -1)
            got = sum(dense_grad(rule, left, right, expected.shape[0]).to(expected.dtype)
                      for i, rule, left, right in sides if i == index)
            scale = float(expected.abs().max()) if expected.numel() else 0.0
            rtol = rounding.get(index, 1e-3)
            atol = (rtol if index in rounding else 1e-5) * scale + 1e-30
            if isinstance(got, int) or not torch.allclose(got, expected, rtol=rtol, atol=atol):
                bad.append(name)
        if bad:
            warnings.warn(
                f"projected_grads: the gradients of {bad} are not their layers' (output "
                "gradient x input) alone (the weight is also used outside a layer's forward); "
                "they are projected from materialised per-example gradients instead (same "
                "projection, more memory and time).", stacklevel=5)
            self.weights = [name for name in self.weights if name not in bad]
            self._finish(params)

    def _materialise_all(self, params: Params, error: Exception) -> None:
        """No layer factorises: their inputs could not be captured (a loss that runs its
        layers inside its own ``torch.func`` transform, whose tensors cannot leave it)."""
        reason = " ".join(str(error).split())[:300]
        warnings.warn(
            f"projected_grads: the layers' inputs and output gradients could not be captured "
            f"for this loss ({type(error).__name__}: {reason}); a loss that runs its layers "
            "inside its own torch.func.grad, jvp or vmap does this. Every gradient is "
            "projected from materialised per-example gradients instead (same projection, "
            "more memory and time).", stacklevel=6)
        self.weights = []
        self._finish(params)


def _plan_for(plans: dict, loss: LossFn, projection: Projection, params: Params,
              example: Example, precondition: Preconditioner | None = None, *,
              shared: tuple[LossFn, Params] | None = None) -> _Plan:
    """This function's plan for the layout of ``params``; with ``shared=(user loss, frozen
    params)`` one already proved for the same loss and layout is reused
    (:mod:`~tracinfunc.grads.plan_cache`)."""
    first = next(iter(params.values()))
    key = (canonical_layout(params), first.device, first.dtype)
    if key not in plans:
        def make() -> _Plan:
            return _new_plan(loss, projection, params, example, precondition)

        def still_valid(plan: _Plan) -> bool:
            return plan.same_layer_calls(loss, params, example)

        plans[key] = make() if shared is None else cached_plan(
            shared[0], projection, params, shared[1], precondition, make, still_valid)
    return plans[key]


def _new_plan(loss: LossFn, projection: Projection, params: Params, example: Example,
              precondition: Preconditioner | None) -> _Plan:
    plan = _Plan(projection, params, precondition)
    plan.discover(loss, params, example)
    plan.check(loss, params, example)
    if not plan.weights:
        warnings.warn(
            "projected_grads: kind='kronecker' factorised no layer (no nn.Linear, HF "
            "Conv1D, nn.Conv2d or nn.Embedding applies a parameter of params); every "
            "gradient is materialised per example and projected by the same Kronecker "
            "matrices. Dense Kronecker blocks need a larger k than sjlt for the same "
            "accuracy; kind='sjlt' is the better choice for such a loss.", stacklevel=5)
    return plan


def factorized_projected_grads(
    loss: LossFn, projection: Projection, *, chunk_size: int | None = None,
    select: Selection | None = None, batched: bool = True,
    precondition: Preconditioner | None = None,
) -> Callable[[Params, Batch], Tensor]:
    """Per-example gradients projected with ``kind="kronecker"``, layer weights factorised.

    Called by :func:`~tracinfunc.projected_grads` for ``kind="kronecker"``; same contract.

    Args:
        loss: Any ``loss(params, example)``; layers it calls (directly, through
            ``functional_call`` or a :func:`~tracinfunc.loss_from_model` loss) are factorised.
        projection: A ``kind="kronecker"`` spec.
        chunk_size: Examples processed at once inside vmap (``None``: the whole batch).
        select: Differentiate only these parameters (as for ``projected_grads``).
        batched: One backward of the batch's summed loss
            (:mod:`~tracinfunc.grads.factorized_batched`, proven on the first batch);
            ``False``: a per-example backward under ``vmap``. Same rows.
        precondition: A factored :class:`~tracinfunc.Preconditioner`
            (``factored=True``), folded into the Kronecker side projections.

    Returns:
        ``fn(params, batch) -> [b, k]``, equal (up to float rounding) to projecting the
        materialised per-example gradients with ``make_projector(projection, layout)``.
    """
    if not callable(loss):
        raise LossFunctionError(
            f"projected_grads: loss must be callable as loss(params, example), got "
            f"{type(loss).__name__}."
        )
    if not isinstance(projection, Projection) or projection.kind != "kronecker":
        raise InvalidTypeError(
            "factorized_projected_grads: projection must be a Projection with "
            f"kind='kronecker', got {projection!r}."
        )
    select = check_select(select)
    plans: dict[tuple, _Plan] = {}

    def factorized_fn(params: Params, batch: Batch) -> Tensor:
        names = selected_names(params, select)
        chosen = {name: params[name] for name in names}
        frozen = {n: v for n, v in params.items() if n not in chosen}

        def selected_loss(selected: Params, example: Example) -> Tensor:
            return loss({**frozen, **selected}, example)

        if precondition is not None:
            precondition.check({n: tuple(v.shape) for n, v in params.items()}, names)
        example = tree_map(lambda leaf: leaf[0], batch)
        plan = _plan_for(plans, selected_loss, projection, chosen, example, precondition,
                         shared=(loss, frozen))
        order, shapes = plan.tap_shapes(selected_loss, chosen, example)

        def one_example(chosen: Params, example: Example) -> Tensor:
            return plan.project(selected_loss, chosen, example, order, shapes)

        def vmapped(batch: Batch) -> Tensor:
            with vmap_attention():
                return vmap(one_example, in_dims=(None, 0), chunk_size=chunk_size)(chosen,
                                                                                   batch)

        if not batched:
            return vmapped(batch)
        batch_loss = _batch_loss(loss, frozen)
        if batch_loss is None and plan.batched is None:
            tell_vmapped_forward(loss)
        return batched_or_vmapped(plan, selected_loss, chosen, batch, order, shapes,
                                  vmapped=vmapped, chunk_size=chunk_size,
                                  batch_loss=batch_loss)

    return factorized_fn


def _batch_loss(loss: LossFn, frozen: Params):
    """``batch_loss(selected, batch) -> [b]`` from one batched forward, for a
    :class:`~tracinfunc.loss.ModuleLoss` with a criterion; else ``None``."""
    if not isinstance(loss, ModuleLoss) or loss.criterion is None:
        return None
    return lambda selected, batch: loss.per_example({**frozen, **selected}, batch)


@entry_point("factorized_weights")
def factorized_weights(loss: LossFn, params: Params, example: Example, *,
                       select: Selection | None = None) -> list[str]:
    """The parameters that ``kind="kronecker"`` factorises for this loss (sorted names).

    Runs the discovery and the one-example check of the factorised path on ``example`` (no
    batch dimension); every other selected parameter is projected from its materialised
    per-example gradient. Use it to see what the fast path covers before a long run.

    Example:
        >>> factorized_weights(causal_lm_loss(gpt2), params, example)
        ['transformer.h.0.attn.c_attn.weight', ..., 'transformer.wte.weight']
    """
    names = selected_names(params, check_select(select))
    chosen = {name: params[name] for name in names}
    frozen = {n: v for n, v in params.items() if n not in chosen}
    any_kronecker = Projection(dim=4, kind="kronecker")

    def selected_loss(selected: Params, example: Example) -> Tensor:
        return loss({**frozen, **selected}, example)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = _plan_for({}, selected_loss, any_kronecker, chosen, example)
    return sorted(plan.weights)


def _add_block(total: Tensor | None, left: Tensor, right: Tensor, scale: float) -> Tensor:
    """``total + scale * (left.T @ right).reshape(-1)`` for one example's layer sides
    ``left [T, k_r]``, ``right [T, k_c]`` (``total [k_r * k_c]`` or ``None``). With one row
    (``T == 1``, a layer seen once per example) the outer product is a single pointwise pass
    under ``vmap``, where a matmul, a scaling and an addition would each make one."""
    if left.shape[0] != 1:
        part = (left.T @ right).reshape(-1) * scale
        return part if total is None else total + part
    if total is None:
        return (left.T * (right * scale)).reshape(-1)
    return torch.addcmul(total.reshape(left.shape[1], right.shape[1]), left.T, right,
                         value=scale).reshape(-1)
