"""The lr-weighted rows an index holds (scattered reads: :mod:`tracinfunc.store.gather`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from tracinfunc._norms import directions
from tracinfunc.store.gather import norms_at, read_rows_at, row_groups
from tracinfunc.store.protocols import GradientStore

__all__ = ["index_rows", "norms_at", "read_rows_at", "row_groups", "weighted_rows"]


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
    weighted = rows.to(dtype, copy=True)  # [n_ckpt, n, k]
    if normalize:  # the direction first: a denormal row times sqrt|lr_c| < 1 loses the bits
        # its direction needs, and its reciprocal norm is inf (tiny rows: their own entries)
        weighted = directions(weighted, norms.to(dtype))
    weighted.mul_(weight.to(dtype)[:, None, None])
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
