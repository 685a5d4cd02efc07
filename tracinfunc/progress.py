"""Progress bars for the long loops (building a store, streaming a score), shown only when useful.

``progress=None`` (the default everywhere) means: on a terminal, and only once the loop has
run for 2 seconds, so quick calls inside a user's own loop (one test triple
at a time) never flash a bar. ``True`` forces a bar, ``False`` silences it.
"""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from tracinfunc.errors import InvalidTypeError

__all__ = ["ProgressArg", "progress_bar"]

#: Seconds a loop must run before an automatic bar appears.
_DELAY_S = 2.0

ProgressArg = bool | None


class _Silent:
    """The no-op stand-in used when no bar is wanted (keeps callers free of branches)."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress_bar(progress: ProgressArg, *, total: int | None, desc: str, unit: str) -> Any:
    """A tqdm bar (or a silent stand-in) with ``update(n)`` and ``close()``.

    Args:
        progress: ``None`` (terminal only, after 2 s), ``True`` or ``False``.
        total: Units the loop will process, when known.
        desc: Short label, e.g. ``"build_store"``.
        unit: What one unit is, e.g. ``"ex"`` or ``"row"``.
    """
    if progress is not None and not isinstance(progress, bool):
        raise InvalidTypeError(f"{desc}: progress must be True, False or None, got {progress!r}.")
    if progress is False:
        return _Silent()
    return tqdm(
        total=total, desc=desc, unit=unit, dynamic_ncols=True,
        disable=None if progress is None else False,  # None: tqdm disables on non-terminals
        delay=_DELAY_S if progress is None else 0.0,
    )
