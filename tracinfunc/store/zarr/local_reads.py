"""Raw reads of row ranges of a sharded zarr v3 array straight from its local shard files.

Zarr's own read path decodes every inner chunk through its async codec pipeline and copies
it twice; for uncompressed chunks that is pure overhead. This reader takes the shard index
and reads runs of contiguous chunks with one ``preadv`` straight into the caller's buffer,
the checksums landing in a scratch buffer, then verifies each crc32c itself (the layout:
``raw_layout.py``; the same layout from object storage: ``remote_reads.py``).

A whole chunk's crc32c is verified on its first read and not on later ones while its shard
file keeps the same identity: device, inode, size, modification and status-change times
(``fstat`` of the open file before and after each read). On a warm page cache the checksum
costs as much as the copy (64 x 20,000 x 4096 float32, 1 thread: crc32c 0.53x, the copy
0.45x, the matmul 1.05x of a numpy memmap + matmul). Any change made through the file system
(a write, a truncation, ``os.utime`` putting the modification time back, a replaced file)
changes the status-change time or the inode, so every chunk of that file is verified again
and its index re-read; a file that changes while it is read has the chunks read verified.
Not detected until the store is reopened: corruption that bypasses the file system (media
decay under a file whose pages left the page cache after their first verified read); file
systems with their own checksums (ZFS, btrfs) catch that.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from tracinfunc.errors import CorruptStoreError
from tracinfunc.store.zarr.integrity import file_identity, open_regular
from tracinfunc.store.zarr.raw_layout import CRC_BYTES, RawLayout, copy_chunk_rows

__all__ = ["ShardReader"]


class ShardReader:
    """Raw reads of rows ``[start, stop)`` of one array from its local shard files.

    Args:
        directory: The array's directory (``<group>/<array path>``).
        layout: Where its rows are (:meth:`RawLayout.of`).
        guard: Checks a file's size and tail as sealed (that it is the file sealed at its
            position) on its first read and whenever its identity changed.
    """

    def __init__(self, directory: Path, layout: RawLayout, *, guard=None) -> None:
        self._directory = directory
        self._layout = layout
        self._guard = guard
        self._indices: dict[int, np.ndarray] = {}
        # shard -> (file identity, chunks verified while the file had that identity)
        self._verified: dict[int, tuple[tuple, set[int]]] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_array(cls, array, *, guard=None) -> ShardReader | None:
        """A local reader for ``array``, or ``None`` if it is not raw local files."""
        from zarr.storage import LocalStore
        layout = RawLayout.of(array)
        if layout is None or not isinstance(array.store, LocalStore):
            return None
        return cls(Path(array.store.root) / array.path, layout, guard=guard)

    @property
    def chunk_rows(self) -> int:
        return self._layout.chunk_rows

    def read_into(self, start: int, stop: int, out: memoryview) -> None:
        """Fill ``out`` (``(stop - start) * row_bytes`` bytes) with rows ``[start, stop)``.

        Raises:
            CorruptStoreError: a checksum fails, or a shard file or chunk is missing or short.
        """
        layout = self._layout
        for shard in layout.shards(start, stop) if stop > start else ():
            lo = max(start, shard * layout.shard_rows)
            hi = min(stop, (shard + 1) * layout.shard_rows)
            begin = (lo - start) * layout.row_bytes
            self._read_shard(shard, lo, hi, out[begin : begin + (hi - lo) * layout.row_bytes])

    def _read_shard(self, shard: int, start: int, stop: int, out: memoryview) -> None:
        layout = self._layout
        path = self._directory / layout.chunk_key(shard)
        try:
            fd = open_regular(path)  # a named pipe there is refused, not waited on
        except FileNotFoundError:
            if self._guard is not None:
                self._guard.check(path)  # names the missing file as the store's
            raise CorruptStoreError(
                f"shard file {path} (rows [{shard * layout.shard_rows}, "
                f"{(shard + 1) * layout.shard_rows})) is missing"
            ) from None
        try:
            if self._guard is not None:  # the file sealed here? (again after any change)
                self._guard.check(path, fd)
            verified = self._verified_chunks(fd, shard)
            index = self._index(fd, shard, path)
            first_chunk = shard * layout.chunks_per_shard
            run: list[tuple[int, int, int]] = []  # (chunk row start, rows, file offset)
            for chunk in range(start // layout.chunk_rows, (stop - 1) // layout.chunk_rows + 1):
                chunk_start = chunk * layout.chunk_rows
                offset, length = index[chunk - first_chunk]
                rows = min(layout.chunk_rows, layout.n_rows - chunk_start)
                layout.check_chunk(offset, length, chunk_start, path)
                whole = rows == layout.chunk_rows
                if whole and start <= chunk_start and chunk_start + rows <= stop:
                    if run and run[-1][2] + layout.stored_bytes != int(offset):
                        self._read_run(fd, run, start, out, path, verified)
                        run = []
                    run.append((chunk_start, rows, int(offset)))
                else:  # partial or edge chunk: through a scratch buffer
                    self._read_run(fd, run, start, out, path, verified)
                    run = []
                    self._read_partial(fd, int(offset), chunk_start, start, stop, out, path)
            self._read_run(fd, run, start, out, path, verified)
        finally:
            os.close(fd)

    def _verified_chunks(self, fd: int, shard: int) -> tuple[tuple, set[int]]:
        """``(identity, chunk starts of shard verified while its file had that identity)``;
        a new identity empties the set and drops the cached index."""
        identity = file_identity(os.fstat(fd))
        with self._lock:
            known = self._verified.get(shard)
            if known is None or known[0] != identity:
                self._indices.pop(shard, None)
                known = self._verified[shard] = (identity, set())
        return known

    def _read_run(self, fd: int, run: list[tuple[int, int, int]], start: int,
                  out: memoryview, path: Path, verified: tuple[tuple, set[int]]) -> None:
        """One ``preadv`` for chunks that follow each other in the file: data into ``out``."""
        if not run:
            return
        layout = self._layout
        data_bytes = layout.chunk_rows * layout.row_bytes
        crcs = bytearray(CRC_BYTES * len(run)) if layout.chunk_crc else bytearray()
        buffers: list[memoryview] = []
        for i, (chunk_start, _, _) in enumerate(run):
            begin = (chunk_start - start) * layout.row_bytes
            buffers.append(out[begin : begin + data_bytes])
            if layout.chunk_crc:
                buffers.append(memoryview(crcs)[i * CRC_BYTES : (i + 1) * CRC_BYTES])
        per_chunk = 2 if layout.chunk_crc else 1
        for part in range(0, len(buffers), 1024):  # IOV_MAX
            offset = run[0][2] + (part // per_chunk) * layout.stored_bytes
            _preadv(fd, buffers[part : part + 1024], offset, path, run[0][0])
        if layout.chunk_crc:
            identity, done = verified
            # A file changed while it was read (identity differs now): trust nothing.
            trusted = done if file_identity(os.fstat(fd)) == identity else set()
            for i, (chunk_start, _, _) in enumerate(run):
                if chunk_start in trusted:
                    continue
                begin = (chunk_start - start) * layout.row_bytes
                layout.verify(
                    out[begin : begin + data_bytes],
                    crcs[i * CRC_BYTES : (i + 1) * CRC_BYTES],
                    chunk_start,
                    path,
                )
                done.add(chunk_start)

    def _read_partial(self, fd: int, offset: int, chunk_start: int, start: int, stop: int,
                      out: memoryview, path: Path) -> None:
        layout = self._layout
        stored = bytearray(layout.stored_bytes)
        _preadv(fd, [memoryview(stored)], offset, path, chunk_start)
        copy_chunk_rows(layout, memoryview(stored), chunk_start, start, stop, out, path)

    def _index(self, fd: int, shard: int, path: Path) -> np.ndarray:
        index = self._indices.get(shard)
        if index is not None:
            return index
        size = self._layout.index_bytes
        file_size = os.fstat(fd).st_size
        raw = os.pread(fd, size, file_size - size) if file_size >= size else b""
        index = self._layout.parse_index(raw, f"file {path}")
        with self._lock:
            self._indices[shard] = index
        return index


def _preadv(fd: int, buffers: list[memoryview], offset: int, path: Path,
            chunk_start: int) -> None:
    expected = sum(len(b) for b in buffers)
    got = os.preadv(fd, buffers, offset)
    if got != expected:
        raise CorruptStoreError(
            f"{path} is truncated: rows from {chunk_start} on could not be read "
            f"({got} of {expected} bytes)"
        )

