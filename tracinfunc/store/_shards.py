"""Read row ranges of an uncompressed, sharded zarr v3 array straight from its shard files.

Zarr's own read path decodes every inner chunk through its async codec pipeline and copies
it twice; for uncompressed chunks that is pure overhead, because a chunk *is* its raw
little-endian bytes (plus a 4-byte crc32c when the codec chain has one). This reader takes
the shard index (``[chunks_per_shard, 2]`` uint64 offset/length pairs at the end of the
shard file, itself followed by its crc32c) and reads runs of contiguous chunks with one
``preadv`` straight into the caller's buffer, the checksums landing in a scratch buffer,
then verifies each crc32c itself. :class:`RawLayout` says whether an array has that layout;
``store/_remote_shards.py`` reads the same layout from object storage.
:func:`shard_reader` picks the reader; ``None`` (compression, other codecs) means use zarr.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tracinfunc.errors import CorruptStoreError

__all__ = ["RawLayout", "ShardReader", "crc32c", "shard_reader"]

try:  # ~2x faster than google_crc32c here and releases the GIL on large buffers
    from crc32c import crc32c
except ImportError:  # zarr's own dependency, always there
    import google_crc32c

    def crc32c(data) -> int:
        return google_crc32c.value(np.frombuffer(data, dtype=np.uint8))

_MISSING = np.uint64(2**64 - 1)
_CRC = 4  # bytes of a crc32c checksum


@dataclass(frozen=True)
class RawLayout:
    """Where the bytes of rows are in a sharded 2-D array ``[n_rows, k]`` of raw chunks.

    Attributes:
        n_rows, row_bytes: Array shape in rows and bytes per row.
        chunk_rows, shard_rows: Inner chunk and shard heights (both span the whole row).
        chunk_crc, index_crc: Whether inner chunks / the shard index end with a crc32c.
        chunk_key: ``shard_number -> key`` relative to the array (zarr's chunk key encoding).
    """

    n_rows: int
    row_bytes: int
    chunk_rows: int
    shard_rows: int
    chunk_crc: bool
    index_crc: bool
    chunk_key: Callable[[int], str]

    @classmethod
    def of(cls, array) -> RawLayout | None:
        """The layout of ``array`` (a ``zarr.Array``), or ``None`` if its chunks are not raw."""
        from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec

        codecs = array.metadata.codecs
        if (
            sys.byteorder != "little"
            or array.ndim != 2
            or len(codecs) != 1
            or not isinstance(codecs[0], ShardingCodec)
            or codecs[0].index_location.value != "end"
        ):
            return None
        sharding = codecs[0]
        chunk_crc = _raw_chain(sharding.codecs, BytesCodec, Crc32cCodec)
        index_crc = _raw_chain(sharding.index_codecs, BytesCodec, Crc32cCodec)
        n_rows, k = array.shape
        (chunk_rows, chunk_k), (shard_rows, shard_k) = sharding.chunk_shape, array.shards
        if chunk_crc is None or index_crc is None or chunk_k != k or shard_k != k:
            return None
        if array.metadata.data_type.to_native_dtype().byteorder == ">":
            return None
        metadata = array.metadata
        return cls(n_rows=n_rows, row_bytes=k * array.dtype.itemsize, chunk_rows=chunk_rows,
                   shard_rows=shard_rows, chunk_crc=chunk_crc, index_crc=index_crc,
                   chunk_key=lambda shard: metadata.encode_chunk_key((shard, 0)))

    @property
    def chunks_per_shard(self) -> int:
        return self.shard_rows // self.chunk_rows

    @property
    def stored_bytes(self) -> int:
        """Bytes of one stored inner chunk: its rows, then its crc32c if it has one."""
        return self.chunk_rows * self.row_bytes + (_CRC if self.chunk_crc else 0)

    @property
    def index_bytes(self) -> int:
        return self.chunks_per_shard * 16 + (_CRC if self.index_crc else 0)

    def shards(self, start: int, stop: int) -> range:
        """Shard numbers holding rows ``[start, stop)`` (``stop > start``)."""
        return range(start // self.shard_rows, (stop - 1) // self.shard_rows + 1)

    def parse_index(self, raw: bytes, where: object) -> np.ndarray:
        """The ``[chunks_per_shard, 2]`` (offset, length) index from a shard's last bytes."""
        if len(raw) != self.index_bytes:
            raise CorruptStoreError(f"shard {where} is too short to hold its index")
        if self.index_crc and crc32c(raw[:-_CRC]) != int.from_bytes(raw[-_CRC:], "little"):
            raise CorruptStoreError(f"checksum mismatch in the shard index of {where}")
        return np.frombuffer(raw, dtype="<u8", count=self.chunks_per_shard * 2).reshape(-1, 2)

    def check_chunk(self, offset, length, chunk_start: int, where: object) -> None:
        """Raise unless the index entry points at a whole stored chunk."""
        if offset == _MISSING or int(length) != self.stored_bytes:
            raise CorruptStoreError(
                f"chunk of rows [{chunk_start}, {chunk_start + self.chunk_rows}) in {where} is "
                f"missing or has the wrong size ({int(length)} bytes, expected "
                f"{self.stored_bytes})"
            )

    def verify(self, data, stored_crc, chunk_start: int, where: object) -> None:
        """Raise unless ``data`` (a chunk's rows) matches its stored crc32c (4 bytes)."""
        if crc32c(data) != int.from_bytes(stored_crc, "little"):
            raise CorruptStoreError(
                f"checksum mismatch in the chunk of rows [{chunk_start}, "
                f"{chunk_start + self.chunk_rows}) of {where}"
            )


def shard_reader(array, *, guard=None, byte_store=None):
    """The raw reader for ``array``: local files, or any other zarr store (object storage).

    ``None`` when its chunks are not raw (compression, other codecs): read through zarr.
    ``guard``: an optional :class:`~tracinfunc.store.integrity.FileGuard` checking each
    local shard file before its first read. ``byte_store``: a zarr store with the same root
    as the array's to read remote bytes through instead (``store/_object_reads.py``)."""
    from zarr.storage import LocalStore

    layout = RawLayout.of(array)
    if layout is None:
        return None
    if isinstance(array.store, LocalStore):
        return ShardReader(Path(array.store.root) / array.path, layout, guard=guard)
    from tracinfunc.store._remote_shards import RemoteShardReader

    return RemoteShardReader(byte_store or array.store, array.path, layout)


class ShardReader:
    """Raw reads of rows ``[start, stop)`` of one array from its local shard files.

    Args:
        directory: The array's directory (``<group>/<array path>``).
        layout: Where its rows are (:meth:`RawLayout.of`).
        guard: Checks a file's size and tail as sealed, on its first read.
    """

    def __init__(self, directory: Path, layout: RawLayout, *, guard=None) -> None:
        self._directory = directory
        self._layout = layout
        self._guard = guard
        self._indices: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_array(cls, array, *, guard=None) -> ShardReader | None:
        """A local reader for ``array``, or ``None`` if it is not raw local files."""
        reader = shard_reader(array, guard=guard)
        return reader if isinstance(reader, ShardReader) else None

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
        if self._guard is not None:
            self._guard.check(path, caller="ZarrStore")
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptStoreError(
                f"shard file {path} (rows [{shard * layout.shard_rows}, "
                f"{(shard + 1) * layout.shard_rows})) is missing"
            ) from None
        try:
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
                        self._read_run(fd, run, start, out, path)
                        run = []
                    run.append((chunk_start, rows, int(offset)))
                else:  # partial or edge chunk: through a scratch buffer
                    self._read_run(fd, run, start, out, path)
                    run = []
                    self._read_partial(fd, int(offset), chunk_start, start, stop, out, path)
            self._read_run(fd, run, start, out, path)
        finally:
            os.close(fd)

    def _read_run(self, fd: int, run: list[tuple[int, int, int]], start: int,
                  out: memoryview, path: Path) -> None:
        """One ``preadv`` for chunks that follow each other in the file: data into ``out``."""
        if not run:
            return
        layout = self._layout
        data_bytes = layout.chunk_rows * layout.row_bytes
        crcs = bytearray(_CRC * len(run)) if layout.chunk_crc else bytearray()
        buffers: list[memoryview] = []
        for i, (chunk_start, _, _) in enumerate(run):
            begin = (chunk_start - start) * layout.row_bytes
            buffers.append(out[begin : begin + data_bytes])
            if layout.chunk_crc:
                buffers.append(memoryview(crcs)[i * _CRC : (i + 1) * _CRC])
        per_chunk = 2 if layout.chunk_crc else 1
        for part in range(0, len(buffers), 1024):  # IOV_MAX
            offset = run[0][2] + (part // per_chunk) * layout.stored_bytes
            _preadv(fd, buffers[part : part + 1024], offset, path, run[0][0])
        if layout.chunk_crc:
            for i, (chunk_start, _, _) in enumerate(run):
                begin = (chunk_start - start) * layout.row_bytes
                layout.verify(out[begin : begin + data_bytes], crcs[i * _CRC : (i + 1) * _CRC],
                              chunk_start, path)

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


def copy_chunk_rows(layout: RawLayout, stored: memoryview, chunk_start: int, start: int,
                    stop: int, out: memoryview, where: object) -> None:
    """Verify one stored chunk (``layout.stored_bytes``) and copy its rows that fall in
    ``[start, stop)`` to their place in ``out`` (which holds rows ``[start, stop)``)."""
    data = stored[: layout.chunk_rows * layout.row_bytes]
    if layout.chunk_crc:
        layout.verify(data, stored[-_CRC:], chunk_start, where)
    lo, hi = max(start, chunk_start), min(stop, chunk_start + layout.chunk_rows)
    out[(lo - start) * layout.row_bytes : (hi - start) * layout.row_bytes] = data[
        (lo - chunk_start) * layout.row_bytes : (hi - chunk_start) * layout.row_bytes
    ]


def _preadv(fd: int, buffers: list[memoryview], offset: int, path: Path,
            chunk_start: int) -> None:
    expected = sum(len(b) for b in buffers)
    got = os.preadv(fd, buffers, offset)
    if got != expected:
        raise CorruptStoreError(
            f"{path} is truncated: rows from {chunk_start} on could not be read "
            f"({got} of {expected} bytes)"
        )


def _raw_chain(codecs, bytes_codec, crc_codec) -> bool | None:
    """``True``/``False``: raw little-endian bytes with/without crc32c; ``None``: other codecs."""
    if not codecs or not isinstance(codecs[0], bytes_codec):
        return None
    if codecs[0].endian is not None and codecs[0].endian.value != "little":
        return None
    rest = codecs[1:]
    if not rest:
        return False
    if len(rest) == 1 and isinstance(rest[0], crc_codec):
        return True
    return None
