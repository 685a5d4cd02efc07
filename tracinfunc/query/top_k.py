"""The ``k`` most or least influential training rows, without forming ``[n_test, n_train]``."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from tracinfunc._devices import full_float32
from tracinfunc._validate import check_int, entry_point
from tracinfunc.curvature.value import Curvature
from tracinfunc.interop import Array, resolve_output, to_framework
from tracinfunc.progress import ProgressArg
from tracinfunc.query.checks import check_not_empty
from tracinfunc.query.chunks import stream_scores
from tracinfunc.query.merge import merge_sorted
from tracinfunc.query.overflow import OverflowWatch, nan_scores_error
from tracinfunc.query.prepared import PreparedQuery, prepare_query
from tracinfunc.query.rows import row_range
from tracinfunc.query.score import candidate_top_k
from tracinfunc.store.protocols import GradientStore, store_meta

__all__ = ["check_k", "top_k"]

# top_k holds a [n_test, chunk] score block and its sort (float32 values + int64 order):
# 16 bytes per query and row. Above this many test rows (256 MiB at 256-row chunks) it scans
# the store once per block of queries instead of letting that block grow without bound.
_MAX_QUERY_BLOCK = 65_536
# top_k merges score blocks in groups of this many rows (fewer when a group's values and
# sort, 16 bytes per query and row, would pass _GROUP_BYTES).
_GROUP_COLUMNS = 2048
_GROUP_BYTES = 32 * 2**20


@entry_point("top_k")
def top_k(
    store: GradientStore,
    test_grads: GradientStore | Array,
    k: int = 10,
    *,
    largest: bool = True,
    normalize: bool = False,
    device: torch.device | str | None = None,
    chunk_rows: int | None = None,
    progress: ProgressArg = None,
    rows: tuple[int, int] | None = None,
    curvature: Curvature | None = None,
    candidates: object = None,
    output: str | None = None,
    like: object = None,
) -> tuple[Array, Array]:
    """The ``k`` most (``largest=True``: proponents) or least (opponents) influential rows.

    Never materialises ``[n_test, n_train]``: each streamed chunk is merged into a running
    top-k of ``[n_test, k]``. Query sets of more than 65,536 test rows are split into blocks
    of that many, one scan of the store each, so the per-chunk score block stays bounded
    (the query is prepared once and split).

    Args:
        store: As in :func:`score`.
        test_grads: As in :func:`score`.
        k: How many training examples per test example, in ``[1, n_train]``.
        largest: ``True`` for the highest scores (proponents), ``False`` for the lowest
            (opponents).
        normalize: As in :func:`score`.
        device: As in :func:`score`.
        chunk_rows: As in :func:`score`.
        progress: As in :func:`score`.
        rows: ``(start, stop)``: scan only training rows ``[start, stop)``; the partial
            results of workers merge exactly with :func:`tracinfunc.distributed.merge_top_k`
            (or :func:`tracinfunc.distributed.gather_top_k` under torchrun).
        curvature: As in :func:`score`.
        candidates: As in :func:`score`: the ``k`` best among each test example's
            candidates, ``k <= M`` (exact: the top-k of the whole store's scores restricted
            to those rows, equal scores by row). Exclusive with ``rows``.
        output: As in :func:`score`.
        like: As in :func:`score`.

    Returns:
        ``(values, indices)``, both ``[n_test, k]``, sorted best first, equal scores by row;
        indices are rows of the store (int64), also with ``rows``. Torch tensors on
        ``device``, or arrays of the framework ``output``/``like`` name.
    """
    framework = resolve_output(output, like)
    check_not_empty(store_meta(store))  # a store instance first: anything else is refused
    if candidates is not None:
        values, indices = candidate_top_k(store, test_grads, k, candidates, rows=rows,
                                          largest=largest, normalize=normalize, device=device,
                                          curvature=curvature)
        return to_framework(values, framework), to_framework(indices, framework)
    part = store if rows is None else row_range(store, rows)
    offset = 0 if rows is None else part.start
    k = check_k(k, part.meta.n_train)
    query = prepare_query(store, test_grads, normalize=normalize, device=device,
                          curvature=curvature)
    # one overflow warning for the whole query, however many scans it takes
    watch = OverflowWatch(part, query)
    options = {"largest": largest, "chunk_rows": chunk_rows, "progress": progress,
               "watch": watch}
    if query.n_test <= _MAX_QUERY_BLOCK:
        values, indices = _exact_top_k(part, query, k, offset, **options)
    else:  # one scan per block of queries; the blocks' results stack row for row
        parts = [_exact_top_k(part, query.split(lo, lo + _MAX_QUERY_BLOCK), k, offset,
                              **options) for lo in range(0, query.n_test, _MAX_QUERY_BLOCK)]
        values, indices = (torch.cat(list(column)) for column in zip(*parts, strict=True))
    watch.warn()
    return to_framework(values, framework), to_framework(indices, framework)


def check_k(k: object, n_rows: int) -> int:
    """``k`` as a Python int if it is an integral scalar in ``[1, n_rows]``: the same error
    from ``top_k`` and ``indexed_top_k``."""
    return check_int(k, "k", maximum=n_rows, maximum_label="n_train",
                     fix="for every training example use tif.score and sort")


def _exact_top_k(store: GradientStore, query: PreparedQuery, k: int, offset: int, *,
                 largest: bool, chunk_rows: int | None, progress: ProgressArg,
                 watch: OverflowWatch | None) -> tuple[Tensor, Tensor]:
    """One scan of ``store``: the running ``[n_test, k]`` top-k over its streamed chunks
    (IEEE float32 set once for the scan, as in ``score``)."""
    with full_float32(hold=True):
        return _scan_top_k(store, query, k, offset, largest=largest, chunk_rows=chunk_rows,
                           progress=progress, watch=watch)


def _scan_top_k(store: GradientStore, query: PreparedQuery, k: int, offset: int, *,
                largest: bool, chunk_rows: int | None, progress: ProgressArg,
                watch: OverflowWatch | None) -> tuple[Tensor, Tensor]:
    best_values: Tensor | None = None
    best_indices: Tensor | None = None
    nan_seen: Tensor | None = None  # on the scores' device: no sync per chunk
    for start, block in _grouped(stream_scores(store, query, chunk_rows=chunk_rows,
                                               progress=progress, watch=watch)):
        nan = block.isnan().any()
        nan_seen = nan if nan_seen is None else nan_seen | nan
        values, order = _block_best(block, k, largest=largest, nan=nan)
        part = (values, order + (start + offset))
        parts = [part] if best_values is None else [(best_values, best_indices), part]
        best_values, best_indices = merge_sorted(parts, k, largest=largest)
    # NaN sorts first: top "proponents". (The meta device, shapes without values: nothing.)
    if nan_seen is not None and not nan_seen.is_meta and bool(nan_seen):
        if watch is not None:
            watch.warn()  # the overflow that made the NaN, named before the error
        raise nan_scores_error()
    return best_values, best_indices


def _grouped(blocks: Iterator[tuple[int, Tensor]]) -> Iterator[tuple[int, Tensor]]:
    """Consecutive score blocks joined into ``[n_test, >= _GROUP_COLUMNS]`` groups: the
    running merge costs a dozen small ops per group, not per stored chunk (256 rows at
    k=4096)."""
    pending: list[Tensor] = []
    first = width = 0
    for start, block in blocks:
        if not pending:
            first = start
        pending.append(block)
        width += block.shape[1]
        if width >= min(_GROUP_COLUMNS, _GROUP_BYTES // (16 * max(1, block.shape[0]))):
            yield first, pending[0] if len(pending) == 1 else torch.cat(pending, dim=1)
            pending, width = [], 0
    if pending:
        yield first, pending[0] if len(pending) == 1 else torch.cat(pending, dim=1)


def _block_best(block: Tensor, k: int, *, largest: bool, nan: Tensor
                ) -> tuple[Tensor, Tensor]:
    """The first ``min(k, rows)`` columns of a stable sort of ``block`` ``[n_test, rows]``:
    equal scores keep row order, so any split of the rows (chunks here, workers with
    ``rows=``) merges into the same result.

    On the CPU, ``topk`` picks them (a full sort of each block cost 0.4x the matmul at
    64 x 256 blocks): the same set as the stable sort unless more columns tie with the k-th
    value than ``topk`` took (then the sort decides) or scores are NaN; the k picked are then
    put in row order and sorted stably by value. Off the CPU the check would synchronise
    every chunk: the sort stays. ``nan``: whether ``block`` holds a NaN (0-d bool).
    """
    def stable_sort() -> tuple[Tensor, Tensor]:
        values, order = block.sort(dim=1, descending=largest, stable=True)
        return values[:, :k], order[:, :k]

    if block.device.type != "cpu" or k >= block.shape[1] or bool(nan):
        return stable_sort()
    values, order = block.topk(k, dim=1, largest=largest, sorted=False)
    kth = values.amin(1, keepdim=True) if largest else values.amax(1, keepdim=True)
    if bool(((block == kth).sum(1) != (values == kth).sum(1)).any()):  # ties cut at k
        return stable_sort()
    order, by_row = order.sort(dim=1)
    values = values.gather(1, by_row)
    by_value = values.argsort(dim=1, descending=largest, stable=True)
    return values.gather(1, by_value), order.gather(1, by_value)
