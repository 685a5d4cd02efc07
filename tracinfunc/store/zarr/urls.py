"""Stores at fsspec URLs (``s3://bucket/grads.zarr``, ``gs://...``, ``memory://...``).

zarr v3 opens URLs itself (its ``FsspecStore``; for S3 through ``s3fs``), with credentials
and endpoint from the usual environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL``, ``~/.aws``). Reads of a row range fetch its chunks concurrently (zarr's
async loop, ``zarr.config`` ``async.concurrency`` requests in flight), each checked against
its crc32c. This module holds the few operations that differ from a local directory:
existence, deletion and the keys of chunk objects.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tracinfunc.errors import MissingDependencyError

__all__ = ["Location", "chunk_keys", "exists", "is_url", "location", "remove"]

Location = Path | str  # a local directory, or an fsspec URL kept as text


def is_url(path: object) -> bool:
    """Whether ``path`` is an fsspec URL (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def location(path: str | os.PathLike[str]) -> Location:
    """A URL as text (``Path`` would turn ``s3://b`` into ``s3:/b``), anything else a Path."""
    return path if is_url(path) else Path(path)


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
