"""A fake device for :class:`tracinfunc.store.device_copy.CopyBackend`: CPU tensors, a lazy
copy stream, and checks of every rule a real GPU would break silently.

The compute stream is the host itself (the caller's CPU work runs when it is issued); the
side stream queues its operations and runs them only when something needs them (a host
``synchronize``, a compute-stream ``wait``) or, with ``eager=True``, as soon as their waits
allow. A copy reads its source and writes its target only when it runs, as DMA does.

Checked (``AssertionError`` naming the rule):

* a buffer is read (``read``) only after the copy into it ran and the compute stream
  waited on that copy's event;
* a copy into a buffer runs only after the side stream waited on a compute event recorded
  after the last read of that buffer ("consumed");
* a host buffer is handed back (``released``) only after the host waited (``synchronize``)
  on every copy reading it: running is not enough, the host cannot see it without waiting.

Copies out of the device (into a host buffer, a target not made by ``empty``), as a GPU
build's copy-out pipeline makes them:

* such a copy runs only after the side stream waited on a compute event recorded after the
  copy was queued's compute clock (the rows it reads were computed);
* the host reads the buffer (``host_reading``) only after it waited (``synchronize``) on the
  event recorded after the copy, and no copy into a buffer is queued while the host reads
  it.

Every method takes one lock: a writer thread may wait on events while the compute thread
queues copies.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(eq=False)
class FakeEvent:
    stream: str
    position: int  # compute: the compute clock at record; side: index in the side queue
    done: bool = False


@dataclass(eq=False)
class _Slot:
    last_read: int = -1  # compute clock of the last read
    pending: list = field(default_factory=list)  # copies into it not yet run
    copy_event: FakeEvent | None = None  # recorded on the side after its last copy
    host: bool = False  # a host buffer copied into (device -> host)
    reading: int = 0  # host readers now


def _locked(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return wrapper


class FakeBackend:
    """A :class:`~tracinfunc.store.device_copy.CopyBackend` whose device memory is the CPU's."""

    pins_host = False

    def __init__(self, *, eager: bool = False) -> None:
        self.side, self.compute = "side", "compute"
        self.eager = eager
        self.clock = 0  # compute-stream operations issued so far
        self.queue: list[tuple] = []  # side-stream operations not run yet
        self.side_cleared = -1  # the latest compute position the side stream waited on
        self.compute_waited: set[int] = set()  # ids of side events the compute stream waited on
        self.slots: dict[int, _Slot] = {}
        self.copies: list[tuple[int, int]] = []  # (side position, source key) of every copy
        self.side_count = 0  # side-stream operations queued so far
        self.host_synced = -1  # the latest side position the host synchronized on
        self.since_record: list[_Slot] = []  # slots copied into since the last side record
        self.allocated = 0
        self.copies_run = 0
        self.lock = threading.RLock()
        self.copied_out = 0  # device -> host copies run

    # --- the CopyBackend protocol -------------------------------------------------------
    @_locked
    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        self.allocated += 1
        garbage = float("nan") if dtype.is_floating_point else 77  # until a copy lands
        buffer = torch.full(shape, garbage, dtype=dtype)
        self.slots[_key(buffer)] = _Slot()
        self.clock += 1
        return buffer

    @_locked
    def copy(self, target: Tensor, source: Tensor, stream: str) -> None:
        assert stream == self.side, "copies belong on the side stream"
        if _key(target) not in self.slots:  # a host buffer: a copy out of the device
            self.slots[_key(target)] = _Slot(host=True)
        slot = self.slots[_key(target)]
        assert not slot.reading, "a copy was queued into a host buffer the host still reads"
        op = ("copy", target, source, slot, self.clock)
        self.copies.append((self.side_count, _key(source)))
        self.side_count += 1
        slot.pending.append(op)
        self.since_record.append(slot)
        self.queue.append(op)
        self._progress()

    @_locked
    def record(self, stream: str) -> FakeEvent:
        if stream == self.compute:
            self.clock += 1
            return FakeEvent(stream, self.clock, done=True)
        event = FakeEvent(stream, self.side_count)
        self.side_count += 1
        for slot in self.since_record:
            slot.copy_event = event
        self.since_record = []
        self.queue.append(("record", event))
        self._progress()
        return event

    @_locked
    def wait(self, stream: str, event: FakeEvent) -> None:
        if stream == self.side:
            self.side_count += 1
            self.queue.append(("wait", event))
            self._progress()
            return
        self._run_until(event)  # the compute stream stalls until the side reaches it
        self.compute_waited.add(id(event))
        self.clock += 1

    @_locked
    def synchronize(self, event: FakeEvent) -> None:
        self._run_until(event)
        if event.stream == self.side:
            self.host_synced = max(self.host_synced, event.position)

    # --- what the consumer and the checks use ------------------------------------------
    @contextlib.contextmanager
    def host_reading(self, *buffers: Tensor):
        """The host reads ``buffers`` (views of host buffers copied into) while inside."""
        with self.lock:
            slots = [self.slots[_key(buffer)] for buffer in buffers]
            for slot in slots:
                assert slot.host and not slot.pending, \
                    "the host read a buffer while a copy into it had not run"
                assert slot.copy_event is not None and \
                    self.host_synced >= slot.copy_event.position, \
                    "the host read a buffer before it waited on the copy into it"
                slot.reading += 1
        try:
            yield
        finally:
            with self.lock:
                for slot in slots:
                    slot.reading -= 1

    @_locked
    def read(self, rows: Tensor) -> None:
        """The caller's compute reads ``rows`` (a view of a device buffer)."""
        slot = self.slots[_key(rows)]
        assert not slot.pending, "a buffer was read while a copy into it had not run"
        assert slot.copy_event is not None and id(slot.copy_event) in self.compute_waited, \
            "a buffer was read before the compute stream waited on its copy"
        self.clock += 1
        slot.last_read = self.clock

    @_locked
    def reads_source(self, source: Tensor) -> bool:
        """Whether a copy may still read ``source`` (a host buffer) as far as the host knows:
        one that no host ``synchronize`` has covered (it may have run, but on a GPU the host
        cannot tell without waiting)."""
        key = _key(source)
        return any(position > self.host_synced and copied == key
                   for position, copied in self.copies)

    # --- the device ---------------------------------------------------------------------
    def _progress(self) -> None:
        if self.eager:
            while self.queue and self._runnable(self.queue[0]):
                self._run(self.queue.pop(0))

    def _run_until(self, event: FakeEvent) -> None:
        if event.stream == self.compute:
            return  # compute events are done when recorded
        while not event.done:
            op = self.queue.pop(0)
            assert self._runnable(op), "the side stream waits on an event nothing completes"
            self._run(op)

    def _runnable(self, op: tuple) -> bool:
        return op[0] != "wait" or op[1].done

    def _run(self, op: tuple) -> None:
        if op[0] == "record":
            op[1].done = True
        elif op[0] == "wait":
            if op[1].stream == self.compute:
                self.side_cleared = max(self.side_cleared, op[1].position)
        else:
            _, target, source, slot, queued_at = op
            assert self.side_cleared >= slot.last_read, \
                "a copy overwrote a buffer before the compute reading it was waited on"
            if slot.host:
                assert self.side_cleared >= queued_at, \
                    "a copy out ran before the side stream waited on the compute producing it"
                self.copied_out += 1
            target.copy_(source)
            slot.pending.remove(op)
            self.copies_run += 1


def _key(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
