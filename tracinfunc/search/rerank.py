"""Approximate top-k: candidates from a FAISS index, then an exact re-rank from the store."""

from __future__ import annotations

import torch
from torch import Tensor

from tracinfunc._validate import current_caller, entry_point
from tracinfunc.curvature.queries import precondition_test_grads
from tracinfunc.curvature.value import Curvature
from tracinfunc.errors import IncompatibleGradientsError, InvalidArgumentError, InvalidTypeError
from tracinfunc.query.prepared import compute_dtype, query_matrix
from tracinfunc.search.binding import meta_fingerprint
from tracinfunc.search.index import SearchIndex, import_faiss
from tracinfunc.search.rows import norms_at, read_rows_at, weighted_rows
from tracinfunc.store.protocols import GradientStore

__all__ = ["indexed_top_k"]

# Bytes of the gathered candidate rows [queries, candidates, k] of one block of queries.
_BLOCK_BYTES = 64 * 2**20


@entry_point("indexed_top_k")
def indexed_top_k(
    store: GradientStore,
    test_grads: GradientStore | Tensor,
    k: int,
    *,
    index: SearchIndex,
    nprobe: int | None = None,
    candidates: int | None = None,
    largest: bool = True,
    normalize: bool = False,
    curvature: Curvature | None = None,
) -> tuple[Tensor, Tensor]:
    """Approximate top-k: candidates from a FAISS ``index``, re-ranked exactly from the store.

    Each test example fetches ``candidates`` rows from the ``nprobe`` nearest clusters, whose
    TracIn scores are then computed exactly from the store (only the candidate rows are
    read, in runs per stored chunk) and the best ``k`` kept. Opponents (``largest=False``)
    search with negated queries: the highest inner products with ``-query`` are the lowest
    scores.

    Args:
        store: As in :func:`tracinfunc.top_k`.
        test_grads: As in :func:`tracinfunc.top_k`.
        k: As in :func:`tracinfunc.top_k`.
        largest: As in :func:`tracinfunc.top_k`.
        normalize: As in :func:`tracinfunc.top_k`.
        index: Built by :func:`~tracinfunc.build_index` from this store, with the same
            ``normalize``.
        nprobe: Clusters searched per test example (default ``index.nprobe``: the value
            ``build_index`` calibrated to its ``target_recall`` of recall@10 on the store's
            rows, else ``max(1, nlist // 16)``; ``nlist`` searches every cluster, which makes
            the result exact for ``"ivf_flat"``). An explicit value always wins.
        candidates: Rows fetched per test example and re-ranked (default
            ``index.candidates(k)``: ``rerank * k`` with the calibrated ``rerank``, else
            ``max(2 * k, 16)``, ``max(10 * k, 100)`` for ``"ivf_pq"``; at most ``n_train``).
        curvature: As in :func:`tracinfunc.query.score`: the index is searched with the
            preconditioned queries and the candidates re-ranked by curvature-aware scores
            (the index of the store serves both, as the store does).

    Returns:
        ``(values, indices)``, both ``[n_test, k]``, best first, on the CPU; values in
        float32 (float64 for float64 gradients), indices int64 rows of the store.

    Raises:
        IncompatibleGradientsError: the index was built from another store.
        InvalidArgumentError: normalize differs from the index's, nprobe or candidates out
            of range, or the clusters searched hold fewer than ``k`` rows for some example.
    """
    faiss = import_faiss()
    meta = store.meta
    nprobe, candidates = _check_args(store, index, k, nprobe, candidates, normalize)
    test_grads = precondition_test_grads(store, test_grads, curvature)
    # Errors name top_k, the entry point. FAISS searches and the re-rank run on the CPU:
    # test gradients may arrive on a GPU.
    test, test_norms = query_matrix(meta, test_grads, device=torch.device("cpu"))
    dtype = compute_dtype(meta.torch_dtype, test.dtype)
    # The exact side folds lr_c (and 1/|test_c| for cosine) into the test rows, as score does.
    scale = torch.tensor(meta.lrs, dtype=dtype)[:, None, None]
    if normalize:
        norms = test_norms.to(dtype)
        scale = scale * torch.where(norms > 0, norms.reciprocal(), torch.zeros_like(norms))[
            ..., None]
    exact_test = test.to(dtype) * scale  # [n_ckpt, n_test, k]
    queries = weighted_rows(test, test_norms, meta.lrs, normalize=normalize, query=True)
    if not largest:
        queries = queries.neg()
    params = faiss.SearchParametersIVF(nprobe=nprobe)
    n_test = test.shape[1]
    block = max(1, _BLOCK_BYTES // (candidates * meta.k * torch.finfo(dtype).bits // 8))
    values, indices = [], []
    for start in range(0, n_test, block):
        stop = min(start + block, n_test)
        _, found = index.faiss_index.search(queries[start:stop].numpy(), candidates,
                                            params=params)
        found = torch.from_numpy(found)  # [b, candidates], -1 where lists ran out
        _check_enough(found, k, nprobe, index.nlist, start)
        scores = _exact_scores(store, exact_test[:, start:stop], found, normalize=normalize,
                               largest=largest, dtype=dtype)
        best, order = scores.topk(k, dim=1, largest=largest, sorted=True)
        values.append(best)
        indices.append(found.gather(1, order))
    return torch.cat(values), torch.cat(indices)


def _exact_scores(store: GradientStore, test: Tensor, found: Tensor, *, normalize: bool,
                  largest: bool, dtype: torch.dtype) -> Tensor:
    """TracIn scores ``[b, candidates]`` of each test row against its own candidate rows.

    ``test`` is ``[n_ckpt, b, k]`` with lr (and the test norm) folded in; missing candidates
    (``-1``) score ``-inf`` (``+inf`` for opponents), so the final topk never picks them.
    """
    meta = store.meta
    valid = found >= 0
    unique = torch.unique(found[valid])  # sorted: read in store order, each row once
    position = torch.searchsorted(unique, found.clamp(min=0))  # [b, candidates]
    total = torch.zeros(found.shape, dtype=dtype)
    for ckpt in range(meta.n_ckpt):
        rows = read_rows_at(store, ckpt, unique).to(dtype)  # [u, k]
        gathered = rows[position]  # [b, candidates, k]
        product = torch.bmm(gathered, test[ckpt][:, :, None]).squeeze(2)  # [b, candidates]
        if normalize:
            norms = norms_at(store, ckpt, unique).to(dtype)
            inverse = torch.where(norms > 0, norms.reciprocal(), torch.zeros_like(norms))
            product = product * inverse[position]
        total += product
    return total.masked_fill(~valid, -torch.inf if largest else torch.inf)


def _check_enough(found: Tensor, k: int, nprobe: int, nlist: int, offset: int) -> None:
    counts = (found >= 0).sum(dim=1)
    short = torch.nonzero(counts < k).flatten()
    if len(short):
        example = int(short[0])
        raise InvalidArgumentError(
            f"{current_caller()}: the {nprobe} of {nlist} clusters searched for test example "
            f"{offset + example} hold only {int(counts[example])} rows, fewer than k={k}; "
            "raise nprobe (nprobe=nlist searches every cluster)."
        )


def _check_args(store: GradientStore, index: object, k: int, nprobe: int | None,
                candidates: int | None, normalize: bool) -> tuple[int, int]:
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
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= meta.n_train:
        raise InvalidArgumentError(
            f"{current_caller()}: k must be an int in [1, n_train={meta.n_train}], got {k!r}."
        )
    nprobe = index.nprobe if nprobe is None else nprobe
    _check_range("nprobe", nprobe, 1, index.nlist, "nlist searches every cluster")
    if candidates is None:
        candidates = index.candidates(k)
    _check_range("candidates", candidates, k, meta.n_train, "more candidates raise recall")
    return nprobe, candidates


def _check_range(name: str, value: object, low: int, high: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidArgumentError(
            f"{current_caller()}: {name} must be an int in [{low}, {high}], got {value!r}; {hint}."
        )
