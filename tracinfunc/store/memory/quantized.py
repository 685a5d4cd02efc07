"""QuantizedMemoryStore: int8 or sign codes with per-row scales, in ordinary (CPU) memory.

Its own class, not a MemoryStore: a MemoryStore lends views of its rows
(:class:`~tracinfunc.store.protocols.SupportsRowViews`), and views of codes are not rows. Rows are
dequantised into float32 as they are read (:mod:`tracinfunc.store.codes`); the codes themselves
are offered through :class:`~tracinfunc.store.protocols.SupportsQuantizedRows`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tracinfunc._validate import entry_point
from tracinfunc.errors import InvalidArgumentError, ReadOnlyStoreError
from tracinfunc.store.codes import code_dtype, code_width, dequantize
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.properties import StoreProperties
from tracinfunc.store.protocols import check_out_buffer, check_row_range

__all__ = ["QuantizedMemoryStore"]


class QuantizedMemoryStore(StoreProperties):
    """Read-only quantised gradients in CPU memory.

    Holds codes ``[n_ckpt, n_train, width]`` (int8 ``width = k``, or uint8 packed signs
    ``width = ceil(k / 8)``), scales ``[n_ckpt, n_train]`` float32 and the exact row norms
    ``[n_ckpt, n_train]`` float32. Built by ``build_store(..., dtype="int8" | "sign")`` or a
    conversion (``tif.to_memory(store, dtype="int8")``).

    Args:
        meta: Metadata with ``quantization`` set.
        codes: ``[n_ckpt, n_train, width]`` int8 or uint8, as above; copied on ingest.
        scales: ``[n_ckpt, n_train]`` float32; copied on ingest.
        norms: ``[n_ckpt, n_train]`` float32, of the rows before quantisation; copied.

    Raises:
        InvalidArgumentError: a shape or dtype does not match ``meta``.
    """

    __slots__ = ("_codes", "_meta", "_norms", "_scales")

    def __init__(self, meta: StoreMeta, codes: Tensor, scales: Tensor, norms: Tensor) -> None:
        rows = (meta.n_ckpt, meta.n_train)
        expected = [("codes", codes, (*rows, code_width(meta)), code_dtype(meta)),
                    ("scales", scales, rows, torch.float32), ("norms", norms, rows, torch.float32)]
        for name, tensor, shape, dtype in expected:
            if meta.quantization is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise InvalidArgumentError(
                    f"QuantizedMemoryStore: {name} must be {list(shape)} {dtype} for "
                    f"quantization={meta.quantization!r}, got {list(tensor.shape)} "
                    f"{tensor.dtype}; quantise rows with tracinfunc.store.codes.quantize (or "
                    "build the store with build_store(..., dtype='int8'))."
                )
        # Copy on ingest: the caller's tensors may be changed later; ours never are.
        self._adopt(meta, *(t.detach().to("cpu", copy=True) for t in (codes, scales, norms)))

    @classmethod
    def _from_owned(cls, meta: StoreMeta, codes: Tensor, scales: Tensor,
                    norms: Tensor) -> QuantizedMemoryStore:
        """Wrap tensors nobody else references (a writer's), skipping the defensive copy."""
        store = object.__new__(cls)
        store._adopt(meta, codes, scales, norms)
        return store

    def _adopt(self, meta: StoreMeta, codes: Tensor, scales: Tensor, norms: Tensor) -> None:
        object.__setattr__(self, "_meta", meta.replace(complete=True))
        object.__setattr__(self, "_codes", codes)
        object.__setattr__(self, "_scales", scales)
        object.__setattr__(self, "_norms", norms)

    def __setattr__(self, name: str, value: object) -> None:
        raise ReadOnlyStoreError(
            f"{type(self).__name__} is read-only: cannot set {name!r}. Build a new store "
            "instead."
        )

    @property
    def meta(self) -> StoreMeta:
        return self._meta

    @entry_point("{cls}.read_rows")
    def read_rows(self, ckpt: int, start: int, stop: int, *, out: Tensor | None = None) -> Tensor:
        """Rows ``[start, stop)`` dequantised: ``[stop - start, k]`` float32 (see the protocol)."""
        ckpt, start, stop = check_row_range(self._meta, ckpt, start, stop)
        target = None if out is None else check_out_buffer(
            out, stop - start, self._meta)
        return dequantize(self._codes[ckpt, start:stop], self._scales[ckpt, start:stop],
                          self._meta.quantization, self._meta.k, out=target)

    @entry_point("{cls}.read_norms")
    def read_norms(self, ckpt: int, start: int, stop: int) -> Tensor:
        """Exact L2 norms of the unquantised rows ``[start, stop)``: ``[stop - start]``."""
        ckpt, start, stop = check_row_range(self._meta, ckpt, start, stop)
        return self._norms[ckpt, start:stop].clone()

    @entry_point("{cls}.read_codes")
    def read_codes(self, ckpt: int, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Stored codes ``[stop - start, width]`` and scales ``[stop - start]`` (copies)."""
        ckpt, start, stop = check_row_range(self._meta, ckpt, start, stop)
        return self._codes[ckpt, start:stop].clone(), self._scales[ckpt, start:stop].clone()

    @entry_point("{cls}.view_codes")
    def view_codes(self, ckpt: int, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Codes ``[stop - start, width]`` and scales ``[stop - start]`` as views of the
        store's memory (page-locked for a QuantizedPinnedStore): what streaming sends to a
        device without a staging copy; never write to them."""
        ckpt, start, stop = check_row_range(self._meta, ckpt, start, stop)
        return self._codes[ckpt, start:stop], self._scales[ckpt, start:stop]
