"""The torch kernels of the counter-based hash under every seeded projection (private).

Everything here is a pure function of integer keys and row/column counters, so a block is the
same on any device, in any process and in NumPy (``tests/numpy_projection.py``). The element
rule is documented in :mod:`tracinfunc.projection.spec`; changing anything here changes every saved
store (``tests/projection/test_projection.py`` guards it with a golden hash).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

MASK = 0xFFFFFFFF
# int64 hash elements generated per slice: on CPU small slices stay in cache (about 3x faster
# than 32 MiB ones); accelerators want few large kernels.
CPU_SLICE_ELEMENTS = 2**18
DEVICE_SLICE_ELEMENTS = 2**24


def mix32(x: Tensor) -> Tensor:
    """lowbias32 in place on int64 holding uint32 values (torch has no CPU uint32 shifts).

    Multiplies may wrap int64; masking right after keeps the exact low 32 bits.
    """
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(MASK)
    x ^= x >> 15
    x.mul_(0x846CA68B).bitwise_and_(MASK)
    x ^= x >> 16
    return x


def signs(bits: Tensor, dtype: torch.dtype) -> Tensor:
    """+1 where ``bits`` is 0, -1 where it is 1, in ``dtype``."""
    return bits.to(dtype).mul_(-2.0).add_(1.0)


def mix32_top_bit(x: Tensor) -> Tensor:
    """``mix32(x) >> 31`` in place, a third cheaper: the last xor-shift keeps bit 31."""
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(MASK)
    x ^= x >> 15
    return x.mul_(0x846CA68B).bitwise_right_shift_(31).bitwise_and_(1)


def row_states(keys: tuple[int, int], row_start: int, row_stop: int, device) -> Tensor:
    """``a = mix32(r ^ s0) ^ s1`` for rows ``[row_start, row_stop)``: ``[rows]`` int64."""
    rows = torch.arange(row_start, row_stop, dtype=torch.int64, device=device)
    return mix32(rows ^ keys[0]) ^ keys[1]


def rademacher_bits(keys, k, row_start, row_stop, device) -> Tensor:
    """``[rows, k]`` int64 of 0 or 1, bit 31 of ``mix32(a ^ c)``: 1 where the sign is ``-1``."""
    a = row_states(keys, row_start, row_stop, device)
    h = a[:, None] ^ torch.arange(k, dtype=torch.int64, device=device)  # [rows, k]
    return mix32_top_bit(h)


def rademacher_rows(keys, k, row_start, row_stop, device, dtype) -> Tensor:
    """``[rows, k]`` of exact +-1: ``-1`` where bit 31 of ``mix32(a ^ c)`` is set."""
    return signs(rademacher_bits(keys, k, row_start, row_stop, device), dtype)


def sjlt_rows(keys, k, nnz, row_start, row_stop, device, dtype) -> tuple[Tensor, Tensor]:
    """``(cols, signs)``, both ``[rows, nnz]``: ``h = mix32(a ^ t)``, column ``(h * k) >> 32``."""
    a = row_states(keys, row_start, row_stop, device)
    h = mix32(a[:, None] ^ torch.arange(nnz, dtype=torch.int64, device=device))  # [rows, nnz]
    cols = (h * k) >> 32  # Lemire: h < 2**32 and k < 2**31, so no int64 overflow
    return cols, signs(mix32_top_bit(h), dtype)  # h is spent: hash it in place


def row_ranges(numel: int, row_elements: int, device: torch.device) -> Iterator[tuple[int, int]]:
    """Row slices ``[start, stop)`` of about one generation budget of hash elements each."""
    budget = CPU_SLICE_ELEMENTS if device.type == "cpu" else DEVICE_SLICE_ELEMENTS
    step = max(1, budget // max(1, row_elements))
    for start in range(0, numel, step):
        yield start, min(numel, start + step)


@functools.cache
def compiled_rademacher_rows() -> Callable[..., Tensor]:
    """:func:`rademacher_rows` through ``torch.compile``, made on first use.

    Integer ops only, so bit-identical to eager; dynamic shapes, so new row ranges and keys
    never recompile. Measured on a 2-core CPU: 9x faster than eager on 100k x 512 rows, for
    a one-off compile of 5-30 s per process: it pays for dense blocks of millions of rows.
    """
    return torch.compile(rademacher_rows, dynamic=True)


def fill_rademacher(out: Tensor, keys: tuple[int, int], row_start: int, *,
                    rows_fn: Callable[..., Tensor] = rademacher_rows) -> Tensor:
    """Write rows ``row_start + [0, len(out))`` into ``out`` ``[rows, k]``, in slices."""
    k = out.shape[1]
    for start, stop in row_ranges(out.shape[0], k, out.device):
        out[start:stop] = rows_fn(keys, k, row_start + start, row_start + stop,
                                  out.device, out.dtype)
    return out
