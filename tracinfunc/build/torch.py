"""build_store: checkpoints x batches -> projected gradients -> a writer -> a read-only store.

A short composition of public pieces (:func:`~tracinfunc.grads.projected_grads` and a store
writer) that a user could rebuild; it adds the checks that make failures early and clear.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from tracinfunc._validate import check_int, entry_point
from tracinfunc.batches import (
    check_ordered,
    expected_rows,
    iter_batches,
    rebatch,
    sized,
    tuple_note,
    tuple_of_batches,
)
from tracinfunc.build.calls import Call, CallSite, numbered
from tracinfunc.build.inputs import (
    build_record,
    fingerprinted,
    first_batch_recorded,
    precision_name,
)
from tracinfunc.build.loop import checkpoint_list, fill_store, new_store_meta
from tracinfunc.build.merge import merge_limit, merged_calls
from tracinfunc.build.unchanged import batch_versions, check_batch_unchanged
from tracinfunc.checkpoint import Checkpoint, loss_at
from tracinfunc.distributed import (
    commit_after_barrier,
    is_distributed,
    rank_shard,
    rank_zero_first,
)
from tracinfunc.errors import (
    IncompatibleGradientsError,
    InvalidArgumentError,
    LossFunctionError,
    NonFiniteGradientError,
    TracInFuncError,
)
from tracinfunc.grads.options import GradientOptions, gradient_options
from tracinfunc.grads.selection import selected_names
from tracinfunc.grads.shared_inputs import sharing_inputs
from tracinfunc.grads.transforms import explain_loss_error, projected_grads
from tracinfunc.loss import ModuleLoss, check_eval_mode, holding, modules_reached
from tracinfunc.precondition.optimizer import Preconditioner, check_preconditioners
from tracinfunc.progress import ProgressArg
from tracinfunc.projection import Projection, canonical_layout
from tracinfunc.projection.spec import check_projection
from tracinfunc.store.memory.dense import MemoryWriter, next_rows_slot
from tracinfunc.store.protocols import GradientStore
from tracinfunc.store.writer import StoreTarget, make_part_writer, make_writer, writes_to_disk
from tracinfunc.store.zarr.parts import PartWriter, StorePart
from tracinfunc.store.zarr.writer import ZarrWriter
from tracinfunc.types import Batch, LossFn, Params

__all__ = ["build_store"]


@entry_point("build_store")
def build_store(
    loss: LossFn,
    checkpoints: Sequence[Checkpoint],
    data: Batch | Iterable[Batch],
    *,
    projection: Projection,
    options: GradientOptions | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str | None = None,
    dataset_fingerprint: str | None = None,
    batch_size: int | None = None,
    store: StoreTarget = None,
    progress: ProgressArg = None,
    preconditioners: Sequence[Preconditioner] | None = None,
    shard: tuple[int, int] | None = None,
) -> GradientStore | StorePart:
    """Compute projected per-example gradients at every checkpoint and store them.

    ``data`` is iterated once; for each batch, gradients at every checkpoint are computed
    with :func:`~tracinfunc.grads.projected_grads` and appended to the store.

    Args:
        loss: ``loss(params, example) -> scalar`` for one example (no batch dimension).
        checkpoints: The checkpoints ``w_c`` with their weights ``lr_c`` (``n_ckpt`` of them).
        data: One batch (a tensor, tuple or dict of tensors with a leading batch dimension)
            or an iterable of batches (a list of batches, a DataLoader, a generator).
        projection: How to project, e.g. ``Projection(dim=512, seed=0)``; to make test
            gradients, pass ``projection=store.projection``.
        options: How gradients are computed, one :class:`~tracinfunc.GradientOptions` (as
            for :func:`~tracinfunc.grads.projected_grads`); with ``select`` the store's
            layout (and projection) covers only the selected parameters, and test gradients
            must use the same selection.
        dtype: Storage dtype: float32 (default), float16, bfloat16 or float64 (exactness
            checks; needs float64 params); or quantised: ``torch.int8``/``"int8"`` (int8
            codes with a per-row scale, 4x smaller than float32) or ``"sign"`` (1 bit per
            value with a per-row scale, ~30x smaller), read back as float32 (see
            ``docs/concepts/stores.md``). Norms are taken before the cast or quantisation.
        device: Where gradients are computed (default: the checkpoints' device).
        dataset_fingerprint: Optional identifier of the data, recorded in the metadata.
        batch_size: Examples per gradient call: the data's batches are merged or split to
            this size (the last may be smaller); ``None`` keeps the data's own batches,
            except that an in-memory build without a memory option (``chunk_size``,
            ``memory_budget``, ``stages``) merges consecutive batches into calls of up to
            64 MiB of per-example gradients and at most 4096 examples (a batch is never
            split; rows equal those of the data's own batches to float32 rounding, not
            always bit for bit: BLAS may round a row differently by how many examples share
            its call and where they lie in memory; pass ``batch_size=`` for the same calls,
            hence the same bits, on every run). Each call has a fixed cost (~2 ms on a CPU), so
            merging small loader batches pays for small models; activation memory grows with
            it unless ``chunk_size`` or ``memory_budget`` bounds it. Merging reads batches
            ahead of the loss (a batch held for a later call is copied, so a loader may
            reuse its buffers): state the loss reads must travel in the batch (e.g. a
            per-example weight tensor), not in a variable the loader sets per batch.
            Resuming needs the same ``batch_size`` (a Zarr store records it; another is
            refused).
        store: Where the rows go: ``None``/``"memory"`` (default), ``"pinned"`` or
            ``tif.store.PinnedStore`` (page-locked memory), a path such as ``"grads.zarr"`` (a new
            Zarr store), or a callable ``meta -> writer`` (e.g. ``functools.partial(
            tif.store.ZarrWriter, path, overwrite=True)``). If the path holds a store left
            incomplete by an interrupted build, calling ``build_store`` again with the same
            arguments resumes it: batches already stored are skipped without computing their
            gradients, and the result is bit-identical to an uninterrupted build.
        progress: A progress bar over examples: ``None`` (default) shows one on a terminal
            once the build has run for 2 s, ``True`` always, ``False`` never.
        preconditioners: Optimizer-aware TracIn: one :class:`~tracinfunc.Preconditioner`
            per checkpoint (its saved optimizer state), all of one kind, applied to these
            (training) gradients; the store records the kind and scoring refuses test
            gradients built with it. Each checkpoint then has its own projector cache.
        shard: ``(index, count)``: compute and write only part ``index`` of ``count`` of
            the rows (whole Zarr shards) into the Zarr store at the path ``store``; every
            part is given the same ``data``, needs a known size (a batch, a list of batches
            or a DataLoader over a sized dataset) and resumes on its own. Returns the
            :class:`~tracinfunc.store.zarr.parts.StorePart`; ``tif.store.commit_store(path)`` (or
            ``tracinfunc commit``) seals the store once every part is done. Under torchrun
            (``torch.distributed`` initialised) a store at a path (or a
            ``functools.partial`` of ``PartWriter``) is split by ``(rank, world_size)``
            unless ``shard`` is given, and rank 0 commits after a barrier: every rank
            returns the store. In-memory stores are built whole by every rank.
            With ``shard``, ``store`` is a path or a ``functools.partial`` of
            ``ZarrWriter`` or ``PartWriter``, e.g. ``functools.partial(tif.store.PartWriter,
            path, shard_rows=4096)``; in-memory stores and other callables are refused.

    Returns:
        A read-only store of ``[n_ckpt, n_train, k]`` rows (:class:`~tracinfunc.store.MemoryStore`,
        :class:`~tracinfunc.store.PinnedStore` or :class:`~tracinfunc.store.ZarrStore`; quantised:
        :class:`~tracinfunc.store.QuantizedMemoryStore`,
        :class:`~tracinfunc.store.QuantizedPinnedStore`
        or :class:`~tracinfunc.store.ZarrStore`).

    Raises:
        EmptyDataError: ``data`` holds no examples.
        LossFunctionError: ``loss`` fails on the checkpoint parameters or is not scalar
            (names the failing batch and its data rows).
        NonFiniteGradientError: a gradient is NaN/inf (names checkpoint and rows).
        IncompatibleGradientsError: checkpoints differ in parameter names or shapes, or an
            incomplete store at ``store`` was started with other arguments.
        StoreExistsError: a finished store already exists at the ``store`` path.
    """
    # An int the store's JSON record can hold (np.int64 from a config), checked before
    # anything is written.
    batch_size = check_int(batch_size, "batch_size", optional=True)
    checkpoints = _check_checkpoints(checkpoints)
    check_ordered(data)
    check_projection(projection)
    options = gradient_options(options)
    names = selected_names(checkpoints[0].params, options.select)
    layout = canonical_layout({name: checkpoints[0].params[name] for name in names})
    meta = new_store_meta([(c.name, c.lr, c.fingerprint) for c in checkpoints], layout,
                          projection, dtype, dataset_fingerprint)
    kind = check_preconditioners(preconditioners, [c.params for c in checkpoints], names)
    meta = meta if kind is None else meta.replace(preconditioner=kind)
    device = torch.device(device) if device is not None else _params_device(checkpoints)
    params_per_ckpt = [_params_on(ckpt.params, device) for ckpt in checkpoints]
    # Each checkpoint is differentiated with its own buffers (BatchNorm statistics), its own
    # projection (per_checkpoint) and preconditioner; equal ones share one transform (and its
    # cached projector).
    ckpt_losses = [_loss_on(loss, c, device) for c in checkpoints]
    transforms: dict[tuple, Callable[[Params, Batch], Tensor]] = {}
    grads_fns = []
    for i, (ckpt_meta, ckpt_loss) in enumerate(zip(meta.checkpoints, ckpt_losses, strict=True)):
        ckpt_projection = projection.for_checkpoint(ckpt_meta.name)
        precondition = None if kind is None else preconditioners[i]
        key = (id(ckpt_loss), ckpt_projection, id(precondition))
        if key not in transforms:
            transforms[key] = projected_grads(ckpt_loss, ckpt_projection, options=options,
                                              precondition=precondition)
        grads_fns.append(transforms[key])
    distributed = shard is None and writes_to_disk(store) and is_distributed()
    if distributed:
        shard = rank_shard()
    stop = None
    if shard is None:
        writer = make_writer(store, meta)
    else:
        full = meta.replace(n_train=sized(data))  # every part sizes the store up front
        writer = rank_zero_first(lambda: make_part_writer(store, full, shard)) if distributed \
            else make_part_writer(store, full, shard)
        stop = writer.stop
    batches = iter_batches(data) if batch_size is None else rebatch(data, batch_size)
    limit = merge_limit(layout, _itemsize(params_per_ckpt[0]), options,
                        in_memory=shard is None and not writes_to_disk(store)
                        and (store is None or isinstance(store, str)))
    merged = batch_size is None and limit > 1
    if merged:  # a small model's fixed cost per call, paid less often
        batches = merged_calls(batches, limit)
    # A resume (or a re-run over a finished store) makes the same calls in the same precision.
    precision = {"mixed_precision": precision_name(options.mixed_precision)}
    if isinstance(writer, ZarrWriter) and batch_size is not None:
        writer.record_build({"batch_size": batch_size, **precision})

    def on_device(batch: Batch) -> Batch:
        return tree_map(lambda leaf: leaf.to(device), batch)

    def rows_of(batch: Batch) -> Tensor:  # [n_ckpt, b, k]
        batch = on_device(batch)
        # Each checkpoint's rows go into the call's block as they come: a call holds one
        # checkpoint's rows beside the block, not every checkpoint's (as a stack would).
        rows = None
        versions = batch_versions(batch)
        with sharing_inputs(batch):  # a first layer's input products, once for all of them
            for c, (grads_fn, params) in enumerate(zip(grads_fns, params_per_ckpt,
                                                       strict=True)):
                one = grads_fn(params, batch)  # [b, k]
                check_batch_unchanged(batch, versions)
                if rows is None:  # the store's reserved rows where they are next: no copy
                    rows = in_place(one)
                    if rows is None:
                        rows = one.new_empty((len(grads_fns), *one.shape))
                rows[c] = one
                del one
        return rows

    lends_rows = store is None and type(writer) is MemoryWriter  # the build's own writer

    def in_place(one: Tensor) -> Tensor | None:
        if not lends_rows or one.device.type != "cpu":
            return None
        return next_rows_slot(writer, one.shape[0], one.dtype)

    site = CallSite(rows_of)  # a failing call is named (batch index, data rows)
    pairs = site.follow(numbered(batches, merged=merged, batch_size=batch_size))
    if isinstance(writer, ZarrWriter) and batch_size is None:  # the data's batches are the calls
        pairs = first_batch_recorded(pairs, writer, record=precision)
    if isinstance(writer, PartWriter):  # what commit compares the parts by
        writer.record_build({**build_record(meta, mixed_precision=options.mixed_precision),
                             "batch_size": batch_size})
        pairs = fingerprinted(pairs, writer)
    try:
        result = fill_store(
            writer, pairs, site, meta=meta,
            check_first=lambda batch: _check_loss(ckpt_losses[0], params_per_ckpt[0],
                                                  on_device(batch), call=site.current),
            progress=progress, total=expected_rows(data), stop=stop, overlap=True,
            fresh_rows=store is None)  # a writer build_store made itself: no one else holds rows
    except NonFiniteGradientError as error:
        if options.mixed_precision is None or not hasattr(error, "bad_rows"):
            raise
        raise NonFiniteGradientError(_precision_hint(error, options.mixed_precision)) from error
    except (LossFunctionError, InvalidArgumentError) as error:
        if type(error) not in (LossFunctionError, InvalidArgumentError) or \
                not tuple_of_batches(data):
            raise
        raise InvalidArgumentError(tuple_note(error, "build_store", data)) from error
    return commit_after_barrier(result.path) if distributed else result


def _precision_hint(error: NonFiniteGradientError, mixed_precision: torch.dtype) -> str:
    """``error``'s message and what ``mixed_precision`` may have to do with the NaN/inf rows."""
    if mixed_precision == torch.float16:
        why = ("float16 overflows above 65504: a forward value or a gradient that large (after "
               "the loss-scaled retries) is inf. If float32 is finite on those examples, pass "
               "mixed_precision=torch.bfloat16 (float32's range) or None (float32)")
    else:
        why = (f"{precision_name(mixed_precision)} keeps float32's range but "
               "rounds to 8 bits; pass mixed_precision=None (float32) to see whether those "
               "examples are NaN/inf in full precision too")
    return (f"{error} This build runs with mixed_precision={mixed_precision}: {why}.")


def _check_checkpoints(checkpoints: Sequence[Checkpoint]) -> list[Checkpoint]:
    checkpoints = checkpoint_list(checkpoints, Checkpoint, name="tracinfunc.Checkpoint")
    layouts = {canonical_layout(c.params) for c in checkpoints}
    if len(layouts) > 1:
        raise IncompatibleGradientsError(
            "build_store: checkpoints differ in parameter names or shapes; all checkpoints "
            "must be snapshots of the same model."
        )
    return checkpoints


def _params_device(checkpoints: list[Checkpoint]) -> torch.device:
    return next(iter(checkpoints[0].params.values())).device


def _itemsize(params: Params) -> int:
    return max(value.element_size() for value in params.values())


def _params_on(params: Params, device: torch.device) -> dict[str, Tensor]:
    return {name: value.to(device) for name, value in params.items()}


def _loss_on(loss: LossFn, checkpoint: Checkpoint, device: torch.device) -> LossFn:
    """``loss`` at ``checkpoint`` with every buffer on ``device``: the checkpoint's, and the
    module's own ones it lacks (a CPU model's BatchNorm statistics with ``device="cuda"``)."""
    own = loss.buffers if isinstance(loss, ModuleLoss) else {}
    if own and checkpoint.buffers:
        loss.check_buffers(checkpoint.buffers)  # a partial set would be mixed with the module's
    buffers = _params_on({**own, **checkpoint.buffers}, device)
    return loss_at(loss, replace(checkpoint, buffers=buffers))


def _check_loss(loss: LossFn, params: Params, batch: Batch, *, call: Call | None = None
                ) -> None:
    """Evaluate the loss on the first example, so mistakes fail before any real work."""
    example = tree_map(lambda leaf: leaf[0], batch)
    if isinstance(loss, ModuleLoss):
        # Before any call: in train mode BatchNorm would update the loss's buffers in place.
        check_eval_mode(loss.module)
    versions = batch_versions(batch)
    try:
        with torch.no_grad(), holding(modules_reached(loss)):  # as the gradient calls do
            value = loss(params, example)
        first = "" if call is None else \
            f" (its first example, on {(call.part(0) if call.first is not None else call).where()})"
        check_batch_unchanged(batch, versions, where=first)
    except TracInFuncError:
        raise  # already says what is wrong and how to fix it
    except Exception as error:
        clearer = explain_loss_error(error)
        if clearer is not None:
            raise clearer from error
        raise LossFunctionError(
            f"build_store: loss(params, example) failed on the first example with "
            f"{type(error).__name__}: {error}. Check that the loss uses the checkpoint's "
            f"parameter names ({sorted(params)[:4]}...) and takes one example without a batch "
            "dimension."
        ) from error
    if not isinstance(value, Tensor) or value.numel() != 1:
        shape = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise LossFunctionError(
            f"build_store: loss(params, example) must return a scalar tensor, got {shape}; "
            "reduce it (e.g. with .sum()) for one example."
        )
