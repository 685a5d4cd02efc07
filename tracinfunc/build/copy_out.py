"""Overlap a GPU build's copy-out and write of batch i with the compute of batch i+1.

Serially, each batch's rows are checked (a host sync), copied to the host (a blocking copy)
and written (disk, or a copy into the store) on the thread that computes the next batch, so
the GPU idles during I/O (issue 23, item 14). :class:`CopyOut` instead, for each batch
after the first (which the loop writes serially, so that a writer's own refusals read as
they always did):

1. on the compute stream, queues what the writer needs: the rows in their stored form
   (cast to the storage dtype, or quantised to codes and scales as the serial path does on
   the device), their norms and a per-row "finite" flag;
2. takes a free slot of ``depth`` (waiting for the writer thread to release one: at most
   ``depth`` batches are ever in flight), whose host buffers (page-locked) are reused;
3. makes the side stream wait on an event recorded after step 1, copies every part into the
   slot's host buffers on the side stream (``non_blocking``) and records ``copied`` there;
4. hands ``(slot, copied, device parts)`` to the writer thread, and returns at once.

The writer thread, in order: waits on ``copied`` (host sync, off the compute thread), drops
its references to the device parts (freed only once copied), raises
:class:`~tracinfunc.errors.NonFiniteGradientError` if a flag is down (the message of the
serial path), appends to the writer, and releases the slot. A writer error is raised on the
compute thread at its next hand-off or at :meth:`CopyOut.close`; nothing is appended after
it. On an early exit (an exception in the compute, ``KeyboardInterrupt``)
:meth:`CopyOut.drain` writes every batch already handed off before the exception goes on:
``writer.rows_written`` then counts every row computed and checked, so a Zarr build resumes
from there.

Written over :class:`~tracinfunc.store.device_copy.CopyBackend`, so a CPU test drives it
with a fake stream/event backend (``tests/fake_device.py``).
"""

from __future__ import annotations

import contextvars
import queue
import threading

import torch
from torch import Tensor

from tracinfunc._norms import row_norms
from tracinfunc._validate import current_caller
from tracinfunc.errors import NonFiniteGradientError
from tracinfunc.store.codes import check_peaks, overflow_limit, row_peaks, to_stored
from tracinfunc.store.device_copy import CopyBackend, copy_backend
from tracinfunc.store.memory.dense import MemoryWriter
from tracinfunc.store.memory.pinned import PinnedWriter, pinned_empty
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import StoreWriter
from tracinfunc.store.zarr.parts import PartWriter
from tracinfunc.store.zarr.writer import ZarrWriter

__all__ = ["CopyOut", "check_finite_flags", "check_norms", "copy_out_for"]

# Writers that copy what they are given before append returns (so host buffers can be
# reused) and that append codes as stored (append_codes) where the store is quantised.
_COPYING = (MemoryWriter, PinnedWriter, ZarrWriter, PartWriter)
_CODES = (MemoryWriter, PinnedWriter, ZarrWriter)
_DONE = object()


def copy_out_for(writer: StoreWriter, meta: StoreMeta, rows: Tensor, *,
                 first_row: int, depth: int = 2) -> CopyOut | None:
    """The pipeline for the rest of a build whose first rows came out like ``rows`` (and
    were written serially: a writer's own refusals, such as a finished Zarr store given more
    data, surface as they are), or ``None`` (serial): rows on the CPU (nothing to copy
    out), or a writer this module does not know (it may keep the tensors it is given, or
    lack ``append_codes``).

    The backend is looked up through the module (``copy_backend``), so a test can fake it.
    """
    backend = copy_backend(rows.device)
    if backend is None or not isinstance(writer, _CODES if meta.quantization else _COPYING):
        return None
    return CopyOut(writer, meta, backend, first_row=first_row, depth=depth)


class CopyOut:
    """The copy-out pipeline of one build (see the module docstring).

    Args:
        writer: Where rows go (one of the known writers).
        meta: The store's metadata (storage dtype, quantisation, checkpoint names).
        backend: The device's streams and events.
        first_row: The store row of the first row handed off (``writer.rows_written``).
        depth: Batches in flight at most (at least 1): 2 lets batch i be copied and written
            while batch i+1 is computed.
    """

    def __init__(self, writer: StoreWriter, meta: StoreMeta, backend: CopyBackend, *,
                 first_row: int, depth: int = 2) -> None:
        self.writer, self.meta, self.backend, self.depth = writer, meta, backend, max(1, depth)
        self.next_row = first_row
        self._hosts: list[list[Tensor]] = [[] for _ in range(self.depth)]  # flat, per part
        self._free: queue.Queue[int] = queue.Queue()
        for index in range(self.depth):
            self._free.put(index)
        self._ready: queue.Queue[object] = queue.Queue()
        self._error: BaseException | None = None  # the writer's, until raised here
        self._failed = False  # set for good at the writer's first error: nothing written after
        self._thread = threading.Thread(target=contextvars.copy_context().run,
                                        args=(self._write_all,), name="tracinfunc-writer",
                                        daemon=True)
        self._thread.start()

    def put(self, rows: Tensor) -> None:
        """Queue ``rows`` ``[n_ckpt, b, k]`` (on the device, just computed) for checking and
        writing; returns once their copy is queued. Raises an earlier writer error."""
        self._raise_error()
        parts = self._device_parts(rows)  # on the compute stream
        index = self._take_slot()
        try:
            hosts = self._host_views(index, parts)
            backend = self.backend
            backend.wait(backend.side, backend.record(backend.compute))
            for host, part in zip(hosts, parts, strict=True):
                backend.copy(host, part, backend.side)
            copied = backend.record(backend.side)
        except BaseException:
            self._free.put(index)
            raise
        self._ready.put((index, copied, parts, hosts, self.next_row))
        self.next_row += rows.shape[1]

    def close(self) -> None:
        """Wait until every batch is written; raise the writer's error, if any."""
        self.drain()
        self._raise_error()

    def drain(self) -> None:
        """Write every batch handed off so far and stop the writer thread (also on an early
        exit: nothing computed is lost)."""
        if self._thread.is_alive():
            self._ready.put(_DONE)
            self._thread.join()

    on_full = staticmethod(lambda: None)  # called before waiting for a slot (tests)

    def _take_slot(self) -> int:
        try:
            index = self._free.get_nowait()
        except queue.Empty:
            self.on_full()
            index = self._free.get()
        self._raise_error()  # the writer failed while this thread waited
        return index

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self.drain()
            raise error

    def _device_parts(self, rows: Tensor) -> list[Tensor]:
        """What the writer needs, computed on the device: ``[stored, (scales,) norms,
        finite]``, as the serial path computes it (norms of the float32 rows; codes by
        :func:`~tracinfunc.store.codes.to_stored`; a float store's cast is exact to redo)."""
        norms, finite = row_norms(rows), torch.isfinite(rows).all(dim=-1)
        if self.meta.quantization is not None:
            codes, scales = to_stored(rows, self.meta)
            parts = [codes, scales, norms, finite]
        else:  # with each row's peak where the cast could overflow (float16 storage)
            peaks = [] if overflow_limit(self.meta, rows.dtype) is None else [row_peaks(rows)]
            parts = [rows.to(self.meta.torch_dtype), norms, *peaks, finite]
        return [part.contiguous() for part in parts]

    def _host_views(self, index: int, parts: list[Tensor]) -> list[Tensor]:
        """Host buffers of slot ``index`` shaped like ``parts`` (contiguous views of flat,
        page-locked buffers, grown when a batch is larger than any before; the slot is free,
        so no copy reads them)."""
        flats = self._hosts[index]
        views = []
        for i, part in enumerate(parts):
            if i == len(flats) or flats[i].numel() < part.numel():
                flat = self._host_empty(part.numel(), part.dtype)
                flats[i:i + 1] = [flat]
            views.append(flats[i][: part.numel()].view(part.shape))
        return views

    def _host_empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        if self.backend.pins_host:
            return pinned_empty((numel,), dtype)
        return torch.empty(numel, dtype=dtype)

    def _write_all(self) -> None:
        while (item := self._ready.get()) is not _DONE:
            index, copied, parts, hosts, first_row = item
            try:
                self.backend.synchronize(copied)  # also after an error: the slot is reused
                del parts, item  # the device rows may be freed now that they are copied
                if not self._failed:
                    self._write(hosts, first_row)
            except BaseException as error:  # raised on the compute thread
                if not self._failed:
                    self._failed, self._error = True, error
            finally:
                del hosts
                self._free.put(index)  # always: the compute thread never waits in vain

    def _write(self, hosts: list[Tensor], first_row: int) -> None:
        check_finite_flags(hosts[-1], self.meta, first_row=first_row)
        if self.meta.quantization is not None:
            codes, scales, norms, _ = hosts
            check_norms(norms, self.meta, first_row=first_row)
            self.writer.append_codes(codes, scales, norms)
        else:
            rows, norms, *peaks, _ = hosts
            check_norms(norms, self.meta, first_row=first_row)
            limit = overflow_limit(self.meta, peaks[0].dtype) if peaks else None
            if limit is not None:  # peaks are float32/64: as wide as the rows they came from
                check_peaks(peaks[0], self.meta, limit=limit, first_row=first_row)
            self.writer.append(rows, norms)


def check_finite_flags(finite: Tensor, meta: StoreMeta, *, first_row: int) -> None:
    """Raise :class:`~tracinfunc.errors.NonFiniteGradientError` naming the checkpoint and
    rows where a flag of ``finite`` ``[n_ckpt, b]`` (rows ``first_row`` on) is down."""
    if bool(finite.all()):
        return
    ckpt, row = (~finite).nonzero()[0].tolist()
    bad_rows = (~finite[ckpt]).nonzero().flatten().add(first_row).tolist()
    error = NonFiniteGradientError(
        f"{current_caller()}: checkpoint {meta.checkpoints[ckpt].name!r} gives NaN/inf gradients "
        f"for examples {bad_rows[:10]}{'...' if len(bad_rows) > 10 else ''} (row {first_row + row} "
        "first); check the loss on those examples (log of zero, overflow) or the checkpoint "
        "weights."
    )
    error.bad_rows = bad_rows  # build_store adds what mixed_precision has to do with it
    raise error


def check_norms(norms: Tensor, meta: StoreMeta, *, first_row: int) -> None:
    """Raise :class:`~tracinfunc.errors.NonFiniteGradientError` where the norm of a finite
    row (checked before) overflows: its entries are finite but their Euclidean norm exceeds
    the largest float32 (``[n_ckpt, b]`` norms, rows ``first_row`` on)."""
    finite = torch.isfinite(norms)
    if bool(finite.all()):
        return
    ckpt = int((~finite).nonzero()[0, 0])
    bad_rows = (~finite[ckpt]).nonzero().flatten().add(first_row).tolist()
    raise NonFiniteGradientError(
        f"{current_caller()}: checkpoint {meta.checkpoints[ckpt].name!r} gives gradients for "
        f"examples {bad_rows[:10]}{'...' if len(bad_rows) > 10 else ''} whose entries are "
        f"finite but whose norm overflows {str(norms.dtype).removeprefix('torch.')} (above "
        f"{torch.finfo(norms.dtype).max:.3g}); the store keeps each row's norm (for "
        "self_influence and normalised scores) and cannot hold it. Scale the loss down on those "
        "examples (e.g. divide it by 1e6: scores scale by its square) or drop them."
    )
