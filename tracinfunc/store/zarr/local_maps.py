"""Zero-copy reads of whole stored chunks: views of a mapping of the local shard file.

On a warm page cache, copying a chunk out of the cache (``preadv``) costs about half as
much as multiplying it (64 test rows, k=4096, float32, 1 thread); a numpy memmap reads in
place. :class:`ShardMaps` lends one stored chunk's rows as a view of a private
(copy-on-write, never written) mapping of its shard file, so a query multiplies the page
cache's own pages.

Integrity, as in :mod:`tracinfunc.store.zarr.local_reads`:

* A chunk's crc32c is verified (over the mapped bytes) on its first use while its shard
  file keeps one identity: device, inode, size, modification and status-change times.
* Before lending a chunk, the file's identity is taken again (``stat`` of its path); a
  change (a write, a truncation, ``os.utime``, a replaced file) drops the mapping: the file
  is mapped again, its index re-read and every chunk verified again.
* After the caller used the chunk (``release``), the identity is taken once more: a file
  changed while its bytes were being multiplied raises :class:`CorruptStoreError` instead
  of letting those scores through.
* A file system that cannot map files (``mmap`` raises) makes :meth:`ShardMaps.view`
  return ``None`` from then on: the caller reads the rows instead.

Not covered: a file truncated by another process in the instant between the identity
check and the end of the multiplication of that chunk ends the process with ``SIGBUS`` (as
with any memory-mapped reader, numpy's memmap included): a sealed store's files are never
truncated by tracinfunc, and a truncation before the chunk is lent is a
:class:`CorruptStoreError`.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tracinfunc.errors import CorruptStoreError
from tracinfunc.store.zarr.raw_layout import CRC_BYTES, RawLayout

__all__ = ["ShardMaps"]

_PAGE = mmap.PAGESIZE
_RESIDENT_BYTES = 16 * 2**20
_AHEAD_BYTES = 32 * 2**20


@dataclass
class _Mapped:
    """One shard file mapped under one identity, with its index and verified chunks."""

    identity: tuple[int, ...]
    buffer: memoryview  # [file size] bytes of the mapping
    index: np.ndarray  # [chunks_per_shard, 2] (offset, length)
    map: mmap.mmap
    verified: set[int] = field(default_factory=set)
    ahead: int = 0  # bytes from here on have not been asked for (MADV_WILLNEED) this pass


class ShardMaps:
    """Whole stored chunks of one array's local shard files, lent as mapped bytes.

    Args:
        directory: The array's directory (``<group>/<array path>``).
        layout: Where its rows are (:meth:`RawLayout.of`).
        guard: Checks a file's size and tail as sealed, on its first use.
        before_map: Called before a file is mapped (again): the store checks it was not
            replaced at its path since it was opened.
    """

    def __init__(self, directory: Path, layout: RawLayout, *, guard=None,
                 before_map: Callable[[], None] | None = None) -> None:
        self._directory = directory
        self._layout = layout
        self._guard = guard
        self._before_map = before_map
        self._paths: dict[int, str] = {}
        self._maps: dict[int, _Mapped] = {}
        self._unmappable = False
        self._resident: tuple[_Mapped, int, int] | None = None  # used bytes not yet dropped
        self._lock = threading.Lock()

    @property
    def chunk_rows(self) -> int:
        return self._layout.chunk_rows

    def view(self, start: int, stop: int) -> tuple[memoryview, Callable[[], None]] | None:
        """Rows ``[start, stop)`` of one stored chunk (``start`` a multiple of ``chunk_rows``,
        ``stop`` the chunk's end or the array's) as ``(bytes, release)``, or ``None`` when
        the range is not one whole chunk or files cannot be mapped here.

        ``bytes`` is a writable view of a private mapping (writes would never reach the
        file); call ``release()`` once done with it: it raises if the file changed meanwhile.

        Raises:
            CorruptStoreError: a checksum fails, or the shard file is missing or short.
        """
        layout = self._layout
        if self._unmappable or start % layout.chunk_rows or stop <= start or \
                stop != min(start + layout.chunk_rows, layout.n_rows):
            return None
        shard = start // layout.shard_rows
        path = self._paths.get(shard) or self._paths.setdefault(
            shard, os.fspath(self._directory / layout.chunk_key(shard)))
        mapped = self._maps.get(shard)
        if mapped is None or mapped.identity != _path_identity(path):
            mapped = self._map(shard, path)
            if mapped is None:
                return None
        offset, length = mapped.index[start // layout.chunk_rows - shard * layout.chunks_per_shard]
        offset = int(offset)
        layout.check_chunk(offset, length, start, path)
        if offset + layout.stored_bytes > len(mapped.buffer):
            raise CorruptStoreError(f"{path} is truncated: the chunk of rows from {start} on "
                                    "is not in the file")
        data_bytes = layout.chunk_rows * layout.row_bytes
        if layout.chunk_crc and start not in mapped.verified:
            end = offset + data_bytes
            layout.verify(mapped.buffer[offset:end], mapped.buffer[end : end + CRC_BYTES],
                          start, path)
            mapped.verified.add(start)
        _read_ahead(mapped, offset)
        data = mapped.buffer[offset : offset + (stop - start) * layout.row_bytes]
        return data, lambda: _release(self, mapped, path, offset, offset + data_bytes, start)

    def _let_go(self, mapped: _Mapped, begin: int, end: int) -> None:
        """Drop used pages from this process's resident set once ``_RESIDENT_BYTES`` of them
        (or another file's) have gathered: memory stays a few chunks whatever the store's
        size; the pages stay in the page cache. One ``madvise`` per 16 MiB, not per chunk."""
        held = self._resident
        if held is not None and (held[0] is not mapped or not 0 <= begin - held[2] < _PAGE):
            self._drop(*held)
            held = None
        held = (mapped, begin if held is None else held[1], end)
        if held[2] - held[1] >= _RESIDENT_BYTES:
            self._drop(*held)
            held = None
        self._resident = held

    @staticmethod
    def _drop(mapped: _Mapped, begin: int, end: int) -> None:
        begin -= begin % _PAGE
        mapped.map.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    def _map(self, shard: int, path: str) -> _Mapped | None:
        """Map the shard file afresh (new identity: nothing verified), or ``None`` (and no
        more tries) where the file system cannot map it."""
        layout = self._layout
        if self._before_map is not None:
            self._before_map()
        if self._guard is not None:
            self._guard.check(Path(path))
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptStoreError(
                f"shard file {path} (rows [{shard * layout.shard_rows}, "
                f"{(shard + 1) * layout.shard_rows})) is missing"
            ) from None
        try:
            identity = _identity(os.fstat(fd))
            size = identity[2]
            raw = os.pread(fd, layout.index_bytes, size - layout.index_bytes) \
                if size >= layout.index_bytes else b""
            index = layout.parse_index(raw, f"file {path}")
            try:
                mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
            except (OSError, ValueError):
                self._unmappable = True
                return None
        finally:
            os.close(fd)
        mapped = _Mapped(identity, memoryview(mapping), index, mapping)
        with self._lock:
            self._maps[shard] = mapped
        return mapped


def _release(maps: ShardMaps, mapped: _Mapped, path: str, begin: int, end: int,
             start: int) -> None:
    """After bytes ``[begin, end)`` of a mapped file were used: refuse if the file changed
    meanwhile, then let go of their pages (see :meth:`ShardMaps._let_go`)."""
    if _path_identity(path) != mapped.identity:
        raise CorruptStoreError(
            f"{path} changed while the chunk of rows from {start} on was being read "
            "(its size, times or inode differ); the rows read may be wrong"
        )
    maps._let_go(mapped, begin, end)


def _read_ahead(mapped: _Mapped, offset: int) -> None:
    """Ask the kernel to read the next ``_AHEAD_BYTES`` of the file in the background (a
    cold page cache then reads while chunks are multiplied, as the copying reader's thread
    did): once per ``_AHEAD_BYTES / 2``, each byte once per pass."""
    if not offset <= mapped.ahead <= offset + _AHEAD_BYTES:  # a new pass, or outrun
        mapped.ahead = offset
    end = min(len(mapped.buffer), offset + _AHEAD_BYTES)
    if end - mapped.ahead >= _AHEAD_BYTES // 2 or (end == len(mapped.buffer) > mapped.ahead):
        begin = mapped.ahead - mapped.ahead % _PAGE
        mapped.map.madvise(mmap.MADV_WILLNEED, begin, end - begin)
        mapped.ahead = end


def _path_identity(path: str) -> tuple[int, ...] | None:
    try:
        return _identity(os.stat(path))
    except FileNotFoundError:
        return None


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
