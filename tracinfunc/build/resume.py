"""Resuming checks the data, not only the arguments: the first batch must give the stored rows.

An interrupted build is resumed by calling ``build_store`` again; the arguments are compared
with the metadata, but the data cannot be (a generator has no identity), so a resume with
other data (``gen(x + 1)``), another ``mixed_precision`` or another order would merge two
datasets into one store. Recomputing the first batch (one batch of work) and comparing it
with the rows stored for it catches all of these.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from tracinfunc._validate import current_caller
from tracinfunc.errors import IncompatibleGradientsError
from tracinfunc.store.codes import INT8_MAX
from tracinfunc.store.meta import StoreMeta

__all__ = ["SupportsReadBack", "check_same_data"]

# Rows recomputed on another device or with nondeterministic kernels differ by rounding only;
# other data or another mixed_precision differ by far more than this (relative to the row).
_TOLERANCE = 1e-3
# Quantised rows: how far (in quantisation steps) a recomputed value may lie outside the cell
# of its stored code, for rounding: a value exactly on a rounding boundary may round either way.
_STEP_TOLERANCE = 1e-2


@runtime_checkable
class SupportsReadBack(Protocol):
    """A writer that can return rows it already stored (a resumed Zarr writer or part)."""

    #: The first row this writer writes (0, or a part's first row): rows before it are
    #: another writer's.
    first_row: int

    def read_back(self, start: int, stop: int) -> Tensor:
        """Stored rows ``[n_ckpt, stop - start, k]``."""
        ...


def _codes_error(recomputed: Tensor, stored: Tensor, quantization: str) -> float:
    """How far recomputed rows ``[n_ckpt, b, k]`` are from giving the stored (dequantised)
    rows, relative to :data:`_TOLERANCE`: a quantised store is held to float32 strictness on
    what it keeps. Each row's scale is a float (``max|row| / 127``, ``mean|row|``) and must
    match as float rows do; each value must lie in the cell of its stored code (within half
    a step of ``code * scale``; on the side of its stored sign), up to
    :data:`_STEP_TOLERANCE` of a step for rounding."""
    x = recomputed.to(torch.float32).to(torch.float64)  # quantised from float32
    if quantization == "int8":
        stored_scale, scale = stored.abs().amax(-1) / INT8_MAX, x.abs().amax(-1) / INT8_MAX
        outside = ((x - stored).abs() - stored_scale[..., None] / 2).clamp_min(0)
    else:  # sign: every stored value is +-scale
        stored_scale, scale = stored.abs().mean(-1), x.abs().mean(-1)
        outside = torch.where((x < 0) & (stored > 0) | (x > 0) & (stored < 0), x.abs(), 0.0)
    step = stored_scale.clamp_min(1e-30)
    scale_error = ((scale - stored_scale).abs() / step).max().item()
    cell_error = (outside.amax(-1) / step).max().item() * (_TOLERANCE / _STEP_TOLERANCE)
    return max(scale_error, cell_error)


def check_same_data(writer: object, rows: Tensor, meta: StoreMeta, *, start: int = 0) -> None:
    """Raise unless ``rows`` ``[n_ckpt, b, k]`` (recomputed) match rows ``[start, start + b)``
    as stored."""
    if not isinstance(writer, SupportsReadBack) or rows.shape[1] == 0:
        return
    stored = writer.read_back(start, start + rows.shape[1]).to(torch.float64)
    recomputed = rows.detach().to(meta.torch_dtype).to(device="cpu", dtype=torch.float64)
    if meta.quantization is not None:
        error = _codes_error(recomputed, stored, meta.quantization)
    else:
        scale = stored.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        error = ((recomputed - stored).norm(dim=-1, keepdim=True) / scale).max().item()
    if not error <= _TOLERANCE:
        raise IncompatibleGradientsError(
            f"{current_caller()}: the data does not match the store being resumed: examples "
            f"[{start}, {start + rows.shape[1]}) give rows that differ from the stored ones "
            f"(relative difference {error:.3g}). Resume with the same data, in the same order, "
            "and the same options (mixed_precision, dtype) as the interrupted build, or delete the "
            "store (or use another path) to start over."
        )
