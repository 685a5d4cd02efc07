"""Quantised row storage: int8 codes or 1-bit signs, each row with its own float32 scale.

A quantised store keeps, per checkpoint, codes ``[n_train, width]`` and scales ``[n_train]``
instead of float rows ``[n_train, k]``; ``read_rows`` hands out the dequantised rows, float32,
so every consumer (scoring, search, conversions) works unchanged. Row norms stay the exact
norms of the unquantised rows (taken before quantising, like the norms of float16 stores).

* ``"int8"``: symmetric, one scale per row: ``scale = max|row| / 127``,
  ``code = round(row / scale)`` in ``[-127, 127]``, ``row ~ scale * code``. Every value is
  within ``scale / 2`` of the row (float32 rounding aside); a zero row has scale 0 and
  comes back exactly. ``width = k`` bytes.
* ``"sign"`` (1 bit per value, as QLESS): ``row ~ scale * sign(row)`` with
  ``scale = mean|row|``, the scale that minimises the L2 error of ``scale * sign(row)``
  (``||x - s sign(x)||^2 = ||x||^2 - 2 s sum|x| + s^2 k`` is smallest at ``s = sum|x| / k``).
  Bits are packed 8 per byte, little-endian within a byte: value ``j`` is bit ``j % 8``
  (``1 << (j % 8)``) of byte ``j // 8``, set when the value is negative (as a float's sign
  bit), so 0 reads as ``+scale``. ``width = ceil(k / 8)`` bytes.

Dequantising is one float32 multiplication per value (``code * scale``, or ``+-scale``), so it
gives the same bits on any device.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from tracinfunc._validate import current_caller
from tracinfunc.errors import InvalidArgumentError, NonFiniteGradientError
from tracinfunc.store.meta import QUANTIZATIONS, StoreMeta

__all__ = ["FLOAT_DTYPES", "INT8_MAX", "QUANTIZATIONS", "check_codes", "check_peaks",
           "check_storable", "code_dtype", "code_width", "dequantize", "overflow_limit",
           "quantize", "row_peaks", "storage_of", "stored_empty", "to_stored"]

INT8_MAX = 127  # symmetric: -128 is never used, so negating a code never overflows
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def storage_of(dtype: Any) -> tuple[torch.dtype, str | None]:
    """What ``dtype=`` asks for: ``(dtype rows are read in, quantization or None)``.

    ``torch.int8``/``"int8"`` and ``"sign"`` are quantised (read as float32); a float dtype is
    stored as it is.

    Raises:
        InvalidArgumentError: anything else.
    """
    if dtype is torch.int8 or (isinstance(dtype, str) and dtype in QUANTIZATIONS):
        return torch.float32, "int8" if dtype is torch.int8 else dtype
    named = {str(d).removeprefix("torch."): d for d in FLOAT_DTYPES}  # "float32", as "int8"
    dtype = named.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if isinstance(dtype, torch.dtype) and dtype in FLOAT_DTYPES:
        return dtype, None
    raise InvalidArgumentError(
        f"{current_caller()}: dtype must be a storage dtype: torch.float32, torch.float16, "
        "torch.bfloat16, torch.float64 (or their names, e.g. 'float16'), torch.int8 or 'int8' "
        "(int8 codes with a per-row "
        f"scale) or 'sign' (1 bit per value with a per-row scale); got {dtype!r}. Pass e.g. "
        "dtype=torch.float16 or dtype='int8'."
    )


def code_width(meta: StoreMeta) -> int:
    """Stored values per row: ``k`` (float rows, int8), ``ceil(k / 8)`` bytes (sign)."""
    return -(-meta.k // 8) if meta.quantization == "sign" else meta.k


def code_dtype(meta: StoreMeta) -> torch.dtype:
    """The dtype rows are stored in: the float dtype, int8, or uint8 (packed signs)."""
    return {None: meta.torch_dtype, "int8": torch.int8, "sign": torch.uint8}[meta.quantization]


def stored_empty(meta: StoreMeta, rows: int, **kwargs: Any) -> Tensor:
    """Uninitialised stored rows ``[n_ckpt, rows, width]`` (``torch.empty`` keywords pass on)."""
    return torch.empty(meta.n_ckpt, rows, code_width(meta), dtype=code_dtype(meta), **kwargs)


def to_stored(rows: Tensor, meta: StoreMeta) -> tuple[Tensor, Tensor | None]:
    """Rows ``[..., k]`` in their stored form: ``(stored, scales [...] float32 or None)``.

    Quantised stores: codes ``[..., width]`` and scales, computed on the rows' device (so only
    codes travel). Float stores: ``rows`` themselves, no scales; the writer casts them to the
    storage dtype as it copies them.
    """
    if meta.quantization is None:
        return rows, None
    return quantize(rows, meta.quantization)


def overflow_limit(meta: StoreMeta, rows_dtype: torch.dtype) -> float | None:
    """The smallest magnitude that becomes inf when rows of ``rows_dtype`` are cast to
    ``meta``'s float storage (float16: 65520, half an ulp above its largest value 65504, as
    round-to-nearest-even rounds it up); ``None`` where the cast cannot overflow (a dtype
    as wide or wider, or quantised storage, whose float32 scales hold any float32 row)."""
    if meta.quantization is not None:
        return None
    target = torch.finfo(meta.torch_dtype)
    if target.max >= torch.finfo(rows_dtype).max:
        return None
    _, exponent = math.frexp(target.max)  # max = (1 - eps/2) * 2**exponent
    return math.ldexp(1.0 - target.eps / 4, exponent)


def row_peaks(rows: Tensor) -> Tensor:
    """``max |row|`` ``[...]`` of rows ``[..., k]``, in float32 (float64 for float64 rows:
    exact either way, as are the limits of :func:`overflow_limit` it is compared with)."""
    peaks = torch.linalg.vector_norm(rows, ord=math.inf, dim=-1)
    return peaks if peaks.dtype == torch.float64 else peaks.float()


def check_storable(rows: Tensor, meta: StoreMeta, *, first_row: int) -> None:
    """Raise unless every value of rows ``[n_ckpt, b, k]`` (rows ``first_row`` on) stays
    finite when cast to ``meta``'s storage dtype (see :func:`check_peaks`)."""
    limit = overflow_limit(meta, rows.dtype)
    if limit is not None:
        check_peaks(row_peaks(rows), meta, limit=limit, first_row=first_row)


def check_peaks(peaks: Tensor, meta: StoreMeta, *, limit: float, first_row: int) -> None:
    """Raise :class:`~tracinfunc.errors.NonFiniteGradientError` naming the checkpoint, the
    rows and the largest value where a row's peak ``[n_ckpt, b]`` reaches ``limit``: stored
    as float16 (largest 65504) such a row would hold inf, and every score with it be NaN."""
    over = peaks >= limit
    if not bool(over.any()):
        return
    ckpt = int(over.any(dim=1).nonzero()[0])
    bad = over[ckpt].nonzero().flatten().add(first_row).tolist()
    name, largest = meta.torch_dtype, float(peaks[ckpt].max())
    wider = ("torch.bfloat16 or torch.float32" if meta.torch_dtype == torch.float16
             and largest < torch.finfo(torch.bfloat16).max else "torch.float32")
    raise NonFiniteGradientError(
        f"{current_caller()}: checkpoint {meta.checkpoints[ckpt].name!r} gives gradients up to "
        f"{largest:.4g} for rows {bad[:10]}{'...' if len(bad) > 10 else ''}, beyond the range "
        f"of {str(name).removeprefix('torch.')} storage (largest {torch.finfo(name).max:.6g}): "
        f"stored as {str(name).removeprefix('torch.')} they would be inf and every score NaN. "
        f"Store them as {wider} (dtype=), or scale the loss down by at least "
        f"{largest / torch.finfo(name).max:.3g}x (scores scale with its square)."
    )


def check_codes(meta: StoreMeta, codes: Tensor, scales: Tensor, norms: Tensor) -> None:
    """Raise unless ``codes`` ``[n_ckpt, b, width]``, ``scales`` and ``norms`` ``[n_ckpt, b]``
    are a block of ``meta``'s quantised rows (scales finite and non-negative)."""
    width, dtype = code_width(meta), code_dtype(meta)
    b = codes.shape[1] if codes.ndim == 3 else -1
    if (meta.quantization is None or tuple(codes.shape) != (meta.n_ckpt, b, width)
            or codes.dtype != dtype or tuple(scales.shape) != (meta.n_ckpt, b)
            or tuple(norms.shape) != (meta.n_ckpt, b) or not scales.is_floating_point()):
        raise InvalidArgumentError(
            f"{current_caller()}: expected codes [n_ckpt={meta.n_ckpt}, b, {width}] {dtype} with "
            f"scales and norms [n_ckpt, b] for quantization={meta.quantization!r}, got codes "
            f"{list(codes.shape)} {codes.dtype}, scales {list(scales.shape)} {scales.dtype}, "
            f"norms {list(norms.shape)}; pass what read_codes of a store with the same "
            "quantization returns, or float rows to append()."
        )
    if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise InvalidArgumentError(
            f"{current_caller()}: scales must be finite and non-negative, got "
            f"{scales.min().item()} .. "
            f"{scales.max().item()}; pass the scales quantize() returned with the codes."
        )


def quantize(rows: Tensor, quantization: str) -> tuple[Tensor, Tensor]:
    """``(codes [..., width], scales [...] float32)`` of float ``rows`` ``[..., k]``.

    Computed in float32 (float64 rows are rounded to float32 first), on the rows' device.
    """
    rows = rows.to(torch.float32)
    if quantization == "int8":
        scales = rows.abs().amax(dim=-1) / INT8_MAX
        # A zero row divides by 1 instead of 0: its codes are 0 and its scale stays 0.
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(rows / divisor[..., None]).clamp_(-INT8_MAX, INT8_MAX)
        return codes.to(torch.int8), scales
    if quantization == "sign":
        return _pack_signs(rows < 0), rows.abs().mean(dim=-1)
    raise InvalidArgumentError(
        f"quantize: quantization must be one of {list(QUANTIZATIONS)}, got "
        f"{quantization!r}; pass 'int8' (codes with a per-row scale) or 'sign' (1 bit a value)."
    )


def dequantize(codes: Tensor, scales: Tensor, quantization: str, k: int, *,
               out: Tensor | None = None) -> Tensor:
    """Float32 rows ``[..., k]`` from ``codes`` ``[..., width]`` and ``scales`` ``[...]``.

    Written into ``out`` (float32, ``[..., k]``, on the codes' device) when given.
    """
    scales = scales.to(torch.float32)[..., None]
    if quantization == "int8":
        if out is None:
            out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
        # A converting copy, then an in-place product: 2.5x faster on a CPU than the mixed
        # int8 * float32 product, and the same values (the int8 -> float32 cast is exact).
        return out.copy_(codes).mul_(scales)
    if quantization == "sign":
        # One lookup per byte gives its 8 signs (+-1.0, exact), so the product is +-scale.
        signs = _sign_table(codes.device).index_select(0, codes.reshape(-1).long())
        signs = signs.reshape(*codes.shape[:-1], codes.shape[-1] * 8)[..., :k]
        return torch.mul(signs, scales, out=out)
    raise InvalidArgumentError(
        f"dequantize: quantization must be one of {list(QUANTIZATIONS)}, got "
        f"{quantization!r}; pass the store's meta.quantization."
    )


def _sign_table(device: torch.device) -> Tensor:
    """``[256, 8]`` float32: row ``b`` holds the signs byte ``b`` packs (bit set: -1.0)."""
    bits = torch.arange(256, device=device)[:, None].bitwise_and(
        _bit_values(device).long()).ne(0)
    return 1.0 - 2.0 * bits.to(torch.float32)


def _bit_values(device: torch.device) -> Tensor:
    return torch.tensor([1 << bit for bit in range(8)], dtype=torch.uint8, device=device)


def _pack_signs(negative: Tensor) -> Tensor:
    """Bool ``[..., k]`` -> uint8 ``[..., ceil(k / 8)]``, value j in bit j % 8 of byte j // 8."""
    k = negative.shape[-1]
    bits = torch.nn.functional.pad(negative.to(torch.uint8), (0, -k % 8))  # pad bits are 0
    bits = bits.reshape(*negative.shape[:-1], bits.shape[-1] // 8, 8)  # [..., width, 8]
    return (bits * _bit_values(bits.device)).sum(dim=-1, dtype=torch.int32).to(torch.uint8)
