"""Stores at fsspec URLs (``s3://bucket/grads.zarr``, ``gs://...``, ``memory://...``).

zarr v3 opens URLs itself (its ``FsspecStore``; for S3 through ``s3fs``), with credentials
and endpoint from the usual environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL``, ``~/.aws``). Reads of a row range fetch its chunks concurrently (zarr's
async loop, ``zarr.config`` ``async.concurrency`` requests in flight), each checked against
its crc32c. This module holds the few operations that differ from a local directory:
existence, deletion and the keys of chunk objects.

:func:`location` is the one place a store path given by a user is decoded, for every
function that takes one (open, build, save, verify, remove, commit): ``str``, ``bytes`` and
``os.PathLike`` paths, ``~`` expanded to the home directory, ``file://`` URLs turned into the
local path they name, other URLs kept as text; anything else is refused naming the caller.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tracinfunc._validate import current_caller
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError, MissingDependencyError

__all__ = ["Location", "chunk_keys", "exists", "is_url", "location", "remove",
           "write_location"]

Location = Path | str  # a local directory, or an fsspec URL kept as text


def is_url(path: object) -> bool:
    """Whether ``path`` is an fsspec URL (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def location(path: object) -> Location:
    """The store location a user's ``path`` names: a local :class:`~pathlib.Path` (``~``
    expanded; a ``file://`` URL decoded to its path) or an fsspec URL kept as text (``Path``
    would turn ``s3://b`` into ``s3:/b``).

    Raises:
        InvalidTypeError: ``path`` is not a ``str``, ``bytes`` or ``os.PathLike`` (a store
            object, ``None``, a number).
        InvalidArgumentError: a ``file://`` URL naming another host.
    """
    if not isinstance(path, str | bytes | os.PathLike):
        raise InvalidTypeError(
            f"{current_caller()}: expected the path of a store (a str, bytes or os.PathLike "
            f"such as 'grads.zarr', or a URL such as 's3://bucket/grads.zarr'), got "
            f"{type(path).__name__} {_short(path)}; pass the store's path. A store object "
            "that is already open needs no opening: use it as it is.")
    text = os.fsdecode(os.fspath(path))
    if is_url(text):
        return text
    if text.startswith("file://"):
        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost"):
            raise InvalidArgumentError(
                f"{current_caller()}: {text!r} is a file URL on host {parts.netloc!r}; only "
                "local file URLs (file:///absolute/path) name a store here. Mount the share "
                "and pass its local path.")
        return Path(unquote(parts.path))
    return Path(text).expanduser()


def write_location(path: object) -> Location:
    """:func:`location` for a writer: a local symlink to a directory is followed, so the
    writer replaces (and locks) the store it points to and the link is kept."""
    where = location(path)
    if isinstance(where, Path) and where.is_symlink() and where.is_dir():
        return where.resolve()
    return where


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def filesystem(url: str):
    try:
        import fsspec

        return fsspec.core.url_to_fs(url)
    except ImportError as error:
        raise MissingDependencyError(
            f"stores at URLs such as {url!r} need fsspec and its backend ({error}); install "
            "them with pip install 'tracinfunc[s3]'."
        ) from error


def exists(where: Location, name: str = "") -> bool:
    """Whether ``where`` (or its member ``name``, e.g. ``"zarr.json"``) exists."""
    if isinstance(where, Path):
        return (where / name).exists() if name else where.exists()
    fs, root = filesystem(where)
    return fs.exists(f"{root.rstrip('/')}/{name}" if name else root)


def remove(where: Location) -> None:
    """Delete the directory (or every object under the prefix) ``where``."""
    if isinstance(where, Path):
        shutil.rmtree(where)
        return
    fs, root = filesystem(where)
    fs.rm(root, recursive=True)


def chunk_keys(array, start: int, stop: int) -> list[str]:
    """Keys (relative to the store's root) of the shard objects rows ``[start, stop)`` of
    ``array`` are read from."""
    if stop <= start:
        return []
    rows_per_file = (array.shards or array.chunks)[0]
    tail = (0,) * (array.ndim - 1)
    return [f"{array.path}/{array.metadata.encode_chunk_key((i, *tail))}"
            for i in range(start // rows_per_file, (stop - 1) // rows_per_file + 1)]
