"""Zero-copy reads of whole stored chunks: views of a mapping of the local shard file.

On a warm page cache, copying a chunk out of the cache (``preadv``) costs about half as
much as multiplying it (64 test rows, k=4096, float32, 1 thread); a numpy memmap reads in
place. :class:`ShardMaps` lends one stored chunk's rows as a view of a private
(copy-on-write) mapping of that chunk of its shard file (widened to 2 MiB boundaries of the
file; only the chunk's bytes are lent), so a query multiplies the page cache's own pages.
A query lends through a :class:`ChunkLender`: windows of up to ``WINDOW_BYTES`` of a shard
file, each mapped once and shared by the chunks it holds (the kernel maps a 64 MiB
mapping's 2 MiB page-cache folios whole, a 6 MiB one's page by page: one mapping per chunk
cost ~5% of a warm query), the files kept open for the pass. A window lends each chunk at
most once and goes when its last view is dropped: a write into a lent view changes that
view only, never the file, another lend or a later score, and a dropped store or a closed
lender holds no mapping and no open file.

Integrity, as in :mod:`tracinfunc.store.zarr.local_reads`:

* Each lend opens the shard file without blocking and refuses anything but a regular file
  (a named pipe there would block ``open``), then takes its identity (``fstat``): device,
  inode, size, modification and status-change times (a lender keeps the file open and
  compares its path's identity, ``stat``, before each lend: a different one reopens it). A
  new identity (a write, a truncation, ``os.utime``, a file renamed, hard-linked or copied
  over it) runs the check a fresh open runs (the store's guard: the file sealed at this
  position, by size and tail hash), then re-reads the index and forgets which chunks were
  verified; nothing is lent from a window mapped under the old identity.
* A chunk's crc32c is verified (over the mapped bytes) on its first lend while its shard
  file keeps one identity.
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
from tracinfunc.store.zarr.integrity import file_identity, open_regular
from tracinfunc.store.zarr.raw_layout import CRC_BYTES, RawLayout

__all__ = ["WINDOW_BYTES", "ChunkLender", "ShardMaps"]

# Mappings start and end on 2 MiB of the file (the kernel then places them 2 MiB-aligned),
# so that the page cache's 2 MiB folios can be mapped by one page-table entry each instead of
# 512 (the bytes beyond the chunk are never exposed). Linux 6.18 does so only for larger
# mappings (measured: none of a 6-16 MiB mapping, 24 of 64 MiB, 215 of 256 MiB): hence a
# pass's 64 MiB windows (ChunkLender).
_ALIGN = max(2 * 2**20, mmap.ALLOCATIONGRANULARITY)
_AHEAD_BYTES = 32 * 2**20
WINDOW_BYTES = 64 * 2**20
"""Bytes of a shard file one mapping of a pass covers (:class:`ChunkLender`)."""
_PROBE_BYTES = 2 * 2**20
_NOWAIT = getattr(os, "RWF_NOWAIT", None)  # Linux: reads that fail instead of waiting


@dataclass
class _Shard:
    """One shard file under one identity: its index and the chunks verified meanwhile."""

    identity: tuple[int, ...]
    index: np.ndarray  # [chunks_per_shard, 2] (offset, length)
    verified: set[int] = field(default_factory=set)
    ahead: int = 0  # bytes from here on have not been asked for (WILLNEED) this pass


class ShardMaps:
    """Whole stored chunks of one array's local shard files, lent as mapped bytes.

    Args:
        directory: The array's directory (``<group>/<array path>``).
        layout: Where its rows are (:meth:`RawLayout.of`).
        guard: Checks a file is the one sealed at its position (size, tail), on its first
            use and whenever its identity changed.
        before_map: Called before a file is read under a new identity: the store checks it
            was not replaced at its path since it was opened.
    """

    def __init__(self, directory: Path, layout: RawLayout, *, guard=None,
                 before_map: Callable[[], None] | None = None) -> None:
        self._directory = directory
        self._layout = layout
        self._guard = guard
        self._before_map = before_map
        self._paths: dict[int, str] = {}
        self._shards: dict[int, _Shard] = {}
        self._unmappable = False
        self._lock = threading.Lock()

    @property
    def chunk_rows(self) -> int:
        return self._layout.chunk_rows

    def view(self, start: int, stop: int) -> tuple[memoryview, Callable[[], None]] | None:
        """Rows ``[start, stop)`` of one stored chunk (``start`` a multiple of ``chunk_rows``,
        ``stop`` the chunk's end or the array's) as ``(bytes, release)``, or ``None`` when
        the range is not one whole chunk or files cannot be mapped here.

        ``bytes`` views a private mapping of this lend alone (a write reaches neither the
        file nor any other lend); call ``release()`` once done with it: it raises if the file
        changed meanwhile.

        Raises:
            CorruptStoreError: a checksum fails, the shard file is missing, short or not the
                one sealed at its position.
        """
        lender = self.lender(window_bytes=0)
        try:
            return lender.view(start, stop)
        finally:
            lender.close()

    def lender(self, *, window_bytes: int = WINDOW_BYTES) -> ChunkLender:
        """A :class:`ChunkLender` for one pass over this array's chunks (close it after)."""
        return ChunkLender(self, window_bytes)

    def _open(self, shard: int, path: str) -> int:
        try:
            return open_regular(path)  # a named pipe there is refused, not waited on
        except FileNotFoundError:
            layout = self._layout
            raise CorruptStoreError(
                f"shard file {path} (rows [{shard * layout.shard_rows}, "
                f"{(shard + 1) * layout.shard_rows})) is missing"
            ) from None

    def _known(self, shard: int, path: str, fd: int) -> tuple[_Shard, int]:
        """The shard's index and verified chunks under the open file's identity (checked as
        at a fresh open, and its index read, when the identity is new) and its size."""
        identity = file_identity(os.fstat(fd))
        known = self._shards.get(shard)
        if known is not None and known.identity == identity:
            return known, identity[2]
        if self._before_map is not None:
            self._before_map()
        if self._guard is not None:
            self._guard.check(Path(path), fd)
        layout, size = self._layout, identity[2]
        raw = os.pread(fd, layout.index_bytes, size - layout.index_bytes) \
            if size >= layout.index_bytes else b""
        known = _Shard(identity, layout.parse_index(raw, f"file {path}"))
        with self._lock:
            self._shards[shard] = known
        return known, size


@dataclass
class _Window:
    """A private mapping of bytes ``[lo, hi)`` of one shard file under one identity, and the
    chunks lent from it (each at most once: a write into one lend never shows in another)."""

    shard: int
    identity: tuple[int, ...]
    lo: int
    hi: int
    mapping: mmap.mmap
    lent: set[int] = field(default_factory=set)


class ChunkLender:
    """Lends the chunks of one pass (a query) through windows of their shard files.

    :meth:`ShardMaps.view` maps each chunk on its own: one ``mmap`` and ``munmap`` per 4 MiB
    chunk, and kernels map only larger mappings' 2 MiB page-cache folios whole (64 MiB
    mappings of a shard file: 2 MiB entries; 6 MiB ones: 4 KiB entries). A pass maps windows
    of ``window_bytes`` (2 MiB-aligned, widened to hold a whole chunk) once and lends the
    chunks each holds as views of it, keeping each shard file open until :meth:`close`. At
    64 MiB: a warm 64 x 50,000 x 4096 float32 query ~5% faster on a 2-core AMD EPYC, peak
    RSS +40 MiB (the window's mapped pages; a window goes with its last view).

    Every lend still takes the file's identity first (``stat`` of its path: a file replaced,
    edited or truncated since its window was mapped is reopened and checked as at a fresh
    open, and its chunks' crc32c verified again; nothing is lent from the old window), and
    ``release`` takes it again after the chunk was used, as :meth:`ShardMaps.view` does.
    Not thread-safe: one lender per pass (the :class:`ShardMaps` under it is).
    """

    def __init__(self, maps: ShardMaps, window_bytes: int) -> None:
        self._maps = maps
        self._window_bytes = window_bytes
        self._files: dict[int, tuple[int, _Shard]] = {}  # shard -> (open fd, its identity)
        self._window: _Window | None = None

    def view(self, start: int, stop: int) -> tuple[memoryview, Callable[[], None]] | None:
        """As :meth:`ShardMaps.view`, the bytes a view of this pass's window (a private
        mapping: a write reaches neither the file nor any other lend)."""
        maps = self._maps
        layout = maps._layout
        if maps._unmappable or start % layout.chunk_rows or stop <= start or \
                stop != min(start + layout.chunk_rows, layout.n_rows):
            return None
        shard = start // layout.shard_rows
        path = maps._paths.get(shard) or maps._paths.setdefault(
            shard, os.fspath(maps._directory / layout.chunk_key(shard)))
        fd, known = self._file(shard, path)
        size = known.identity[2]
        offset, length = known.index[start // layout.chunk_rows
                                     - shard * layout.chunks_per_shard]
        offset = int(offset)
        layout.check_chunk(offset, length, start, path)
        if offset + layout.stored_bytes > size:
            raise CorruptStoreError(f"{path} is truncated: the chunk of rows from {start} "
                                    "on is not in the file")
        window = self._window_for(shard, known, fd, start, offset, size)
        if window is None:
            return None
        _read_ahead(known, fd, offset, size)
        window.lent.add(start)
        begin = offset - window.lo
        buffer = memoryview(window.mapping)[begin : begin + layout.stored_bytes]
        data_bytes = layout.chunk_rows * layout.row_bytes
        if layout.chunk_crc and start not in known.verified:
            layout.verify(buffer[:data_bytes], buffer[data_bytes : data_bytes + CRC_BYTES],
                          start, path)
            known.verified.add(start)
        identity = known.identity
        return buffer[: (stop - start) * layout.row_bytes], \
            lambda: _release(path, identity, start)

    def close(self) -> None:
        """Close the files kept open and drop the window (lent views keep their mapping)."""
        self._window = None
        files, self._files = self._files, {}
        for fd, _ in files.values():
            os.close(fd)

    def _file(self, shard: int, path: str) -> tuple[int, _Shard]:
        """The shard's open file and what is known of it, reopened (and checked as at a
        fresh open) when the path's identity is not the one it was opened under."""
        held = self._files.get(shard)
        if held is not None:
            if _path_identity(path) == held[1].identity:
                return held
            del self._files[shard]
            os.close(held[0])
        maps = self._maps
        fd = maps._open(shard, path)
        try:
            known, _ = maps._known(shard, path, fd)
        except BaseException:
            os.close(fd)
            raise
        self._files[shard] = (fd, known)
        return fd, known

    def _window_for(self, shard: int, known: _Shard, fd: int, start: int, offset: int,
                    size: int) -> _Window | None:
        """The window holding the stored chunk at ``offset`` (a new one unless the current
        one does, under the same identity, and has not lent it yet); ``None`` where the
        file system cannot map files."""
        stored = self._maps._layout.stored_bytes
        window = self._window
        if window is not None and window.shard == shard and \
                window.identity == known.identity and window.lo <= offset and \
                offset + stored <= window.hi and start not in window.lent:
            return window
        self._window = None
        lo = offset - offset % _ALIGN
        hi = min(size, max(lo + self._window_bytes, -(-(offset + stored) // _ALIGN) * _ALIGN))
        try:
            mapping = mmap.mmap(fd, hi - lo, access=mmap.ACCESS_COPY, offset=lo)
        except (OSError, ValueError):
            self._maps._unmappable = True
            return None
        self._window = _Window(shard, known.identity, lo, hi, mapping)
        return self._window


def _release(path: str, identity: tuple[int, ...], start: int) -> None:
    """After a lent chunk was used: refuse if its file changed meanwhile."""
    if _path_identity(path) != identity:
        raise CorruptStoreError(
            f"{path} changed while the chunk of rows from {start} on was being read "
            "(its size, times or inode differ); the rows read may be wrong"
        )


def _read_ahead(known: _Shard, fd: int, offset: int, size: int) -> None:
    """Ask the kernel to read the next ``_AHEAD_BYTES`` of the file in the background (a
    cold page cache then reads while chunks are multiplied): once per ``_AHEAD_BYTES / 2``,
    each byte once per pass, and only where a probe finds a page of it not yet cached (on a
    warm cache the request walks every page of the span for nothing)."""
    if not offset <= known.ahead <= offset + _AHEAD_BYTES:  # a new pass, or outrun
        known.ahead = offset
    end = min(size, offset + _AHEAD_BYTES)
    if end - known.ahead >= _AHEAD_BYTES // 2 or (end == size > known.ahead):
        if not _cached(fd, known.ahead, end):
            os.posix_fadvise(fd, known.ahead, end - known.ahead, os.POSIX_FADV_WILLNEED)
        known.ahead = end


def _cached(fd: int, start: int, end: int) -> bool:
    """Whether bytes ``[start, end)`` of the file look cached: one byte every
    ``_PROBE_BYTES`` (and the last) is read without waiting (``RWF_NOWAIT``: the read fails
    rather than go to the disk). ``False`` where that read is not supported."""
    if _NOWAIT is None:
        return False
    probe = bytearray(1)
    try:
        for position in (*range(start, end - 1, _PROBE_BYTES), end - 1):
            if os.preadv(fd, [probe], position, _NOWAIT) != 1:
                return False
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP/EINVAL: no such reads here
        return False
    return True


def _path_identity(path: str) -> tuple[int, ...] | None:
    try:
        return file_identity(os.stat(path))
    except FileNotFoundError:
        return None
