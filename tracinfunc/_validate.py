"""The checks every public entry point repeats, written once, and the name errors carry.

Public functions are marked with :func:`entry_point`; helpers deep inside read
:func:`current_caller` for the name of the function the user called, so the name is attached
once, where the call enters the library, and never threaded through every helper. Nested
public calls (``top_k`` runs ``score_chunks``) report the outermost one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
import operator
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from tracinfunc.errors import InvalidArgumentError, InvalidTypeError

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)

__all__ = ["as_int", "calling", "check_bool", "check_int", "current_caller", "entry_point",
           "user_stacklevel"]

F = TypeVar("F", bound=Callable[..., Any])
_CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("tracinfunc_caller",
                                                                     default=None)


def current_caller(default: str = "tracinfunc") -> str:
    """The public function the user called (the outermost :func:`entry_point`)."""
    return _CALLER.get() or default


def entry_point(name: str) -> Callable[[F], F]:
    """Mark a public function: errors raised while it runs name ``name``.

    ``"{cls}"`` in ``name`` stands for the class of the first argument (a method's ``self``),
    so one method shared by several store classes names the class the user holds. Works for
    generator functions too (the name holds while each item is produced, not while the
    caller holds the generator).
    """
    def name_for(args: tuple) -> str:
        return name.replace("{cls}", type(args[0]).__name__) if "{cls}" in name else name

    def decorate(fn: F) -> F:
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def generator(*args: Any, **kwargs: Any) -> Any:
                called = name_for(args)
                items = _run_as(called, fn, *args, **kwargs)
                while True:
                    try:
                        item = _run_as(called, next, items)
                    except StopIteration:
                        return
                    yield item

            return generator  # type: ignore[return-value]

        @functools.wraps(fn)
        def function(*args: Any, **kwargs: Any) -> Any:
            return _run_as(name_for(args), fn, *args, **kwargs)

        return function  # type: ignore[return-value]

    return decorate


@contextlib.contextmanager
def calling(name: str) -> Iterator[None]:
    """Name the caller for everything run inside (the command line names its command); an
    enclosing entry point still speaks first."""
    if _CALLER.get() is not None:
        yield
        return
    token = _CALLER.set(name)
    try:
        yield
    finally:
        _CALLER.reset(token)


def _run_as(name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    # Positional-only: the wrapped function may take keywords called name or fn.
    if _CALLER.get() is not None:  # a public function calling another: the outer one speaks
        return fn(*args, **kwargs)
    token = _CALLER.set(name)
    try:
        return fn(*args, **kwargs)
    finally:
        _CALLER.reset(token)


def check_int(value: Any, name: str, *, minimum: int = 1,
              maximum: int | None = None, maximum_label: str = "", optional: bool = False,
              fix: str = "", wanted: str | None = None,
              error: type[Exception] = InvalidArgumentError) -> Any:
    """``value`` as a Python ``int`` if it is an integral scalar in ``[minimum, maximum]``
    (or ``None`` when ``optional``).

    NumPy integers and 0-d integer arrays of torch, NumPy or JAX are accepted and returned as
    a Python ``int`` (callers use the returned value). ``True``/``False`` are refused: they are
    ints to Python but never a meaningful size; floats are refused even when whole.

    Args:
        maximum_label: How the message names the maximum (``"n_train"`` gives
            ``[1, n_train=40]``).
        wanted: The expectation in words, replacing the one derived from the range.
        error: The exception class (a TracInFuncError subclass).

    Raises:
        InvalidArgumentError (or ``error``): anything else, naming the caller, ``name``, what
            was expected and how to fix it.
    """
    if value is None and optional:
        return None
    number = as_int(value)
    if number is None or number < minimum or (maximum is not None and number > maximum):
        if wanted is None:
            wanted = ("a positive int" if minimum == 1 else
                      "a non-negative int" if minimum == 0 else f"an int >= {minimum}")
        if maximum is not None:
            label = f"{maximum_label}=" if maximum_label else ""
            wanted = f"an int in [{minimum}, {label}{maximum}]"
        raise error(
            f"{current_caller()}: {name} must be {wanted}"
            f"{' or None' if optional else ''}, got {value!r}{'; ' + fix if fix else ''}."
        )
    return number


def as_int(value: Any) -> int | None:
    """``value`` as a Python ``int`` when it is an integral scalar, else ``None``.

    Integral scalars are Python ints, NumPy integers and 0-d integer arrays of torch, NumPy
    and JAX (anything with ``__index__`` and no elements beyond one 0-d value). Refused
    (``None``): bools of any framework, floats (even whole ones) and arrays with a shape.
    """
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return None
    shape = getattr(value, "shape", ())
    if shape is None or tuple(shape) != ():
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_real(value: Any) -> float | None:
    """``value`` as a float when it is a real scalar of any framework (Python, NumPy, torch,
    JAX; 0-d), else ``None``: bools and arrays with a shape are not. Integers beyond
    float32's range give +-inf."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return None
    if isinstance(value, int) and abs(value) > _FLOAT32_MAX:
        return math.inf if value > 0 else -math.inf  # float(10**400) would raise OverflowError
    if isinstance(value, int | float):
        return float(value)
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or tuple(shape) != () or dtype is None:
        return None
    kind = getattr(dtype, "kind", None)  # NumPy/JAX dtypes; torch's have is_floating_point
    if kind is None and isinstance(dtype, torch.dtype):
        kind = "f" if dtype.is_floating_point else ("b" if dtype == torch.bool else
                                                    "c" if dtype.is_complex else "i")
    if kind not in ("f", "i", "u") and str(dtype) != "bfloat16":
        return None
    try:
        return float(value)
    except OverflowError:  # a huge integer array value
        return math.inf
    except Exception:  # a jax tracer: not concrete inside jit
        return None


def check_bool(value: Any, name: str, *, error: type[Exception] = InvalidTypeError) -> bool:
    """``value`` if it is ``True`` or ``False``, else ``error`` (:class:`InvalidTypeError`)."""
    if not isinstance(value, bool):
        raise error(
            f"{current_caller()}: {name} must be True or False, got {value!r}."
        )
    return value


_PACKAGE_DIR = __file__.rsplit("/", 1)[0] + "/"


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised here point at the first frame outside
    tracinfunc (the user's call), however deep the library code that warns. Python 3.11 has no
    ``skip_file_prefixes``."""
    frame, level = sys._getframe(1), 1  # the frame calling this function is level 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level
