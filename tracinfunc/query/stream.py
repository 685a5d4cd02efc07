"""Stream row pieces of a store to a device: background reads, reusable buffers, async copies.

``stream_rows`` is what ``score`` iterates. For each piece ``(ckpt, start, stop)`` it yields
the rows on the target device, in the storage dtype:

* In-memory stores on the CPU: a view of the store's own memory (no copy at all).
* Stores that lend mapped chunks (a ZarrStore of local, uncompressed files), on the CPU,
  when every piece is one stored chunk: a view of the mapped file (no copy, no thread);
  each piece's ``release`` checks the file did not change while it was multiplied.
* Any other store: a background thread reads piece i+1 (``read_rows(out=buffer)``) while the
  caller multiplies piece i, into a small ring of preallocated buffers (page-locked when the
  target is a GPU) that are reused for the whole pass.
* On CUDA: each host piece (a ring buffer, or a PinnedStore's own pinned memory) is copied
  with ``non_blocking=True`` on a side stream into a ring of ``depth`` device buffers, each
  reused only after the compute that read it (:mod:`tracinfunc.store.device_copy`); a host
  buffer goes back to the reader only once its copy has finished.
* On any other device (mps, xpu, ...): a plain ``.to(device)`` per piece.
* Quantised stores, to any device but the CPU: their codes and scales travel (views of an
  in-memory store's own memory, pinned for a QuantizedPinnedStore; read by the background
  thread from Zarr) and are dequantised on the device.

A yielded tensor is valid until the next one is requested.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from tracinfunc.store.codes import code_dtype, code_width, dequantize
from tracinfunc.store.device_copy import CopyBackend, Rows, copy_backend, copy_through_ring
from tracinfunc.store.memory.pinned import pinned_empty
from tracinfunc.store.protocols import (
    GradientStore,
    SupportsCodeViews,
    SupportsMappedRows,
    SupportsQuantizedRows,
    SupportsRowViews,
)

__all__ = ["ComputeThreads", "Piece", "compute_threads", "stream_rows"]

Piece = tuple[int, int, int]  # (ckpt, start, stop)
_HostPieces = Iterator[tuple[Piece, Rows, Callable[[], None]]]
_DONE = object()


def stream_rows(store: GradientStore, pieces: Sequence[Piece], *, device: torch.device,
                max_rows: int, depth: int | None = None) -> Iterator[tuple[Piece, Tensor]]:
    """Yield ``(piece, rows [stop - start, k])`` for every piece, rows on ``device``.

    Args:
        store: Any GradientStore.
        pieces: What to read, in order.
        device: Where the rows are needed: the CPU, CUDA (asynchronous copies through a ring
            of device buffers, :mod:`tracinfunc.store.device_copy`) or any other device
            (mps, xpu, ...: a plain copy per piece). A quantised store's codes and scales
            travel to an accelerator (1/4 or 1/32 of the float32 bytes) and are dequantised
            there.
        max_rows: The largest ``stop - start`` among ``pieces`` (sizes the buffers).
        depth: Buffers in each ring. Default: 2 on the CPU (one read while one is
            multiplied), 3 with asynchronous copies (one more is in flight to the device).
    """
    backend = copy_backend(device)
    depth = depth or (2 if backend is None else 3)
    if (backend is not None or device.type != "cpu") and _sends_codes(store):
        yield from _dequantized_on_device(store, pieces, device, backend, depth=depth,
                                          max_rows=max_rows)
        return
    pin = backend is not None and backend.pins_host
    if isinstance(store, SupportsRowViews) and (not pin or _is_pinned(store.view_rows(0, 0, 0))):
        host = _views(store.view_rows, pieces)
    elif device.type == "cpu" and lends_chunks(store, pieces):
        host = _mapped(store, pieces, max_rows=max_rows)
    else:
        meta = store.meta
        buffers = _buffers([((max_rows, meta.k), meta.torch_dtype)], pin=pin, depth=depth)
        host = _prefetch(lambda piece, index: store.read_rows(*piece, out=buffers[index][0]),
                         pieces, depth=depth)
    try:
        if backend is not None:
            yield from copy_through_ring(host, backend, depth=depth, max_rows=max_rows)
            return
        for piece, rows, release in host:
            yield piece, rows.to(device)  # the CPU: the rows themselves
            release()
    finally:
        host.close()  # an early exit stops the reader thread now, not at garbage collection


def _sends_codes(store: GradientStore) -> bool:
    return store.meta.quantization is not None and isinstance(store, SupportsQuantizedRows)


def _dequantized_on_device(store: GradientStore, pieces: Sequence[Piece], device: torch.device,
                           backend: CopyBackend | None, *, depth: int, max_rows: int
                           ) -> Iterator[tuple[Piece, Tensor]]:
    """Send a quantised store's codes and scales (1/4 or 1/32 of the float32 bytes) and
    dequantise on the device, into float32 rows allocated in the compute stream's order.

    In-memory stores lend views of their codes (a QuantizedPinnedStore's are pinned: sent
    straight from its memory); others (Zarr) are read on a background thread into a ring
    of ``depth`` host buffers, page-locked for asynchronous copies.
    """
    meta = store.meta
    pin = backend is not None and backend.pins_host
    if isinstance(store, SupportsCodeViews) and (not pin or
                                                 _is_pinned(store.view_codes(0, 0, 0)[0])):
        host = _views(store.view_codes, pieces)
    elif pin:  # read on a background thread into page-locked buffers, reused
        shapes = [((max_rows, code_width(meta)), code_dtype(meta)), ((max_rows,), torch.float32)]
        buffers = _buffers(shapes, pin=True, depth=depth)

        def read(piece: Piece, index: int) -> tuple[Tensor, Tensor]:
            codes, scales = store.read_codes(*piece)
            targets = buffers[index]
            n = codes.shape[0]
            return targets[0][:n].copy_(codes), targets[1][:n].copy_(scales)

        host = _prefetch(read, pieces, depth=depth)
    else:  # fresh tensors per piece: nothing to reuse
        host = _prefetch(lambda piece, index: store.read_codes(*piece), pieces, depth=depth)
    try:
        if backend is not None:
            sent = copy_through_ring(host, backend, depth=depth, max_rows=max_rows)
            for piece, (codes, scales) in sent:
                yield piece, dequantize(codes, scales, meta.quantization, meta.k)
            return
        for piece, (codes, scales), release in host:  # mps, xpu, ...: plain copies
            codes, scales = codes.to(device), scales.to(device)
            release()
            yield piece, dequantize(codes, scales, meta.quantization, meta.k)
    finally:
        host.close()


def _is_pinned(tensor: Tensor) -> bool:
    return torch.cuda.is_available() and tensor.is_pinned()


def _views(view: Callable[[int, int, int], Rows], pieces: Sequence[Piece]) -> _HostPieces:
    for piece in pieces:
        yield piece, view(*piece), _nothing


def _nothing() -> None:
    return None


def lends_chunks(store: GradientStore, pieces: Sequence[Piece]) -> bool:
    """Whether ``store`` lends mapped chunks and every piece is one whole stored chunk."""
    if not isinstance(store, SupportsMappedRows):
        return False
    rows, n_train = store.mapped_chunk_rows, store.meta.n_train
    return bool(rows) and all(start % rows == 0 and stop == min(start + rows, n_train)
                              for _, start, stop in pieces)


def _mapped(store: SupportsMappedRows, pieces: Sequence[Piece], *, max_rows: int
            ) -> _HostPieces:
    """Mapped views of each piece, lent through one pass (:meth:`lend_rows`: windows of the
    shard files shared by their chunks); pieces the store cannot lend (its file system
    cannot map files) are read into one buffer instead."""
    buffer = None
    lent_pieces = store.lend_rows(pieces)
    try:
        for piece in pieces:
            lent = next(lent_pieces)
            if lent is not None:
                yield piece, *lent
                continue
            if buffer is None:
                buffer = torch.empty(max_rows, store.meta.k, dtype=store.meta.torch_dtype)
            yield piece, store.read_rows(*piece, out=buffer), _nothing
    finally:
        lent_pieces.close()  # its files, now: not at garbage collection


def _buffers(shapes: Sequence[tuple[tuple[int, ...], torch.dtype]], *, pin: bool,
             depth: int) -> list[tuple[Tensor, ...]]:
    """``depth`` sets of host buffers, one per ``(shape, dtype)``; page-locked if ``pin``."""
    empty = pinned_empty if pin else (lambda shape, dtype: torch.empty(shape, dtype=dtype))
    return [tuple(empty(shape, dtype) for shape, dtype in shapes) for _ in range(depth)]


def _prefetch(read: Callable[[Piece, int], Rows], pieces: Sequence[Piece], *,
              depth: int) -> _HostPieces:
    """Read pieces on a background thread, ``read(piece, index)`` filling buffer set
    ``index`` of ``depth``; each is reused once the consumer releases it."""
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
                ready.put((piece, read(piece, index), index))
            ready.put(_DONE)
        except BaseException as error:  # handed to the consumer, raised there
            ready.put(error)

    thread = threading.Thread(target=contextvars.copy_context().run, args=(read_all,),
                              name="tracinfunc-prefetch", daemon=True)
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


def compute_threads(store: GradientStore, device: torch.device,
                    pieces: Sequence[Piece]) -> ComputeThreads:
    """The thread policy for compute over ``stream_rows(store, pieces, ...)`` on ``device``."""
    streamed = device.type == "cpu" and not isinstance(store, SupportsRowViews) and \
        not lends_chunks(store, pieces)
    threads = torch.get_num_threads()
    return ComputeThreads(max(1, threads - 1) if streamed and threads > 1 else None)
