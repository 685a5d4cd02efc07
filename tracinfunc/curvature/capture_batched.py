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
A batch whose output gradients are large is instead handed to the factor sums a layer at a
time, as the backward reaches each layer (:meth:`BatchedIO.stream`): the consumer is a
:data:`Feed`'s ``start(keys)``, as :class:`~tracinfunc.curvature.kfac.FactorBatch`.

The first batch, and each batch larger than every batch proved before in the fit, proves the
batched mode: every example's inputs and output gradients must equal those of the per-example
(vmapped) capture of the batch (largest difference at most 1e-6 of the largest value in
float64, 1e-3 in float32, four units of the last place in bfloat16 and float16). A model
whose examples interact in a batched forward, or that fails on one, is captured under vmap
from that batch on, with one
:class:`~tracinfunc.grads.factorized_batched.BatchedPathWarning` per fit saying why; a loss
that draws random numbers is refused.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.func import vmap
from torch.utils._pytree import tree_leaves, tree_map

from tracinfunc._hooks import register_thread_forward_hook
from tracinfunc.curvature.capture import KfacLayer, _hooked, _reader, check_inputs_unchanged
from tracinfunc.curvature.kfac import input_key, input_keys
from tracinfunc.errors import LossFunctionError
from tracinfunc.grads.factorized_batched import BatchedPathWarning, proof_tolerance
from tracinfunc.grads.transforms import explain_loss_error
from tracinfunc.loss import ModuleLoss
from tracinfunc.types import Batch, Example, Params

__all__ = ["BatchedIO", "BatchedProof", "Feed", "Start", "batched_io", "layer_by_layer",
           "proven_io", "stream_keys"]

IO = Callable[[Batch], list[tuple[Tensor, Tensor]]]


def batched_io(loss: ModuleLoss, frozen: Params, params: Params, layers: list[KfacLayer],
               example: Example) -> BatchedIO | None:
    """The batched capture of ``layers`` (:class:`BatchedIO`), or ``None`` where a layer's
    output has no leading batch dimension of 1 for one example (the batched outputs could not
    be split by example)."""
    consts = {name: value.detach() for name, value in params.items()}  # views, no copy
    state = {**frozen, **consts}
    ids = {id(consts[layer.weight]): i for i, layer in enumerate(layers)}
    with torch.no_grad(), _hooked(ids, None) as seen:
        loss(state, example)
    if any(output.shape[:1] != (1,) for _, _, _, output, *_ in seen):
        return None
    readers = [vmap(_reader(module, layers[index])) for index, module, *_ in seen]
    ways = [_way_of_reading(module, layers[index], index) for index, module, *_ in seen]
    return BatchedIO(loss, state, ids, readers, ways, layers)


def _way_of_reading(module, layer: KfacLayer, index: int) -> tuple:
    """Equal for two layers whose readers turn one input into the same ``x``: Linears of one
    input width, Conv2d of one geometry; an embedding's ids are never shared."""
    if layer.rule == "conv2d":
        return ("conv2d", layer.d_in, module.kernel_size, module.stride, module.padding,
                module.dilation)
    if layer.rule == "linear":
        return ("linear", layer.d_in)
    return (layer.rule, index)


class BatchedIO:
    """Every layer's inputs and output gradients of a batch from one batched forward and
    backward: all at once (:meth:`__call__`, what the proof compares), or handed to a
    consumer a layer at a time as the backward produces them (:meth:`stream`)."""

    def __init__(self, loss: ModuleLoss, state: Params, ids: dict[int, int],
                 readers: list[Callable], ways: list[tuple], layers: list[KfacLayer]) -> None:
        self.loss, self.state, self.ids, self.readers, self.layers = (loss, state, ids,
                                                                      readers, layers)
        self.ways = ways  # per layer, how its reader reads its input (_way_of_reading)
        self.held_per_example = 0  # output-gradient bytes of an example, all layers (last call)

    def __call__(self, batch: Batch) -> list[tuple[Tensor, Tensor]]:
        """``[(x [b, T, d_in], delta [b, T, d_out]) per layer]``."""
        b = tree_leaves(batch)[0].shape[0]
        with _output_writes(), torch.enable_grad(), _recording(self.ids, None) as calls:
            values = self.loss.per_example(self.state, batch)  # [b]
        _check_calls(calls, len(self.layers), b)
        deltas = torch.autograd.grad(values.sum(), [output for _, _, output, *_ in calls],
                                     materialize_grads=True)
        del values
        self.held_per_example = sum(delta.nbytes for delta in deltas) // max(b, 1)
        out, read_once = [], {}
        for read, way, (_, x, *_), delta in zip(self.readers, self.ways, calls, deltas,
                                                  strict=True):
            x_read, delta_read = read(_per_example(x, b), delta.unsqueeze(1))
            out.append((read_once.setdefault((id(x), way), x_read), delta_read))  # q, k, v
        return out

    def stream(self, batch: Batch, start: Start) -> None:
        """Hand each layer's ``(x [b, T, d_in], delta [b, T, d_out])`` to ``start(keys)``
        (``keys``: :func:`stream_keys`) as the backward reaches the layer: its output
        gradient is freed once consumed, so the batch never holds every layer's at once
        (kronfluence folds them in its hooks alike). A layer whose output does not reach the
        loss gets zeros, as ``materialize_grads`` gives."""
        b = tree_leaves(batch)[0].shape[0]
        anchor = torch.zeros((), requires_grad=True)  # every tap leads here: one backward
        arrived: dict[int, Callable] = {}
        with _output_writes(), torch.enable_grad(), \
                _recording(self.ids, (anchor, arrived)) as calls:
            values = self.loss.per_example(self.state, batch)  # [b]
        _check_calls(calls, len(self.layers), b)
        consume = start(stream_keys(calls, self.layers))
        pending = {index: (x, output.shape, output.dtype) for index, x, output, *_ in calls}
        del calls  # the inputs the backward no longer needs go as it goes

        def arrive(index: int, delta: Tensor) -> None:
            x, *_ = pending.pop(index)
            consume(index, *self.readers[index](_per_example(x, b), delta.unsqueeze(1)))

        arrived["fn"] = arrive
        torch.autograd.grad(values.sum(), anchor, allow_unused=True)
        del values
        for index, (x, shape, dtype) in sorted(pending.items()):  # outputs the loss ignores
            zeros = torch.zeros(shape, dtype=dtype, device=x.device).unsqueeze(1)
            consume(index, *self.readers[index](_per_example(x, b), zeros))


# A proved batch is streamed (BatchedIO.stream) where all its layers' output gradients would
# hold more than this, as measured on the fit's largest proved batch; below it, captured whole
# and handed over in order: on a 2-layer Llama (10 MiB of output gradients a batch),
# streaming measured 5-10% more CPU time and no less memory.
_STREAM_BYTES = 32 * 2**20

Start = Callable[[list[tuple]], Callable[[int, Tensor, Tensor], None]]
"""``start(keys) -> consume``: a batch's consumer, told each layer's input key first, then
called ``consume(index, x, delta)`` once per layer, in any order."""


def stream_keys(calls: list, layers: list[KfacLayer]) -> list[tuple]:
    """Per layer, the key of its input for :class:`~tracinfunc.curvature.kfac.FactorBatch`:
    a Linear reads its input as a view, so layers reading one input the same way share
    its key (:func:`~tracinfunc.curvature.kfac.input_key`); other layers' readers make new
    tensors (Conv2d patches), so each has a key of its own."""
    return [input_key(x, layers[index]) if layers[index].rule == "linear"
            else ("layer", index) for index, x, *_ in calls]


def _per_example(x: Tensor, b: int) -> Tensor:
    """``[b, 1, ...]``: the batched input as the vmapped reader takes it."""
    return x.detach().expand(b, *x.shape[1:]).unsqueeze(1)


def layer_by_layer(io: IO, layers: list[KfacLayer]) -> Feed:
    """A capture that returns every layer's ``(x, delta)`` at once, as a feed (in order)."""

    def feed(batch: Batch, start: Start) -> None:
        _consume_all(io(batch), layers, start)

    return feed


def _consume_all(pairs: list[tuple[Tensor, Tensor]], layers: list[KfacLayer],
                 start: Start) -> None:
    consume = start(input_keys(pairs, layers))
    for index, (x, delta) in enumerate(pairs):
        consume(index, x, delta)


Feed = Callable[[Batch, Start], None]
"""``feed(batch, start)``: a batch's layer inputs and output gradients, handed to a consumer
(:data:`Start`)."""


class _Tap(torch.autograd.Function):
    """The identity on a layer's output whose backward hands the output gradient to the
    feed's ``arrive``; its second input, the feed's anchor, makes every tap a step of the
    one backward to the anchor (no gradient is formed for the anchor itself)."""

    @staticmethod
    def forward(ctx, output: Tensor, anchor: Tensor, index: int, arrived: dict):
        ctx.index, ctx.arrived = index, arrived
        return output.view_as(output)

    @staticmethod
    def backward(ctx, delta: Tensor):
        ctx.arrived["fn"](ctx.index, delta)
        return delta, None, None, None


@contextmanager
def _recording(ids: dict[int, int], taps: tuple[Tensor, dict] | None) -> Iterator[list]:
    """Record ``(layer index, input, output, output version, input version)`` of the calls
    of layers in ``ids``. Without ``taps``, an output that needs no gradient (the first
    layers: the weights are constants) is made to need one, so the backward reaches it (no
    zero tap to allocate and add); with ``(anchor, arrived)``, each output goes on through a
    :class:`_Tap` (a view of it: the same memory)."""
    seen: list = []

    def hook(module, inputs, output):
        index = ids.get(id(getattr(module, "weight", None)))
        if index is None:
            return None
        if taps is not None:
            anchor, arrived = taps
            output = _Tap.apply(output, anchor, index, arrived)
        elif not output.requires_grad:
            output = output.detach().requires_grad_()
        seen.append((index, inputs[0], output, output._version, inputs[0]._version))
        return output

    handle = register_thread_forward_hook(hook)
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
           for _, _, output, version, _ in calls):
        raise _OutputWritten(_IN_PLACE)
    # No capture can fit it: refused (_InputWritten passes the proof), not a fallback.
    check_inputs_unchanged((x._version != version for _, x, _, _, version in calls),
                           _InputWritten)


class _OutputWritten(LossFunctionError):
    """A layer's batched output written in place (or without a batch dimension first): the
    per-example capture fits it (its taps are added, not viewed), so a proved batch falls
    back to it, as the proof does."""


@contextmanager
def _output_writes() -> Iterator[None]:
    """Torch's refusals of a write into a layer's recorded output (a leaf made to need a
    gradient, or a tap's view) as :class:`_OutputWritten`."""
    try:
        yield
    except RuntimeError as error:
        if "in-place operation" in str(error) or "modified inplace" in str(error):
            raise _OutputWritten(_IN_PLACE) from error
        raise


class _InputWritten(LossFunctionError):
    """A layer's input written in place after the layer read it (refused by the proof too,
    where another failure of the batched forward falls back to the per-example capture)."""


_IN_PLACE = ("fit_curvature: a layer's batched output has no batch dimension first, or was "
             "modified in place")


class BatchedProof:
    """What one ``fit_curvature`` call proved of its batched capture, shared by its
    checkpoints: the largest batch size proved (a larger batch is proved again: a model may
    interact only in large batches), and whether a proof failed (then every later batch,
    of every later checkpoint, is captured per example; the warning is given once)."""

    def __init__(self) -> None:
        self.largest = 0
        self.failed = False
        self.held_per_example = 0  # output-gradient bytes of an example, on the largest proved


def proven_io(vmapped: IO, batched: BatchedIO | None, proof: BatchedProof,
              layers: list[KfacLayer]) -> Feed:
    """A feed (:data:`Feed`) through ``batched`` for each batch no larger than one it was
    proved on (streamed where its output gradients would exceed ``_STREAM_BYTES``, as
    measured on the largest proved batch); a larger batch is proved first: every example's
    inputs and output gradients in the batched run must equal those of the per-example
    ``vmapped`` capture (the cost of the per-example capture, once per larger batch). From a
    failed proof on, ``vmapped`` (with one BatchedPathWarning per fit; the batches already
    captured were proved at their own sizes, so they stay).

    Raises:
        LossFunctionError: two batched runs of one batch differ: the loss draws random
            numbers (dropout in training mode), which no capture can fit."""
    per_example = layer_by_layer(vmapped, layers)
    if batched is None:
        return per_example

    def feed(batch: Batch, start: Start) -> None:
        if proof.failed:
            return per_example(batch, start)
        size = tree_leaves(batch)[0].shape[0]
        if size <= proof.largest:
            try:
                if size * proof.held_per_example > _STREAM_BYTES:
                    return batched.stream(batch, start)
                return _consume_all(batched(batch), layers, start)
            except _OutputWritten as error:  # only on a later batch; before any layer is added
                proof.failed = True
                _warn(f"one batched forward failed ({error})")
                return per_example(batch, start)
        reason, together = _prove(batched, vmapped, batch)
        if reason is not None:
            proof.failed = True
            _warn(reason)
            return per_example(batch, start)
        proof.largest, proof.held_per_example = size, batched.held_per_example
        return _consume_all(together, layers, start)

    return feed


def _prove(batched: IO, vmapped: IO, batch: Batch) -> tuple[str | None, list]:
    """``(None, batched(batch))`` where every example's batched capture is its own (its
    per-example ``vmapped`` capture), else ``(why not, [])``."""
    try:
        together = batched(batch)
    except _InputWritten:
        raise
    except Exception as error:  # a model may refuse a real batch in many ways
        return f"one batched forward failed ({error})", []
    try:
        gap = _worst(_slice_gaps(together, vmapped, batch))
    except Exception as error:  # the fallback fails too: say why, if the library knows
        _refuse_random(batched, batch, together)
        clearer = explain_loss_error(error)
        if clearer is None:
            raise
        raise clearer from error
    if gap is None:
        return None, together
    _refuse_random(batched, batch, together)
    diff, scale = gap
    return ("one batched forward gives layer inputs or output gradients that differ from "
            f"the examples' own on a batch of {tree_leaves(batch)[0].shape[0]} (largest "
            f"difference {diff:.3g} where the examples' own values reach {scale:.3g}: "
            "examples interact)"), []


def _slice_gaps(together: list, vmapped: IO, batch: Batch) -> list[tuple[float, float, float]]:
    """Per layer and side, ``(largest difference, largest value, tolerance)`` between the
    batched capture ``together`` and the per-example ``vmapped`` capture of ``batch``.

    The per-example capture runs on slices of the batch (each at most ``_PROOF_BYTES`` of
    captured values; one slice where the batch's capture is that small): both maxima over
    the slices are those over the batch, and its whole capture, with every layer's
    per-example forward and backward at once, is never held beside ``together``."""
    size = tree_leaves(batch)[0].shape[0]
    held = sum(value.nbytes for pair in together for value in pair)
    step = max(1, _PROOF_BYTES * size // max(held, 1))
    gaps: list[tuple[float, float, float]] = []
    for start in range(0, size, step):
        want = vmapped(_rows(batch, start, start + step))
        part = [(*_gap(have[start:start + step], expected), proof_tolerance(expected.dtype))
                for got_pair, want_pair in zip(together, want, strict=True)
                for have, expected in zip(got_pair, want_pair, strict=True)]
        del want
        gaps = part if not gaps else [(_larger(a, c), _larger(b, d), allowed) for (a, b, _),
                                      (c, d, allowed) in zip(gaps, part, strict=True)]
    return gaps


def _larger(a: float, b: float) -> float:
    """``max`` that keeps a NaN, as one ``Tensor.max`` over the whole batch does."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


# The proof's per-example capture runs on slices of a batch holding about this many bytes of
# captured layer inputs and output gradients (its forward and backward hold a few times that).
_PROOF_BYTES = 4 * 2**20


def _rows(batch: Batch, start: int, stop: int) -> Batch:
    """Examples ``start:stop`` of a batch (every tensor leaf is batch-first, as vmap reads
    it)."""
    return tree_map(lambda leaf: leaf[start:stop] if isinstance(leaf, Tensor) else leaf, batch)


def _refuse_random(batched: IO, batch: Batch, together: list) -> None:
    """Raise where a second batched run of ``batch`` differs from the first: the loss draws
    random numbers (a failing second run says nothing)."""
    try:
        again = batched(batch)
    except Exception:
        return
    if _worst_gap(together, [list(pair) for pair in again]) is not None:
        raise LossFunctionError(
            "fit_curvature: the loss draws random numbers: two batched forwards of one batch "
            "gave different layer inputs or output gradients (as dropout in training mode "
            "does, also F.dropout(..., training=True) inside forward). Put the model in eval "
            "mode and remove random operations from the loss: curvature needs a deterministic "
            "loss.")


def _worst_gap(got: list, want: list) -> tuple[float, float] | None:
    """``None`` where every ``got[layer][side]`` equals ``want[layer][side]`` within the
    tolerance of :func:`_worst`, else the worst ``(largest difference, largest value)``."""
    return _worst([(*_gap(have, expected), proof_tolerance(expected.dtype))
                   for got_pair, want_pair in zip(got, want, strict=True)
                   for have, expected in zip(got_pair, want_pair, strict=True)])


def _worst(gaps: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """``None`` where every ``(largest difference, largest value, tolerance)`` is within its
    tolerance (:func:`~tracinfunc.grads.factorized_batched.proof_tolerance`: the largest
    absolute difference at most that fraction of the largest absolute value), else the worst
    ``(largest difference, largest value)``."""
    worst, ratio = None, 0.0
    for diff, scale, allowed in gaps:
        if diff > allowed * scale and (scale == 0 or diff / scale > ratio):
            worst, ratio = (diff, scale), (math.inf if scale == 0 else diff / scale)
    return worst


def _gap(got: Tensor, want: Tensor) -> tuple[float, float]:
    if got.shape != want.shape:
        return math.inf, 0.0
    if not got.is_floating_point():  # token ids
        return (0.0 if torch.equal(got, want) else math.inf), 0.0
    if not want.numel():
        return 0.0, 0.0
    return float((got - want).abs().max()), float(want.abs().max())


def _warn(reason: str) -> None:
    warnings.warn(f"fit_curvature: K-FAC captures each example under vmap (slower, more "
                  f"memory) for this loss from here on because {reason}.", BatchedPathWarning,
                  stacklevel=8)  # the caller of fit_curvature (entry_point: 2 frames)
