"""The seal of a store on object storage: the same manifest and checks as on a local disk.

A local store's seal (``integrity.py``) lists every file below the root with its size and the
BLAKE2b of its last :data:`~tracinfunc.store.zarr.integrity.TAIL_BYTES`; opening checks every
array's ``zarr.json`` in full and the first read of each shard file its size and tail, which
binds shards to their positions. Objects have no ``stat`` or ``pread``, but a zarr store
answers ``getsize`` and byte-range reads, so the same manifest (same names, same hashes: a
store copied between a disk and a bucket keeps its seal) is made and checked here through
zarr's store API: sealing lists the objects under the store's prefix; opening reads each
sealed ``zarr.json`` object; the first read of a shard object asks its size and reads its
tail (two small requests, once per object).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from typing import Any

from tracinfunc._validate import current_caller
from tracinfunc.errors import CorruptStoreError
from tracinfunc.store.zarr.integrity import INTEGRITY_KEY, TAIL_BYTES, digest

__all__ = ["ObjectGuard", "seal_objects"]

_ROOT_JSON = "zarr.json"
_MOVED = ("is not the object sealed at this position (shard objects or checkpoint "
          "prefixes swapped, or its index damaged)")


async def _size(store, key: str) -> int | None:
    try:
        return int(await store.getsize(key))
    except (FileNotFoundError, KeyError):
        return None


async def _tail_hash(store, key: str, size: int) -> str | None:
    """BLAKE2b-64 of the last ``TAIL_BYTES`` of the object (as ``integrity._tail_hash`` of a
    file); ``None`` if the object is gone (a listing or size may come from a cache)."""
    from zarr.abc.store import RangeByteRequest
    from zarr.core.buffer import default_buffer_prototype
    begin = max(0, size - TAIL_BYTES)
    data = await store.get(key, default_buffer_prototype(), RangeByteRequest(begin, size))
    if data is None:
        return None
    if len(data) != size - begin:
        return f"short: {begin + len(data)} of {size} bytes"  # matches no sealed hash
    return hashlib.blake2b(data.to_bytes(), digest_size=8).hexdigest()


def object_manifest(store, where: str) -> dict[str, list]:
    """``key -> [size, BLAKE2b-64 of the tail]`` of every object of the zarr ``store`` but the
    root ``zarr.json`` (keys relative to the store's root, as a local manifest's names).

    Raises:
        CorruptStoreError: an object is empty (a lost write, which zarr would read as zeros).
    """
    from zarr.core.sync import sync
    async def entries() -> dict[str, list]:
        keys = sorted([key async for key in store.list() if key != _ROOT_JSON])

        async def entry(key: str) -> list:
            size = await _size(store, key)
            if not size:
                raise CorruptStoreError(
                    f"{current_caller()}: object {key!r} of {where!r} is "
                    f"{'empty' if size == 0 else 'gone'}: its write was lost, and zarr would "
                    "read it as zeros. The store is not sealed; rebuild it (or resume the build)."
                )
            return [size, await _tail_hash(store, key, size)]

        return dict(zip(keys, await asyncio.gather(*(entry(key) for key in keys)), strict=True))

    return sync(entries())


def seal_objects(store, where: str, meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with an integrity block for the objects now in ``store`` (every PUT is durable
    when it returns: nothing to sync first)."""
    files = object_manifest(store, where)
    return {**meta, INTEGRITY_KEY: {"algorithm": "sha256", "digest": digest(meta, files),
                                    "files": files}}


class ObjectGuard:
    """Checks the objects of one store on object storage against its sealed manifest.

    Args:
        store: The store's zarr store (keys relative to its root).
        where: The store's URL (for messages).
        files: The sealed manifest, or ``None`` for a store sealed before object manifests
            (opened with ``allow_unsealed=True``): objects are then only required to exist.
    """

    def __init__(self, store, where: str, files: dict[str, list] | None) -> None:
        self._store, self._where, self._files = store, where.rstrip("/"), files
        self._checked: set[str] = set()
        self._lock = threading.Lock()

    def check_metadata_files(self) -> None:
        """Every sealed array and group ``zarr.json`` present and unedited (read in full)."""
        from zarr.core.sync import sync
        names = [n for n in self._files or {} if n.endswith(".json")]

        async def run() -> None:
            await asyncio.gather(*(self.acheck(name, differs=(
                "differs from the object the store was sealed with (array metadata edited: "
                "codecs, byte order or shape, or objects moved)")) for name in names))

        sync(run())

    def check(self, key: str) -> None:
        """Before the first read of object ``key``: present, right size, tail as sealed."""
        from zarr.core.sync import sync
        if key not in self._checked:
            sync(self.acheck(key))

    async def acheck(self, key: str, *, differs: str | None = None) -> None:
        """:meth:`check`, awaitable (the raw reader calls it on zarr's loop)."""
        if key in self._checked:
            return
        url = repr(f"{self._where}/{key}")
        size = await _size(self._store, key)
        tail = None if not size else await _tail_hash(self._store, key, size)
        if not size or tail is None:
            raise CorruptStoreError(
                f"{current_caller()}: object {url} is "
                f"{'empty' if size == 0 else 'missing'}; the store is damaged. Rebuild it "
                "or restore it from a copy."
            )
        if self._files is not None:
            if key not in self._files:
                raise CorruptStoreError(
                    f"{current_caller()}: object {url} is not part of the store as sealed "
                    "(objects moved or added); rebuild the store."
                )
            sealed_size, sealed_hash = self._files[key]
            if size != sealed_size:
                raise CorruptStoreError(
                    f"{current_caller()}: object {url} has {size} bytes, expected "
                    f"{sealed_size} (truncated or replaced); the store is damaged. Rebuild it "
                    "or restore it from a copy."
                )
            if tail != sealed_hash:
                raise CorruptStoreError(
                    f"{current_caller()}: object {url} {differs or _MOVED}; rebuild the store "
                    "or restore it from a copy."
                )
        with self._lock:
            self._checked.add(key)
