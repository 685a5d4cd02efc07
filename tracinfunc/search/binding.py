"""Which store an index belongs to: the metadata exactly, the rows to float32 rounding.

An index answers for the rows it was built from, so it must refuse a store rebuilt with other
data under the same metadata. Comparing the rows' bits would also refuse the *same* store
rebuilt with another torch thread count (``torchrun`` runs one thread per process), another
BLAS or another device: reductions there are summed in another order, and the rows differ by
float32 rounding (about 1e-7 relative). So an index is bound to

- the metadata that decides what its rows are (:func:`meta_fingerprint`), compared exactly;
- every row's norm, ``[n_ckpt, n_train]`` float32 (4 bytes a row and checkpoint, a small
  fraction of any index), compared to a tolerance that rounding never reaches and another
  example's gradient almost always exceeds (:func:`norms_mismatch`).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import GradientStore

__all__ = ["NORM_ATOL", "NORM_RTOL", "meta_fingerprint", "norms_mismatch", "store_fingerprint",
           "store_norms"]

# Rounding moves a recomputed row's norm by ~1e-7 relative (a norm is a sum of squares, so it
# moves less than the row does); the norm of another example's gradient differs by orders of
# magnitude more. 1e-4 leaves three orders of headroom on either side.
NORM_RTOL = 1e-4
# Rows that are themselves rounding noise (examples the model fits exactly) carry no relative
# precision at all: below this fraction of the checkpoint's mean norm, differences are allowed.
NORM_ATOL = 1e-6


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
    scale = np.abs(a).mean(axis=1, keepdims=True) if a.size else a
    allowed = NORM_RTOL * np.maximum(np.abs(a), np.abs(b)) + NORM_ATOL * scale
    bad = ~(np.abs(a - b) <= allowed)  # NaN counts as different
    if not bad.any():
        return None
    ckpt, row = (int(i) for i in np.argwhere(bad)[0])
    return (f"{int(bad.sum())} of {bad.size} row norms differ beyond float32 rounding "
            f"(first: row {row} at checkpoint {ckpt}, {a[ckpt, row]:.7g} when the index was "
            f"built, {b[ckpt, row]:.7g} now)")
