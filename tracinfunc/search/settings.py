"""The settings of an index (nlist, m, train_size), checked and chosen from the store's size.

FAISS's k-means prints ``WARNING clustering N points to K centroids`` to the C stderr (no
Python warning a caller could filter) when it gets fewer than 39 training points per
centroid. The defaults here never ask for that: ``nlist`` shrinks with the store so that the
training sample holds at least 39 rows per list, and small stores get one list. Explicit
settings below FAISS's advice give a Python ``UserWarning`` instead of FAISS's print.
"""

from __future__ import annotations

import warnings
from typing import Any

from tracinfunc._validate import check_int
from tracinfunc.errors import InvalidArgumentError
from tracinfunc.store.meta import StoreMeta

__all__ = ["KINDS", "build_settings", "default_nlist", "quiet_clustering"]

KINDS = ("ivf_flat", "ivf_pq")
# Training points per IVF list; FAISS warns below 39 and gains little above ~100.
_TRAIN_PER_LIST = 64
_FAISS_ADVISED = 39  # FAISS's ClusteringParameters.min_points_per_centroid
_PQ_CENTROIDS = 256  # 2**8 centroids per sub-quantiser (8-bit codes)


def default_nlist(n_train: int) -> int:
    """``4 * sqrt(n_train)`` lists, fewer where that leaves under 39 rows a list (at least 1)."""
    return max(1, min(round(4 * n_train**0.5), n_train // _FAISS_ADVISED))


def build_settings(meta: StoreMeta, kind: str, nlist: int | None, m: int | None,
                   train_size: int | None) -> tuple[int, int, int]:
    """``(nlist, m, train_size)``: the given values checked, the defaults filled in.

    Raises:
        InvalidArgumentError: an unknown kind, or a value out of range.
    """
    if kind not in KINDS:
        raise InvalidArgumentError(
            f"build_index: kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}."
        )
    n_train, dim = meta.n_train, meta.n_ckpt * meta.k
    nlist = default_nlist(n_train) if nlist is None else nlist
    nlist = _check_int("nlist", nlist, 1, n_train, "fewer clusters than rows")
    m = _default_m(dim) if m is None else m
    if kind == "ivf_pq":
        m = _check_int("m", m, 1, dim, "a divisor of n_ckpt * k")
        if dim % m:
            raise InvalidArgumentError(
                f"build_index: m must divide n_ckpt * k = {dim}, got m={m}; pick a divisor "
                f"such as {_default_m(dim)}."
            )
    least = max(nlist, _PQ_CENTROIDS if kind == "ivf_pq" else 1)
    if least > n_train:
        raise InvalidArgumentError(
            f"build_index: kind='ivf_pq' trains 256 centroids per sub-quantiser and needs at "
            f"least 256 rows, got n_train={n_train}; use kind='ivf_flat' for small stores."
        )
    advised = _FAISS_ADVISED * _PQ_CENTROIDS if kind == "ivf_pq" else 0
    default = min(n_train, max(_TRAIN_PER_LIST * nlist, least, advised))
    train_size = default if train_size is None else train_size
    train_size = _check_int("train_size", train_size, least, n_train,
               "at least nlist (and 256 for ivf_pq) rows")
    return nlist, m, train_size


def quiet_clustering(index: Any, kind: str, nlist: int, train_size: int, *,
                     chosen: bool) -> None:
    """Stop FAISS printing its k-means warning; warn in Python when ``chosen`` settings
    (given by the caller, not defaults) give fewer than 39 training rows per cluster (one
    cluster needs no clustering)."""
    index.cp.min_points_per_centroid = 1  # only ever used for that print
    if kind == "ivf_pq":
        index.pq.cp.min_points_per_centroid = 1
    if chosen and nlist > 1 and train_size < _FAISS_ADVISED * nlist:
        warnings.warn(
            f"build_index: {train_size} training rows for nlist={nlist} clusters is fewer "
            f"than the {_FAISS_ADVISED} per cluster FAISS advises, so clusters may be poor "
            f"and searches miss rows; lower nlist (the default is {default_nlist(train_size)} "
            "here) or raise train_size.", UserWarning, stacklevel=3)


def _check_int(name: str, value: object, low: int, high: int, hint: str) -> int:
    return check_int(value, name, minimum=low, maximum=high,
                     fix=f"use {hint}, or leave it None for the default")


def _default_m(dim: int) -> int:
    return max(d for d in range(1, min(64, max(1, dim // 8)) + 1) if dim % d == 0)
