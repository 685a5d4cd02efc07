"""One bounded reader for the JSON files the library reads back (metadata, manifests).

Every JSON file tracinfunc writes is small and shallow (a store's ``zarr.json`` is a few
kilobytes, nested fewer than ten levels). A crafted file is not: 200,000 nested brackets make
``json.loads`` raise ``RecursionError`` and a gigabyte of metadata exhausts memory. Reading
through :func:`read_json` turns both into :class:`~tracinfunc.errors.CorruptStoreError`
naming the file, before anything else (zarr included) parses it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tracinfunc._validate import current_caller
from tracinfunc.errors import CorruptStoreError

__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "check_json_file", "read_json"]

MAX_JSON_BYTES = 64 * 2**20  # far above any metadata the library writes
MAX_JSON_DEPTH = 64


def read_json(path: str | os.PathLike[str], *, what: str = "metadata") -> Any:
    """The JSON value in the file ``path``, refused if it is too large or too deep.

    Raises:
        FileNotFoundError: no file at ``path`` (left to the caller, who knows the fix).
        CorruptStoreError: the file is larger than ``MAX_JSON_BYTES``, nested deeper than
            ``MAX_JSON_DEPTH``, or not JSON.
    """
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise _corrupt(path, what, f"{size} bytes, more than the {MAX_JSON_BYTES} any "
                                   "tracinfunc metadata file holds")
    try:
        value = json.loads(path.read_bytes())
    except RecursionError:  # the C decoder's own guard: deeper than Python's recursion limit
        raise _corrupt(path, what, "nested deeper than Python can parse") from None
    except ValueError as error:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise _corrupt(path, what, f"not valid JSON ({error})") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise _corrupt(path, what, f"nested more than {MAX_JSON_DEPTH} levels deep, deeper "
                                   "than any tracinfunc metadata file")
    return value


def check_json_file(path: str | os.PathLike[str], *, what: str = "metadata") -> None:
    """Raise as :func:`read_json` does if the file at ``path`` exists and is not sane JSON
    (call before a third party, such as zarr, parses it); a missing file passes."""
    if os.path.isfile(path):
        read_json(path, what=what)


def _depth(value: Any) -> int:
    """How deeply lists and dicts nest in ``value`` (iteratively: no recursion to exhaust),
    stopping once past the limit."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if deepest > MAX_JSON_DEPTH:
                return deepest
            stack.extend((child, level + 1)
                         for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _corrupt(path: Path, what: str, problem: str) -> CorruptStoreError:
    return CorruptStoreError(
        f"{current_caller()}: the {what} file {str(path)!r} is {problem}; it was crafted, "
        "edited or damaged. Rebuild the artefact or restore it from a copy."
    )
