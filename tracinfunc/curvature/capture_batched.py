"""K-FAC's layer inputs and output gradients from one batched forward and backward, no vmap.

:func:`~tracinfunc.curvature.capture.layer_io` runs ``vmap(grad(loss))``: a forward and a
backward per example under torch.func. A :class:`~tracinfunc.loss.ModuleLoss` also computes a
batch's per-example losses from one ordinary forward of the model
(:meth:`~tracinfunc.loss.ModuleLoss.per_example`). The losses of a batch's examples are
independent, so each example's output gradient at a layer is also the gradient of the *sum* of
the batch's losses there: one autograd backward, with respect to zero taps ``[b, *out]`` added
to the layers' outputs (the weights are constants), gives every example's ``delta``, as a
training step's backward does (kronfluence's capture). The layers' inputs are recorded by the
same forward hook. Each example's ``(x, delta)`` is then read by the per-example readers.

The first batch proves the batched mode: its first examples' inputs and output gradients must
equal those of each example run alone (relative difference at most 1e-6 in float64, 1e-3
otherwise, as the factorised projection's batched path). A model whose examples interact in a
batched forward, or that fails on one, keeps the vmapped capture, with a
:class:`~tracinfunc.grads.factorized_batched.BatchedPathWarning` saying why.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.func import vmap
from torch.nn.modules.module import register_module_forward_hook
from torch.utils._pytree import tree_leaves, tree_map

from tracinfunc.curvature.capture import KfacLayer, _hooked, _reader
from tracinfunc.errors import LossFunctionError
from tracinfunc.grads.factorized_batched import BatchedPathWarning
from tracinfunc.loss import ModuleLoss
from tracinfunc.types import Batch, Example, Params

__all__ = ["batched_io", "proven_io"]

IO = Callable[[Batch], list[tuple[Tensor, Tensor]]]
_CHECKED_EXAMPLES = 4  # of the first batch, compared with the vmapped capture


def batched_io(loss: ModuleLoss, frozen: Params, params: Params, layers: list[KfacLayer],
               example: Example) -> IO | None:
    """``fn(batch) -> [(x [b, T, d_in], delta [b, T, d_out]) per layer]`` from one batched
    forward and backward, or ``None`` where a layer's output has no leading batch dimension
    of 1 for one example (the batched outputs could not be split by example)."""
    consts = {name: value.detach() for name, value in params.items()}  # views, no copy
    state = {**frozen, **consts}
    ids = {id(consts[layer.weight]): i for i, layer in enumerate(layers)}
    with torch.no_grad(), _hooked(ids, None) as seen:
        loss(state, example)
    if any(output.shape[:1] != (1,) for *_, output, _ in seen):
        return None
    readers = [vmap(_reader(module, layers[index])) for index, module, *_ in seen]

    def io(batch: Batch) -> list[tuple[Tensor, Tensor]]:
        b = tree_leaves(batch)[0].shape[0]
        with torch.enable_grad(), _recording(ids) as calls:
            values = loss.per_example(state, batch)  # [b]
        _check_calls(calls, len(layers), b)
        deltas = torch.autograd.grad(values.sum(), [output for _, _, output, _ in calls],
                                     materialize_grads=True)
        del values
        out, read_once = [], {}
        for read, (_, x, _, _), delta in zip(readers, calls, deltas, strict=True):
            inputs = x.detach().expand(b, *x.shape[1:]).unsqueeze(1)  # [b, 1, ...]
            x_read, delta_read = read(inputs, delta.unsqueeze(1))
            out.append((read_once.setdefault(id(x), x_read), delta_read))  # q, k, v: one x
        return out

    return io


@contextmanager
def _recording(ids: dict[int, int]) -> Iterator[list]:
    """Record ``(layer index, input, output, output version)`` of the calls of layers in
    ``ids``; an output that needs no gradient (the first layers: the weights are constants)
    is made to need one, so the backward reaches it (no zero tap to allocate and add)."""
    seen: list = []

    def hook(module, inputs, output):
        index = ids.get(id(getattr(module, "weight", None)))
        if index is None:
            return None
        if not output.requires_grad:
            output = output.detach().requires_grad_()
        seen.append((index, inputs[0], output, output._version))
        return output

    handle = register_module_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def _check_calls(calls: list, n_layers: int, b: int) -> None:
    """The layers called once each, in order, on outputs with the batch first, none changed
    in place after its call (the gradient there would be its last version's)."""
    if [index for index, *_ in calls] != list(range(n_layers)):
        raise LossFunctionError("fit_curvature: the batched forward called the layers "
                                "differently from one example's forward")
    if any(output.shape[:1] != (b,) or output._version != version
           for _, _, output, version in calls):
        raise LossFunctionError("fit_curvature: a layer's batched output has no batch "
                                "dimension first, or was modified in place")


def proven_io(vmapped: IO, batched: IO | None, batch: Batch) -> IO:
    """``batched`` where its inputs and output gradients of the first examples of ``batch``
    (the first batch) equal those of the same examples run one at a time (a batch of one is
    the loss's own forward: so no example changes another's), else ``vmapped`` (with a
    BatchedPathWarning). The check runs no torch.func transform, which would import
    torch._dynamo (~70 MiB of RSS)."""
    if batched is None:
        return vmapped
    n = min(_CHECKED_EXAMPLES, tree_leaves(batch)[0].shape[0])
    try:
        together = batched(_rows(batch, 0, n))
        alone = [batched(_rows(batch, i, i + 1)) for i in range(n)]
    except Exception as error:  # a model may refuse a real batch in many ways
        return _keep_vmapped(vmapped, f"one batched forward failed ({error})")
    error = max(_relative(got[side], torch.cat([one[layer][side] for one in alone]))
                for layer, got in enumerate(together) for side in (0, 1))
    allowed = 1e-6 if together[0][1].dtype == torch.float64 else 1e-3
    if error <= allowed:
        return batched
    return _keep_vmapped(vmapped, "one batched forward gives layer inputs or output "
                         "gradients that differ from the examples' own on the first batch "
                         f"(relative difference {error:.3g}, allowed {allowed}: examples "
                         "interact)")


def _rows(batch: Batch, start: int, stop: int) -> Batch:
    return tree_map(lambda leaf: leaf[start:stop] if isinstance(leaf, Tensor) and leaf.dim()
                    else leaf, batch)


def _relative(got: Tensor, want: Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    if not got.is_floating_point():  # token ids
        return 0.0 if torch.equal(got, want) else float("inf")
    return float((got - want).double().norm() / want.double().norm().clamp_min(1e-30))


def _keep_vmapped(vmapped: IO, reason: str) -> IO:
    warnings.warn(f"fit_curvature: K-FAC captures each example under vmap (slower, more "
                  f"memory) for this loss because {reason}.", BatchedPathWarning,
                  stacklevel=5)
    return vmapped
