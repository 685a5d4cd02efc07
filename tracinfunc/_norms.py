"""Row norms that neither underflow nor overflow: exact for rows of 1e-24 and of 1e20.

``rows.norm(dim=-1)`` squares in the rows' dtype: in float32 entries around 1e-24 square to
0 (a stored norm of exactly 0: cosine 0 against the example's own copy) and entries around
1e20 square to inf (a finite row refused as NaN/inf). Each row is divided by a power of two
near its largest value first, which is exact, so the norm of an ordinary row is bit-for-bit
the one ``norm`` gives, and tiny or huge rows get their true norm (inf only when the norm
itself exceeds the dtype's range).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["row_norms"]


def row_norms(rows: Tensor) -> Tensor:
    """Euclidean norms over the last dimension, computed on power-of-two rescaled rows.

    Args:
        rows: ``[..., k]`` floating point, any device.

    Returns:
        ``[...]``, the dtype and device of ``rows``.
    """
    peak = rows.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    _, exponent = torch.frexp(peak)  # peak = m * 2**exponent, m in [0.5, 1)
    # 2**(exponent - 1) <= peak: finite for the largest float (2**128 would not be).
    ones = torch.ones_like(peak)
    scale = torch.where(peak > 0, torch.ldexp(ones, exponent - 1), ones)
    scale = torch.where(torch.isfinite(scale), scale, ones)  # NaN/inf rows stay NaN/inf
    return (rows / scale).norm(dim=-1) * scale.squeeze(-1)
