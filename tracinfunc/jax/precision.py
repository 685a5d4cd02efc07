"""Every program the JAX frontend compiles runs float32 matmuls in IEEE float32.

On NVIDIA GPUs, JAX's default precision for float32 matmuls and convolutions is TF32
(inputs rounded to 10 mantissa bits, ~1e-3 relative error); a JAX user's MLP on an H100
scored 2.2e-4 off the float64 brute force where the CPU gives 1e-7. The torch frontend runs
gradients, projections and scores in IEEE float32 whatever the process set
(:func:`tracinfunc._devices.full_float32`), so a store written from JAX would otherwise score
differently from the same store written from torch on the same GPU.

The precision is a trace-time setting and part of ``jax.jit``'s cache key, so setting it
around each call compiles the program once, in IEEE float32, and leaves the caller's setting
as it was. A loss that sets a precision itself (``jax.default_matmul_precision`` inside the
loss, or ``precision=`` on an op) keeps it: only the default changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["Float32Program", "float32_jit", "float32_matmuls"]

# "float32" is JAX's name for Precision.HIGHEST on 32-bit inputs (IEEE float32 on GPUs; TPUs
# emulate it with six bfloat16 passes). Inputs of 16 bits are unaffected.
_PRECISION = "float32"


def float32_matmuls() -> contextlib.AbstractContextManager:
    """A context in which JAX traces float32 matmuls and convolutions in IEEE float32: every
    trace of a user's loss runs in it, the shape-only ones (``jax.eval_shape``) included, so
    a loss sees one precision whatever traces it."""
    return jax.default_matmul_precision(_PRECISION)


class Float32Program:
    """``jax.jit(fn)`` whose every trace and call runs under
    ``jax.default_matmul_precision("float32")``."""

    __slots__ = ("_jitted",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._jitted = jax.jit(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with float32_matmuls():
            return self._jitted(*args, **kwargs)

    def _cache_size(self) -> int:
        """Programs compiled so far (one per argument shapes), as ``jax.jit``'s own."""
        return self._jitted._cache_size()


def float32_jit(fn: Callable[..., Any]) -> Float32Program:
    """``jax.jit(fn)`` compiled and run with float32 matmuls and convolutions in IEEE
    float32 (never TF32), whatever the caller's default precision."""
    return Float32Program(fn)
