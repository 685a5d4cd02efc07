"""Which store an index belongs to: the metadata exactly, the rows to float32 rounding.

An index answers for the rows it was built from, so it must refuse a store rebuilt with other
data under the same metadata. Comparing the rows' bits would also refuse the *same* store
rebuilt with another torch thread count (``torchrun`` runs one thread per process), another
BLAS or another device: reductions there are summed in another order, and the rows differ by
float32 rounding (about 1e-7 relative). So an index is bound to

- the metadata that decides what its rows are (:func:`meta_fingerprint`), compared exactly;
- every row's norm, ``[n_ckpt, n_train]`` float32 (4 bytes a row and checkpoint, a small
  fraction of any index), compared to a tolerance that rounding never reaches and another
  example's gradient almost always exceeds (:func:`norms_mismatch`);
- from format 4, a sketch of every indexed row: its inner products with ``SKETCH_SIZE``
  seeded Gaussian directions, ``[n_train, SKETCH_SIZE]`` float32 (32 bytes a row). Norms do
  not see row order: two examples with equal norms swapped pass them. The sketch does, but
  comparing it means reading rows, so on load it is compared for the rows a permutation could
  move unseen by the norms (:func:`rows_to_check`), within what rounding could move it
  (:func:`sketch_mismatch`).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

from tracinfunc._norms import directions, row_norms
from tracinfunc.search.rows import index_rows
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import GradientStore

__all__ = ["NORM_ATOL", "NORM_RTOL", "SKETCH_SIZE", "CandidateSketch", "meta_fingerprint",
           "norms_mismatch",
           "rows_to_check", "sketch_check", "sketch_mismatch", "sketch_projection", "sketch_rows",
           "store_fingerprint", "store_norms"]

# Rounding moves a recomputed row's norm by ~1e-7 relative (a norm is a sum of squares, so it
# moves less than the row does); the norm of another example's gradient differs by orders of
# magnitude more. 1e-4 leaves three orders of headroom on either side.
NORM_RTOL = 1e-4
# Rows that are themselves rounding noise (examples the model fits exactly) carry no relative
# precision at all: below this fraction of the checkpoint's median norm, differences are
# allowed. The median, not the mean: one exploding row (norm 1e9 among norms of 3) made the
# mean's allowance larger than an ordinary row, and a replaced ordinary row went through.
NORM_ATOL = 1e-6
# Directions in a row's sketch: one differing direction suffices; 8 make a chance agreement of
# two unrelated rows (each direction within 1e-4 of the row's scale) vanishingly rare.
SKETCH_SIZE = 8
# Bytes of rows read on load to compare the sketch (stored chunks are read whole, so a chunk
# costs all its rows): within it, every row a permutation could move unseen by the norms when
# their chunks fit, else a seeded sample of those chunks.
SKETCH_READ_BYTES = 64 * 2**20
SKETCH_SAMPLE_ROWS = 64  # and one seeded run of other rows


def meta_fingerprint(meta: StoreMeta) -> str:
    """sha256 of the metadata that decides what an index's rows are (no norms read)."""
    data = meta.to_dict()
    described = {key: data[key] for key in ("projection", "checkpoints", "layout", "n_train",
                                            "k", "dtype", "dataset_fingerprint")}
    if meta.quantization is not None:  # absent for float stores: their fingerprints stay
        described["quantization"] = meta.quantization
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def store_norms(store: GradientStore) -> np.ndarray:
    """Every row's norm, ``[n_ckpt, n_train]`` float32 (read once, a checkpoint at a time)."""
    meta = store.meta
    return np.stack([store.read_norms(ckpt, 0, meta.n_train).to(torch.float32).numpy()
                     for ckpt in range(meta.n_ckpt)]) if meta.n_ckpt else np.zeros((0, 0),
                                                                                  np.float32)


def store_fingerprint(store: GradientStore, norms: np.ndarray | None = None) -> str:
    """sha256 of the store's metadata and the bits of its row norms.

    An exact identity: it changes when any row set changes, and also when the same store is
    rebuilt with another thread count or device (float32 rounding). Indexes therefore do not
    compare it; they compare the norms within rounding (:func:`norms_mismatch`).

    Args:
        store: The store.
        norms: Its :func:`store_norms` when already read (not read again).
    """
    norms = store_norms(store) if norms is None else norms
    digest = hashlib.sha256(meta_fingerprint(store.meta).encode())
    digest.update(np.ascontiguousarray(norms).tobytes())
    return digest.hexdigest()


def norms_mismatch(built_from: np.ndarray, ours: np.ndarray) -> str | None:
    """Why the rows with norms ``ours`` are not those an index was built from, or ``None``.

    Args:
        built_from: ``[n_ckpt, n_train]`` norms recorded when the index was built.
        ours: ``[n_ckpt, n_train]`` norms of the store it is used with.

    Returns:
        ``None`` when every norm agrees to :data:`NORM_RTOL` (rows recomputed with another
        reduction order); otherwise a sentence naming how many rows differ and the first.
    """
    if built_from.shape != ours.shape:
        return f"norms of shape {tuple(built_from.shape)} recorded, {tuple(ours.shape)} read"
    a, b = built_from.astype(np.float64), ours.astype(np.float64)
    scale = np.median(np.abs(a), axis=1, keepdims=True) if a.size else a
    allowed = NORM_RTOL * np.maximum(np.abs(a), np.abs(b)) + NORM_ATOL * scale
    bad = ~(np.abs(a - b) <= allowed)  # NaN counts as different
    if not bad.any():
        return None
    ckpt, row = (int(i) for i in np.argwhere(bad)[0])
    return (f"{int(bad.sum())} of {bad.size} row norms differ beyond float32 rounding "
            f"(first: row {row} at checkpoint {ckpt}, {a[ckpt, row]:.7g} when the index was "
            f"built, {b[ckpt, row]:.7g} now)")


def sketch_projection(dim: int, seed: int) -> np.ndarray:
    """``[dim, SKETCH_SIZE]`` float64 standard Gaussian directions drawn from ``seed``."""
    return np.random.default_rng(seed).standard_normal((dim, SKETCH_SIZE))


def sketch_rows(rows: np.ndarray, directions: np.ndarray) -> np.ndarray:
    """``[n, SKETCH_SIZE]`` float32 sketch of index rows ``[n, dim]`` (summed in float64)."""
    return (np.asarray(rows, np.float64) @ directions).astype(np.float32)


def rows_to_check(norms: np.ndarray, seed: int, chunk_rows: int = 1,
                  budget_rows: int = 65536) -> np.ndarray:
    """Sorted rows whose sketch :meth:`SearchIndex.check_store` compares, int64.

    A permutation of rows passes :func:`norms_mismatch` only if each moved row lands where the
    norm agrees to the tolerance at every checkpoint: such rows ("ambiguous") have a neighbour
    in sorted norm order at every checkpoint. Every ambiguous row is taken when the stored
    chunks holding them hold at most ``budget_rows`` rows; else a seeded sample of those
    chunks, up to that many rows. Plus a seeded run of :data:`SKETCH_SAMPLE_ROWS`
    consecutive rows (one or two chunks), for other edits. Every row of a chunk taken is
    compared (a chunk is read whole anyway).

    Args:
        norms: ``[n_ckpt, n_train]`` norms recorded when the index was built.
        seed: The index's sketch seed (the sample is the same on every load).
        chunk_rows: Rows per stored chunk (a chunk is read whole; 1 for memory stores).
        budget_rows: Rows that may be read (:data:`SKETCH_READ_BYTES` over a row's bytes).
    """
    n_train = norms.shape[1]
    chunks = np.unique(np.flatnonzero(_ambiguous(norms)) // chunk_rows)
    rng = np.random.default_rng(seed)
    fits = max(1, budget_rows // chunk_rows)
    if len(chunks) > fits:
        chunks = rng.choice(chunks, fits, replace=False)
    start = int(rng.integers(0, max(1, n_train - SKETCH_SAMPLE_ROWS + 1)))
    run = np.arange(start, min(n_train, start + SKETCH_SAMPLE_ROWS)) // chunk_rows
    chunks = np.union1d(chunks, run)  # every row of a chunk read: it is read whole anyway
    rows = (chunks[:, None] * chunk_rows + np.arange(chunk_rows)[None]).reshape(-1)
    return rows[rows < n_train].astype(np.int64)


def _ambiguous(norms: np.ndarray) -> np.ndarray:
    """``[n_train]`` bool: rows with a norm within twice the tolerance of another row's, at
    every checkpoint (over-inclusive: neighbours may differ by checkpoint; that only reads
    more)."""
    n_ckpt, n_train = norms.shape
    ambiguous = np.ones(n_train, bool)
    for ckpt in range(n_ckpt):
        values = norms[ckpt].astype(np.float64)
        order = np.argsort(values, kind="stable")
        ranked = values[order]
        scale = float(np.median(np.abs(values))) if n_train else 0.0
        close = np.diff(ranked) <= 2 * (NORM_RTOL * np.maximum(np.abs(ranked[1:]),
                                                               np.abs(ranked[:-1]))
                                        + NORM_ATOL * scale)
        near = np.zeros(n_train, bool)
        near[order[1:][close]] = near[order[:-1][close]] = True
        ambiguous &= near
    return ambiguous


def sketch_mismatch(recorded: np.ndarray, now: np.ndarray, row_norms: np.ndarray,
                    rows: np.ndarray, directions: np.ndarray) -> str | None:
    """Why the index rows now at ``rows`` are not those sketched in ``recorded``, or ``None``.

    A row moved by rounding (``NORM_RTOL`` of its norm at most) moves each sketch entry by at
    most ``NORM_RTOL * |row| * |direction|`` (Cauchy-Schwarz); rows of noise (below
    ``NORM_ATOL`` of the median row norm) carry no relative precision and are allowed that
    much.

    Args:
        recorded: ``[n_train, SKETCH_SIZE]`` sketch saved with the index.
        now: ``[len(rows), SKETCH_SIZE]`` sketch of the index rows read from the store now.
        row_norms: ``[len(rows)]`` norms of those index rows.
        rows: Their row numbers, sorted int64.
        directions: :func:`sketch_projection` of the index.
    """
    if len(rows) == 0:
        return None
    then = recorded[rows].astype(np.float64)
    scale = float(np.median(row_norms))  # a typical row (one exploding row moves a mean)
    reach = np.linalg.norm(directions, axis=0)[None]  # [1, SKETCH_SIZE]
    allowed = (NORM_RTOL * row_norms[:, None] + NORM_ATOL * scale) * reach
    bad = ~(np.abs(now.astype(np.float64) - then) <= allowed).all(axis=1)  # NaN: different
    if not bad.any():
        return None
    named = rows[bad][:8].tolist()
    return (f"rows {named}{' ...' if bad.sum() > 8 else ''} differ from the rows the index was "
            f"built from ({int(bad.sum())} of the {len(rows)} rows checked; their norms agree, "
            "so the rows were swapped or replaced by others of equal norm)")


def sketch_check(store: GradientStore, norms: np.ndarray, sketch: np.ndarray, seed: int,
                 normalize: bool) -> str | None:
    """Compare the sketch of :func:`rows_to_check`'s rows of ``store`` (read now, once) with
    the ``sketch`` ``[n_train, SKETCH_SIZE]`` recorded; a sentence naming the rows, or ``None``.
    """
    chunk_rows = getattr(store, "chunk_rows", 1)  # as read_rows_at reads them
    chunk_rows = chunk_rows if isinstance(chunk_rows, int) and chunk_rows > 0 else 1
    meta = store.meta
    row_bytes = max(1, meta.n_ckpt * meta.k * torch.empty(0, dtype=meta.torch_dtype).element_size())
    rows = rows_to_check(norms, seed, chunk_rows, SKETCH_READ_BYTES // row_bytes)
    directions = sketch_projection(meta.n_ckpt * meta.k, seed)
    step = max(chunk_rows, SKETCH_READ_BYTES // 8 // (4 * meta.n_ckpt * meta.k))
    now = np.empty((len(rows), SKETCH_SIZE), np.float32)
    row_norms = np.empty(len(rows))
    for start in range(0, len(rows), step):  # [step, dim] float32 at a time
        block = index_rows(store, torch.from_numpy(rows[start:start + step]), normalize)
        now[start:start + step] = sketch_rows(block, directions)
        row_norms[start:start + step] = np.sqrt(np.einsum("ij,ij->i", block, block))
    return sketch_mismatch(sketch, now, row_norms, rows, directions)


class CandidateSketch:
    """The sketch of rows a query reads anyway (re-ranked candidates), built checkpoint by
    checkpoint as they are read: about ``SKETCH_SIZE`` multiply-adds per element read, so
    every row that can reach a result is compared with the index's recorded sketch, not only
    the rows :func:`rows_to_check` samples on load.

    Args:
        sketch: ``[n_train, SKETCH_SIZE]`` recorded with the index.
        seed: Its seed.
        lrs: The store's ``n_ckpt`` learning rates.
        k: The store's ``k``.
        rows: The rows read, sorted unique int64 ``[u]``.
    """

    def __init__(self, sketch: np.ndarray, seed: int, lrs: list[float], k: int,
                 rows: torch.Tensor) -> None:
        self._recorded, self._k, self._rows = sketch, k, rows.cpu().numpy()
        self._weights = [abs(float(lr)) ** 0.5 for lr in lrs]  # training rows: sqrt|lr_c|
        self._directions = sketch_projection(len(lrs) * k, seed)  # [n_ckpt * k, SKETCH_SIZE]
        self._now = np.zeros((len(self._rows), SKETCH_SIZE))
        self._squares = np.zeros(len(self._rows))

    def add(self, ckpt: int, rows: torch.Tensor, norms: torch.Tensor | None) -> None:
        """Fold in checkpoint ``ckpt``'s rows ``[u, k]`` (``norms`` ``[u]``: normalised
        index, as :func:`~tracinfunc.search.rows.weighted_rows`)."""
        # float32 at least: its rounding (~1e-7 of a row's scale) is far inside the tolerance.
        dtype = torch.promote_types(rows.dtype, torch.float32)
        weighted = rows.to(dtype, copy=True)  # [u, k], as index_rows makes them: the direction
        if norms is not None:  # first (tiny rows from their own entries)
            weighted = directions(weighted, norms.to(weighted))
        weighted.mul_(self._weights[ckpt])
        part = torch.from_numpy(self._directions[ckpt * self._k:(ckpt + 1) * self._k])
        self._now += (weighted @ part.to(rows.device, dtype)).double().cpu().numpy()  # [u, 8]
        squares = row_norms(weighted).double()  # rows of 1e-30: their squares underflow
        self._squares += squares.square().cpu().numpy()

    def mismatch(self) -> str | None:
        """As :func:`sketch_mismatch`, for the rows added."""
        return sketch_mismatch(self._recorded, self._now, np.sqrt(self._squares), self._rows,
                               self._directions)
