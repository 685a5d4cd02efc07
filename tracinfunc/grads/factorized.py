"""Factorised (LoGra-style) projected gradients: Linear/Conv2d weights never materialised.

For one example, a Linear layer's weight gradient is ``G = delta.T @ x``, with ``x [T, d_in]``
the layer's inputs and ``delta [T, d_out]`` the loss gradient at its outputs (``T`` = tokens,
or conv output positions after ``F.unfold``). The ``kind="kronecker"`` block of ``G`` is
``P_out.T @ G @ P_in = (delta @ P_out).T @ (x @ P_in)``: ``[k_out, k_in]`` from two thin
products, never the ``[d_out, d_in]`` gradient. This module computes it with torch.func:
under ``vmap`` over examples, ``grad`` differentiates the loss with respect to zero "taps"
added to each layer's output (which gives ``delta``) and to the other parameters (biases,
norms, embeddings: projected by the generic projector), while forward hooks hand back ``x``.
The numbers are those of :func:`~tracinfunc.projection.make_projector` applied to the
materialised gradients, up to float rounding.

A layer is factorised when it is exactly ``nn.Linear`` or ``nn.Conv2d`` (``groups=1``, zero
padding given as numbers), its weight is a trainable parameter used by no other module, and a
one-example check confirms ``G = sum over calls of delta.T @ x`` (it fails when the weight is
also read outside the layer's forward); any other parameter takes the generic path.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad, vmap
from torch.utils._pytree import tree_leaves, tree_map

from tracinfunc.errors import InvalidTypeError, LossFunctionError
from tracinfunc.loss import ModuleLoss
from tracinfunc.projection import (
    Projection,
    Projector,
    canonical_layout,
    kronecker_factors,
    make_projector,
)
from tracinfunc.types import Batch, Example, Params

__all__ = ["factorizable_layers", "factorized_projected_grads"]


@dataclass(frozen=True, eq=False)
class _Layer:
    """One factorised layer: its module, weight name and how to read ``x``/``delta``."""

    name: str
    weight: str
    module: nn.Module

    def inputs_matrix(self, inputs: Tensor) -> Tensor:
        """``x [T, d_in]`` from the layer's input (one example, leading batch dim of 1)."""
        module = self.module
        if isinstance(module, nn.Conv2d):
            columns = F.unfold(inputs, module.kernel_size, module.dilation, module.padding,
                               module.stride)  # [1, C_in * kh * kw, L]
            return columns.reshape(columns.shape[-2], columns.shape[-1]).T
        return inputs.reshape(-1, module.in_features)

    def output_grads_matrix(self, output_grads: Tensor) -> Tensor:
        """``delta [T, d_out]`` from the gradient at the layer's output."""
        if isinstance(self.module, nn.Conv2d):
            return output_grads.reshape(self.module.out_channels, -1).T  # [L, C_out]
        return output_grads.reshape(-1, self.module.out_features)


def factorizable_layers(module: nn.Module, params: Params) -> list[str]:
    """Names of the weights in ``params`` that the factorised path can handle (sorted).

    Exactly ``nn.Linear`` and ``nn.Conv2d`` (``groups=1``, numeric zero padding) whose weight
    is in ``params`` and belongs to no other module; subclasses are excluded because some
    (``nn.MultiheadAttention.out_proj``) are used without calling their forward. A weight
    used outside its layer's forward is caught later by a one-example check.
    """
    return sorted(layer.weight for layer in _find_layers(module, params))


def _find_layers(module: nn.Module, params: Params) -> list[_Layer]:
    owners: dict[int, int] = {}
    for _, sub in module.named_modules(remove_duplicate=False):
        for value in sub.parameters(recurse=False):
            owners[id(value)] = owners.get(id(value), 0) + 1
    layers = []
    for name, sub in module.named_modules():
        weight = f"{name}.weight" if name else "weight"
        if weight not in params or owners.get(id(sub.weight), 0) != 1:
            continue
        conv_ok = (type(sub) is nn.Conv2d and sub.groups == 1 and sub.padding_mode == "zeros"
                   and not isinstance(sub.padding, str))
        if type(sub) is nn.Linear or conv_ok:
            layers.append(_Layer(name, weight, sub))
    return sorted(layers, key=lambda layer: layer.weight)


@contextmanager
def _tapping(layers: Sequence[_Layer], taps: Sequence[Tensor] | None, order: list[int] | None):
    """Hooks that record each layer call's input, add its tap to the output, and the order.

    Yields a list that fills with ``(layer index, input)`` per call; ``taps[i]`` is added to
    the ``i``-th call's output (``None``: record only). ``order`` (when given) is the call
    order found when the taps were shaped; a different order is refused.
    """
    seen: list[tuple[int, Tensor, Tensor]] = []

    def hook_for(index: int):
        def hook(_module, inputs, output):
            call = len(seen)
            if order is not None and (call >= len(order) or order[call] != index):
                raise LossFunctionError(
                    f"projected_grads: layer {layers[index].name!r} was called in another "
                    "order (or number of times) than on the first example; the factorised "
                    "kind='kronecker' path needs the same layer calls for every example of a "
                    "batch. Use kind='sjlt' or 'rademacher' for data-dependent control flow."
                )
            seen.append((index, inputs[0], output))
            return output if taps is None else output + taps[call]
        return hook

    handles = [layer.module.register_forward_hook(hook_for(i)) for i, layer in enumerate(layers)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


class _Plan:
    """Everything fixed for one parameter layout, device and dtype: layers, factors, projector."""

    def __init__(self, loss: ModuleLoss, projection: Projection, params: Params) -> None:
        first = next(iter(params.values()))
        self.device, self.dtype = first.device, first.dtype
        self.loss, self.projection = loss, projection
        self.layers = _find_layers(loss.module, params)
        self.scale = 1 / math.sqrt(projection.dim)
        self.shapes: dict[tuple, tuple[list[int], list[tuple]]] = {}
        self.checked = False
        self._finish(params)

    def _finish(self, params: Params) -> None:
        weights = {layer.weight for layer in self.layers}
        rest = {name: value for name, value in params.items() if name not in weights}
        self.factors = [kronecker_factors(self.projection, layer.weight,
                                          params[layer.weight].shape, device=self.device,
                                          dtype=self.dtype) for layer in self.layers]
        self.rest: Projector | None = None
        if rest and sum(v.numel() for v in rest.values()) > 0:
            self.rest = make_projector(self.projection, canonical_layout(rest),
                                       device=self.device, dtype=self.dtype)

    def drop_layers(self, weights: set[str], params: Params) -> None:
        self.layers = [layer for layer in self.layers if layer.weight not in weights]
        self.shapes.clear()
        self._finish(params)

    def tap_shapes(self, params: Params, example: Example) -> tuple[list[int], list[tuple]]:
        """Call order and output shapes/dtypes of the layers for examples shaped like this one."""
        key = tuple((leaf.shape, leaf.dtype) for leaf in tree_leaves(example))
        if key not in self.shapes:
            with torch.no_grad(), _tapping(self.layers, None, None) as seen:
                self.loss(params, example)
            self.shapes[key] = ([i for i, _, _ in seen],
                                [(out.shape, out.dtype) for _, _, out in seen])
        return self.shapes[key]

    def layer_grads(self, params: Params, example: Example, order, shapes):
        """``(rest grads, [(layer index, x, delta)])`` for one example (vmappable)."""
        weights = {layer.weight for layer in self.layers}
        consts = {n: v for n, v in params.items() if n in weights}
        rest = {n: v for n, v in params.items() if n not in weights}
        taps = [torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in shapes]

        def inner(rest: Params, taps: list[Tensor]):
            with _tapping(self.layers, taps, order) as seen:
                value = self.loss({**consts, **rest}, example)
            if len(seen) != len(order):
                raise LossFunctionError(
                    f"projected_grads: {len(seen)} layer calls, {len(order)} on the first "
                    "example; the factorised kind='kronecker' path needs the same layer calls "
                    "for every example. Use kind='sjlt' or 'rademacher'."
                )
            return value, [inputs for _, inputs, _ in seen]

        (rest_grads, tap_grads), inputs = grad(inner, argnums=(0, 1), has_aux=True)(rest, taps)
        calls = [(index, self.layers[index].inputs_matrix(x),
                  self.layers[index].output_grads_matrix(delta))
                 for index, x, delta in zip(order, inputs, tap_grads, strict=True)]
        return rest_grads, calls

    def project(self, params: Params, example: Example, order, shapes) -> Tensor:
        rest_grads, calls = self.layer_grads(params, example, order, shapes)
        total = self.rest(rest_grads) if self.rest is not None else None
        for index, x, delta in calls:
            p_out, p_in = self.factors[index]
            block = (delta @ p_out).T @ (x @ p_in)  # [k_out, T] @ [T, k_in]
            part = block.reshape(-1) * self.scale
            total = part if total is None else total + part
        return total

    def check(self, params: Params, example: Example) -> None:
        """Drop layers whose weight gradient is not ``sum of delta.T @ x`` (used elsewhere)."""
        self.checked = True
        if not self.layers:
            return
        order, shapes = self.tap_shapes(params, example)
        _, calls = self.layer_grads(params, example, order, shapes)
        exact = grad(self.loss)(params, example)
        bad = set()
        for index, layer in enumerate(self.layers):
            factorised = sum(delta.T @ x for i, x, delta in calls if i == index)
            expected = exact[layer.weight].reshape(exact[layer.weight].shape[0], -1)
            scale = float(expected.abs().max()) if expected.numel() else 0.0
            if isinstance(factorised, int) or not torch.allclose(
                    factorised, expected, rtol=1e-3, atol=1e-5 * scale + 1e-30):
                bad.add(layer.weight)
        if bad:
            warnings.warn(
                f"projected_grads: the gradients of {sorted(bad)} are not the layer's "
                "(output gradient x input) alone (the weight is also used outside the layer's "
                "forward, e.g. tied or read directly); they are projected from materialised "
                "per-example gradients instead (same projection, more memory and time).",
                stacklevel=4,
            )
            self.drop_layers(bad, params)


def factorized_projected_grads(
    loss: ModuleLoss, projection: Projection, *, chunk_size: int | None = None
) -> Callable[[Params, Batch], Tensor]:
    """Per-example gradients projected with ``kind="kronecker"``, Linear/Conv2d factorised.

    Called by :func:`~tracinfunc.projected_grads` for ``kind="kronecker"``; same contract.

    Args:
        loss: A :class:`~tracinfunc.loss.ModuleLoss` from :func:`~tracinfunc.loss_from_module`.
        projection: A ``kind="kronecker"`` spec.
        chunk_size: Examples processed at once inside vmap (``None``: the whole batch).

    Returns:
        ``fn(params, batch) -> [b, k]``, equal (up to float rounding) to projecting the
        materialised per-example gradients with ``make_projector(projection, layout)``.

    Raises:
        LossFunctionError: ``loss`` is not a ModuleLoss.
    """
    if not isinstance(loss, ModuleLoss):
        raise LossFunctionError(
            "projected_grads: kind='kronecker' projects Linear/Conv2d weights from layer "
            "inputs and output gradients, so it needs the model: pass "
            f"loss=tif.loss_from_module(model, criterion), got {type(loss).__name__}. For any "
            "other loss, project materialised gradients with the same matrix: "
            "vmap(make_projector(projection, canonical_layout(params)))(per_sample_grads(loss)"
            "(params, batch))."
        )
    if not isinstance(projection, Projection) or projection.kind != "kronecker":
        raise InvalidTypeError(
            "factorized_projected_grads: projection must be a Projection with "
            f"kind='kronecker', got {projection!r}."
        )
    plans: dict[tuple, _Plan] = {}

    def factorized_fn(params: Params, batch: Batch) -> Tensor:
        params = dict(params)
        first = next(iter(params.values()))
        key = (canonical_layout(params), first.device, first.dtype)
        if key not in plans:
            plans[key] = _Plan(loss, projection, params)
        plan = plans[key]
        example = tree_map(lambda leaf: leaf[0], batch)
        if not plan.checked:
            plan.check(params, example)
        order, shapes = plan.tap_shapes(params, example)

        def one_example(params: Params, example: Example) -> Tensor:
            return plan.project(params, example, order, shapes)

        return vmap(one_example, in_dims=(None, 0), chunk_size=chunk_size)(params, batch)

    return factorized_fn

