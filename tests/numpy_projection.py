"""Plain-NumPy reference of ``tracinfunc.projection``'s matrices, for bit-exact tests.

Deliberately independent of the library: no torch import, and the hash runs in native
``uint32`` arithmetic (wrapping multiply, logical shifts) instead of the library's masked
``int64``, so agreement checks the masking as well as the algorithm.

Element rule for row ``r`` (a parameter's flattened coordinate) with keys ``(s0, s1)``::

    a = mix32(r ^ s0) ^ s1
    rademacher: P[r, c] = -1 if bit 31 of mix32(a ^ c) else +1
    sjlt, t < nnz: h = mix32(a ^ t); col = (h * k) >> 32; sign = -1 if bit 31 of mix32(h) else +1
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

PERSON = b"tracinfunc.proj1"


def block_seed(seed, kind, dim, nnz, name, shape) -> tuple[int, int]:
    """The two uint32 keys of one parameter's block."""
    record = {"dim": dim, "kind": kind, "name": name, "nnz": nnz, "seed": seed,
              "shape": [int(s) for s in shape]}
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    digest = hashlib.blake2b(text.encode("ascii"), digest_size=8, person=PERSON).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def mix32(x: np.ndarray) -> np.ndarray:
    """lowbias32 on a uint32 array."""
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def _row_states(s0, s1, row_start, row_stop) -> np.ndarray:
    rows = np.arange(row_start, row_stop, dtype=np.uint64).astype(np.uint32)
    return mix32(rows ^ np.uint32(s0)) ^ np.uint32(s1)


def _signs(h: np.ndarray) -> np.ndarray:
    return np.where(h >> np.uint32(31), -1.0, 1.0).astype(np.float32)


def rademacher_block(seed, dim, name, shape, row_start, row_stop) -> np.ndarray:
    """``[rows, dim]`` float32 of exact +-1 (unscaled)."""
    s0, s1 = block_seed(seed, "rademacher", dim, 1, name, shape)
    a = _row_states(s0, s1, row_start, row_stop)
    cols = np.arange(dim, dtype=np.uint32)
    return _signs(mix32(a[:, None] ^ cols[None, :]))


def sjlt_block(seed, dim, nnz, name, shape, row_start, row_stop):
    """``(cols [rows, nnz] int64, signs [rows, nnz] float32)`` (signs unscaled)."""
    s0, s1 = block_seed(seed, "sjlt", dim, nnz, name, shape)
    a = _row_states(s0, s1, row_start, row_stop)
    h = mix32(a[:, None] ^ np.arange(nnz, dtype=np.uint32)[None, :])
    cols = (h.astype(np.uint64) * np.uint64(dim)) >> np.uint64(32)
    return cols.astype(np.int64), _signs(mix32(h))


def project(grads: dict, seed, kind, dim, nnz=1) -> np.ndarray:
    """One example's ``{name: array}`` projected to ``[k]`` in float64, via dense matrices."""
    parts = []
    for name in sorted(grads):
        g = np.asarray(grads[name], dtype=np.float64)
        flat, shape, numel = g.reshape(-1), g.shape, g.size
        if kind == "identity":
            parts.append(flat)
        elif kind == "rademacher":
            block = rademacher_block(seed, dim, name, shape, 0, numel).astype(np.float64)
            parts.append(flat @ block / np.sqrt(dim))
        else:
            cols, signs = sjlt_block(seed, dim, nnz, name, shape, 0, numel)
            dense = np.zeros((numel, dim))
            for t in range(nnz):
                np.add.at(dense, (np.arange(numel), cols[:, t]), signs[:, t])
            parts.append(flat @ dense / np.sqrt(nnz))
    return np.concatenate(parts) if kind == "identity" else np.sum(parts, axis=0)
