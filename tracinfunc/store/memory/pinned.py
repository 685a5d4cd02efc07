"""PinnedStore: projected gradients in page-locked host memory, for fast copies to a GPU.

Page-locked (pinned) memory can be copied to the GPU asynchronously (``non_blocking=True``) at
full PCIe/NVLink bandwidth, so ``score`` streams a PinnedStore straight from its own memory
with no staging copy. Without CUDA there is nothing to pin for: the store falls back to
ordinary memory and says so once per process.

A store's memory is pinned at its exact size (issue 23, item 12): ``torch.empty(...,
pin_memory=True)`` goes through torch's caching host allocator, which rounds every block up
to a power of two and keeps freed blocks pinned, so a 20.5 GB store pinned 32 GB and kept
them. :func:`pinned_store_empty` instead makes one ordinary allocation, page-aligned, of
the bytes needed rounded up to a whole page, and registers it with ``cudaHostRegister``;
it is unregistered and returned to the system when the last tensor viewing it is freed.
How memory is registered is a :class:`HostPinning` looked up through :func:`host_pinning`,
so a CPU test can count the bytes requested.
"""

from __future__ import annotations

import functools
import mmap
import warnings
import weakref
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from tracinfunc._validate import entry_point
from tracinfunc.errors import InvalidArgumentError, ReadOnlyStoreError
from tracinfunc.interop import as_tensor
from tracinfunc.store.codes import check_codes, code_dtype, code_width, to_stored
from tracinfunc.store.memory.dense import MemoryStore
from tracinfunc.store.memory.quantized import QuantizedMemoryStore
from tracinfunc.store.meta import StoreMeta, norm_dtype
from tracinfunc.store.protocols import check_block

__all__ = ["CudaHostPinning", "HostPinning", "PinnedStore", "PinnedWriter",
           "QuantizedPinnedStore", "host_pinning", "pinned_empty", "pinned_store_empty"]

PAGE = mmap.PAGESIZE


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


class QuantizedPinnedStore(QuantizedMemoryStore):
    """Read-only quantised gradients (codes and scales) in pinned host memory.

    Behaves exactly like :class:`~tracinfunc.store.memory.quantized.QuantizedMemoryStore`; the codes
    and scales are page-locked (:attr:`pinned` is ``False`` without CUDA).
    """

    __slots__ = ()

    def __init__(self, meta: StoreMeta, codes: Tensor, scales: Tensor, norms: Tensor) -> None:
        super().__init__(meta, codes, scales, norms)
        # The parent copied on ingest; move those private copies into pinned memory.
        object.__setattr__(self, "_codes", _pinned_copy(self._codes))
        object.__setattr__(self, "_scales", _pinned_copy(self._scales))

    @property
    def pinned(self) -> bool:
        """Whether the codes are page-locked (needs CUDA)."""
        return bool(self._codes.is_pinned())


class PinnedWriter:
    """Collects blocks of rows and returns a :class:`PinnedStore` when finished (a
    :class:`QuantizedPinnedStore` for a quantised ``meta``).

    Args:
        meta: Metadata of the store to write; ``n_train`` is filled in by :meth:`finish`.
        n_train: If known, the final number of rows: the pinned buffer is then allocated once
            and filled in place (half the peak memory of collecting blocks).
    """

    def __init__(self, meta: StoreMeta, *, n_train: int | None = None) -> None:
        self._meta = meta
        self._blocks: list[tuple[Tensor, Tensor | None, Tensor]] = []  # (stored, scales, norms)
        self._rows_written = 0
        self._finished = False
        self._rows: Tensor | None = None
        if n_train is not None:
            self._allocate(n_train)

    def _allocate(self, n_train: int) -> None:
        """The store's tensors: rows as stored (codes for quantised stores), pinned."""
        meta = self._meta
        shape = (meta.n_ckpt, n_train, code_width(meta))
        self._rows = pinned_store_empty(shape, code_dtype(meta))
        # Per-row scales of quantised rows (none for float rows).
        self._scales = pinned_store_empty((meta.n_ckpt, n_train if meta.quantization else 0),
                                          torch.float32)
        self._norms = torch.empty(meta.n_ckpt, n_train, dtype=norm_dtype(meta))

    @property
    def rows_written(self) -> int:
        return self._rows_written

    @entry_point("PinnedWriter.append")
    def append(self, rows: Tensor, norms: Tensor) -> None:
        """Add ``rows`` ``[n_ckpt, b, k]`` (any float dtype) and their ``norms`` ``[n_ckpt, b]``."""
        if self._finished:
            raise ReadOnlyStoreError("PinnedWriter.append: the store is already finished.")
        rows = as_tensor(rows)  # any __dlpack__ array
        norms = as_tensor(norms)
        check_block(self._meta, rows, norms)
        self._check_room(rows.shape[1])
        self._add(*to_stored(rows.detach(), self._meta), norms.detach())

    @entry_point("PinnedWriter.append_codes")
    def append_codes(self, codes: Tensor, scales: Tensor, norms: Tensor) -> None:
        """Add a block of a quantised store as stored (see ``MemoryWriter.append_codes``)."""
        if self._finished:
            raise ReadOnlyStoreError("PinnedWriter.append_codes: the store is already finished.")
        check_codes(self._meta, codes, scales, norms)
        self._check_room(codes.shape[1])
        self._add(codes, scales, norms)

    def _check_room(self, rows: int) -> None:
        stop = self._rows_written + rows
        if self._rows is not None and stop > self._rows.shape[1]:
            raise InvalidArgumentError(
                f"PinnedWriter.append: got rows up to {stop} but n_train={self._rows.shape[1]}"
                " was announced; pass the right n_train or none."
            )

    def _add(self, stored: Tensor, scales: Tensor | None, norms: Tensor) -> None:
        if self._rows is not None:  # straight into the pinned buffers, cast as copied
            self._store(self._rows_written, stored, scales, norms)
        else:  # collect copies: a block the caller changes later must not change the store
            scales = None if scales is None else scales.to("cpu", torch.float32, copy=True)
            self._blocks.append((stored.to("cpu", code_dtype(self._meta), copy=True), scales,
                                 norms.to("cpu", norm_dtype(self._meta), copy=True)))
        self._rows_written += stored.shape[1]

    def _store(self, start: int, stored: Tensor, scales: Tensor | None, norms: Tensor) -> None:
        stop = start + stored.shape[1]
        self._rows[:, start:stop] = stored
        self._norms[:, start:stop] = norms
        if scales is not None:
            self._scales[:, start:stop] = scales

    def finish(self) -> PinnedStore | QuantizedPinnedStore:
        """Seal the store; the writer cannot be used afterwards."""
        if self._finished:
            raise ReadOnlyStoreError("PinnedWriter.finish: the store is already finished.")
        self._finished = True
        meta = self._meta.replace(n_train=self._rows_written, complete=True)
        if self._rows is None:
            self._allocate(meta.n_train)
            start = 0
            while self._blocks:  # pop as we go: peak memory is the store plus one block
                stored, scales, norms = self._blocks.pop(0)
                self._store(start, stored, scales, norms)
                start += stored.shape[1]
        n = meta.n_train
        rows, scales, norms = self._rows[:, :n], self._scales[:, :n], self._norms[:, :n]
        self._rows = self._scales = self._norms = None
        if meta.quantization is None:
            return PinnedStore._from_owned(meta, rows, norms)
        return QuantizedPinnedStore._from_owned(meta, rows, scales, norms)


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """``torch.empty`` in page-locked memory when CUDA is available, else ordinary memory.

    Through torch's caching host allocator (sizes rounded up to powers of two, blocks kept
    for reuse): for small buffers that are reused, such as the streaming ring's. A store's
    memory is allocated with :func:`pinned_store_empty`.
    """
    if torch.cuda.is_available():
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    _warn_not_pinned()
    return torch.empty(shape, dtype=dtype)


class HostPinning(Protocol):
    """How host memory is page-locked: registered in place, and unregistered before it is
    freed."""

    def register(self, address: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` bytes at ``address`` (page-aligned, a whole number of pages)."""

    def unregister(self, address: int) -> None:
        """Undo :meth:`register` of the block at ``address``."""


class CudaHostPinning:
    """:class:`HostPinning` through ``cudaHostRegister`` (portable: pinned for every GPU)."""

    PORTABLE = 1  # cudaHostRegisterPortable

    def register(self, address: int, nbytes: int) -> None:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(address, nbytes,
                                                                     self.PORTABLE))

    def unregister(self, address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)  # nothing to do if it fails


def host_pinning() -> HostPinning | None:
    """The pinning of this process: CUDA's when available, else ``None`` (nothing to pin
    for). Looked up through the module, so a test can count what is registered."""
    return CudaHostPinning() if torch.cuda.is_available() else None


def pinned_store_empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An uninitialised tensor ``shape`` of ``dtype`` in page-locked memory of its own size.

    The bytes pinned are ``prod(shape) * itemsize`` rounded up to a whole page, never to a
    power of two (see the module docstring); ordinary memory without CUDA (with a warning,
    once per process) and for an empty tensor.
    """
    pinning = host_pinning()
    nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    if pinning is None:
        _warn_not_pinned()
        return torch.empty(shape, dtype=dtype)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    size = -(-nbytes // PAGE) * PAGE
    block = np.empty(size + PAGE, dtype=np.uint8)  # ordinary memory, exactly this size
    offset = -block.ctypes.data % PAGE
    region = block[offset : offset + size]  # page-aligned: no page shared with other memory
    address = region.ctypes.data
    try:
        pinning.register(address, size)
    except Exception as error:  # e.g. a driver that cannot register this much: still pinned
        _warn_not_registered(f"{type(error).__name__}: {error}")
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    # Called as the block is freed (when the last tensor viewing it is), before its memory
    # goes back to the system; not at interpreter exit, when CUDA may be gone.
    weakref.finalize(block, pinning.unregister, address).atexit = False
    return torch.from_numpy(region)[:nbytes].view(dtype).view(shape)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _pinned_copy(tensor: Tensor) -> Tensor:
    if tensor.is_pinned():
        return tensor
    if host_pinning() is None:
        _warn_not_pinned()
        return tensor
    pinned = pinned_store_empty(tuple(tensor.shape), tensor.dtype)
    return pinned.copy_(tensor)


@functools.cache
def _warn_not_pinned() -> None:
    # functools.cache makes this say it once per process, not once per store.
    warnings.warn(
        "PinnedStore: CUDA is not available, so rows are kept in ordinary (pageable) memory; "
        "pinning only speeds up copies to a GPU.",
        RuntimeWarning,
        stacklevel=3,
    )


def _warn_not_registered(reason: str) -> None:
    warnings.warn(
        f"PinnedStore: registering the store's memory with cudaHostRegister failed ({reason}); "
        "it is pinned through torch's caching host allocator instead, which rounds the size "
        "up to a power of two.",
        RuntimeWarning,
        stacklevel=3,
    )
