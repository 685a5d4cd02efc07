"""FAISS indexes over a gradient store whose inner product is the TracIn score.

Row ``i`` of the index is ``concat_c(sqrt|lr_c| * train_c[i])`` and a query is
``concat_c(sign(lr_c) * sqrt|lr_c| * test_c)``, so ``<query, row_i>`` is
``sum_c lr_c * <test_c, train_c[i]>``: the TracIn score, negative learning rates included.
With ``normalize=True`` every checkpoint's rows (and the query's) are unit-normalised first,
exactly as :func:`tracinfunc.query.score` does for cosine TracIn.

On disk an index is a directory (by default beside a Zarr store: ``grads.zarr.faiss/``)::

    grads.zarr.faiss/
      index.faiss     faiss.write_index output
      norms.npy       every row's norm [n_ckpt, n_train], which binds the index to its rows
      sketch.npy      every row's sketch [n_train, 8]: 8 seeded projections (row order)
      meta.json       kind, nlist, m, normalize, the calibrated query defaults (nprobe,
                      candidates per result, the recall measured), the store's fingerprints,
                      the SHA-256 of the other files and a checksum of itself (see
                      tracinfunc.search.files)
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tracinfunc._validate import current_caller, entry_point
from tracinfunc._version import __version__
from tracinfunc.errors import (
    CorruptStoreError,
    IncompatibleGradientsError,
    InvalidArgumentError,
    MissingDependencyError,
)
from tracinfunc.progress import ProgressArg, progress_bar
from tracinfunc.search.binding import (
    meta_fingerprint,
    norms_mismatch,
    sketch_check,
    sketch_projection,
    sketch_rows,
    store_fingerprint,
    store_norms,
)
from tracinfunc.search.calibrate import (
    DEFAULT_TARGET,
    Calibration,
    calibrate,
    check_target,
    default_candidates,
    default_rerank,
)
from tracinfunc.search.files import (
    NORMS_FILE,
    SKETCH_FILE,
    check_index_target,
    checked_sketch,
    read_index_files,
    save_index_files,
)
from tracinfunc.search.rows import index_rows
from tracinfunc.search.settings import KINDS, build_settings, quiet_clustering
from tracinfunc.store.protocols import GradientStore
from tracinfunc.store.zarr.urls import is_url

__all__ = ["KINDS", "SearchIndex", "build_index", "load_index", "store_fingerprint"]

# 2: meta.json holds checksums of itself and index.faiss; 3: norms.npy (the rows' norms,
# which bind the index to its store) and the calibrated query defaults; 4: sketch.npy (seeded
# projections of every row, which bind the row order)
INDEX_FORMAT_VERSION = 4
# Rows added to FAISS per step: bounds the float32 copy next to the index (~32 MiB at k=512).
_ADD_BYTES = 32 * 2**20


@dataclass(frozen=True)
class SearchIndex:
    """A FAISS index over a store, with what is needed to check and query it.

    Attributes:
        faiss_index: The ``faiss.IndexIVF`` (inner product) over ``[n_train, n_ckpt * k]``.
        fingerprint: :func:`store_fingerprint` of the store it was built from (recorded;
            the exact bits, so not what binds the index: see ``norms``).
        meta_fingerprint: The metadata part of it, compared exactly (and on every query).
        kind: ``"ivf_flat"`` or ``"ivf_pq"``.
        nlist: Number of inverted lists (clusters).
        m: PQ sub-quantisers (``None`` for ``"ivf_flat"``).
        normalize: Whether rows were unit-normalised per checkpoint (cosine TracIn).
        n_train: Rows indexed.
        path: Directory it was saved to or loaded from; ``None`` when in memory only.
        calibration: The query defaults measured on the store's rows when it was built
            (``None``: built with ``target_recall=None``, or saved before format 3; then
            ``nprobe = max(1, nlist // 16)``).
        norms: ``[n_ckpt, n_train]`` float32 row norms of the store it was built from, which
            a store must match to float32 rounding (``None``: an index saved before format 3,
            bound by the exact ``fingerprint``).
        sketch: ``[n_train, 8]`` float32 seeded projections of every indexed row, which
            bind the row order (``None``: saved before format 4, norms only).
        sketch_seed: The seed of the sketch's directions.
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
    calibration: Calibration | None = None
    norms: np.ndarray | None = field(default=None, repr=False, compare=False)
    sketch: np.ndarray | None = field(default=None, repr=False, compare=False)
    sketch_seed: int | None = None
    # Store objects already matched against ``norms`` (reading every norm once each).
    _verified: Any = field(default_factory=weakref.WeakSet, init=False, repr=False,
                           compare=False)

    def check_store(self, store: GradientStore) -> None:
        """Raise unless ``store`` holds the rows this index was built from.

        Compares the metadata exactly and every row norm to float32 rounding, then (format 4)
        the sketch of the rows a permutation could move unseen by the norms (read as whole
        chunks, up to 64 MiB, plus a seeded run of 64 rows), once per store object: a store
        rebuilt with other data, or with rows of equal norm swapped, under the same metadata
        is refused, not searched with clusters of rows it no longer holds, while the same
        store rebuilt with another thread count or device (rows equal to rounding) is
        accepted.

        Raises:
            IncompatibleGradientsError: the store holds other rows than the index's.
        """
        try:
            if store in self._verified:
                return
        except TypeError:  # a user's store without weak references: checked every time
            pass
        caller = current_caller("top_k")
        fix = "rebuild the index with tif.build_index(store, overwrite=True)."
        ours = meta_fingerprint(store.meta)
        if ours != self.meta_fingerprint:
            raise IncompatibleGradientsError(
                f"{caller}: the index was built for a store with metadata fingerprint "
                f"{self.meta_fingerprint} but this store's is {ours} (other projection, "
                f"checkpoints, size or dtype); pass the store it was built from, or {fix}"
            )
        if self.norms is None:  # saved before format 3: only the exact fingerprint is known
            exact = store_fingerprint(store)
            if exact != self.fingerprint:
                raise IncompatibleGradientsError(
                    f"{caller}: the index was built for a store with fingerprint "
                    f"{self.fingerprint} but this store's is {exact} (same metadata, other "
                    f"rows: was the store rebuilt?); {fix}"
                )
        elif (problem := norms_mismatch(self.norms, store_norms(store))) is not None:
            raise IncompatibleGradientsError(
                f"{caller}: the index was built from other rows than this store holds (same "
                f"metadata; {problem}): was the store rebuilt with other data? {fix}"
            )
        if self.sketch is not None and self.norms is not None and (problem := sketch_check(
                store, self.norms, self.sketch, self.sketch_seed, self.normalize)) is not None:
            raise IncompatibleGradientsError(f"{caller}: {problem}; {fix}")
        with contextlib.suppress(TypeError):
            self._verified.add(store)

    @property
    def nprobe(self) -> int:
        """Clusters ``indexed_top_k`` searches unless told: the calibrated value, else
        ``max(1, nlist // 16)``."""
        if self.calibration is not None:
            return self.calibration.nprobe
        return max(1, self.nlist // 16)

    def candidates(self, k: int) -> int:
        """Rows ``indexed_top_k`` re-ranks per test example for ``k`` results unless told:
        ``rerank * k`` (calibrated; else 2, or 10 for ``"ivf_pq"``), at least 16 (100 for
        ``"ivf_pq"``), at most ``n_train``."""
        rerank = (default_rerank(self.kind) if self.calibration is None
                  else self.calibration.rerank)
        return default_candidates(self.kind, rerank, k, self.n_train)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able description written to ``meta.json``."""
        return {
            "format_version": INDEX_FORMAT_VERSION, "library_version": __version__,
            "fingerprint": self.fingerprint, "meta_fingerprint": self.meta_fingerprint,
            "kind": self.kind, "nlist": self.nlist, "m": self.m,
            "normalize": self.normalize, "n_train": self.n_train,
            "calibration": None if self.calibration is None else self.calibration.to_dict(),
            "sketch": None if self.sketch is None else {"seed": self.sketch_seed,
                                                         "size": int(self.sketch.shape[1])},
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
    target_recall: float | None = DEFAULT_TARGET,
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
        nlist: Number of clusters (default ``4 * sqrt(n_train)``, fewer so that each has at
            least 39 training rows, as FAISS advises; 1 for stores under 78 rows).
        m: PQ sub-quantisers for ``"ivf_pq"``; must divide ``n_ckpt * k`` (default: the
            largest divisor of it that is at most ``(n_ckpt * k) // 8``, up to 64).
        normalize: Index per-checkpoint unit-normalised rows, for ``top_k(normalize=True)``.
        path: Directory to save to (local). Default: beside a local Zarr store
            (``<store>.faiss``); in memory only for stores without a ``path``. Never the
            store's directory or a path inside a store or another index.
        overwrite: Replace an index already at ``path`` (only a directory that holds an
            index). The new one is written beside it and swapped in by renames, so a
            failure leaves the old index as it was.
        train_size: Rows sampled to train the clustering (default ``64 * nlist``, at most
            ``n_train``; more for ``"ivf_pq"`` when its codebooks need it).
        seed: Seed of the training sample, of FAISS's k-means and of the calibration sample.
        target_recall: recall@10 the default query settings should reach. After the rows
            are added, 256 rows of the store (seeded) are searched as queries, each left out
            of its own results, against the exact scan: the smallest ``nprobe`` (then, if
            ``nprobe = nlist`` is not enough, more candidates re-ranked) reaching it becomes
            ``indexed_top_k``'s default, recorded with the recall measured in
            ``SearchIndex.calibration`` and ``meta.json``. A ``UserWarning`` says so when
            no setting reaches it. ``None``: no calibration (``nprobe = nlist // 16``).
        progress: Progress bar over the rows added (as in :func:`tracinfunc.query.score`).

    Returns:
        A :class:`SearchIndex`; pass it as ``top_k(store, test_grads, index=...)``.

    Raises:
        MissingDependencyError: faiss is not installed.
        InvalidArgumentError: an unknown kind, nlist/m/train_size/target_recall out of
            range, ``path`` inside a store or an index (or a URL), or a URL store without a
            local ``path``.
        StoreExistsError: an index is already at ``path`` and ``overwrite`` is False, or
            something other than an index is there.
        ForeignArtifactError: ``path`` is, lies inside, or holds an artefact of another
            kind (a store, curvature, recording...; see docs/concepts/stores.md).
        StoreWriteError: saving failed (disk full); an index already at ``path`` is kept.
    """
    faiss = import_faiss()
    meta = store.meta
    dim = meta.n_ckpt * meta.k
    chosen = nlist is not None or train_size is not None
    nlist, m, train_size = build_settings(meta, kind, nlist, m, train_size)
    target = None if target_recall is None else check_target(target_recall)
    saved_to = _target_path(store, path, overwrite)
    quantizer = faiss.IndexFlatIP(dim)
    if kind == "ivf_flat":
        index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    else:
        index = faiss.IndexIVFPQ(quantizer, dim, nlist, m, 8, faiss.METRIC_INNER_PRODUCT)
    index.cp.seed = seed
    quiet_clustering(index, kind, nlist, train_size, chosen=chosen)
    sample = np.sort(np.random.default_rng(seed).choice(meta.n_train, train_size,
                                                        replace=False))
    index.train(index_rows(store, torch.from_numpy(sample), normalize))
    step = max(1, _ADD_BYTES // (4 * dim))
    bar = progress_bar(progress, total=meta.n_train, desc="build_index", unit="row")
    directions = sketch_projection(dim, seed)
    sketch = np.empty((meta.n_train, directions.shape[1]), np.float32)
    for start in range(0, meta.n_train, step):
        stop = min(start + step, meta.n_train)
        rows = index_rows(store, torch.arange(start, stop), normalize)
        index.add(rows)
        sketch[start:stop] = sketch_rows(rows, directions)  # the rows just added, in order
        bar.update(stop - start)
    bar.close()
    calibration = None if target is None else calibrate(
        index, store, kind=kind, nlist=nlist, normalize=normalize, target=target, seed=seed)
    norms = store_norms(store)  # read once: the binding, and the exact fingerprint from it
    built = SearchIndex(index, store_fingerprint(store, norms), meta_fingerprint(meta), kind,
                        nlist, m if kind == "ivf_pq" else None, normalize, meta.n_train,
                        saved_to, calibration, norms, sketch, seed)
    if saved_to is not None:
        _save(built, saved_to, faiss)
    return _verified_for(built, store)


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
        CorruptStoreError: ``index.faiss``, ``norms.npy``, ``sketch.npy`` or ``meta.json``
            differ from the files saved (damaged, edited, truncated, or another index's
            file), an array is not of the shape build_index writes, or the index predates
            checksums.
        IncompatibleGradientsError: the index was built from another store: other metadata
            (checkpoints, learning rates, projection, size), row norms that differ beyond
            float32 rounding (other data), or (format 4) rows whose sketch differs beyond
            rounding (rows of equal norm swapped or replaced; the rows compared are those
            a permutation could move unseen by the norms, see docs/search.md).
    """
    faiss = import_faiss()
    path = Path(path)
    saved, faiss_index, arrays = read_index_files(path, faiss.read_index)
    nlist = int(saved["nlist"])
    sketch, seed = checked_sketch(saved, arrays.get(SKETCH_FILE), path)
    loaded = SearchIndex(faiss_index, saved["fingerprint"], saved["meta_fingerprint"],
                         saved["kind"], nlist, saved["m"], bool(saved["normalize"]),
                         int(saved["n_train"]), path, _saved_calibration(saved, nlist, path),
                         arrays.get(NORMS_FILE), sketch, seed)
    loaded.check_store(store)
    if faiss_index.d != store.meta.n_ckpt * store.meta.k:  # a resealed file of another size
        raise CorruptStoreError(
            f"load_index: {str(path / 'index.faiss')!r} holds vectors of dimension "
            f"{faiss_index.d}, but the store's rows give n_ckpt * k = "
            f"{store.meta.n_ckpt * store.meta.k}; another index's file was put there; rebuild "
            "it with tif.build_index(store, overwrite=True).")
    return loaded


def _saved_calibration(saved: dict[str, Any], nlist: int, path: Path) -> Calibration | None:
    """The calibration in ``meta.json`` (absent before format 3: ``None``)."""
    data = saved.get("calibration")
    if data is None:
        return None
    calibration = Calibration.from_dict(data, nlist)
    if calibration is None:  # the checksum matched: written so, never by build_index
        raise CorruptStoreError(
            f"{current_caller()}: {str(path / 'meta.json')!r} holds calibration values no "
            f"build_index writes ({data!r}, nlist={nlist}); rebuild the index with "
            "tif.build_index(store, overwrite=True)."
        )
    return calibration


def _verified_for(index: SearchIndex, store: GradientStore) -> SearchIndex:
    """``index``, knowing that ``store`` (just read) is the one it was built for."""
    with contextlib.suppress(TypeError):
        index._verified.add(store)
    return index


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


def _target_path(store: GradientStore, path: str | os.PathLike[str] | None,
                 overwrite: bool) -> Path | None:
    store_path = getattr(store, "path", None)
    if path is None:
        if isinstance(store_path, str):  # a URL: never "saved" silently nowhere
            raise InvalidArgumentError(
                f"build_index: the store is at {store_path!r}, and indexes are saved to local "
                "directories only; pass path='grads.faiss' (a local directory) to save it."
            )
        if not isinstance(store_path, Path):
            return None
        path = store_path.with_name(store_path.name + ".faiss")
    if is_url(os.fspath(path)):
        raise InvalidArgumentError(
            f"build_index: path={os.fspath(path)!r} is a URL, but indexes are saved to local "
            "directories only; pass a local path (an index is read into memory whole anyway)."
        )
    target = Path(path)
    check_index_target(target, store_path, overwrite=overwrite)
    return target


def _save(index: SearchIndex, target: Path, faiss: Any) -> None:
    save_index_files(target, index.to_dict(),
                     lambda file: faiss.write_index(index.faiss_index, file),
                     {NORMS_FILE: index.norms, SKETCH_FILE: index.sketch})
