"""Stage-boundary activations kept on the device or offloaded to (pinned) CPU memory.

The forward of a staged gradient keeps one activation per stage boundary; with offloading
each is copied to CPU as soon as it exists and copied back just before the backward needs
it. On CUDA both copies run on a side stream into/from pinned memory, so they overlap with
compute: the copy back of boundary ``s - 1`` is started (:meth:`ActivationStash.prefetch`)
while stage ``s`` is being differentiated. Activations that already live in CPU memory are
kept as they are (offloading them would copy to the same place); other accelerators copy
synchronously. These are ordinary tensors outside any torch.func transform, which is why
offloading works here while ``save_on_cpu`` hooks are refused inside ``vmap``/``grad``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ActivationStash"]


@dataclass
class _Offloaded:
    host: Tensor
    device_copy: Tensor | None = None
    ready: torch.cuda.Event | None = None


class ActivationStash:
    """Boundary activations by stage index; :meth:`pop` hands each back once, then forgets it.

    Args:
        device: Where the computation runs.
        offload: Move activations to CPU memory between forward and backward.
    """

    def __init__(self, device: torch.device, *, offload: bool) -> None:
        self.device = device
        self.mode = "keep" if not offload or device.type == "cpu" else (
            "cuda" if device.type == "cuda" else "sync")
        self._stream = torch.cuda.Stream(device) if self.mode == "cuda" else None
        self._slots: dict[int, Tensor | _Offloaded] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def put(self, index: int, activation: Tensor, *, offload: bool = True) -> None:
        """Keep ``activation`` for the backward of stage ``index`` (offloaded if enabled)."""
        if self.mode == "keep" or not offload or not isinstance(activation, Tensor):
            self._slots[index] = activation
        elif self.mode == "sync":
            self._slots[index] = _Offloaded(activation.to("cpu"))
        else:
            self._slots[index] = self._offload_cuda(activation)

    def prefetch(self, index: int) -> None:
        """Start copying activation ``index`` back to the device (CUDA: asynchronously)."""
        slot = self._slots.get(index)
        if not isinstance(slot, _Offloaded) or slot.device_copy is not None:
            return
        if self.mode == "sync":
            slot.device_copy = slot.host.to(self.device)
            return
        with torch.cuda.stream(self._stream):
            slot.device_copy = torch.empty(slot.host.shape, dtype=slot.host.dtype,
                                           device=self.device)
            slot.device_copy.copy_(slot.host, non_blocking=True)
            slot.ready = torch.cuda.Event()
            slot.ready.record(self._stream)

    def pop(self, index: int) -> Tensor:
        """Activation ``index`` on the device, ready to use; the stash drops its reference."""
        self.prefetch(index)
        slot = self._slots.pop(index)
        if not isinstance(slot, _Offloaded):
            return slot
        if slot.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(slot.ready)
            # Allocated on the side stream, used on the current one: tell the allocator.
            slot.device_copy.record_stream(current)
        return slot.device_copy

    def _offload_cuda(self, activation: Tensor) -> _Offloaded:
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # activation is written
        with torch.cuda.stream(stream):
            host = torch.empty(activation.shape, dtype=activation.dtype, pin_memory=True)
            host.copy_(activation, non_blocking=True)
        # The caller drops its reference next; its memory must outlive the copy on `stream`.
        activation.record_stream(stream)
        return _Offloaded(host)
