"""PinnedStore: projected gradients in page-locked host memory, for fast copies to a GPU.

Page-locked (pinned) memory can be copied to the GPU asynchronously (``non_blocking=True``) at
full PCIe/NVLink bandwidth, so ``score`` streams a PinnedStore straight from its own memory
with no staging copy. Without CUDA there is nothing to pin for: the store falls back to
ordinary memory and says so once per process.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from tracinfunc.errors import InvalidArgumentError, ReadOnlyStoreError
from tracinfunc.interop import as_tensor
from tracinfunc.store.memory import MemoryStore, check_block, norm_dtype
from tracinfunc.store.meta import StoreMeta

__all__ = ["PinnedStore", "PinnedWriter", "pinned_empty"]


class PinnedStore(MemoryStore):
    """Read-only gradients in pinned host memory: rows ``[n_ckpt, n_train, k]``.

    Behaves exactly like :class:`~tracinfunc.store.MemoryStore` (same protocol, same copies
    handed out); only where the rows live differs. :attr:`pinned` says whether they really are
    page-locked (``False`` on a machine without CUDA).
    """

    __slots__ = ()

    def __init__(self, meta: StoreMeta, rows: Tensor, norms: Tensor) -> None:
        super().__init__(meta, rows, norms)
        # The parent copied on ingest; move that private copy into pinned memory.
        object.__setattr__(self, "_rows", _pinned_copy(self._rows))

    @property
    def pinned(self) -> bool:
        """Whether the rows are page-locked (needs CUDA)."""
        return bool(self._rows.is_pinned())


class PinnedWriter:
    """Collects blocks of rows and returns a :class:`PinnedStore` when finished.

    Args:
        meta: Metadata of the store to write; ``n_train`` is filled in by :meth:`finish`.
        n_train: If known, the final number of rows: the pinned buffer is then allocated once
            and filled in place (half the peak memory of collecting blocks).
    """

    def __init__(self, meta: StoreMeta, *, n_train: int | None = None) -> None:
        self._meta = meta
        self._blocks: list[tuple[Tensor, Tensor]] = []
        self._rows_written = 0
        self._finished = False
        self._rows: Tensor | None = None
        self._norms: Tensor | None = None
        if n_train is not None:
            self._rows = pinned_empty((meta.n_ckpt, n_train, meta.k), meta.torch_dtype)
            self._norms = torch.empty(meta.n_ckpt, n_train, dtype=norm_dtype(meta))

    @property
    def rows_written(self) -> int:
        return self._rows_written

    def append(self, rows: Tensor, norms: Tensor) -> None:
        """Add ``rows`` ``[n_ckpt, b, k]`` (any float dtype) and their ``norms`` ``[n_ckpt, b]``."""
        if self._finished:
            raise ReadOnlyStoreError("PinnedWriter.append: the store is already finished.")
        rows = as_tensor(rows, caller="PinnedWriter.append")  # any __dlpack__ array
        norms = as_tensor(norms, caller="PinnedWriter.append")
        check_block(self._meta, rows, norms, caller="PinnedWriter.append")
        start, stop = self._rows_written, self._rows_written + rows.shape[1]
        if self._rows is not None:
            if stop > self._rows.shape[1]:
                raise InvalidArgumentError(
                    f"PinnedWriter.append: got rows up to {stop} but n_train={self._rows.shape[1]}"
                    " was announced; pass the right n_train or none."
                )
            self._rows[:, start:stop].copy_(rows.detach())
            self._norms[:, start:stop].copy_(norms.detach())
        else:
            self._blocks.append((rows.detach().to("cpu", self._meta.torch_dtype, copy=True),
                                 norms.detach().to("cpu", norm_dtype(self._meta), copy=True)))
        self._rows_written = stop

    def finish(self) -> PinnedStore:
        """Seal the store; the writer cannot be used afterwards."""
        if self._finished:
            raise ReadOnlyStoreError("PinnedWriter.finish: the store is already finished.")
        self._finished = True
        meta = self._meta.replace(n_train=self._rows_written, complete=True)
        if self._rows is None:
            self._rows = pinned_empty((meta.n_ckpt, meta.n_train, meta.k), meta.torch_dtype)
            self._norms = torch.empty(meta.n_ckpt, meta.n_train, dtype=norm_dtype(meta))
            start = 0
            while self._blocks:  # pop as we go: peak memory is the store plus one block
                rows, norms = self._blocks.pop(0)
                self._rows[:, start : start + rows.shape[1]] = rows
                self._norms[:, start : start + rows.shape[1]] = norms
                start += rows.shape[1]
        rows, norms = self._rows[:, : meta.n_train], self._norms[:, : meta.n_train]
        self._rows = self._norms = None
        store = object.__new__(PinnedStore)
        store._adopt(meta, rows, norms)
        return store


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """``torch.empty`` in page-locked memory when CUDA is available, else ordinary memory."""
    if torch.cuda.is_available():
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    _warn_not_pinned()
    return torch.empty(shape, dtype=dtype)


def _pinned_copy(tensor: Tensor) -> Tensor:
    if tensor.is_pinned():
        return tensor
    if torch.cuda.is_available():
        return tensor.pin_memory()
    _warn_not_pinned()
    return tensor


@functools.cache
def _warn_not_pinned() -> None:
    # functools.cache makes this say it once per process, not once per store.
    warnings.warn(
        "PinnedStore: CUDA is not available, so rows are kept in ordinary (pageable) memory; "
        "pinning only speeds up copies to a GPU.",
        RuntimeWarning,
        stacklevel=3,
    )
