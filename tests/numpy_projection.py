"""Plain-NumPy reference of ``tracinfunc.projection``'s matrices, for bit-exact tests.

Deliberately independent of the library: no torch import, and the hash runs in native
``uint32`` arithmetic (wrapping multiply, logical shifts) instead of the library's masked
``int64``, so agreement checks the masking as well as the algorithm.

Element rule for row ``r`` (a parameter's flattened coordinate) with keys ``(s0, s1)``::

    a = mix32(r ^ s0) ^ s1
    rademacher: P[r, c] = -1 if bit 31 of mix32(a ^ c) else +1
    sjlt, t < nnz: h = mix32(a ^ t); col = (h * k) >> 32; sign = -1 if bit 31 of mix32(h) else +1
    kronecker, >= 2 dims: P_out, P_in follow the rademacher rule with the keys of the record plus
        "side": "out" / "in"; block = P_out.T @ G.reshape(d_out, -1) @ P_in, flattened
    kronecker, < 2 dims: the rademacher rule with the plain record (kind "kronecker")
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np

PERSON = b"tracinfunc.proj1"


def block_seed(seed, kind, dim, nnz, name, shape, side=None) -> tuple[int, int]:
    """The two uint32 keys of one parameter's block (of one Kronecker side with ``side``)."""
    record = {"dim": dim, "kind": kind, "name": name, "nnz": nnz, "seed": seed,
              "shape": [int(s) for s in shape]}
    if side is not None:
        record["side"] = side
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


def _rademacher(s0, s1, k, row_start, row_stop) -> np.ndarray:
    a = _row_states(s0, s1, row_start, row_stop)
    cols = np.arange(k, dtype=np.uint32)
    return _signs(mix32(a[:, None] ^ cols[None, :]))


def rademacher_block(seed, dim, name, shape, row_start, row_stop, kind="rademacher"):
    """``[rows, dim]`` float32 of exact +-1 (unscaled)."""
    return _rademacher(*block_seed(seed, kind, dim, 1, name, shape), dim, row_start, row_stop)


def kronecker_split(dim, shape=None) -> tuple[int, int]:
    """``(k_out, k_in)`` with ``k_out * k_in = dim``.

    No shape ("square"): the largest divisor of ``dim`` not above its square root, and the
    rest. A shape ("shape"): among the divisor pairs with ``k_out <= d_out`` and
    ``k_in <= d_in``, the one with the largest ``min(k_out / d_out, k_in / d_in)`` (ties: the
    larger ``k_out``); if none fits, the smallest ``max(k_out / d_out, k_in / d_in)`` (ties:
    the larger ``k_out``). Written as a plain loop over every pair.
    """
    if shape is None or shape[0] == 0 or int(np.prod(shape[1:])) == 0:  # empty: square
        k_out = max(d for d in range(1, math.isqrt(dim) + 1) if dim % d == 0)
        return k_out, dim // k_out
    d_out, d_in = shape[0], int(np.prod(shape[1:]))
    best, best_score, fits = None, None, False
    for k_out in range(1, dim + 1):
        if dim % k_out:
            continue
        k_in = dim // k_out
        pair_fits = k_out <= d_out and k_in <= d_in
        score = (min(k_out / d_out, k_in / d_in) if pair_fits
                 else -max(k_out / d_out, k_in / d_in))
        if (pair_fits, score) >= (fits, best_score if best_score is not None else -np.inf):
            best, best_score, fits = (k_out, k_in), score, pair_fits
    return best


def vector_view(numel) -> tuple[int, int]:
    """``(d_out, d_in)`` of a vector under ``vectors="kronecker"``: ``d_in`` the smallest
    integer whose square is at least ``numel``, ``d_out`` the rows of ``d_in`` needed to hold
    ``numel`` entries (written as plain loops)."""
    d_in = 1
    while d_in * d_in < numel:
        d_in += 1
    d_out = 1
    while d_out * d_in < numel:
        d_out += 1
    return d_out, d_in


def kronecker_factors(seed, dim, name, shape, split="square"):
    """``(P_out [d_out, k_out], P_in [d_in, k_in])`` float32 +-1 (unscaled); a shape with
    fewer than two dimensions is a vector under ``vectors="kronecker"``."""
    if len(shape) >= 2:
        d_out, d_in = shape[0], int(np.prod(shape[1:]))
    else:
        d_out, d_in = vector_view(int(np.prod(shape)))
    k_out, k_in = kronecker_split(dim, (d_out, d_in) if split == "shape" else None)
    keys_out = block_seed(seed, "kronecker", dim, 1, name, shape, side="out")
    keys_in = block_seed(seed, "kronecker", dim, 1, name, shape, side="in")
    return _rademacher(*keys_out, k_out, 0, d_out), _rademacher(*keys_in, k_in, 0, d_in)


def sjlt_block(seed, dim, nnz, name, shape, row_start, row_stop):
    """``(cols [rows, nnz] int64, signs [rows, nnz] float32)`` (signs unscaled)."""
    s0, s1 = block_seed(seed, "sjlt", dim, nnz, name, shape)
    a = _row_states(s0, s1, row_start, row_stop)
    h = mix32(a[:, None] ^ np.arange(nnz, dtype=np.uint32)[None, :])
    cols = (h.astype(np.uint64) * np.uint64(dim)) >> np.uint64(32)
    return cols.astype(np.int64), _signs(mix32(h))


def project(grads: dict, seed, kind, dim, nnz=1, split="square", vectors="dense"
            ) -> np.ndarray:
    """One example's ``{name: array}`` projected to ``[k]`` in float64, via dense matrices."""
    parts = []
    for name in sorted(grads):
        g = np.asarray(grads[name], dtype=np.float64)
        flat, shape, numel = g.reshape(-1), g.shape, g.size
        if kind == "identity":
            parts.append(flat)
        elif kind == "kronecker" and numel > 0 and (g.ndim >= 2 or vectors == "kronecker"):
            p_out, p_in = kronecker_factors(seed, dim, name, shape, split)
            kron = np.kron(p_out.astype(np.float64), p_in.astype(np.float64))  # [>=numel, dim]
            parts.append(flat @ kron[:numel] / np.sqrt(dim))  # a vector's padding: rows unused
        elif kind in ("rademacher", "kronecker"):
            block = rademacher_block(seed, dim, name, shape, 0, numel, kind).astype(np.float64)
            parts.append(flat @ block / np.sqrt(dim))
        else:
            cols, signs = sjlt_block(seed, dim, nnz, name, shape, 0, numel)
            dense = np.zeros((numel, dim))
            for t in range(nnz):
                np.add.at(dense, (np.arange(numel), cols[:, t]), signs[:, t])
            parts.append(flat @ dense / np.sqrt(nnz))
    return np.concatenate(parts) if kind == "identity" else np.sum(parts, axis=0)
