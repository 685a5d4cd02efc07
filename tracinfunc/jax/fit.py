"""fit_curvature from JAX: a JAX loss and JAX checkpoints -> the same ``Curvature`` as torch.

The reduction is :mod:`tracinfunc.curvature.fit`'s, once for both frontends: labels drawn from
the model (a JAX sampler), gradients at those labels reduced to ``E[g g^T]`` in parameter
space (``"dense"``) or in the store's projected space (``"projected"``), ``lambda_c`` from the
damping. Only how a labelled batch becomes rows differs: JAX per-example gradients mapped to
torch names and layout (``"dense"``), or projected with the torch path's matrices
(``"projected"``). The curvature is bound to the checkpoints' torch-layout fingerprints, so it
serves JAX-written and torch-written stores of the same weights alike.

K-FAC and EK-FAC need each layer's inputs and output gradients: they are captured where the
loss calls its Flax layers (:mod:`tracinfunc.jax.capture`: linen ``Dense``/``Embed``, NNX
``Linear``/``Embed``), named through the mapping, and reduced by the torch path's own loop
(:func:`tracinfunc.curvature.fit._fit_factors`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import tree_util

from tracinfunc._validate import check_int, current_caller, entry_point
from tracinfunc.curvature.capture_batched import layer_by_layer
from tracinfunc.curvature.damping import Damping, check_damping
from tracinfunc.curvature.fit import (
    _blocks,
    _check_dense_size,
    _check_kind,
    _fit_factors,
    _fit_matrix,
    check_rereadable,
    damped_fit,
)
from tracinfunc.curvature.flat import flatten
from tracinfunc.curvature.samplers import CheckedSampler, _draw_labels
from tracinfunc.curvature.value import Curvature
from tracinfunc.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    LossFunctionError,
    NonFiniteGradientError,
)
from tracinfunc.jax.build import (
    Checkpoint,
    _check_checkpoints,
    device_check,
    host_tensor,
    iter_batches,
)
from tracinfunc.jax.capture import kfac_io
from tracinfunc.jax.grads import held_slot, projected_grads, torch_layout_grads, weakly
from tracinfunc.jax.layout import ParamMapping
from tracinfunc.jax.precision import float32_jit
from tracinfunc.projection import Projection
from tracinfunc.projection.spec import check_projection
from tracinfunc.store.meta import CheckpointMeta

__all__ = ["classification_sampler", "fit_curvature"]


@dataclass(frozen=True)
class ClassificationSampler:
    """Class labels for ``(inputs, target)`` batches, drawn from ``softmax(logits)``.

    Attributes:
        logits: ``logits(params, x) -> [n_classes]`` for one input (``logits(params, state,
            x)`` for checkpoints with state), in JAX.
        samples: Labels drawn per input (weights ``1 / samples`` each).
        exact: Every class once, weighted by its probability: the exact Fisher.
    """

    logits: Callable
    samples: int = 1
    exact: bool = False

    def __call__(self, checkpoint: Checkpoint, batch: Any, generator: torch.Generator
                 ) -> tuple[Any, torch.Tensor]:
        inputs, target = batch[0], batch[1]
        logits = _batched_logits(self.logits)(checkpoint.args, inputs)
        if logits.ndim != 2:
            raise LossFunctionError(
                f"{current_caller()}: logits(params, x) must return [n_classes] for one input, "
                f"got {list(logits.shape[1:])}; pass sampler= your own for other outputs."
            )
        logits = torch.from_numpy(np.asarray(logits, np.float64))  # [b, C]
        finite = logits.isfinite().all(1)
        if not bool(finite.all()):
            error = NonFiniteGradientError(
                f"{current_caller()}: the model's logits are NaN or infinite; labels cannot be "
                "drawn from them.")
            error.rows = torch.nonzero(~finite).reshape(-1).tolist()
            raise error
        probs = logits.softmax(-1)  # [b, C]
        b, n_classes = probs.shape
        if self.exact:
            labels = torch.arange(n_classes).repeat(b)
            owner = torch.arange(b).repeat_interleave(n_classes)
            weights = probs.reshape(-1)
        else:
            labels = _draw_labels(probs, self.samples, generator).reshape(-1)
            owner = torch.arange(b).repeat_interleave(self.samples)
            weights = torch.full((b * self.samples,), 1 / self.samples, dtype=torch.float64)
        take = jnp.asarray(owner.numpy())
        labelled = (inputs[take], jnp.asarray(labels.numpy()).astype(target.dtype))
        return labelled, weights


def _batched_logits(logits: Callable) -> Callable[[tuple, Any], jax.Array]:
    """``jit(vmap(logits))`` over the inputs, compiled once and kept while ``logits`` lives."""
    held = held_slot(_LOGITS, logits)
    if held is None:  # not weak-referenceable
        return _compile_logits(logits)
    if "program" not in held:
        held["program"] = _compile_logits(logits)
    return held["program"]


def _compile_logits(logits: Callable) -> Callable[[tuple, Any], jax.Array]:
    logits = weakly(logits)  # cached under logits: never keep it alive
    return float32_jit(lambda args, inputs: jax.vmap(lambda x: logits(*args, x))(inputs))


_LOGITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def classification_sampler(logits: Callable, *, samples: int = 1, exact: bool = False
                           ) -> ClassificationSampler:
    """Labels for a JAX classifier from its logits: ``samples`` draws per input, or every class.

    Args:
        logits: ``logits(params, x) -> [n_classes]`` for one input (no batch dimension);
            ``logits(params, state, x)`` for checkpoints with state.
        samples: Draws per input, a positive int.
        exact: Use every class weighted by its probability (the exact Fisher).
    """
    if not callable(logits):
        raise InvalidTypeError(
            f"tracinfunc.jax.classification_sampler: logits must be a function "
            f"logits(params, x) -> [n_classes], got {type(logits).__name__}.")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise InvalidArgumentError(
            "tracinfunc.jax.classification_sampler: samples must be a positive int, got "
            f"{samples!r}; e.g. 1.")
    if not isinstance(exact, bool):
        raise InvalidTypeError(
            f"tracinfunc.jax.classification_sampler: exact must be True or False, got {exact!r}.")
    return ClassificationSampler(logits, samples, exact)


@entry_point("tracinfunc.jax.fit_curvature")
def fit_curvature(
    loss: Callable,
    checkpoints: Sequence[Checkpoint],
    data: Any,
    *,
    sampler: ClassificationSampler | Callable,
    kind: str = "projected",
    projection: Projection | None = None,
    mapping: ParamMapping | None = None,
    damping: Damping | float | None = None,
    max_examples: int | None = None,
    chunk_size: int | None = None,
    seed: int = 0,
    block_diagonal: bool = False,
) -> Curvature:
    """Fit a damped Gauss-Newton (true Fisher) estimate at every JAX checkpoint.

    The twin of :func:`tracinfunc.fit_curvature`: on the same weights, the same labels and the
    same damping it returns the same curvature (to float32 rounding of the gradients), bound to
    the same fingerprints, so it preconditions JAX and torch queries alike.

    Args:
        loss: ``loss(params, example) -> scalar`` (``loss(params, state, example)`` with
            state), the loss the store was built with.
        checkpoints: The store's :class:`Checkpoint` values, in the store's order.
        data: Training batches ``(inputs, target)`` (one or an iterable), or a sample.
        sampler: Draws labels from the model: :func:`classification_sampler` (``logits``
            in JAX), or ``sampler(checkpoint, batch, generator) -> (labelled batch,
            weights [b'] float64 torch)``.
        kind: ``"projected"`` (``[k, k]`` in ``projection``'s space), ``"dense"`` (the
            exact ``[p, p]`` matrix, small models), or ``"kfac"``/``"ekfac"`` (per-layer
            Kronecker factors: every parameter the kernel or bias of a Flax ``Dense``/
            ``nnx.Linear`` or the table of an ``Embed`` the loss calls, see
            :mod:`tracinfunc.jax.capture`; ``"ekfac"`` iterates ``data`` twice).
        projection: The store's projection (``store.projection``), for ``"projected"``.
        mapping: The store's :class:`ParamMapping` (default: identity).
        damping, max_examples, chunk_size, seed, block_diagonal: As for
            :func:`tracinfunc.fit_curvature`.

    Returns:
        A :class:`~tracinfunc.Curvature` for ``tif.score(..., curvature=)`` and
        :func:`tracinfunc.jax.preconditioned_test_grads`.

    Raises:
        InvalidArgumentError: unknown kind, missing projection; ``"kfac"``/``"ekfac"`` with
            parameters no supported Flax layer applies (named); a ``Damping`` at checkpoints
            whose estimate is zero, as :func:`tracinfunc.fit_curvature`.
        IncompatibleGradientsError: a mapping that does not give a layer torch's layout.
        NonFiniteGradientError: an example's input, logits or layer values are NaN/inf
            (named by its index in ``data``, with the checkpoint).
        MemoryBudgetError: ``"dense"`` over ``MAX_DENSE_PARAMS`` parameters.
        EmptyDataError: ``data`` holds no examples.
        NonFiniteGradientError: an example's input, logits or gradient is NaN/inf (named by
            its index in ``data`` and the checkpoint), as :func:`tracinfunc.fit_curvature`.
    """
    kind = _check_kind(kind)
    damping = check_damping(Damping() if damping is None else damping)
    checkpoints = _check_checkpoints(checkpoints)
    if kind == "projected":
        check_projection(projection)
    max_examples = check_int(max_examples, "max_examples", optional=True)
    if not callable(sampler):
        raise InvalidTypeError(
            f"tracinfunc.jax.fit_curvature: sampler must be callable, got "
            f"{type(sampler).__name__}; e.g. tracinfunc.jax.classification_sampler(logits).")
    mapping = mapping or ParamMapping.identity(checkpoints[0].params)
    layout = mapping.layout
    if kind == "dense":
        _check_dense_size(layout)
    blocks = _blocks(block_diagonal, kind, layout, projection)
    metas = tuple(CheckpointMeta(c.name or f"checkpoint-{i}", c.lr,
                                 c._fingerprint(mapping))
                  for i, c in enumerate(checkpoints))
    check_rereadable(data, kind, len(checkpoints))
    # Read once (the checkpoints' leaves; their own device conflict refused here), then
    # each pass over the data checks its batches against them.
    batches = partial(_limited, data, max_examples, device_check(checkpoints))
    estimates, layers, seen = [], [], 0
    captured: list = []  # one compiled capture serves every checkpoint (same shapes)
    for position, (ckpt, meta) in enumerate(zip(checkpoints, metas, strict=True)):
        checked = _JaxCheckedSampler(sampler, meta.name)
        generator = torch.Generator().manual_seed(seed + position)
        if kind in ("kfac", "ekfac"):
            estimate, seen, layers = _fit_factors(
                lambda batch, c=ckpt, g=generator, s=checked: s(loss, c, batch, g), batches,
                lambda labelled, c=ckpt: _capture(loss, mapping, c, labelled, captured), checked,
                eigen=kind == "ekfac")
        else:
            rows = _rows_fn(loss, kind, mapping, chunk_size,
                            None if projection is None else projection.for_checkpoint(meta.name))
            estimate, seen = _fit_matrix(
                lambda c, batch, rows=rows: rows(*c.args, batch), ckpt, batches, checked,
                loss, generator, blocks)
        estimates.append(estimate)
    info = {"n_examples": seen, "sampler": repr(sampler), "seed": seed, "frontend": "jax",
            "damping": damping.describe(kind) if isinstance(damping, Damping) else "fixed"}
    return damped_fit(Curvature(kind, metas, layout,
                                projection if kind == "projected" else None,
                                (0.0,) * len(estimates), tuple(estimates), tuple(layers), info,
                                blocks), damping)


def _capture(loss: Callable, mapping: ParamMapping, checkpoint: Checkpoint, labelled: Any,
             captured: list):
    """``(layers, feed)`` for the K-FAC loop, at ``checkpoint``; the layers are found
    (and the capture compiled) at the first checkpoint only, kept in ``captured``."""
    if not captured:
        first = tree_util.tree_map(lambda leaf: leaf[0], labelled)
        captured.append(kfac_io(loss, mapping, checkpoint.args, first))
    layers, io = captured[0]
    return layers, layer_by_layer(lambda batch: io(*checkpoint.args, batch), layers)


class _JaxCheckedSampler(CheckedSampler):
    """:class:`~tracinfunc.curvature.samplers.CheckedSampler` for JAX batches and samplers
    ``sampler(checkpoint, batch, generator)``: NaN/inf inputs, logits and weights are refused
    by their index in the data."""

    def __call__(self, loss: Any, checkpoint: Checkpoint, batch: Any,
                 generator: torch.Generator) -> tuple[Any, torch.Tensor]:
        self.start += self.size
        leaves = tree_util.tree_leaves(batch)
        self.size = int(np.shape(leaves[0])[0])
        finite = np.ones(self.size, dtype=bool)
        for leaf in leaves:
            leaf = np.asarray(leaf)
            if leaf.dtype.kind in "fc" and leaf.ndim and leaf.shape[0] == self.size:
                finite &= np.isfinite(leaf.reshape(self.size, -1)).all(1)
        if not finite.all():
            self.refuse("the input", (np.flatnonzero(~finite) + self.start).tolist())
        try:
            labelled, weights = self.sampler(checkpoint, batch, generator)
        except NonFiniteGradientError as error:
            rows = getattr(error, "rows", None)
            if rows is None:
                raise
            self.refuse("the model's output", [self.start + r for r in rows])
        if not bool(torch.isfinite(torch.as_tensor(weights)).all()):
            self.refuse("the sampler's weights")
        return labelled, weights


def _rows_fn(loss, kind, mapping, chunk_size, projection) -> Callable[..., torch.Tensor]:
    """``fn(*checkpoint.args, batch) -> [b, dim]`` torch rows of the labelled batch."""
    if kind == "projected":
        project = projected_grads(loss, projection, mapping=mapping, chunk_size=chunk_size)
        return lambda *args: host_tensor(project(*args))
    mapped = torch_layout_grads(loss, mapping, chunk_size)

    def rows(*args: Any) -> torch.Tensor:
        grads = mapped(*args)
        return flatten({name: host_tensor(value) for name, value in grads.items()},
                       mapping.layout)

    return rows


def _limited(data: Any, max_examples: int | None, check: Callable[[Any, str], None]
             ) -> Iterator[Any]:
    """The non-empty JAX batches of ``data``, cut after ``max_examples`` inputs (no batch at
    all for empty data: the fit refuses it with EmptyDataError), each passed to ``check``
    (a :func:`~tracinfunc.jax.build.device_check`) as it is read."""
    left = max_examples
    for index, batch in enumerate(iter_batches(data)):
        size = tree_util.tree_leaves(batch)[0].shape[0]
        if size == 0:
            continue
        if left is not None:
            if left <= 0:
                return
            if size > left:
                batch = tree_util.tree_map(lambda leaf, n=left: leaf[:n], batch)
            left -= min(size, left)
        check(batch, f"batch {index}")  # only the batches the fit reads
        yield batch
