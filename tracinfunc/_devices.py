"""Device facts the library acts on: which device is meant, its free memory, float32 scope.

Each is a small function with its device queries injectable (module-level hooks that a CPU
test replaces), so the logic that only a GPU would exercise runs in CPU tests:

* :func:`usable_device`: a device named by the user that exists and can be used here, or the
  library's error naming it (``"tpu"``, ``"cuda:7"`` on a one-GPU machine, CUDA without CUDA).
* :func:`canonical_device`: ``"cuda"`` means the current CUDA device, so ``cuda`` and
  ``cuda:0`` name the same device there and ``cuda:1`` does not.
* :func:`check_device_memory`: refuse to allocate a result that cannot fit, naming the
  alternatives, before any work.
* :func:`check_allocation`: the same before any allocation whose size came from a file or an
  argument, on the CPU against physical memory (a crafted store claiming 10**12 rows).
* :func:`full_float32`: matmuls in true float32 (no TF32, no reduced-precision float32
  matmuls) for the duration of a call, whatever the process set, restored afterwards.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from tracinfunc._validate import current_caller
from tracinfunc.errors import InvalidArgumentError, MemoryBudgetError

__all__ = ["canonical_device", "check_device_memory", "free_bytes", "full_float32",
           "in_full_float32", "module_device", "usable_device"]

F = TypeVar("F", bound=Callable[..., Any])


def current_index(device_type: str) -> int | None:
    """The current device index of ``device_type`` (``None`` where it has no notion of one)."""
    module = getattr(torch, device_type, None)
    is_available = getattr(module, "is_available", None)
    current = getattr(module, "current_device", None)
    if device_type == "cpu" or None in (is_available, current) or not is_available():
        return None
    return current()


def device_count(device_type: str) -> int | None:
    """How many ``device_type`` devices this process can use (``None``: the backend does not
    say). Looked up through the module, so a CPU test can fake a GPU machine."""
    module = getattr(torch, device_type, None)
    is_available = getattr(module, "is_available", None)
    if is_available is None:
        return None
    if not is_available():
        return 0
    count = getattr(module, "device_count", None)
    return None if count is None else int(count())


def usable_device(device: torch.device | str) -> torch.device:
    """``device`` as a :class:`torch.device`, checked to exist and be usable in this process.

    Raises:
        InvalidArgumentError: ``device`` is not a device name torch knows (``"tpu"``), its
            backend is not available here (CUDA in a CPU-only build), or its index is beyond
            the devices present (``"cuda:7"`` on a one-GPU machine).
    """
    fix = "pass device='cpu', or one of this machine's devices (torch.cuda.device_count())"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"{current_caller()}: device={device!r} is not a device torch knows ({e}); {fix}."
        ) from None
    if resolved.type in ("cpu", "meta"):
        return resolved
    count = device_count(resolved.type)
    if count == 0:
        raise InvalidArgumentError(
            f"{current_caller()}: device={device!r}: no {resolved.type} device is available in "
            f"this process; {fix}."
        )
    if count is not None and resolved.index is not None and resolved.index >= count:
        raise InvalidArgumentError(
            f"{current_caller()}: device={device!r}: this machine has {count} {resolved.type} "
            f"device(s) (indices 0..{count - 1}); {fix}."
        )
    return resolved


def canonical_device(device: torch.device | str,
                     index_of: Callable[[str], int | None] | None = None) -> torch.device:
    """``device`` with its index filled in (``cuda`` -> ``cuda:<current>``), comparable with
    ``==`` to a tensor's device.

    Args:
        device: A device or its name.
        index_of: ``device_type -> current index`` (default :func:`current_index`).
    """
    device = torch.device(device)
    if device.index is not None:
        return device
    index = (index_of or current_index)(device.type)
    return device if index is None else torch.device(device.type, index)


def module_device(module: torch.nn.Module) -> torch.device:
    """Where tensors for ``module`` belong: its first parameter's (or buffer's) device; the
    CPU for an empty module or one on the meta device (shapes only: its weights are loaded
    into real memory)."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device if tensor.device.type != "meta" else torch.device("cpu")
    return torch.device("cpu")


def free_bytes(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device``; ``None`` when unknown (the CPU).

    On CUDA, free device memory plus what torch's caching allocator holds unused.
    """
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + cached)


def check_device_memory(device: torch.device, nbytes: int, *, what: str, fix: str) -> None:
    """Raise :class:`MemoryBudgetError` if ``nbytes`` cannot fit on ``device`` now.

    Looked up through the module (``_devices.free_bytes``), so a test can fake the device.
    """
    free = free_bytes(device)
    if free is not None and nbytes > free:
        raise MemoryBudgetError(
            f"{current_caller()}: {what} needs {nbytes / 2**30:.2f} GiB on {device} but only "
            f"{free / 2**30:.2f} GiB is free there; {fix}"
        )


def physical_bytes() -> int | None:
    """The machine's physical memory in bytes (``None`` where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_allocation(device: torch.device | str, nbytes: int, *, what: str, fix: str) -> None:
    """Raise :class:`MemoryBudgetError` before allocating ``nbytes`` on ``device`` if they
    cannot fit: on CUDA against free memory (:func:`check_device_memory`), on the CPU
    against the machine's physical memory (free memory there is elastic: caches, swap).

    Call it where a size read from a file or an argument decides an allocation (a crafted
    store claiming 10**12 rows), so the user gets the sizes and ``fix`` instead of the
    allocator's failure or the OOM killer.
    """
    device = torch.device(device)
    if device.type == "cuda":
        check_device_memory(device, nbytes, what=what, fix=fix)
        return
    total = physical_bytes()  # looked up at call time: a test can replace it
    if total is not None and nbytes > total:
        raise MemoryBudgetError(
            f"{current_caller()}: {what} needs {nbytes / 2**30:.2f} GiB of host memory but this "
            f"machine has {total / 2**30:.2f} GiB in all; {fix}"
        )


# torch >= 2.9 keeps one fp32_precision per backend and operator family; the legacy flags
# (allow_tf32, set_float32_matmul_precision) are views of these, and reading one raises once
# the families differ, so the knobs themselves are saved and restored.
_KNOBS = ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv",
          "mkldnn.rnn")
# Set inside full_float32(hold=True): nested calls then read no knob (see full_float32).
_HELD: contextvars.ContextVar[bool] = contextvars.ContextVar("tracinfunc_ieee_held",
                                                             default=False)


@contextlib.contextmanager
def full_float32(*, hold: bool = False) -> Iterator[None]:
    """Run float32 matmuls and convolutions in IEEE float32, then restore the settings.

    TF32 (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``, or
    ``torch.set_float32_matmul_precision("high")``, as Hugging Face's ``tf32=True`` sets)
    rounds matmul inputs to 10 mantissa bits: ~1e-3 relative error in scores and
    projections; ``"medium"`` also runs CPU (oneDNN) matmuls in bfloat16. These are
    process-wide settings, so they are set for the call only and the caller's values
    restored on exit, exception or not.

    ``hold=True`` is for a caller that runs no foreign code inside (a query's scan: no user
    callback between its chunks): nested ``full_float32()`` calls in the same context then
    return at once instead of reading the six knobs (~50 us a chunk, ~4% of a warm 50,000
    x 4096 CPU query). A generator resumed elsewhere (``score_chunks``' blocks, between which
    the user's code runs) is outside it and checks again.
    """
    if _HELD.get():
        yield
        return
    token = _HELD.set(True) if hold else None
    try:
        with _ieee_float32():
            yield
    finally:
        if token is not None:
            _HELD.reset(token)


@contextlib.contextmanager
def _ieee_float32() -> Iterator[None]:
    knobs = _precision_knobs()
    if knobs:
        legacy = _legacy_precision()
        values = [knob.fp32_precision for knob in knobs]
        if legacy == "highest" and all(value == "ieee" for value in values):
            yield  # already IEEE (the default): nothing to set per streamed chunk
            return
        try:
            if legacy is not None:
                torch.set_float32_matmul_precision("highest")  # what torch.compile consults
            for knob in knobs:
                knob.fp32_precision = "ieee"
            yield
        finally:
            if legacy is not None:
                torch.set_float32_matmul_precision(legacy)
            for knob, value in zip(knobs, values, strict=True):
                knob.fp32_precision = value
        return
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn  # torch < 2.9
    legacy = (torch.get_float32_matmul_precision(), matmul.allow_tf32, cudnn.allow_tf32)
    try:
        torch.set_float32_matmul_precision("highest")
        matmul.allow_tf32 = cudnn.allow_tf32 = False
        yield
    finally:
        torch.set_float32_matmul_precision(legacy[0])
        matmul.allow_tf32, cudnn.allow_tf32 = legacy[1], legacy[2]


def in_full_float32(fn: F) -> F:
    """``fn`` with every call run under :func:`full_float32`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with full_float32():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _legacy_precision() -> str | None:
    """``torch.get_float32_matmul_precision()``, or ``None`` where the caller set the
    per-backend knobs (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``, ...) so that
    no legacy value describes them (torch then raises rather than answer): only the knobs
    themselves are set and restored."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


@functools.cache
def _precision_knobs() -> tuple[object, ...]:
    """The fp32 precision knobs this torch has (fixed for the process)."""
    knobs = []
    for path in _KNOBS:
        knob: object = torch.backends
        for part in path.split("."):
            knob = getattr(knob, part, None)
        if knob is not None and hasattr(knob, "fp32_precision"):
            knobs.append(knob)
    return tuple(knobs)
