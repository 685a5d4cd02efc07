"""The checks every public entry point repeats, written once.

Helpers take the public function's name (``caller``) so the message names what the user
called, and say what was expected, what was got and how to fix it.
"""

from __future__ import annotations

from typing import Any

from tracinfunc.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["check_bool", "check_int"]


def check_int(value: Any, name: str, *, caller: str, minimum: int = 1,
              maximum: int | None = None, optional: bool = False, fix: str = "") -> Any:
    """``value`` if it is an int in ``[minimum, maximum]`` (or ``None`` when ``optional``).

    ``True``/``False`` are refused: they are ints to Python but never a meaningful size.

    Raises:
        InvalidArgumentError: anything else, naming ``caller``, ``name`` and the range.
    """
    if value is None and optional:
        return None
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not is_int or value < minimum or (maximum is not None and value > maximum):
        wanted = ("a positive int" if minimum == 1 else
                  "a non-negative int" if minimum == 0 else f"an int >= {minimum}")
        if maximum is not None:
            wanted = f"an int in [{minimum}, {maximum}]"
        raise InvalidArgumentError(
            f"{caller}: {name} must be {wanted}{' or None' if optional else ''}, got "
            f"{value!r}{'; ' + fix if fix else ''}."
        )
    return value


def check_bool(value: Any, name: str, *, caller: str) -> bool:
    """``value`` if it is ``True`` or ``False``, else :class:`InvalidTypeError`."""
    if not isinstance(value, bool):
        raise InvalidTypeError(f"{caller}: {name} must be True or False, got {value!r}.")
    return value
