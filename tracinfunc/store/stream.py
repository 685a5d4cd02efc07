"""Stream row pieces of a store to a device: background reads, reusable buffers, async copies.

``stream_rows`` is what ``score`` iterates. For each piece ``(ckpt, start, stop)`` it yields
the rows on the target device, in the storage dtype:

* In-memory stores on the CPU: a view of the store's own memory (no copy at all).
* Any other store: a background thread reads piece i+1 (``read_rows(out=buffer)``) while the
  caller multiplies piece i, into a small ring of preallocated buffers (page-locked when the
  target is a GPU) that are reused for the whole pass.
* On CUDA: each host piece (a ring buffer, or a PinnedStore's own pinned memory) is copied
  with ``non_blocking=True`` on a side stream into a ring of ``depth`` device buffers, each
  reused only after the compute that read it (:mod:`tracinfunc.store.device_copy`); a host
  buffer goes back to the reader only once its copy has finished.
* On any other device (mps, xpu, ...): a plain ``.to(device)`` per piece.

A yielded tensor is valid until the next one is requested.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from tracinfunc.store.codes import dequantize
from tracinfunc.store.device_copy import CopyBackend, CudaBackend, copy_through_ring
from tracinfunc.store.memory.pinned import pinned_empty
from tracinfunc.store.memory.quantized import QuantizedMemoryStore
from tracinfunc.store.protocols import GradientStore, SupportsRowViews

__all__ = ["ComputeThreads", "Piece", "compute_threads", "stream_rows"]

Piece = tuple[int, int, int]  # (ckpt, start, stop)
_HostPieces = Iterator[tuple[Piece, Tensor, Callable[[], None]]]
_DONE = object()


def stream_rows(store: GradientStore, pieces: Sequence[Piece], *, device: torch.device,
                max_rows: int, depth: int | None = None) -> Iterator[tuple[Piece, Tensor]]:
    """Yield ``(piece, rows [stop - start, k])`` for every piece, rows on ``device``.

    Args:
        store: Any GradientStore.
        pieces: What to read, in order.
        device: Where the rows are needed: the CPU, CUDA (asynchronous copies through a ring
            of device buffers, :mod:`tracinfunc.store.device_copy`) or any other device
            (mps, xpu, ...: a plain copy per piece).
        max_rows: The largest ``stop - start`` among ``pieces`` (sizes the buffers).
        depth: Buffers in each ring. Default: 2 on the CPU (one read while one is
            multiplied), 3 with asynchronous copies (one more is in flight to the device).
    """
    backend = copy_backend(device)
    depth = depth or (2 if backend is None else 3)
    if backend is not None and isinstance(store, QuantizedMemoryStore):
        yield from _dequantized_on_device(store, pieces, backend, depth=depth,
                                          max_rows=max_rows)
        return
    pin = backend is not None and backend.pins_host
    if isinstance(store, SupportsRowViews) and (not pin or _is_pinned(store.view_rows(0, 0, 0))):
        host = _views(store.view_rows, pieces)
    else:
        host = _prefetch(store, pieces, max_rows=max_rows, pin=pin, depth=depth)
    try:
        if backend is not None:
            yield from copy_through_ring(host, backend, depth=depth, max_rows=max_rows)
            return
        for piece, rows, release in host:
            yield piece, rows.to(device)  # the CPU: the rows themselves
            release()
    finally:
        host.close()  # an early exit stops the reader thread now, not at garbage collection


def _dequantized_on_device(store: QuantizedMemoryStore, pieces: Sequence[Piece],
                           backend: CopyBackend, *, depth: int, max_rows: int
                           ) -> Iterator[tuple[Piece, Tensor]]:
    """Send an in-memory quantised store's codes and scales (1/4 or 1/32 of the float32
    bytes) and dequantise on the device, into float32 rows allocated in the compute
    stream's order. (A quantised Zarr store is still read and dequantised by the background
    reader, which overlaps its disk reads with compute.)"""
    meta = store.meta
    host = ((piece, store.read_codes(*piece), _nothing) for piece in pieces)
    for piece, (codes, scales) in copy_through_ring(host, backend, depth=depth,
                                                    max_rows=max_rows):
        yield piece, dequantize(codes, scales, meta.quantization, meta.k)


def copy_backend(device: torch.device) -> CopyBackend | None:
    """The asynchronous copy backend of ``device``: CUDA's, or ``None`` (plain copies)."""
    return CudaBackend(device) if device.type == "cuda" else None


def _is_pinned(tensor: Tensor) -> bool:
    return torch.cuda.is_available() and tensor.is_pinned()


def _views(view: Callable[[int, int, int], Tensor], pieces: Sequence[Piece]) -> _HostPieces:
    for piece in pieces:
        yield piece, view(*piece), _nothing


def _nothing() -> None:
    return None


def _prefetch(store: GradientStore, pieces: Sequence[Piece], *, max_rows: int, pin: bool,
              depth: int) -> _HostPieces:
    """Read pieces on a background thread into ``depth`` reusable buffers."""
    meta = store.meta
    shape = (max_rows, meta.k)
    buffers = [pinned_empty(shape, meta.torch_dtype) if pin else
               torch.empty(shape, dtype=meta.torch_dtype) for _ in range(depth)]
    free: queue.Queue[int] = queue.Queue()
    ready: queue.Queue[object] = queue.Queue()
    stop = threading.Event()
    for index in range(depth):
        free.put(index)

    def read_all() -> None:
        try:
            for piece in pieces:
                index = free.get()
                if stop.is_set():
                    return
                ready.put((piece, store.read_rows(*piece, out=buffers[index]), index))
            ready.put(_DONE)
        except BaseException as error:  # handed to the consumer, raised there
            ready.put(error)

    thread = threading.Thread(target=read_all, name="tracinfunc-prefetch", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            piece, rows, index = item
            yield piece, rows, lambda index=index: free.put(index)
    finally:
        stop.set()
        free.put(-1)  # wake the reader if it waits for a buffer
        thread.join()


class ComputeThreads:
    """Run CPU compute on one thread fewer than torch's default while a reader thread runs.

    torch's OpenMP team uses every core; the background reader then preempts one of its
    threads and the whole team waits at each barrier (measured 3x slower on 2 cores). The
    setting is process-wide, so it is applied around each piece's compute only.
    """

    def __init__(self, threads: int | None) -> None:
        self._threads = threads
        self._saved = 0

    def __enter__(self) -> None:
        if self._threads is not None:
            self._saved = torch.get_num_threads()
            torch.set_num_threads(self._threads)

    def __exit__(self, *exc_info: object) -> None:
        if self._threads is not None:
            torch.set_num_threads(self._saved)


def compute_threads(store: GradientStore, device: torch.device) -> ComputeThreads:
    """The thread policy for compute over ``stream_rows(store, ...)`` on ``device``."""
    streamed = device.type == "cpu" and not isinstance(store, SupportsRowViews)
    threads = torch.get_num_threads()
    return ComputeThreads(max(1, threads - 1) if streamed and threads > 1 else None)
