"""Arrays in, arrays out: DLPack conversions between torch and JAX, NumPy or CuPy.

tracinfunc computes in torch. Inputs that implement ``__dlpack__`` (a JAX, NumPy or CuPy
array) become torch tensors that share their memory; results go back to the framework asked
for, sharing memory when DLPack allows. Two cases always copy, and :func:`to_framework` does
the copy for you:

* JAX on the CPU imports only buffers aligned to 64 bytes: a tensor view that starts inside
  its storage (``t[1:]``) or a non-contiguous one is first copied into a fresh buffer from
  a fresh 64-byte-aligned buffer. Tensors from ``torch.empty`` and everything tracinfunc returns are
  already aligned, so they go across without a copy.
* JAX cannot import page-locked ("pinned") torch memory (DLPack calls it ``kDLCUDAHost``):
  pinned tensors are copied to ordinary aligned memory first.

Tensors made from a JAX array alias JAX's immutable buffer: tracinfunc never writes to its
inputs, and you should not either. This module imports no JAX: it is looked up in
``sys.modules`` and imported only when a result is asked for in JAX.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import torch
from torch import Tensor

from tracinfunc._validate import current_caller
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError

if TYPE_CHECKING:  # annotations only: the frameworks stay optional
    import cupy
    import jax

__all__ = [
    "ALIGNMENT",
    "FRAMEWORKS",
    "Array",
    "as_tensor",
    "framework_of",
    "resolve_output",
    "tensor_if_array",
    "to_framework",
]

ALIGNMENT = 64
"""Bytes: the alignment XLA's CPU client needs to import a buffer without copying it."""

FRAMEWORKS = ("torch", "numpy", "jax", "cupy")

Array: TypeAlias = "Tensor | np.ndarray | jax.Array | cupy.ndarray"
"""What a query returns: a ``torch.Tensor`` by default, the framework ``output=``/``like=``
name otherwise (see :func:`to_framework`)."""


def as_tensor(array: Any) -> Tensor:
    """A torch tensor sharing ``array``'s memory: a tensor as is, else through DLPack.

    Args:
        array: A ``torch.Tensor`` or any object with ``__dlpack__`` (JAX, NumPy, CuPy, ...).
            A NumPy array that DLPack cannot export (a dtype DLPack lacks) is copied.

    Returns:
        A tensor on the array's device, zero-copy wherever the producer allows it.

    Raises:
        TypeError: ``array`` is neither a tensor nor a DLPack producer.
    """
    if isinstance(array, Tensor):
        return array
    if not hasattr(array, "__dlpack__"):
        raise InvalidTypeError(
            f"{current_caller('as_tensor')}: expected a torch.Tensor or an array implementing "
            "__dlpack__ (JAX, "
            f"NumPy, CuPy), got {type(array).__name__}; convert it with numpy.asarray first."
        )
    try:
        return torch.from_dlpack(array)
    except (BufferError, RuntimeError, TypeError) as error:
        if isinstance(array, np.ndarray):
            return torch.from_numpy(np.array(array, copy=True))
        raise InvalidTypeError(
            f"{current_caller('as_tensor')}: could not import a {type(array).__name__} through "
            f"DLPack ({error}); pass a torch tensor or a NumPy array instead."
        ) from error


def tensor_if_array(value: Any) -> Any:
    """``value`` as a tensor if it is a ``__dlpack__`` array, else unchanged (e.g. a store)."""
    if isinstance(value, Tensor) or not hasattr(value, "__dlpack__"):
        return value
    return as_tensor(value)


def framework_of(array: Any) -> str:
    """``"torch"``, ``"numpy"``, ``"jax"`` or ``"cupy"``: the framework ``array`` belongs to.

    Raises:
        TypeError: an object of none of these frameworks.
    """
    if isinstance(array, Tensor):
        return "torch"
    if isinstance(array, np.ndarray | np.generic):
        return "numpy"
    root = type(array).__module__.split(".", 1)[0]
    if root in ("jax", "jaxlib"):
        return "jax"
    if root == "cupy":
        return "cupy"
    raise InvalidTypeError(
        f"{current_caller('framework_of')}: like= must be a torch, NumPy, JAX or CuPy array, got "
        f"{type(array).__name__}; pass output= one of {', '.join(map(repr, FRAMEWORKS))} instead."
    )


def resolve_output(output: str | None, like: Any) -> str:
    """The framework results are returned in: ``output``, ``like``'s framework, or torch.

    Validated before any work, so a typo fails fast.
    """
    if output is not None and like is not None:
        raise InvalidArgumentError(
            f"{current_caller()}: pass output= or like=, not both (got output={output!r} and a "
            f"{type(like).__name__})."
        )
    if like is not None:
        return framework_of(like)
    if output is None:
        return "torch"
    if output not in FRAMEWORKS:
        raise InvalidArgumentError(
            f"{current_caller()}: output must be one of {', '.join(map(repr, FRAMEWORKS))}, got "
            f"{output!r}; e.g. output='jax' to get a jax.Array."
        )
    return output


def to_framework(tensor: Tensor, framework: str) -> Any:
    """``tensor`` as an array of ``framework``, sharing memory where DLPack allows.

    ``"numpy"`` shares CPU memory (CUDA tensors are copied to the host). ``"jax"`` shares
    memory unless the tensor is pinned, unaligned or non-contiguous (then it is copied once,
    see the module docs), or lives on a device JAX was not built for (then it comes back on
    JAX's default device).
    """
    if framework == "torch":
        return tensor
    tensor = tensor.detach()
    if framework == "numpy":
        return _to_numpy(tensor)
    if framework == "jax":
        return _to_jax(tensor)
    if framework == "cupy":
        cupy = _import("cupy", "pip install cupy-cuda12x")
        with _exporting_from(tensor):
            return cupy.from_dlpack(tensor.contiguous())
    raise InvalidArgumentError(
        f"to_framework: framework must be one of {', '.join(map(repr, FRAMEWORKS))}, got "
        f"{framework!r}."
    )


def _aligned_empty(
    shape: Sequence[int], dtype: torch.dtype = torch.float32, *, alignment: int = ALIGNMENT
) -> Tensor:
    """An uninitialised contiguous CPU tensor whose first byte is ``alignment``-aligned.

    torch's CPU allocator usually aligns to 64 bytes already; this guarantees it (over-
    allocating by ``alignment`` bytes and starting at the first aligned address), so buffers
    handed to JAX are imported without a copy.
    """
    shape = tuple(int(s) for s in shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = int(np.prod(shape, dtype=np.int64))
    raw = torch.empty(numel * itemsize + alignment, dtype=torch.uint8)
    offset = -raw.data_ptr() % alignment
    return raw[offset : offset + numel * itemsize].view(dtype).view(shape)


def _is_aligned(tensor: Tensor, alignment: int = ALIGNMENT) -> bool:
    """Whether ``tensor``'s first element sits on an ``alignment``-byte boundary."""
    return tensor.data_ptr() % alignment == 0


def _to_numpy(tensor: Tensor) -> np.ndarray:
    tensor = tensor.cpu()
    if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16; ml_dtypes (a JAX dependency) has
        ml_dtypes = _import("ml_dtypes", "pip install ml_dtypes")
        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _to_jax(tensor: Tensor) -> Any:
    jax = _import("jax", 'pip install "tracinfunc[jax]"')
    if tensor.device.type != "cpu" and not _jax_has(jax, tensor.device.type):
        tensor = tensor.cpu()  # a CPU-only JAX cannot see this device
    if tensor.device.type == "cpu" and (
        _is_pinned(tensor) or not tensor.is_contiguous() or not _is_aligned(tensor)
    ):
        tensor = _aligned_empty(tensor.shape, tensor.dtype).copy_(tensor)
    with _exporting_from(tensor):
        return jax.dlpack.from_dlpack(tensor.contiguous())


def _exporting_from(tensor: Tensor) -> contextlib.AbstractContextManager:
    """Make ``tensor``'s GPU the current one while DLPack exports it: torch (2.13) raises
    ``BufferError`` exporting a tensor of a GPU other than the current one."""
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def _is_pinned(tensor: Tensor) -> bool:
    try:
        return tensor.is_pinned()
    except RuntimeError:  # builds without an accelerator cannot pin at all
        return False


def _jax_has(jax: Any, device_type: str) -> bool:
    platform = {"cuda": "gpu"}.get(device_type, device_type)
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


def _import(name: str, install: str) -> Any:
    module = sys.modules.get(name)
    if module is not None:
        return module
    try:
        return __import__(name)
    except ImportError as error:
        raise ImportError(
            f"tracinfunc: results in {name} need the {name} package, which is not installed; "
            f"install it with `{install}`."
        ) from error
