"""The one build loop every frontend shares: batches -> rows -> a writer -> a read-only store.

``tracinfunc.build_store`` (torch) and ``tracinfunc.jax.build_store`` differ only in how a
batch becomes rows; what a build promises lives here, once:

- **resume**: a writer that already holds rows (an interrupted Zarr build) skips the batches
  stored before, without computing them; a batch straddling the resume point is computed
  whole, as in the first build, and its stored head dropped, so the result is bit-identical;
- **checks**: the first computed batch is checked (the frontend's loss check) before any real
  work; every row must be finite (and stay finite cast to float16/bfloat16 storage), or the
  error names the checkpoint and the rows;
- **empty data** and **resuming with less data** than was stored are clear errors;
- **overlap** (``overlap=True``, torch's ``build_store``): rows that come out on a GPU are
  checked, copied out and written on a writer thread while the next batch is computed
  (:mod:`tracinfunc.build.copy_out`), with the same rows and errors as the serial loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tracinfunc._norms import row_norms
from tracinfunc._validate import current_caller
from tracinfunc._version import __version__
from tracinfunc.build.copy_out import CopyOut, check_finite_flags, check_norms, copy_out_for
from tracinfunc.build.resume import SupportsReadBack, check_same_data
from tracinfunc.errors import (
    EmptyDataError,
    InvalidArgumentError,
    InvalidTypeError,
)
from tracinfunc.progress import ProgressArg, progress_bar
from tracinfunc.projection.spec import Layout, Projection, plan_projection
from tracinfunc.store.codes import check_storable, storage_of
from tracinfunc.store.memory.dense import MemoryWriter, append_fresh, reserve_rows
from tracinfunc.store.meta import CheckpointMeta, StoreMeta, dtype_name
from tracinfunc.store.protocols import GradientStore, StoreWriter
from tracinfunc.store.zarr.parts import StorePart

__all__ = ["RowBlock", "checkpoint_list", "fill_store", "new_store_meta"]


@dataclass(frozen=True)
class RowBlock:
    """Rows with their norms and finiteness already computed (where the rows were made, e.g.
    in the JAX frontend's compiled program), so the loop makes no pass over them itself.

    Attributes:
        rows: ``[n_ckpt, b, k]``.
        norms: ``[n_ckpt, b]``, as :func:`tracinfunc._norms.row_norms` gives them.
        finite: ``[n_ckpt, b]`` bool, whether each row is free of NaN/inf.
    """

    rows: Tensor
    norms: Tensor
    finite: Tensor

    def __getitem__(self, index: tuple) -> RowBlock:  # [:, lo:hi]: the same rows of all three
        return RowBlock(self.rows[index], self.norms[index], self.finite[index])


def checkpoint_list(checkpoints: Any, kind: type, *, name: str) -> list[Any]:
    """``checkpoints`` as a non-empty list of ``kind`` (one checkpoint alone is accepted);
    ``name`` is how the user spells ``kind`` (``"tracinfunc.Checkpoint"``).

    Raises:
        InvalidTypeError: empty, or an element that is not a ``kind``.
    """
    if isinstance(checkpoints, kind):
        checkpoints = [checkpoints]
    checkpoints = list(checkpoints) if isinstance(checkpoints, Iterable) else [checkpoints]
    if not checkpoints or not all(isinstance(c, kind) for c in checkpoints):
        raise InvalidTypeError(
            f"{current_caller()}: checkpoints must be a non-empty list of {name}, got "
            f"{[type(c).__name__ for c in checkpoints]}; e.g. [{name}(params, lr=0.1, "
            "name='epoch-1')]."
        )
    return checkpoints


def new_store_meta(
    checkpoints: Sequence[tuple[str | None, float, str]], layout: Layout,
    projection: Projection, dtype: torch.dtype | str, dataset_fingerprint: str | None) -> StoreMeta:
    """The metadata a build starts from (``n_train=0``, ``complete=False``).

    Args:
        checkpoints: ``(name or None, lr, fingerprint)`` per checkpoint, in order; unnamed
            checkpoints become ``"checkpoint-<i>"``.
        layout, projection: What the rows are projected from and with.
        dtype: The storage dtype: a float ``torch.dtype``, or ``torch.int8``/``"int8"`` or
            ``"sign"`` for quantised rows (:mod:`tracinfunc.store.codes`).

    Raises:
        InvalidArgumentError: two checkpoints share a name, or ``dtype`` is none of these.
        InvalidProjectionError: ``projection`` cannot project this layout (identity ``dim``
            other than ``p``, ``dim`` over the projectors' limit, seeds colliding): said here,
            before a writer exists, so ``overwrite=True`` never deletes a store for a build
            that cannot start.
    """
    read_dtype, quantization = storage_of(dtype)
    names = [name or f"checkpoint-{i}" for i, (name, _, _) in enumerate(checkpoints)]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(
            f"{current_caller()}: checkpoint names must be distinct, got {names}; name them apart, "
            "e.g. Checkpoint(params, lr=0.1, name='epoch-3')."
        )
    for name in names if projection.per_checkpoint else names[:1]:
        plan_projection(projection.for_checkpoint(name), layout)  # raises what a projector would
    return StoreMeta(
        projection=projection,
        checkpoints=tuple(CheckpointMeta(name, lr, fingerprint)
                          for name, (_, lr, fingerprint) in zip(names, checkpoints, strict=True)),
        layout=layout,
        n_train=0,
        k=projection.output_dim(layout),
        dtype=dtype_name(read_dtype),
        quantization=quantization,
        complete=False,
        library_version=__version__,
        dataset_fingerprint=dataset_fingerprint,
    )


def fill_store(
    writer: StoreWriter,
    batches: Iterable[tuple[int, Any]],
    rows_of: Callable[[Any], Tensor],
    *,
    meta: StoreMeta,
    check_first: Callable[[Any], None] | None = None,
    progress: ProgressArg = None,
    total: int | None = None,
    stop: int | None = None,
    overlap: bool = False,
    fresh_rows: bool = False,
) -> GradientStore | StorePart:
    """Append the rows of every batch to ``writer`` and seal it.

    Args:
        writer: Where rows go; one holding ``rows_written > 0`` rows is resumed.
        batches: ``(b, batch)`` pairs, ``b`` the batch's number of examples.
        rows_of: ``batch -> [n_ckpt, b, k]`` rows (a tensor, any float dtype), or a
            :class:`RowBlock` of them with their norms and finiteness.
        meta: The store's metadata (names checkpoints in errors).
        check_first: Called with the first batch to be computed, before ``rows_of``.
        progress, total: The progress bar over examples (``total`` when known; an
            in-memory writer also allocates that many rows up front, as a hint).
        stop: Write no row at or past ``stop`` and stop iterating there: a part of a sharded
            build (its writer's ``rows_written`` starts at the part's first row).
        overlap: Where rows come out on an accelerator, check, copy out and write batch i on
            a writer thread while batch i+1 is computed (:mod:`tracinfunc.build.copy_out`);
            the rows stored are the same, bit for bit.
        fresh_rows: ``rows_of`` returns new tensors that no one else holds: an in-memory
            writer keeps them without copying them first.

    Returns:
        ``writer.finish()``: the read-only store ``[n_ckpt, n_train, k]`` (for a part
        writer, the finished part).

    Raises:
        EmptyDataError: no examples, or fewer than an interrupted build already stored.
        NonFiniteGradientError: a row is NaN/inf (names the checkpoint and examples).
    """
    resume_at = writer.rows_written  # > 0 when resuming, or at a part's first row
    if type(writer) is MemoryWriter and total:  # rows in place: no concatenation at finish
        reserve_rows(writer, total)
    # The rows this writer stored before (a part's start, or 0, up to the resume point); only
    # writers that can read rows back are checked. The batches holding the first and the last
    # of them are recomputed and compared: an example inserted or dropped anywhere before the
    # resume point shifts every row after it.
    own = writer.first_row if isinstance(writer, SupportsReadBack) else resume_at
    proofs = {own, resume_at - 1} if resume_at > own else set()
    seen = 0
    stop = float("inf") if stop is None else stop
    checked = check_first is None
    pipeline: CopyOut | None = None
    decided = not overlap
    try:
        with progress_bar(progress, total=total, desc=current_caller(), unit="ex") as bar:
            bar.update(resume_at)
            for size, batch in batches:
                if seen >= stop:  # past this part: later batches are other parts' work
                    break
                seen += size
                first = seen - size
                computed = None
                if any(first <= row < seen for row in proofs):  # stored before: same data?
                    computed = rows_of(batch)
                    lo = max(first, own)  # this writer's rows only: a part's start, or 0
                    check_same_data(writer, _rows(computed)[:, lo - first : resume_at - first],
                                    meta, start=lo)
                if size == 0 or seen <= resume_at:  # stored before the interruption: skip
                    continue
                if not checked:
                    check_first(batch)
                    checked = True
                # A batch straddling the resume point or the part's end is computed whole, as
                # in a one-process build, and cut: the rows are bit-identical.
                computed = rows_of(batch) if computed is None else computed
                rows = computed[:, max(0, resume_at - first) : min(size, stop - first)]
                if isinstance(rows, RowBlock):
                    check_finite_flags(rows.finite, meta, first_row=writer.rows_written)
                    check_norms(rows.norms, meta, first_row=writer.rows_written)
                    # Rows computed elsewhere (JAX) are cast to the storage dtype here too.
                    check_storable(rows.rows, meta, first_row=writer.rows_written)
                    writer.append(rows.rows, rows.norms)
                    rows = rows.rows
                elif pipeline is not None:
                    pipeline.put(rows)
                else:
                    norms = row_norms(rows)
                    if not bool(torch.isfinite(norms).all()):  # finite norms: finite rows
                        check_finite(rows, meta, first_row=writer.rows_written)
                        # finite rows whose norm overflows (entries near the float32 max)
                        check_norms(norms, meta, first_row=writer.rows_written)
                    check_storable(rows, meta, first_row=writer.rows_written)
                    if fresh_rows and type(writer) is MemoryWriter:
                        append_fresh(writer, rows, norms)  # the loop's own: no copy
                    else:
                        writer.append(rows, norms)
                if not decided:  # the first rows go serially (a writer's refusals surface as
                    # they are); where they came out decides the rest
                    pipeline = copy_out_for(writer, meta, rows, first_row=writer.rows_written)
                    decided = True
                bar.update(rows.shape[1])
    except BaseException:
        if pipeline is not None:  # write what was handed off: nothing computed is lost
            pipeline.drain()
        raise
    if pipeline is not None:
        pipeline.close()
    if stop != float("inf") and seen < stop:
        raise EmptyDataError(
            f"{current_caller()}: this part needs rows up to {stop} but data has only {seen}; "
            "every part of a sharded build must see the same data as the whole build."
        )
    if seen < resume_at:
        raise EmptyDataError(
            f"{current_caller()}: the store already holds {resume_at} rows but data has only "
            f"{seen}; resume (or re-run) with the same data as the build that wrote it."
        )
    if writer.rows_written == 0 and stop == float("inf"):
        raise EmptyDataError(
            f"{current_caller()}: data holds no examples; pass a non-empty batch or iterable of "
            "batches (a tensor or array, a tuple/dict of them, a list of those, or a "
            "DataLoader)."
        )
    return writer.finish()


def _rows(computed: Tensor | RowBlock) -> Tensor:
    return computed.rows if isinstance(computed, RowBlock) else computed


def check_finite(rows: Tensor, meta: StoreMeta, *, first_row: int) -> None:
    """Raise :class:`NonFiniteGradientError` naming the checkpoint and rows of any NaN/inf."""
    check_finite_flags(torch.isfinite(rows).all(dim=-1), meta, first_row=first_row)
