"""Row norms that neither underflow nor overflow: exact for rows of 1e-24 and of 1e20.

``rows.norm(dim=-1)`` squares in the rows' dtype: in float32 entries around 1e-24 square to
0 (a stored norm of exactly 0: cosine 0 against the example's own copy) and entries around
1e20 square to inf (a finite row refused as NaN/inf). Each row is divided by a power of two
near its largest value first, which is exact, so the norm of an ordinary row is bit-for-bit
the one ``norm`` gives, and tiny or huge rows get their true norm (inf only when the norm
itself exceeds the dtype's range). On the CPU the rescaling runs only for the rows that need
it: ``norm`` itself is taken first (one pass), and only rows whose norm is outside the range
where no square can underflow or overflow noticeably (or is 0, NaN or inf) are redone.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["directions", "has_small_norms", "row_norms", "smallest_plain_norm"]


def row_norms(rows: Tensor) -> Tensor:
    """Euclidean norms over the last dimension, computed on power-of-two rescaled rows.

    Args:
        rows: ``[..., k]`` floating point, any device.

    Returns:
        ``[...]``, the dtype and device of ``rows``.
    """
    low, high = _ordinary_norms(rows.dtype)
    if rows.device.type != "cpu" or low >= high:  # no host sync on an accelerator
        return _rescaled_norms(rows)
    norms = rows.norm(dim=-1)
    odd = ~((norms >= low) & (norms <= high))  # 0, tiny, huge, NaN or inf
    if bool(odd.any()):
        norms[odd] = _rescaled_norms(rows[odd])
    return norms


def _ordinary_norms(dtype: torch.dtype) -> tuple[float, float]:
    """``(low, high)``: a row whose plain norm lies in ``[low, high]`` has no square that
    overflows and only squares below ``2**-24`` of the sum that underflow (``k < 2**24``), so
    ``norm`` is what the rescaled computation gives."""
    info = torch.finfo(dtype)
    return math.sqrt(info.tiny) * 2.0**24, math.sqrt(info.max) * 2.0**-24


def _rescaled_norms(rows: Tensor) -> Tensor:
    peak = rows.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    _, exponent = torch.frexp(peak)  # peak = m * 2**exponent, m in [0.5, 1)
    # 2**(exponent - 1) <= peak: finite for the largest float (2**128 would not be).
    ones = torch.ones_like(peak)
    scale = torch.where(peak > 0, torch.ldexp(ones, exponent - 1), ones)
    scale = torch.where(torch.isfinite(scale), scale, ones)  # NaN/inf rows stay NaN/inf
    return (rows / scale).norm(dim=-1) * scale.squeeze(-1)


def directions(rows: Tensor, norms: Tensor) -> Tensor:
    """``rows`` ``[n, k]`` over their ``norms`` ``[n]``: unit rows, a new tensor (a zero row
    stays zero).

    Rows of small norm are redone from the rows themselves: divided by a power of two near
    their largest entry (exact), then by their own norm. Their given norm may have lost its
    bits (a float32 denormal norm: a row ``[d, d]`` of the smallest denormal has a norm 1.41x
    off), and their products with a test row would be subnormal too: ``score`` used to give
    such a row a cosine of 0, or 1.41.
    """
    out = rows / torch.where(norms > 0, norms, torch.full_like(norms, math.inf))[..., None]
    if rows.is_meta:  # shapes without values (the tests' stand-in device)
        return out
    small = has_small_norms(norms, rows.dtype)
    if rows.device.type != "cpu" or bool(small.any()):
        out[small] = _unit(rows[small])
    return out


def has_small_norms(norms: Tensor, dtype: torch.dtype) -> Tensor:
    """Which ``norms`` (of rows of ``dtype``) :func:`directions` redoes from the rows."""
    return (norms > 0) & (norms < smallest_plain_norm(dtype))


def smallest_plain_norm(dtype: torch.dtype) -> float:
    """Below this norm a row of ``dtype`` has squares that underflow: ``rows.norm()`` may be
    off, or 0 (``sqrt(tiny) * 2**24``, ~2e-12 in float32)."""
    return _ordinary_norms(dtype)[0]


def _unit(rows: Tensor) -> Tensor:
    peak = rows.abs().amax(dim=-1, keepdim=True)
    _, exponent = torch.frexp(peak)
    scaled = rows / torch.ldexp(torch.ones_like(peak), exponent - 1)  # entries in (-2, 2]
    return scaled / scaled.norm(dim=-1, keepdim=True)
