"""The batched kronecker path's fastest mode: one batched forward of the module, no vmap.

A :class:`~tracinfunc.loss.ModuleLoss` computes a batch's per-example losses from one ordinary
forward (:meth:`~tracinfunc.loss.ModuleLoss.per_example`), as a training step does. One
backward of the summed losses, taken at every factorised layer's output ``[b, ...]`` itself (no
zero tap to allocate and add, except on an output that needs no gradient or is shared by the
batch), gives each example's output gradients; an output modified in place later in the
forward is refused (the gradient at it would be the one at its last version). Parameters that
are not factorised weights get their per-example gradients from the same output gradients,
when each is

- the bias of a factorised layer: the output gradient summed over positions;
- the weight or bias of an ``nn.LayerNorm`` over the last dimension: the output gradient
  times the normalised input (weight), or alone (bias), summed over positions.

Any other parameter, examples that interact in a batched forward, or layer outputs without a
leading batch dimension make this mode fail or disagree on the first batch, and the caller
(:mod:`tracinfunc.grads.factorized_batched`) keeps a slower mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from tracinfunc._hooks import register_thread_forward_hook
from tracinfunc.errors import LossFunctionError
from tracinfunc.grads.layer_rules import differentiable, layer_rule, tapping
from tracinfunc.types import Batch, Params

__all__ = ["forward_sides"]


def forward_sides(plan, batch_loss: Callable[[Params, Batch], Tensor], params: Params,
                  batch: Batch, order, shapes) -> tuple[list, list, list, Params]:
    """``(modules, inputs [b, 1, ...], deltas [b, 1, ...], rest grads [b, *shape])``.

    Raises:
        LossFunctionError: a parameter is neither a factorised weight nor claimed by a rule, or
            the batched forward called the layers differently.
    """
    b = tree_leaves(batch)[0].shape[0]
    consts = {name: value.detach() for name, value in params.items()}  # views, no copy
    ids = {id(consts[name]): i for i, name in enumerate(plan.weights)}
    rest = {id(value): name for name, value in consts.items() if name not in plan.weights}
    claims = _Claims(ids, rest, b)
    with torch.enable_grad(), tapping(ids, "outputs", order, b) as seen, claims:
        values = batch_loss(consts, batch)  # [b]
        outputs = [out for *_, out in seen] + [out for *_, out in claims.norms]
        _check_unchanged(outputs, claims.versions)
        grads = torch.autograd.grad(values.sum(), outputs, materialize_grads=True)
    if len(seen) != len(order):
        raise LossFunctionError(
            f"projected_grads: {len(seen)} layer calls in one batched forward, {len(order)} "
            "for one example")
    deltas, norm_deltas = grads[:len(seen)], grads[len(seen):]
    rest_grads: dict[str, Tensor] = {}
    for (_, module, _, _), bias, delta in zip(seen, claims.biases, deltas, strict=True):
        if bias is not None:
            _add(rest_grads, bias, _bias_grad(module, delta))
    for (module, x, names, _), delta in zip(claims.norms, norm_deltas, strict=True):
        xhat = F.layer_norm(x.detach(), module.normalized_shape, eps=module.eps)
        width = module.normalized_shape[0]
        _add(rest_grads, names[0], (delta * xhat).reshape(b, -1, width).sum(1))
        _add(rest_grads, names[1], delta.reshape(b, -1, width).sum(1))
    missing = sorted(set(rest.values()) - set(rest_grads))
    if missing:
        raise LossFunctionError(
            f"projected_grads: parameters {missing[:4]} are not biases of factorised layers "
            "or LayerNorm parameters")
    modules = [(index, module) for index, module, _, _ in seen]
    # An input shared by the batch (GPT-2's position ids, [1, T]) is every example's input.
    inputs = [x.detach().expand(b, *x.shape[1:]).unsqueeze(1) for _, _, x, _ in seen]
    return modules, inputs, [d.unsqueeze(1) for d in deltas], rest_grads


def _check_unchanged(targets: list[Tensor], versions: dict[int, tuple]) -> None:
    """Refuse layer outputs modified in place after their layer returned them: the gradient
    taken at such a tensor is the gradient at its last version, not at the layer's output (a
    zero tap, where one was added, is never modified)."""
    changed = [target for target in targets if id(target) in versions
               and versions[id(target)][1] != target._version]
    if changed:
        raise LossFunctionError(
            f"projected_grads: {len(changed)} layer outputs were modified in place during the "
            "forward; their output gradients cannot be read from one batched backward")


def _bias_grad(module: nn.Module, delta: Tensor) -> Tensor:
    """Per-example bias gradient ``[b, out]`` of a factorised layer."""
    if layer_rule(module) == "conv2d":
        return delta.sum(dim=(2, 3))  # [b, C_out, H, W] -> [b, C_out]
    return delta.reshape(delta.shape[0], -1, delta.shape[-1]).sum(1)


def _add(grads: dict[str, Tensor], name: str | None, value: Tensor) -> None:
    if name is not None:
        grads[name] = grads[name] + value if name in grads else value


class _Claims:
    """A forward hook noting, while parameters are swapped in, the bias of each factorised
    layer call (``biases``, in call order) and the output of every ``nn.LayerNorm`` over the
    last dimension whose weight or bias is one of ``rest`` (``norms``: module, input, (weight
    name, bias name), output), and each kept output's version."""

    def __init__(self, weights: dict[int, int], rest: dict[int, str], batch: int) -> None:
        self.weights, self.rest, self.batch = weights, rest, batch
        self.biases: list[str | None] = []
        self.norms: list[tuple] = []
        # id(output) -> (output, its version when made); held so that no id is reused
        self.versions: dict[int, tuple[Tensor, int]] = {}

    def _hook(self, module, inputs, output):
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if id(weight) in self.weights and layer_rule(module) is not None:
            self.versions[id(output)] = (output, output._version)
            self.biases.append(None if bias is None else self.rest.get(id(bias)))
            return None
        names = (self.rest.get(id(weight)), self.rest.get(id(bias)))
        if type(module) is not nn.LayerNorm or len(module.normalized_shape) != 1 \
                or names == (None, None):
            return None
        output, target = differentiable(output, self.batch)
        self.versions[id(output)] = (output, output._version)
        self.norms.append((module, inputs[0], names, target))
        return output

    def __enter__(self) -> _Claims:
        self.handle = register_thread_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()
