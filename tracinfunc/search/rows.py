"""Reading scattered store rows, and the lr-weighted concatenation an index holds."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from tracinfunc.store.protocols import GradientStore

__all__ = ["index_rows", "norms_at", "read_rows_at", "row_groups", "weighted_rows"]


def read_rows_at(store: GradientStore, ckpt: int, indices: Tensor) -> Tensor:
    """Rows ``indices`` (sorted, unique, int64 ``[n]``) of checkpoint ``ckpt``: ``[n, k]``.

    Indices are grouped into runs that share a stored chunk (or follow each other), and
    each run is one ``read_rows`` of its span: a stored chunk is read and checksummed whole
    anyway, so reading it once per run, not once per row, is what keeps scattered reads
    cheap. Memory stores are indexed directly.
    """
    view = getattr(store, "_view_rows", None)
    meta = store.meta
    if view is not None:  # in memory: one gather, no copies of spans
        return view(ckpt, 0, meta.n_train).index_select(0, indices)
    out = torch.empty(len(indices), meta.k, dtype=meta.torch_dtype)
    chunk_rows = getattr(store, "chunk_rows", 1)
    chunk_rows = chunk_rows if isinstance(chunk_rows, int) and chunk_rows > 0 else 1
    for begin, end in row_groups(indices, chunk_rows):
        lo, hi = int(indices[begin]), int(indices[end - 1]) + 1
        span = store.read_rows(ckpt, lo, hi)
        out[begin:end] = span if hi - lo == end - begin else span[indices[begin:end] - lo]
    return out


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


def norms_at(store: GradientStore, ckpt: int, indices: Tensor) -> Tensor:
    """Row norms at ``indices`` (sorted, int64 ``[n]``): one read of their span, ``[n]``."""
    if len(indices) == 0:
        return torch.empty(0)
    lo, hi = int(indices[0]), int(indices[-1]) + 1
    return store.read_norms(ckpt, lo, hi)[indices - lo]


def weighted_rows(rows: Tensor, norms: Tensor | None, lrs: Sequence[float], *,
                  normalize: bool, query: bool, dtype: torch.dtype = torch.float32) -> Tensor:
    """``concat_c(w_c * rows_c)``: the vectors whose inner products are TracIn scores.

    Training rows take ``w_c = sqrt|lr_c|`` and queries ``sign(lr_c) * sqrt|lr_c|``, so
    ``<query, row> = sum_c lr_c * <test_c, train_c>`` for any sign of ``lr_c``.

    Args:
        rows: ``[n_ckpt, n, k]`` in any float dtype.
        norms: ``[n_ckpt, n]`` row norms (used only when ``normalize``; zero norm -> zero row).
        lrs: ``n_ckpt`` TracIn weights.
        normalize: Unit-normalise each checkpoint's rows first (cosine TracIn).
        query: Whether these are queries (carry the sign of ``lr_c``).
        dtype: Result dtype.

    Returns:
        ``[n, n_ckpt * k]``, contiguous.
    """
    lr = torch.tensor(lrs, dtype=torch.float64)
    weight = lr.abs().sqrt() * (lr.sign() if query else 1.0)
    scale = weight.to(dtype)[:, None, None]  # [n_ckpt, 1, 1]
    if normalize:
        norms = norms.to(dtype)
        scale = scale * torch.where(norms > 0, norms.reciprocal(),
                                    torch.zeros_like(norms))[..., None]
    weighted = rows.to(dtype) * scale  # [n_ckpt, n, k]
    return weighted.permute(1, 0, 2).reshape(rows.shape[1], -1).contiguous()


def index_rows(store: GradientStore, indices: Tensor, normalize: bool, *,
               query: bool = False) -> np.ndarray:
    """``[len(indices), n_ckpt * k]`` float32 rows as a FAISS index holds them (``query``:
    weighted as queries are, for store rows searched as test examples).

    Args:
        store: The store, ``[n_ckpt, n_train, k]``.
        indices: Sorted unique rows, int64 ``[n]``.
        normalize: Unit-normalise each checkpoint's rows by the store's norms first.
    """
    meta = store.meta
    rows = torch.stack([read_rows_at(store, c, indices) for c in range(meta.n_ckpt)])
    norms = None
    if normalize:  # [n_ckpt, n]: the store's norms, as score divides by
        norms = torch.stack([norms_at(store, c, indices) for c in range(meta.n_ckpt)])
    return weighted_rows(rows, norms, meta.lrs, normalize=normalize, query=query).numpy()
