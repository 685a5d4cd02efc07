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
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad, vmap
from torch.nn.modules.module import register_module_forward_hook
from torch.utils._pytree import tree_leaves, tree_map

from tracinfunc._validate import entry_point
from tracinfunc.errors import InvalidTypeError, LossFunctionError
from tracinfunc.grads.selection import Selection, check_select, selected_names
from tracinfunc.projection import (
    Projection,
    Projector,
    canonical_layout,
    kronecker_factors,
    make_projector,
)
from tracinfunc.types import Batch, Example, LossFn, Params

__all__ = ["factorizable_layers", "factorized_projected_grads", "factorized_weights"]


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


def _sides(rule: str, module: nn.Module, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
    """``(left, right)`` with ``G = left.T @ right``; for embeddings ``left`` is token ids
    ``[T]`` with ``-1`` where the gradient is zero (``padding_idx``)."""
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


def _project_left(rule: str, left: Tensor, p_rows: Tensor) -> Tensor:
    """``left @ P_r`` ``[T, k_r]``: a row gather for embeddings (zero for ``-1`` ids)."""
    if rule != "embedding":
        return left @ p_rows
    rows = p_rows[left.clamp_min(0)]  # [T, k_r]
    return rows * (left >= 0).unsqueeze(-1).to(rows.dtype)


def _dense(rule: str, left: Tensor, right: Tensor, rows: int) -> Tensor:
    """``G [r, c]`` of one call (the one-example check only)."""
    if rule != "embedding":
        return left.T @ right
    keep = (left >= 0).unsqueeze(-1).to(right.dtype)
    zeros = right.new_zeros(rows, right.shape[-1])
    return zeros.index_add(0, left.clamp_min(0), right * keep)


@contextmanager
def _tapping(weight_ids: dict[int, int], taps: list[Tensor] | None, order: list | None):
    """A global forward hook recording calls of layers whose weight is in ``weight_ids``.

    Yields a list that fills with ``(weight index, module, input, output)`` per call;
    ``taps[i]`` is added to the ``i``-th call's output (``None``: record only). ``order`` (when
    given) is the call order found on the first example; a different order is refused.
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
        seen.append((index, module, inputs[0], output))
        return None if taps is None else output + taps[call]

    handle = register_module_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


class _Plan:
    """Everything fixed for one parameter layout, device and dtype: weights, factors."""

    def __init__(self, projection: Projection, params: Params) -> None:
        first = next(iter(params.values()))
        self.device, self.dtype = first.device, first.dtype
        self.projection = projection
        self.scale = 1 / math.sqrt(projection.dim)
        self.weights: list[str] = []
        self.shapes: dict[tuple, tuple[list, list]] = {}
        self.checked = False
        self._finish(params)

    def _finish(self, params: Params) -> None:
        self.shapes.clear()
        self.factors = [kronecker_factors(self.projection, name, params[name].shape,
                                          device=self.device, dtype=self.dtype)
                        for name in self.weights]
        rest = {name: value for name, value in params.items() if name not in self.weights}
        self.rest: Projector | None = None
        if rest:
            self.rest = make_projector(self.projection, canonical_layout(rest),
                                       device=self.device, dtype=self.dtype)

    def _ids(self, params: Params) -> dict[int, int]:
        return {id(params[name]): i for i, name in enumerate(self.weights)}

    def discover(self, loss: LossFn, params: Params, example: Example) -> None:
        """Find the matrix parameters applied by factorisable layers (one no-grad call)."""
        candidates = sorted(n for n, v in params.items() if v.dim() >= 2)
        ids = {id(params[name]): i for i, name in enumerate(candidates)}
        with torch.no_grad(), _tapping(ids, None, None) as seen:
            loss(params, example)
        found = {index for index, *_ in seen}
        self.weights = [name for i, name in enumerate(candidates) if i in found]
        self._finish(params)

    def tap_shapes(self, loss: LossFn, params: Params, example: Example):
        """Call order and output shapes/dtypes of the layers for examples shaped like this one."""
        key = tuple((leaf.shape, leaf.dtype) for leaf in tree_leaves(example))
        if key not in self.shapes:
            with torch.no_grad(), _tapping(self._ids(params), None, None) as seen:
                loss(params, example)
            self.shapes[key] = ([(i, id(m)) for i, m, _, _ in seen],
                                [(out.shape, out.dtype) for *_, out in seen])
        return self.shapes[key]

    def layer_sides(self, loss: LossFn, params: Params, example: Example, order, shapes):
        """``(rest grads, [(weight index, rule, left, right)])`` for one example (vmappable)."""
        consts = {name: params[name] for name in self.weights}
        rest = {n: v for n, v in params.items() if n not in consts}
        taps = [torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in shapes]
        ids = self._ids(params)
        modules: list[tuple[int, nn.Module]] = []  # not tensors: kept out of grad's aux

        def inner(rest: Params, taps: list[Tensor]):
            with _tapping(ids, taps, order) as seen:
                value = loss({**consts, **rest}, example)
            if len(seen) != len(order):
                raise LossFunctionError(
                    f"projected_grads: {len(seen)} layer calls, {len(order)} on the first "
                    "example; the factorised kind='kronecker' path needs the same layer calls "
                    "for every example. Use kind='sjlt' or 'rademacher'."
                )
            modules[:] = [(index, module) for index, module, _, _ in seen]
            return value, [x for _, _, x, _ in seen]

        (rest_grads, tap_grads), inputs = grad(inner, argnums=(0, 1), has_aux=True)(rest, taps)
        sides = [(index, layer_rule(module), *_sides(layer_rule(module), module, x, delta))
                 for (index, module), x, delta in zip(modules, inputs, tap_grads, strict=True)]
        return rest_grads, sides

    def project(self, loss: LossFn, params: Params, example: Example, order, shapes) -> Tensor:
        rest_grads, sides = self.layer_sides(loss, params, example, order, shapes)
        total = self.rest(rest_grads) if self.rest is not None else None
        for index, rule, left, right in sides:
            p_rows, p_cols = self.factors[index]
            block = _project_left(rule, left, p_rows).T @ (right @ p_cols)  # [k_r, k_c]
            part = block.reshape(-1) * self.scale
            total = part if total is None else total + part
        return total

    def check(self, loss: LossFn, params: Params, example: Example) -> None:
        """Drop weights whose gradient is not the sum of their layers' ``left.T @ right``."""
        self.checked = True
        if not self.weights:
            return
        order, shapes = self.tap_shapes(loss, params, example)
        _, sides = self.layer_sides(loss, params, example, order, shapes)
        exact = grad(loss)(params, example)
        bad = []
        for index, name in enumerate(self.weights):
            expected = exact[name].reshape(exact[name].shape[0], -1)
            got = sum(_dense(rule, left, right, expected.shape[0])
                      for i, rule, left, right in sides if i == index)
            scale = float(expected.abs().max()) if expected.numel() else 0.0
            if isinstance(got, int) or not torch.allclose(
                    got, expected, rtol=1e-3, atol=1e-5 * scale + 1e-30):
                bad.append(name)
        if bad:
            warnings.warn(
                f"projected_grads: the gradients of {bad} are not their layers' (output "
                "gradient x input) alone (the weight is also used outside a layer's forward); "
                "they are projected from materialised per-example gradients instead (same "
                "projection, more memory and time).", stacklevel=5)
            self.weights = [name for name in self.weights if name not in bad]
            self._finish(params)


def _plan_for(plans: dict, loss: LossFn, projection: Projection, params: Params,
              example: Example) -> _Plan:
    first = next(iter(params.values()))
    key = (canonical_layout(params), first.device, first.dtype)
    if key not in plans:
        plan = _Plan(projection, params)
        plan.discover(loss, params, example)
        plan.check(loss, params, example)
        if not plan.weights:
            warnings.warn(
                "projected_grads: kind='kronecker' factorised no layer (no nn.Linear, HF "
                "Conv1D, nn.Conv2d or nn.Embedding applies a parameter of params); every "
                "gradient is materialised per example and projected by the same Kronecker "
                "matrices. Dense Kronecker blocks need a larger k than sjlt for the same "
                "accuracy; kind='sjlt' is the better choice for such a loss.", stacklevel=4)
        plans[key] = plan
    return plans[key]


def factorized_projected_grads(
    loss: LossFn, projection: Projection, *, chunk_size: int | None = None,
    select: Selection | None = None,
) -> Callable[[Params, Batch], Tensor]:
    """Per-example gradients projected with ``kind="kronecker"``, layer weights factorised.

    Called by :func:`~tracinfunc.projected_grads` for ``kind="kronecker"``; same contract.

    Args:
        loss: Any ``loss(params, example)``; layers it calls (directly, through
            ``functional_call`` or a :func:`~tracinfunc.loss_from_model` loss) are factorised.
        projection: A ``kind="kronecker"`` spec.
        chunk_size: Examples processed at once inside vmap (``None``: the whole batch).
        select: Differentiate only these parameters (as for ``projected_grads``).

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

        example = tree_map(lambda leaf: leaf[0], batch)
        plan = _plan_for(plans, selected_loss, projection, chosen, example)
        order, shapes = plan.tap_shapes(selected_loss, chosen, example)

        def one_example(chosen: Params, example: Example) -> Tensor:
            return plan.project(selected_loss, chosen, example, order, shapes)

        return vmap(one_example, in_dims=(None, 0), chunk_size=chunk_size)(chosen, batch)

    return factorized_fn


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


def factorizable_layers(module: nn.Module, params: Params) -> list[str]:
    """Names of the weights in ``params`` applied by a factorisable layer of ``module``.

    A static look at the module tree (:func:`factorized_weights` runs the loss and is the
    authority): exactly ``nn.Linear``, HF ``Conv1D``, ``nn.Conv2d`` (``groups=1``, numeric
    zero padding) and ``nn.Embedding`` (no ``max_norm``), whose weight is in ``params``.
    """
    names = {id(value): name for name, value in module.named_parameters()}
    found = set()
    for _, sub in module.named_modules(remove_duplicate=False):
        name = names.get(id(getattr(sub, "weight", None)))
        if name in params and layer_rule(sub) is not None:
            found.add(name)
    return sorted(found)
