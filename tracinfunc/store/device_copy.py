"""Host-to-device copies through a ring of ``depth`` device buffers, over a small backend.

The schedule that :func:`~tracinfunc.query.stream.stream_rows` runs on a GPU, written once
against :class:`CopyBackend` (streams, events, buffers) so that a CPU test can drive it with a
fake backend whose copies land only when their events complete
(``tests/fake_device.py``). For piece ``i`` in ring slot ``s = i % depth``:

1. the side stream waits on ``consumed[s]``, an event recorded on the compute stream after
   the caller's work on the slot's previous piece was queued (no host wait);
2. the piece is copied into slot ``s`` on the side stream, and ``copied`` recorded there;
3. the compute stream waits on ``copied``, and the slot (a view of its first rows) is yielded;
4. the host buffer of piece ``i - 1`` goes back to its reader once that piece's copy is done.

So at most ``depth`` device buffers ever exist (they are allocated once, on the compute
stream, and reused), a slot is never overwritten before the work that reads it, and a host
buffer is never reused before the copy that reads it. The host waits only on copies, and a
copy waits on the compute of the piece ``depth`` before it: when compute is slower than
copying, the host runs at most ``depth`` pieces ahead and memory stays bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["CopyBackend", "CudaBackend", "copy_backend", "copy_through_ring"]

Piece = tuple[int, int, int]  # (ckpt, start, stop)
Rows = Tensor | tuple[Tensor, ...]  # rows, or parts with rows first (codes and scales)
HostPieces = Iterator[tuple[Piece, Rows, Callable[[], None]]]


class CopyBackend(Protocol):
    """Streams, events and device buffers: all the copy schedule needs of a device.

    Attributes:
        side: The stream copies run on.
        compute: The stream the caller computes on.
        pins_host: Whether host buffers should be page-locked (asynchronous copies need it).
    """

    side: Any
    compute: Any
    pins_host: bool

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A device buffer, allocated in the compute stream's order."""

    def copy(self, target: Tensor, source: Tensor, stream: Any) -> None:
        """Queue ``target.copy_(source)`` on ``stream`` (asynchronous)."""

    def record(self, stream: Any) -> Any:
        """An event that completes when the work queued on ``stream`` so far is done."""

    def wait(self, stream: Any, event: Any) -> None:
        """Make work queued later on ``stream`` wait for ``event`` (no host wait)."""

    def synchronize(self, event: Any) -> None:
        """Block the host until ``event`` completes."""


class CudaBackend:
    """:class:`CopyBackend` of one CUDA device: a side stream and the current stream."""

    pins_host = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device=device)
        self.compute = torch.cuda.current_stream(device)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        with torch.cuda.stream(self.compute):
            return torch.empty(shape, dtype=dtype, device=self.device)

    def copy(self, target: Tensor, source: Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            target.copy_(source, non_blocking=True)

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def synchronize(self, event: Any) -> None:
        event.synchronize()


def copy_through_ring(host: HostPieces, backend: CopyBackend, *, depth: int,
                      max_rows: int) -> Iterator[tuple[Piece, Rows]]:
    """Yield ``(piece, rows on the device)`` for each host piece, through ``depth`` buffers.

    Args:
        host: ``(piece, rows [n, ...], release)``; ``release()`` hands the host buffer back.
            ``rows`` may be a tuple of tensors with ``n`` rows each (quantised codes and
            their scales): each gets its own buffers, and the tuple is yielded.
        backend: The device's streams and events.
        depth: Device buffers in the ring (at least 1).
        max_rows: The largest ``n`` (sizes the buffers).

    Yields:
        ``(piece, rows)``: a view of a ring buffer, valid until the next one is requested.
    """
    slots: list[tuple[Tensor, ...]] = []
    consumed: list[Any] = []  # per slot: the compute-stream event after its last reader
    previous: tuple[Callable[[], None], Any] | None = None
    try:
        for index, (piece, rows, release) in enumerate(host):
            slot, parts = index % depth, rows if isinstance(rows, tuple) else (rows,)
            if slot == len(slots):
                slots.append(tuple(backend.empty((max_rows, *part.shape[1:]), part.dtype)
                                   for part in parts))
                consumed.append(backend.record(backend.compute))  # after the allocation
            targets = tuple(buffer[: part.shape[0]]
                            for buffer, part in zip(slots[slot], parts, strict=True))
            backend.wait(backend.side, consumed[slot])
            for target, part in zip(targets, parts, strict=True):
                backend.copy(target, part, backend.side)
            copied = backend.record(backend.side)
            backend.wait(backend.compute, copied)
            if previous is not None:  # queued before this copy: done or nearly
                _release(backend, previous)
            previous = (release, copied)
            yield piece, targets if isinstance(rows, tuple) else targets[0]
            consumed[slot] = backend.record(backend.compute)  # the caller's work is queued
    finally:
        if previous is not None:  # also on an early exit: no copy still reads a host buffer
            _release(backend, previous)


def _release(backend: CopyBackend, pending: tuple[Callable[[], None], Any]) -> None:
    release, copied = pending
    backend.synchronize(copied)
    release()


def copy_backend(device: torch.device) -> CopyBackend | None:
    """The asynchronous copy backend of ``device``: CUDA's, or ``None`` (plain copies)."""
    return CudaBackend(device) if device.type == "cuda" else None
