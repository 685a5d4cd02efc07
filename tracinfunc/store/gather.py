"""Reading scattered rows of a store: runs of indices read together, never the whole store.

Shared by the exact re-rank of :func:`tracinfunc.indexed_top_k` and by ``candidates=`` in
:func:`tracinfunc.score` / :func:`tracinfunc.top_k`, which score only given rows.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from tracinfunc.store.protocols import GradientStore, SupportsChunkAlignment, SupportsRowViews

__all__ = ["norms_at", "read_rows_at", "row_groups"]


def read_rows_at(store: GradientStore, ckpt: int, indices: Tensor) -> Tensor:
    """Rows ``indices`` (sorted, unique, int64 ``[n]``) of checkpoint ``ckpt``: ``[n, k]``.

    Indices are grouped into runs that share a stored chunk (or follow each other), and
    each run is one ``read_rows`` of its span: a stored chunk is read and checksummed whole
    anyway, so reading it once per run, not once per row, is what keeps scattered reads
    cheap. Stores that lend views of their rows are indexed directly.
    """
    meta = store.meta
    if isinstance(store, SupportsRowViews):  # in memory: one gather, no copies of spans
        return store.view_rows(ckpt, 0, meta.n_train).index_select(0, indices)
    out = torch.empty(len(indices), meta.k, dtype=meta.torch_dtype)
    for begin, end in row_groups(indices, _chunk_rows(store)):
        lo, hi = int(indices[begin]), int(indices[end - 1]) + 1
        span = store.read_rows(ckpt, lo, hi)
        out[begin:end] = span if hi - lo == end - begin else span[indices[begin:end] - lo]
    return out


def norms_at(store: GradientStore, ckpt: int, indices: Tensor) -> Tensor:
    """Row norms at ``indices`` (sorted, unique, int64 ``[n]``), read in the same runs as
    :func:`read_rows_at`: ``[n]``."""
    parts = []
    for begin, end in row_groups(indices, _chunk_rows(store)):
        lo, hi = int(indices[begin]), int(indices[end - 1]) + 1
        parts.append(store.read_norms(ckpt, lo, hi)[indices[begin:end] - lo])
    return torch.cat(parts) if parts else torch.empty(0)


def row_groups(indices: Tensor, chunk_rows: int) -> list[tuple[int, int]]:
    """``[begin, end)`` positions of runs of ``indices`` read together.

    A run continues while the next index follows the previous one or lies in the same
    stored chunk of ``chunk_rows`` rows.

    Args:
        indices: Sorted unique row indices, int64 ``[n]``.
        chunk_rows: Rows per stored chunk (1 when the store has none).

    Returns:
        Positions into ``indices``, covering it in order.
    """
    if len(indices) == 0:
        return []
    follows = indices[1:] == indices[:-1] + 1
    same_chunk = indices[1:] // chunk_rows == indices[:-1] // chunk_rows
    breaks = torch.nonzero(~(follows | same_chunk)).flatten() + 1
    edges = [0, *breaks.tolist(), len(indices)]
    return list(itertools.pairwise(edges))


def _chunk_rows(store: GradientStore) -> int:
    chunk_rows = store.chunk_rows if isinstance(store, SupportsChunkAlignment) else 1
    return chunk_rows if isinstance(chunk_rows, int) and chunk_rows > 0 else 1
