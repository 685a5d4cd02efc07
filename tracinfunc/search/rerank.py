"""Approximate top-k: candidates from a FAISS index, then an exact re-rank from the store."""

from __future__ import annotations

import torch
from torch import Tensor

from tracinfunc._norms import directions
from tracinfunc._validate import check_int, current_caller, entry_point
from tracinfunc.curvature.value import Curvature
from tracinfunc.errors import (
    IncompatibleGradientsError,
    InvalidArgumentError,
    InvalidTypeError,
    NonFiniteGradientError,
)
from tracinfunc.interop import Array, resolve_output, to_framework
from tracinfunc.progress import ProgressArg, progress_bar
from tracinfunc.query.checks import check_not_empty
from tracinfunc.query.overflow import OverflowWatch, warn_candidate_overflow
from tracinfunc.query.prepared import PreparedQuery, prepare_query
from tracinfunc.query.rows import check_rows, row_range
from tracinfunc.query.top_k import check_k
from tracinfunc.search.binding import CandidateSketch, meta_fingerprint
from tracinfunc.search.index import SearchIndex, import_faiss
from tracinfunc.store.gather import norms_at, read_rows_at
from tracinfunc.store.protocols import GradientStore

__all__ = ["indexed_top_k"]

# Bytes of the gathered candidate rows [queries, n_candidates, k] of one block of queries.
_BLOCK_BYTES = 64 * 2**20
_MISSING = torch.iinfo(torch.int64).max  # FAISS's -1, sorted after every row


@entry_point("indexed_top_k")
def indexed_top_k(
    store: GradientStore,
    test_grads: GradientStore | Array,
    k: int = 10,
    *,
    index: SearchIndex,
    nprobe: int | None = None,
    n_candidates: int | None = None,
    largest: bool = True,
    normalize: bool = False,
    device: torch.device | str | None = None,
    progress: ProgressArg = None,
    rows: tuple[int, int] | None = None,
    curvature: Curvature | None = None,
    output: str | None = None,
    like: object = None,
) -> tuple[Array, Array]:
    """Approximate top-k: candidates from a FAISS ``index``, re-ranked exactly from the store.

    Each test example fetches ``n_candidates`` rows from the ``nprobe`` nearest clusters,
    whose TracIn scores are then computed exactly from the store (only the candidate rows are
    read, in runs per stored chunk) and the best ``k`` kept. Opponents (``largest=False``)
    search with negated queries: the highest inner products with ``-query`` are the lowest
    scores. There is no ``chunk_rows``: only candidate rows are read, per block of queries.

    Args:
        store: As in :func:`tracinfunc.top_k`.
        test_grads: As in :func:`tracinfunc.top_k`.
        k: As in :func:`tracinfunc.top_k`.
        index: Built by :func:`~tracinfunc.build_index` from this store, with the same
            ``normalize``.
        nprobe: Clusters searched per test example (default ``index.nprobe``: the value
            ``build_index`` calibrated to its ``target_recall`` of recall@10 on the store's
            rows, else ``max(1, nlist // 16)``; ``nlist`` searches every cluster, which makes
            the result exact for ``"ivf_flat"``). An explicit value always wins.
        n_candidates: How many rows are fetched per test example and re-ranked (default
            ``index.candidates(k)``: ``rerank * k`` with the calibrated ``rerank``, else
            ``max(2 * k, 16)``, ``max(10 * k, 100)`` for ``"ivf_pq"``; at most the rows
            searched).
        largest: As in :func:`tracinfunc.top_k`.
        normalize: As in :func:`tracinfunc.top_k`.
        device: Where the exact re-rank runs and the result lands, as in
            :func:`tracinfunc.score` (FAISS itself searches on the CPU).
        progress: A progress bar over test examples, as in :func:`tracinfunc.score`.
        rows: ``(start, stop)``: search and re-rank only training rows ``[start, stop)``;
            indices stay rows of the whole store, so workers' results merge with
            :func:`tracinfunc.distributed.merge_top_k`.
        curvature: As in :func:`tracinfunc.score`: the index is searched with the
            preconditioned queries and the candidates re-ranked by curvature-aware scores
            (the index of the store serves both, as the store does).
        output: As in :func:`tracinfunc.score`.
        like: As in :func:`tracinfunc.score`.

    Returns:
        ``(values, indices)``, both ``[n_test, k]``, best first, on ``device``; values in
        float32 (float64 for float64 gradients), indices int64 rows of the store. Torch
        tensors, or arrays of the framework ``output``/``like`` name.

    Raises:
        IncompatibleGradientsError: the index was built from another store.
        InvalidArgumentError: normalize differs from the index's, k, nprobe or n_candidates
            out of range, or the clusters searched hold fewer than ``k`` rows for some example.
    """
    framework = resolve_output(output, like)
    faiss = import_faiss()
    check_not_empty(store.meta)
    span = (0, store.meta.n_train) if rows is None else check_rows(rows, store.meta.n_train)
    k, nprobe, n_candidates = _check_args(store, index, k, nprobe, n_candidates, normalize,
                                          span)
    query = prepare_query(store, test_grads, normalize=normalize, device=device,
                          curvature=curvature)
    # FAISS sums in float32 and leaves out rows whose products overflow: said before the
    # search, naming the rows (the exact re-rank then says nothing more of them)
    warned = not normalize and OverflowWatch(store if rows is None else row_range(store, rows),
                                             query).warn_search()
    # FAISS searches on the CPU; the exact side takes the prepared (lr-weighted) rows.
    queries = _search_queries(query)
    if not largest:
        queries = queries.neg()
    selector = None if rows is None else faiss.IDSelectorRange(*span)  # alive while searching
    params = faiss.SearchParametersIVF(nprobe=nprobe, sel=selector)
    meta = store.meta
    block = max(1, _BLOCK_BYTES // (n_candidates * meta.k * torch.finfo(query.dtype).bits // 8))
    values, indices = [], []
    bar = progress_bar(progress, total=query.n_test, desc="indexed_top_k", unit="query")
    for start in range(0, query.n_test, block):
        stop = min(start + block, query.n_test)
        _, found = index.faiss_index.search(queries[start:stop].numpy(), n_candidates,
                                            params=params)
        found = torch.from_numpy(found)  # [b, n_candidates], -1 where lists ran out
        _check_enough(found, k, nprobe, index.nlist, start, overflow=warned)
        # In row order (the -1s last), then a stable sort: equal scores resolve by row, as
        # top_k over the whole store orders them.
        found = torch.where(found < 0, _MISSING, found).sort(dim=1).values
        found = torch.where(found == _MISSING, -1, found).to(query.device)
        scores = _exact_scores(store, query.split(start, stop), found, index,
                               normalize=normalize, largest=largest, warn=not warned)
        best, order = scores.sort(dim=1, descending=largest, stable=True)
        values.append(best[:, :k])
        indices.append(found.gather(1, order[:, :k]))
        bar.update(stop - start)
    bar.close()
    return (to_framework(torch.cat(values), framework),
            to_framework(torch.cat(indices), framework))


def _search_queries(query: PreparedQuery) -> Tensor:
    """``[n_test, n_ckpt * k]`` float32 CPU queries as the index expects them:
    ``sign(lr_c) sqrt|lr_c| test_c`` (over ``|test_c|`` with normalize), from the prepared
    ``lr_c test_c`` rows (a checkpoint with ``lr_c = 0`` contributes zeros either way)."""
    lr = torch.tensor(query.lrs, dtype=torch.float64)
    unscale = torch.where(lr != 0, lr.abs().sqrt().reciprocal(), torch.zeros_like(lr))
    # lr_c / sqrt|lr_c| = sign(lr_c) sqrt|lr_c|, where lr_c is left to the products
    unscale = unscale * torch.tensor([query.scale(c) for c in range(len(query.lrs))],
                                     dtype=torch.float64)
    rows = query.rows.cpu().to(torch.float64) * unscale[:, None, None]
    return rows.to(torch.float32).permute(1, 0, 2).reshape(query.n_test, -1).contiguous()


def _exact_scores(store: GradientStore, query: PreparedQuery, found: Tensor,
                  index: SearchIndex, *, normalize: bool, largest: bool,
                  warn: bool = True) -> Tensor:
    """TracIn scores ``[b, candidates]`` of each test row against its own candidate rows.

    ``query`` holds ``b`` test rows, with lr (and the test norm) folded in; missing candidates
    (``-1``) score ``-inf`` (``+inf`` for opponents), so the final topk never picks them.
    The candidate rows read are compared with the index's sketch (format 4) on the way: a
    row replaced since the index was built is refused, wherever it lies in the store.
    """
    test = query.rows  # [n_ckpt, b, k]
    meta, dtype, device = store.meta, test.dtype, test.device
    valid = found >= 0
    unique = torch.unique(found[valid]).cpu()  # sorted: read in store order, each row once
    position = torch.searchsorted(unique.to(device), found.clamp(min=0))  # [b, candidates]
    total = torch.zeros(found.shape, dtype=dtype, device=device)
    sketch = (None if index.sketch is None else
              CandidateSketch(index.sketch, index.sketch_seed, meta.lrs, meta.k, unique))
    for ckpt in range(meta.n_ckpt):
        rows = read_rows_at(store, ckpt, unique).to(device, dtype)  # [u, k]
        norms = norms_at(store, ckpt, unique).to(device, dtype) if normalize else None
        if sketch is not None:
            sketch.add(ckpt, rows, norms)
        if normalize:  # the rows' directions first: a denormal row's product keeps its bits
            rows = directions(rows, norms)
        gathered = rows[position]  # [b, candidates, k]
        product = torch.bmm(gathered, test[ckpt][:, :, None]).squeeze(2)  # [b, candidates]
        total += query.scaled(ckpt, product)
    if sketch is not None and (problem := sketch.mismatch()) is not None:
        raise IncompatibleGradientsError(
            f"{current_caller()}: candidate {problem}; rebuild the index with "
            "tif.build_index(store, overwrite=True) or pass the store it was built from.")
    if warn and not normalize:  # cosines are bounded
        warn_candidate_overflow(total, found, query, store)
    return total.masked_fill(~valid, -torch.inf if largest else torch.inf)


def _check_enough(found: Tensor, k: int, nprobe: int, nlist: int, offset: int, *,
                  overflow: bool = False) -> None:
    """Refuse a search that found fewer than ``k`` rows for some test example (``overflow``:
    rows whose float32 scores may overflow were warned of: FAISS leaves them out)."""
    counts = (found >= 0).sum(dim=1)
    short = torch.nonzero(counts < k).flatten()
    if len(short):
        example = int(short[0])
        if overflow:
            raise NonFiniteGradientError(
                f"{current_caller()}: the index returned only {int(counts[example])} rows for "
                f"test example {offset + example}, fewer than k={k}: the others' scores "
                "overflow float32 in its search, which leaves them out (see the warning "
                "before it). tif.top_k is exact and names overflowed scores; build the store "
                "and the test gradients with dtype='float64' to keep them finite.")
        raise InvalidArgumentError(
            f"{current_caller()}: the {nprobe} of {nlist} clusters searched for test example "
            f"{offset + example} hold only {int(counts[example])} rows, fewer than k={k}; "
            "raise nprobe (nprobe=nlist searches every cluster)."
        )


def _check_args(store: GradientStore, index: object, k: int, nprobe: int | None,
                n_candidates: int | None, normalize: bool, span: tuple[int, int]
                ) -> tuple[int, int, int]:
    """``(k, nprobe, n_candidates)`` checked, as Python ints, defaults filled in."""
    meta = store.meta
    if not isinstance(index, SearchIndex):
        raise InvalidTypeError(
            f"{current_caller()}: index must be a SearchIndex from tif.build_index or "
            f"tif.load_index, got {type(index).__name__}."
        )
    ours = meta_fingerprint(meta)
    if index.meta_fingerprint != ours or index.n_train != meta.n_train:
        raise IncompatibleGradientsError(
            f"{current_caller()}: the index was built for a store with metadata fingerprint "
            f"{index.meta_fingerprint} ({index.n_train} rows) but this store's is {ours} "
            f"({meta.n_train} rows); build the index from this store with tif.build_index."
        )
    index.check_store(store)  # same metadata: the same rows too?
    if bool(normalize) != index.normalize:
        raise InvalidArgumentError(
            f"{current_caller()}: normalize={normalize} but the index was built with "
            f"normalize={index.normalize}; pass normalize={index.normalize} or build an index "
            f"with tif.build_index(store, normalize={normalize})."
        )
    n_rows = span[1] - span[0]
    k = check_k(k, n_rows)
    nprobe = index.nprobe if nprobe is None else nprobe
    nprobe = _check_range("nprobe", nprobe, 1, index.nlist, "nlist searches every cluster")
    if n_candidates is None:
        n_candidates = min(index.candidates(k), n_rows)
    n_candidates = _check_range("n_candidates", n_candidates, k, n_rows,
                                "more candidates raise recall")
    return k, nprobe, n_candidates


def _check_range(name: str, value: object, low: int, high: int, hint: str) -> int:
    return check_int(value, name, minimum=low, maximum=high, fix=hint)
