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
from tracinfunc.store.codes import dequantize, quantize
from tracinfunc.store.meta import StoreMeta

__all__ = ["SupportsReadBack", "check_same_data"]

# Rows recomputed on another device or with nondeterministic kernels differ by rounding only;
# other data or another mixed_precision differ by far more than this (relative to the row).
_TOLERANCE = 1e-3


@runtime_checkable
class SupportsReadBack(Protocol):
    """A writer that can return rows it already stored (a resumed Zarr writer or part)."""

    #: The first row this writer writes (0, or a part's first row): rows before it are
    #: another writer's.
    first_row: int

    def read_back(self, start: int, stop: int) -> Tensor:
        """Stored rows ``[n_ckpt, stop - start, k]``."""
        ...


def check_same_data(writer: object, rows: Tensor, meta: StoreMeta, *, start: int = 0) -> None:
    """Raise unless ``rows`` ``[n_ckpt, b, k]`` (recomputed) match rows ``[start, start + b)``
    as stored."""
    if not isinstance(writer, SupportsReadBack) or rows.shape[1] == 0:
        return
    stored = writer.read_back(start, start + rows.shape[1]).to(torch.float64)
    recomputed = rows.detach().to(meta.torch_dtype).to(device="cpu", dtype=torch.float64)
    slack = torch.zeros(())
    if meta.quantization is not None:
        # Quantised rows are their rows plus the quantisation error (0.6 of the row for
        # signs): the same data leaves the stored rows no further from the recomputed ones
        # than quantising those puts them; a code flipped by recomputation rounding moves
        # that distance by almost nothing, other data by far more.
        requantized = dequantize(*quantize(recomputed, meta.quantization), meta.quantization,
                                 meta.k).to(torch.float64)
        slack = (recomputed - requantized).norm(dim=-1, keepdim=True)
    scale = stored.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    error = (((recomputed - stored).norm(dim=-1, keepdim=True) - slack) / scale).max().item()
    if not error <= _TOLERANCE:
        raise IncompatibleGradientsError(
            f"{current_caller()}: the data does not match the store being resumed: examples "
            f"[{start}, {start + rows.shape[1]}) give rows that differ from the stored ones "
            f"(relative difference {error:.3g}). Resume with the same data, in the same order, "
            "and the same options (mixed_precision, dtype) as the interrupted build, or delete the "
            "store (or use another path) to start over."
        )
