"""FAISS indexes over a gradient store whose inner product is the TracIn score.

Row ``i`` of the index is ``concat_c(sqrt|lr_c| * train_c[i])`` and a query is
``concat_c(sign(lr_c) * sqrt|lr_c| * test_c)``, so ``<query, row_i>`` is
``sum_c lr_c * <test_c, train_c[i]>``: the TracIn score, negative learning rates included.
With ``normalize=True`` every checkpoint's rows (and the query's) are unit-normalised first,
exactly as :func:`tracinfunc.score` does for cosine TracIn.

On disk an index is a directory (by default beside a Zarr store: ``grads.zarr.faiss/``)::

    grads.zarr.faiss/
      index.faiss     faiss.write_index output
      meta.json       kind, nlist, m, normalize, the store's fingerprint, ...
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tracinfunc._validate import current_caller, entry_point
from tracinfunc._version import __version__
from tracinfunc.errors import (
    IncompatibleGradientsError,
    InvalidArgumentError,
    MissingDependencyError,
    StoreExistsError,
    StoreNotFoundError,
)
from tracinfunc.progress import ProgressArg, progress_bar
from tracinfunc.search.rows import norms_at, read_rows_at, weighted_rows
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import GradientStore

__all__ = ["KINDS", "SearchIndex", "build_index", "load_index", "store_fingerprint"]

KINDS = ("ivf_flat", "ivf_pq")
INDEX_FORMAT_VERSION = 1
# Rows added to FAISS per step: bounds the float32 copy next to the index (~32 MiB at k=512).
_ADD_BYTES = 32 * 2**20
# Training points per IVF list; FAISS warns below 39 and gains little above ~100.
_TRAIN_PER_LIST = 64


@dataclass(frozen=True)
class SearchIndex:
    """A FAISS index over a store, with what is needed to check and query it.

    Attributes:
        faiss_index: The ``faiss.IndexIVF`` (inner product) over ``[n_train, n_ckpt * k]``.
        fingerprint: :func:`store_fingerprint` of the store it was built from.
        meta_fingerprint: The metadata part of it (cheap to recheck on every query).
        kind: ``"ivf_flat"`` or ``"ivf_pq"``.
        nlist: Number of inverted lists (clusters).
        m: PQ sub-quantisers (``None`` for ``"ivf_flat"``).
        normalize: Whether rows were unit-normalised per checkpoint (cosine TracIn).
        n_train: Rows indexed.
        path: Directory it was saved to or loaded from; ``None`` when in memory only.
    """

    faiss_index: Any = field(repr=False, compare=False)
    fingerprint: str
    meta_fingerprint: str
    kind: str
    nlist: int
    m: int | None
    normalize: bool
    n_train: int
    path: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able description written to ``meta.json``."""
        return {
            "format_version": INDEX_FORMAT_VERSION, "library_version": __version__,
            "fingerprint": self.fingerprint, "meta_fingerprint": self.meta_fingerprint,
            "kind": self.kind, "nlist": self.nlist, "m": self.m,
            "normalize": self.normalize, "n_train": self.n_train,
        }


@entry_point("build_index")
def build_index(
    store: GradientStore,
    *,
    kind: str = "ivf_flat",
    nlist: int | None = None,
    m: int | None = None,
    normalize: bool = False,
    path: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    train_size: int | None = None,
    seed: int = 0,
    progress: ProgressArg = None,
) -> SearchIndex:
    """Build an approximate-search index whose inner product equals the TracIn score.

    Rows are streamed from the store a few MiB at a time; only FAISS's own copy (float32
    rows for ``"ivf_flat"``, ``m`` bytes per row for ``"ivf_pq"``) stays in memory. The IVF
    clustering is trained on a seeded sample of rows, so the same arguments build the same
    index.

    Args:
        store: Projected training gradients, ``[n_ckpt, n_train, k]``.
        kind: ``"ivf_flat"`` (exact vectors in clusters) or ``"ivf_pq"`` (product-quantised
            codes: ``m`` bytes per row; candidates then need the exact re-rank).
        nlist: Number of clusters (default ``4 * sqrt(n_train)``, at most ``n_train``).
        m: PQ sub-quantisers for ``"ivf_pq"``; must divide ``n_ckpt * k`` (default: the
            largest divisor of it that is at most ``(n_ckpt * k) // 8``, up to 64).
        normalize: Index per-checkpoint unit-normalised rows, for ``top_k(normalize=True)``.
        path: Directory to save to. Default: beside a Zarr store (``<store>.faiss``); in
            memory only for stores without a ``path``.
        overwrite: Replace an index already at ``path``.
        train_size: Rows sampled to train the clustering (default ``64 * nlist``, at most
            ``n_train``; more for ``"ivf_pq"`` when its codebooks need it).
        seed: Seed of the training sample and of FAISS's k-means.
        progress: Progress bar over the rows added (as in :func:`tracinfunc.score`).

    Returns:
        A :class:`SearchIndex`; pass it as ``top_k(store, test_grads, index=...)``.

    Raises:
        MissingDependencyError: faiss is not installed.
        InvalidArgumentError: an unknown kind, or nlist/m/train_size out of range.
        StoreExistsError: an index is already at ``path`` and ``overwrite`` is False.
    """
    faiss = import_faiss()
    meta = store.meta
    dim = meta.n_ckpt * meta.k
    nlist, m, train_size = _check_build_args(meta, kind, nlist, m, train_size)
    target = _target_path(store, path, overwrite)
    quantizer = faiss.IndexFlatIP(dim)
    if kind == "ivf_flat":
        index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    else:
        index = faiss.IndexIVFPQ(quantizer, dim, nlist, m, 8, faiss.METRIC_INNER_PRODUCT)
    index.cp.seed = seed
    sample = np.sort(np.random.default_rng(seed).choice(meta.n_train, train_size,
                                                        replace=False))
    index.train(_index_rows(store, torch.from_numpy(sample), normalize))
    step = max(1, _ADD_BYTES // (4 * dim))
    bar = progress_bar(progress, total=meta.n_train, desc="build_index", unit="row")
    for start in range(0, meta.n_train, step):
        stop = min(start + step, meta.n_train)
        index.add(_index_rows(store, torch.arange(start, stop), normalize))
        bar.update(stop - start)
    bar.close()
    built = SearchIndex(index, store_fingerprint(store), meta_fingerprint(meta), kind, nlist,
                        m if kind == "ivf_pq" else None, normalize, meta.n_train, target)
    if target is not None:
        _save(built, target, faiss)
    return built


@entry_point("load_index")
def load_index(path: str | os.PathLike[str], store: GradientStore) -> SearchIndex:
    """Reopen an index saved by :func:`build_index`, refusing one built for another store.

    Args:
        path: The index directory (e.g. ``grads.zarr.faiss``).
        store: The store it will be queried against.

    Returns:
        The :class:`SearchIndex`.

    Raises:
        StoreNotFoundError: no index at ``path``.
        IncompatibleGradientsError: the index was built from a store with another
            fingerprint (other rows, checkpoints, learning rates, projection or size).
    """
    faiss = import_faiss()
    path = Path(path)
    if not (path / "meta.json").exists() or not (path / "index.faiss").exists():
        raise StoreNotFoundError(
            f"load_index: no index at {str(path)!r} (expected meta.json and index.faiss); "
            "build one with tif.build_index(store, path=...)."
        )
    saved = json.loads((path / "meta.json").read_text())
    ours = store_fingerprint(store)
    if saved["fingerprint"] != ours:
        raise IncompatibleGradientsError(
            f"load_index: the index at {str(path)!r} was built for a store with fingerprint "
            f"{saved['fingerprint']} but this store's is {ours}; rebuild it with "
            "tif.build_index(store, overwrite=True) or pass the store it was built from."
        )
    return SearchIndex(faiss.read_index(str(path / "index.faiss")), saved["fingerprint"],
                       saved["meta_fingerprint"], saved["kind"], int(saved["nlist"]),
                       saved["m"], bool(saved["normalize"]), int(saved["n_train"]), path)


def store_fingerprint(store: GradientStore) -> str:
    """sha256 of the store's metadata and its row norms: changes when any row set changes.

    The metadata covers projection, layout, checkpoints (names, lrs, parameter
    fingerprints), n_train, k, dtype and quantisation; the norms (``4 * n_ckpt * n_train``
    bytes, read once) tell apart stores made from different data with the same metadata.
    """
    meta = store.meta
    digest = hashlib.sha256(meta_fingerprint(meta).encode())
    for ckpt in range(meta.n_ckpt):
        norms = store.read_norms(ckpt, 0, meta.n_train).to(torch.float32).contiguous()
        digest.update(norms.numpy().tobytes())
    return digest.hexdigest()


def meta_fingerprint(meta: StoreMeta) -> str:
    """sha256 of the metadata that decides what an index's rows are (no norms read)."""
    data = meta.to_dict()
    described = {key: data[key] for key in ("projection", "checkpoints", "layout", "n_train",
                                            "k", "dtype", "dataset_fingerprint")}
    if meta.quantization is not None:  # absent for float stores: their fingerprints stay
        described["quantization"] = meta.quantization
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def import_faiss() -> Any:
    """``import faiss``, or a :class:`MissingDependencyError` with the install command."""
    try:
        import faiss
    except ImportError as error:
        raise MissingDependencyError(
            f"{current_caller()}: approximate search needs faiss, which is not installed; install "
            "it with `pip install 'tracinfunc[search]'` (or `pip install faiss-cpu`)."
        ) from error
    return faiss


def _index_rows(store: GradientStore, indices: torch.Tensor, normalize: bool) -> np.ndarray:
    """``[len(indices), n_ckpt * k]`` float32 rows as FAISS stores them."""
    meta = store.meta
    rows = torch.stack([read_rows_at(store, c, indices) for c in range(meta.n_ckpt)])
    norms = None
    if normalize:  # [n_ckpt, n]: the store's norms, as score divides by
        norms = torch.stack([norms_at(store, c, indices) for c in range(meta.n_ckpt)])
    return weighted_rows(rows, norms, meta.lrs, normalize=normalize, query=False).numpy()


def _check_build_args(meta: StoreMeta, kind: str, nlist: int | None, m: int | None,
                      train_size: int | None) -> tuple[int, int, int]:
    if kind not in KINDS:
        raise InvalidArgumentError(
            f"build_index: kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}."
        )
    n_train, dim = meta.n_train, meta.n_ckpt * meta.k
    nlist = max(1, min(n_train, round(4 * n_train**0.5))) if nlist is None else nlist
    _check_int("nlist", nlist, 1, n_train, "fewer clusters than rows")
    m = _default_m(dim) if m is None else m
    if kind == "ivf_pq":
        _check_int("m", m, 1, dim, "a divisor of n_ckpt * k")
        if dim % m:
            raise InvalidArgumentError(
                f"build_index: m must divide n_ckpt * k = {dim}, got m={m}; pick a divisor "
                f"such as {_default_m(dim)}."
            )
    least = max(nlist, 256 if kind == "ivf_pq" else 1)  # PQ codebooks: 2**8 centroids
    if least > n_train:
        raise InvalidArgumentError(
            f"build_index: kind='ivf_pq' trains 256 centroids per sub-quantiser and needs at "
            f"least 256 rows, got n_train={n_train}; use kind='ivf_flat' for small stores."
        )
    default = min(n_train, max(_TRAIN_PER_LIST * nlist, least))
    train_size = default if train_size is None else train_size
    _check_int("train_size", train_size, least, n_train,
               "at least nlist (and 256 for ivf_pq) rows")
    return nlist, m, train_size


def _check_int(name: str, value: object, low: int, high: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidArgumentError(
            f"build_index: {name} must be an int in [{low}, {high}], got {value!r}; use "
            f"{hint}, or leave it None for the default."
        )


def _default_m(dim: int) -> int:
    return max(d for d in range(1, min(64, max(1, dim // 8)) + 1) if dim % d == 0)


def _target_path(store: GradientStore, path: str | os.PathLike[str] | None,
                 overwrite: bool) -> Path | None:
    if path is None:
        store_path = getattr(store, "path", None)
        if not isinstance(store_path, Path):
            return None
        path = store_path.with_name(store_path.name + ".faiss")
    target = Path(path)
    if target.exists() and not overwrite:
        raise StoreExistsError(
            f"build_index: an index already exists at {str(target)!r}; pass overwrite=True "
            "to replace it, or load it with tif.load_index(path, store)."
        )
    return target


def _save(index: SearchIndex, target: Path, faiss: Any) -> None:
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    faiss.write_index(index.faiss_index, str(target / "index.faiss"))
    # meta.json last: a directory without it is an interrupted save, never loaded.
    (target / "meta.json").write_text(json.dumps(index.to_dict(), indent=1))
