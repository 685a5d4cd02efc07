"""fit_curvature: one pass over (a sample of) the training data per checkpoint -> a Curvature.

For each checkpoint ``w_c``, labels are drawn from the model's predictive distribution (a
:mod:`~tracinfunc.curvature.samplers` sampler), and the gradients at those labels are reduced
to the kind's estimate of the Gauss-Newton matrix ``H_c`` (the Fisher, for cross-entropy):
``E[g g^T]`` in parameter space (``"dense"``) or in the store's projected space
(``"projected"``), or per-layer Kronecker factors (``"kfac"``; ``"ekfac"`` adds a second pass
refitting the eigenvalues). ``lambda_c`` follows from ``damping``.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.utils._pytree import tree_leaves, tree_map

from tracinfunc._validate import check_int, current_caller, entry_point
from tracinfunc.batches import iter_batches, rebatch, tuple_note, tuple_of_batches
from tracinfunc.build.loop import checkpoint_list
from tracinfunc.checkpoint import Checkpoint, loss_at
from tracinfunc.curvature import kfac
from tracinfunc.curvature.blocks import Block, block_index, layer_blocks
from tracinfunc.curvature.capture import find_layers, first_example, layer_io
from tracinfunc.curvature.capture_batched import BatchedProof, batched_io, proven_io
from tracinfunc.curvature.damping import Damping, check_damping, resolve
from tracinfunc.curvature.flat import flatten
from tracinfunc.curvature.samplers import CheckedSampler, Sampler, default_sampler
from tracinfunc.curvature.value import CURVATURE_KINDS, Curvature
from tracinfunc.errors import (
    EmptyDataError,
    InvalidArgumentError,
    InvalidTypeError,
    LossFunctionError,
    MemoryBudgetError,
)
from tracinfunc.grads import per_sample_grads, projected_grads
from tracinfunc.grads.options import GradientOptions, gradient_options
from tracinfunc.grads.selection import selected_names
from tracinfunc.grads.transforms import explain_loss_error
from tracinfunc.loss import ModuleLoss, holds_loss_modules
from tracinfunc.projection import Projection, canonical_layout
from tracinfunc.projection.spec import check_projection
from tracinfunc.store.meta import CheckpointMeta
from tracinfunc.types import Batch, LossFn, Params

__all__ = ["MAX_DENSE_PARAMS", "fit_curvature"]

# A [p, p] float64 matrix per checkpoint: 3.2 GB at this size; beyond, use kfac or projected.
MAX_DENSE_PARAMS = 20_000


@entry_point("fit_curvature")
def fit_curvature(
    loss: LossFn,
    checkpoints: Sequence[Checkpoint],
    data: Batch | Iterable[Batch],
    *,
    kind: str = "projected",
    projection: Projection | None = None,
    damping: Damping | float | None = None,
    sampler: Sampler | None = None,
    options: GradientOptions | None = None,
    max_examples: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    block_diagonal: bool = False,
) -> Curvature:
    """Fit a damped Gauss-Newton (true Fisher) estimate at every checkpoint.

    Args:
        loss: The per-example loss the store was built with.
        checkpoints: The store's checkpoints, in the store's order.
        data: Training batches (one batch or an iterable of them), or a sample of them; their
            labels are replaced by the sampler's. ``"ekfac"`` iterates them twice, so pass a
            list or a DataLoader, not a generator.
        kind: ``"projected"`` (``[k, k]`` in ``projection``'s space: any model, any
            projection kind), ``"kfac"``/``"ekfac"`` (per-layer Kronecker factors of
            ``nn.Linear``, HF ``Conv1D``, ``nn.Conv2d`` and ``nn.Embedding`` layers), or
            ``"dense"`` (the exact ``[p, p]`` matrix, for small models: the reference).
        projection: The store's projection (``store.projection``); needed by
            ``"projected"``, ignored by the others (their queries are preconditioned before
            any projection).
        damping: A :class:`~tracinfunc.curvature.Damping` (``lambda_c`` a multiple of each
            checkpoint's mean eigenvalue; the default ``Damping()`` uses the multiple
            measured best for the kind) or a float (the same ``lambda`` for every
            checkpoint).
        sampler: Draws labels from the model (see :mod:`tracinfunc.curvature.samplers`);
            default: chosen for :func:`~tracinfunc.loss_from_module` classifiers and
            :func:`~tracinfunc.causal_lm_loss`.
        options: The store's gradient options; only ``options.select`` (the parameter
            selection) and ``options.chunk_size`` are used, so the selection is given once,
            as for ``build_store`` and ``preconditioned_test_grads``.
        max_examples: Use only the first this many inputs of ``data`` (``None``: all).
        batch_size: Regroup ``data`` into batches of this many inputs.
        seed: Seeds the label draws (results are a function of the arguments).
        block_diagonal: ``"projected"`` only: keep each layer's block of the ``k x k`` Fisher
            and invert the blocks alone (``sum_l k_l^2`` numbers instead of ``k^2``); needs a
            projection where each layer owns its outputs (``kind="identity"``; see
            :mod:`tracinfunc.curvature.blocks`).

    Returns:
        A :class:`~tracinfunc.Curvature` bound to these checkpoints, the layout and (for
        ``"projected"``) the projection.

    Raises:
        InvalidArgumentError: unknown kind, missing projection, parameters K-FAC does not
            cover (named), no sampler for the loss, ``block_diagonal`` with another kind or
            a projection that mixes layers, or a ``Damping`` at checkpoints whose estimate
            is zero (named; the fitted estimates are in the error's ``curvature``, for
            ``error.curvature.with_damping(lambda)``).
        MemoryBudgetError: ``"dense"`` for more than ``MAX_DENSE_PARAMS`` parameters.
        EmptyDataError: ``data`` holds no examples.
        NonFiniteGradientError: an example's logits or gradient is NaN/inf (named by its
            index in ``data``, with the checkpoint).
        LossFunctionError: called inside a loss being differentiated (a ``torch.func``
            transform, or another ``fit_curvature``): fit before, outside the loss.
    """
    kind = _check_kind(kind)
    if retrieve_all_functorch_interpreters() or getattr(_FITTING, "depth", 0):
        raise LossFunctionError(
            "fit_curvature: called inside a loss that is being differentiated (under a "
            "torch.func transform, or by another fit_curvature); a fit takes its own "
            "per-example gradients of every batch and cannot run there. Fit the curvature "
            "before, outside the loss, and pass the result in."
        )
    _FITTING.depth = 1  # refused above before any lock is asked for (no waits to untangle)
    try:
        return _fit(loss, checkpoints, data, kind=kind, projection=projection, damping=damping,
                    sampler=sampler, options=options, max_examples=max_examples,
                    batch_size=batch_size, seed=seed, block_diagonal=block_diagonal)
    finally:
        _FITTING.depth = 0


_FITTING = threading.local()  # depth 1 while this thread fits: a loss may not fit again


@holds_loss_modules  # a hand-written loss swaps tensors into its module: one thread at a time
def _fit(loss, checkpoints, data, *, kind, projection, damping, sampler, options,
         max_examples, batch_size, seed, block_diagonal) -> Curvature:
    damping = check_damping(Damping() if damping is None else damping)
    checkpoints = checkpoint_list(checkpoints, Checkpoint, name="tracinfunc.Checkpoint")
    if kind == "projected":
        check_projection(projection)
    max_examples = check_int(max_examples, "max_examples", optional=True)
    options = gradient_options(options)  # the store's: the selection is given once
    select, chunk_size = options.select, options.chunk_size
    sampler = default_sampler(loss) if sampler is None else _check_sampler(sampler)
    names = selected_names(checkpoints[0].params, select)
    layout = canonical_layout({name: checkpoints[0].params[name] for name in names})
    if kind == "dense":
        _check_dense_size(layout)
    blocks = _blocks(block_diagonal, kind, layout, projection)
    metas = tuple(CheckpointMeta(c.name or f"checkpoint-{i}", c.lr, c.fingerprint)
                  for i, c in enumerate(checkpoints))

    check_rereadable(data, kind, len(checkpoints))

    def batches() -> Iterator[Batch]:
        return _limited(data if batch_size is None else rebatch(data, batch_size), max_examples)

    estimates, layers, seen = [], (), 0
    shared = {"proof": BatchedProof()} if kind in ("kfac", "ekfac") else {}
    for position, (ckpt, meta) in enumerate(zip(checkpoints, metas, strict=True)):
        fit_one = partial(_fit_projected, blocks=blocks) if blocks else _FITTERS[kind]
        try:
            estimate, n, layers = fit_one(
                loss_at(loss, ckpt), dict(ckpt.params), names, batches,
                CheckedSampler(sampler, meta.name),
                torch.Generator().manual_seed(seed + position), chunk_size,
                None if projection is None else projection.for_checkpoint(meta.name),
                **shared)  # K-FAC: one proof of the batched capture (and one warning) per fit
        except (TypeError, ValueError, RuntimeError, LossFunctionError,
                InvalidArgumentError) as error:
            if tuple_of_batches(data):
                raise InvalidArgumentError(tuple_note(error, "fit_curvature", data)) from error
            clearer = explain_loss_error(error) if isinstance(error, RuntimeError) else None
            if clearer is None:
                raise
            raise clearer from error  # a known torch failure of the loss (a random op, ...)
        estimates.append(estimate)
        seen = n
    info = {"n_examples": seen, "sampler": repr(sampler), "seed": seed,
            "preconditioner": None,  # raw gradients: binding.py refuses a preconditioned store
            "damping": damping.describe(kind) if isinstance(damping, Damping) else "fixed"}
    return damped_fit(Curvature(kind, metas, layout,
                                projection if kind == "projected" else None,
                                (0.0,) * len(estimates), tuple(estimates), tuple(layers), info,
                                blocks), damping)


def damped_fit(fitted: Curvature, damping: Damping | float) -> Curvature:
    """``fitted`` (its dampings placeholders) with ``damping`` resolved at every checkpoint
    once every estimate exists: a float as it is, a :class:`Damping` from each estimate's
    mean eigenvalue over the dimension or over the rank. Shared by the torch and JAX fits.

    Raises:
        InvalidArgumentError: a ``Damping`` at checkpoints whose estimate is zero
            (:func:`~tracinfunc.curvature.damping.resolve`), naming them all; the
            fitted estimates are kept in the error's ``curvature`` (damping 0 there), so
            ``error.curvature.with_damping(lambda)`` needs no refit.
    """
    if not isinstance(damping, Damping):
        return dataclasses.replace(fitted, damping=(float(damping),) * fitted.n_ckpt)
    values, refused = [], []
    for mean, c in zip(fitted.mean_eigenvalues(damping.over), fitted.checkpoints, strict=True):
        try:
            values.append(resolve(damping, mean, fitted.kind, c.name))
        except InvalidArgumentError as error:
            if getattr(error, "checkpoint", None) is None:
                raise
            values.append(0.0)
            refused.append((c.name, mean))
    out = dataclasses.replace(fitted, damping=tuple(values))  # checked at first use
    if refused:
        names = ", ".join(repr(name) for name, _ in refused)
        out = dataclasses.replace(out, info={
            **out.info, "damping": f"{out.info['damping']}; 0 at {names} (zero estimate: "
                                   "re-damp with a fixed damping)"})
        others = [v for v in values if v > 0]
        fix = (f"error.curvature.with_damping({max(others):.2g}) (the largest lambda of the "
               "others)" if others else "error.curvature.with_damping(lambda), a lambda of "
               "your choice (every estimate is zero)")
        error = InvalidArgumentError(
            f"{current_caller()}: {damping!r} ({damping.describe(fitted.kind)}) takes each "
            "checkpoint's lambda from its mean eigenvalue, which is zero at "
            f"{'checkpoint' if len(refused) == 1 else 'checkpoints'} {names}: the estimate is "
            "zero there (every sampled gradient vanishes: the model's predictions are "
            "certain), so there is nothing to be relative to, while other gradients need not "
            "vanish. The fitted estimates are kept: this error's .curvature holds them; give "
            f"every checkpoint one fixed damping with {fix}, or rebuild the store and the fit "
            "without those checkpoints.")
        error.curvature = out
        raise error
    return out


def _fit_matrix(grads_fn: Callable[[Params, Batch], Tensor], params: Params, batches,
                sampler: CheckedSampler, loss: LossFn, generator: torch.Generator,
                blocks: tuple[Block, ...] = ()) -> tuple[dict[str, Tensor], int]:
    """``E[g g^T]`` of rows ``grads_fn(params, labelled batch) -> [b', dim]``: the whole
    ``"matrix"``, or with ``blocks`` each block's ``"block:<i>"`` ``[k_l, k_l]`` only."""
    total: dict[str, Tensor] | None = None
    seen = 0.0
    for batch in batches():
        labelled, weights = sampler(loss, params, batch, generator)
        rows = grads_fn(params, labelled).double()  # [b', dim]
        if not bool(rows.isfinite().all()):
            sampler.refuse("a gradient")
        weighted = rows * weights.to(rows)[:, None]
        if blocks:
            index = [block_index(block, rows.device) for block in blocks]
            part = {f"block:{i}": (weighted[:, at].T @ rows[:, at]).cpu()
                    for i, at in enumerate(index)}
        else:
            part = {"matrix": (weighted.T @ rows).cpu()}
        total = part if total is None else {key: total[key] + part[key] for key in part}
        seen += float(weights.sum())
    if total is None:
        raise EmptyDataError(f"{current_caller()}: data holds no examples; pass training "
                             "batches (or a sample of them).")
    estimate = {key: value / seen for key, value in total.items()}
    return estimate, round(seen)


def _fit_dense(loss, params, names, batches, sampler, generator, chunk_size, projection):
    psg = per_sample_grads(loss, options=GradientOptions(select=list(names), chunk_size=chunk_size))
    layout = canonical_layout({name: params[name] for name in names})

    def rows(params: Params, batch: Batch) -> Tensor:
        return flatten(psg(params, batch), layout)

    return (*_fit_matrix(rows, params, batches, sampler, loss, generator), ())


def _fit_projected(loss, params, names, batches, sampler, generator, chunk_size, projection,
                   *, blocks: tuple[Block, ...] = ()):
    fn = projected_grads(
        loss, projection, options=GradientOptions(select=list(names), chunk_size=chunk_size)
    )
    return (*_fit_matrix(fn, params, batches, sampler, loss, generator, blocks), ())


def _fit_kfac(loss, params, names, batches, sampler, generator, chunk_size, projection,
              *, eigen: bool = False, proof: BatchedProof | None = None):
    proof = BatchedProof() if proof is None else proof  # fit_curvature's: one per fit
    selected = {name: params[name] for name in names}
    frozen = {n: v for n, v in params.items() if n not in selected}

    def selected_loss(chosen: Params, example) -> Tensor:
        return loss({**frozen, **chosen}, example)

    def capture(labelled: Batch):
        example = first_example(labelled)
        layers = find_layers(selected_loss, selected, example)
        vmapped = layer_io(selected_loss, selected, layers, example)
        batched = (batched_io(loss, frozen, selected, layers, example)
                   if isinstance(loss, ModuleLoss) and loss.criterion is not None else None)
        return layers, proven_io(vmapped, batched, proof, layers)

    return _fit_factors(lambda batch: sampler(loss, params, batch, generator), batches,
                        capture, sampler, eigen=eigen)


def _fit_factors(sample: Callable, batches, capture: Callable, sampler: CheckedSampler,
                 *, eigen: bool) -> tuple[dict[str, Tensor], int, list]:
    """K-FAC's factors (and EK-FAC's eigenvalues) from layer inputs and output gradients.

    Shared by the torch and JAX frontends: only how a labelled batch becomes per-layer
    ``(x, delta)`` differs.

    Args:
        sample: ``batch -> (labelled batch, weights [b'])``.
        batches: ``() -> iterator of batches`` (called twice for EK-FAC).
        capture: ``labelled batch -> (layers, feed)`` (called once, on the first batch), with
            ``feed(labelled, start)`` handing each layer's ``(x, delta)`` to a consumer
            (:data:`~tracinfunc.curvature.capture_batched.Feed`).
        sampler: The checked sampler, for refusals naming the data index.
        eigen: Refit the eigenvalues (EK-FAC) in a second pass.
    """
    sums, seen, feed, layers = {}, 0.0, None, []
    for batch in batches():
        labelled, weights = sample(batch)
        if feed is None:
            layers, feed = capture(labelled)
        feed(labelled, partial(kfac.FactorBatch, sums, layers, weights))
        if not _all_finite(sums.values()):
            sampler.refuse("a layer's input or output gradient")
        seen += float(weights.sum())
    if feed is None:
        raise EmptyDataError(f"{current_caller()}: data holds no examples; pass training "
                             "batches (or a sample of them).")
    estimate = {key: value.div_(seen) for key, value in sums.items()}  # the sums, in place
    if not eigen:
        return estimate, round(seen), layers
    estimate.update(kfac.eigenbases(estimate, layers))
    corrected: dict[str, Tensor] = {}
    sampler.start = sampler.size = 0  # data indices in messages restart with the pass
    again = 0.0
    for batch in batches():  # EK-FAC's second pass: eigenvalues in the fitted eigenbases
        labelled, weights = sample(batch)
        feed(labelled, partial(kfac.EigenBatch, corrected, layers, weights, estimate))
        again += float(weights.sum())
    if round(again) != round(seen):
        raise InvalidArgumentError(
            f"{current_caller()}: kind='ekfac' reads data twice, but the second pass gave "
            f"{round(again)} examples and the first {round(seen)}; pass a list or a "
            "DataLoader (data that can be iterated again), not a generator.")
    estimate.update({key: value.div_(seen) for key, value in corrected.items()})
    return estimate, round(seen), layers


def _all_finite(values: Iterable[Tensor]) -> bool:
    """Whether every entry is finite: one sum per tensor (a NaN or inf makes it non-finite),
    the full check only where a sum is not finite (finite entries that overflow it)."""
    return all(bool(value.sum().isfinite()) or bool(value.isfinite().all()) for value in values)


_fit_ekfac = partial(_fit_kfac, eigen=True)  # no frame of its own: the warning's stacklevel


_FITTERS = {"dense": _fit_dense, "projected": _fit_projected, "kfac": _fit_kfac,
            "ekfac": _fit_ekfac}


def check_rereadable(data: Any, kind: str, n_ckpt: int) -> None:
    """Refuse a one-pass iterator (a generator) as ``data`` where the fit reads it more than
    once: once per checkpoint, and twice for ``"ekfac"`` (the second reading would find it
    empty: "no examples")."""
    reads = n_ckpt * (2 if kind == "ekfac" else 1)
    if isinstance(data, Iterator) and reads > 1:
        raise InvalidArgumentError(
            f"{current_caller()}: data is a one-pass iterator ({type(data).__name__}), but "
            f"kind={kind!r} at {n_ckpt} checkpoint(s) reads it {reads} times; pass a list or a "
            "DataLoader (data that can be iterated again), not a generator.")


def _limited(data: Batch | Iterable[Batch], max_examples: int | None) -> Iterator[Batch]:
    """The batches of ``data``, cut after ``max_examples`` inputs; empty batches are skipped
    (so data of 0 examples is the EmptyDataError of the fitters, not a reshape error)."""
    left = max_examples
    for batch in iter_batches(data):
        leaves = [leaf for leaf in tree_leaves(batch) if isinstance(leaf, Tensor) and leaf.dim()]
        if leaves and leaves[0].shape[0] == 0:
            continue
        if left is not None:
            size = _batch_len(batch)
            if left <= 0:
                return
            if size > left:
                batch = _take(batch, left)
            left -= min(size, left)
        yield batch


def _batch_len(batch: Batch) -> int:
    return next(leaf for leaf in tree_leaves(batch) if isinstance(leaf, Tensor)).shape[0]


def _take(batch: Batch, n: int) -> Batch:
    return tree_map(lambda leaf: leaf[:n] if isinstance(leaf, Tensor) else leaf, batch)


def _check_kind(kind: object) -> str:
    if kind not in CURVATURE_KINDS:
        raise InvalidArgumentError(
            f"{current_caller()}: kind must be one of {list(CURVATURE_KINDS)}, got {kind!r}; "
            "'projected' works for any model and projection, 'kfac' for Linear, Conv1D, "
            "Conv2d and Embedding layers, 'dense' for small models."
        )
    return kind


def _blocks(block_diagonal: object, kind: str, layout, projection) -> tuple[Block, ...]:
    """The per-layer blocks ``block_diagonal=True`` asks for, or ``()``."""
    if not isinstance(block_diagonal, bool):
        raise InvalidTypeError(
            f"{current_caller()}: block_diagonal must be True or False, got {block_diagonal!r}."
        )
    if not block_diagonal:
        return ()
    if kind != "projected":
        raise InvalidArgumentError(
            f"{current_caller()}: block_diagonal=True applies to kind='projected' (per-layer "
            f"blocks of the k x k Fisher), got kind={kind!r}; 'kfac' and 'ekfac' are "
            "block-diagonal per layer already."
        )
    return layer_blocks(layout, projection)


def _check_sampler(sampler: object) -> Sampler:
    if not callable(sampler):
        raise InvalidArgumentError(
            f"{current_caller()}: sampler must be callable as sampler(loss, params, batch, "
            f"generator) -> (labelled batch, weights), got {type(sampler).__name__}; e.g. "
            "tracinfunc.curvature.classification_sampler()."
        )
    return sampler


def _check_dense_size(layout) -> None:
    p = sum(math.prod(shape) for _, shape in layout)
    if p > MAX_DENSE_PARAMS:
        raise MemoryBudgetError(
            f"{current_caller()}: kind='dense' holds a [p, p] matrix per checkpoint, and "
            f"p={p} is over {MAX_DENSE_PARAMS} ({8 * p * p / 2**30:.1f} GiB in float64); use "
            "kind='kfac' or 'projected', or select= fewer parameters."
        )
