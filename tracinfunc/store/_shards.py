"""Read row ranges of an uncompressed, sharded zarr v3 array straight from its shard files.

Zarr's own read path decodes every inner chunk through its async codec pipeline and copies
it twice; for uncompressed chunks that is pure overhead, because a chunk *is* its raw
little-endian bytes (plus a 4-byte crc32c when the codec chain has one). This reader takes
the shard index (``[chunks_per_shard, 2]`` uint64 offset/length pairs at the end of the
shard file, itself followed by its crc32c) and reads runs of contiguous chunks with one
``preadv`` straight into the caller's buffer, the checksums landing in a scratch buffer,
then verifies each crc32c itself. Any other layout (compression, other codecs, another
store backend) returns ``None`` from :meth:`ShardReader.for_array` and the caller uses zarr.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import numpy as np

from tracinfunc.errors import CorruptStoreError

__all__ = ["ShardReader", "crc32c"]

try:  # ~2x faster than google_crc32c here and releases the GIL on large buffers
    from crc32c import crc32c
except ImportError:  # zarr's own dependency, always there
    import google_crc32c

    def crc32c(data) -> int:
        return google_crc32c.value(np.frombuffer(data, dtype=np.uint8))

_MISSING = np.uint64(2**64 - 1)
_CRC = 4  # bytes of a crc32c checksum


class ShardReader:
    """Raw reads of rows ``[start, stop)`` of one 2-D sharded array ``[n_rows, k]``.

    Args:
        directory: The array's directory (``<group>/<array path>``).
        n_rows, row_bytes: Array shape in rows and bytes per row.
        chunk_rows, shard_rows: Inner chunk and shard heights (both span the whole row).
        chunk_crc, index_crc: Whether inner chunks / the shard index end with a crc32c.
        chunk_key: ``shard_number -> relative file path`` (zarr's chunk key encoding).
    """

    def __init__(self, directory: Path, *, n_rows: int, row_bytes: int, chunk_rows: int,
                 shard_rows: int, chunk_crc: bool, index_crc: bool, chunk_key,
                 guard=None) -> None:
        self._directory = directory
        self._n_rows, self._row_bytes = n_rows, row_bytes
        self._chunk_rows, self._shard_rows = chunk_rows, shard_rows
        self._chunks_per_shard = shard_rows // chunk_rows
        self._chunk_crc, self._index_crc = chunk_crc, index_crc
        self._chunk_key = chunk_key
        self._guard = guard  # FileGuard: a file's size and tail as sealed, on its first read
        self._indices: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_array(cls, array, *, guard=None) -> ShardReader | None:
        """A reader for ``array`` (a ``zarr.Array``), or ``None`` if its layout is not raw.

        ``guard``: an optional :class:`~tracinfunc.store.integrity.FileGuard` checking each
        shard file before its first read."""
        from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec
        from zarr.storage import LocalStore

        codecs = array.metadata.codecs
        if (
            sys.byteorder != "little"
            or not isinstance(array.store, LocalStore)
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
        return cls(
            Path(array.store.root) / array.path,
            n_rows=n_rows,
            row_bytes=k * array.dtype.itemsize,
            chunk_rows=chunk_rows,
            shard_rows=shard_rows,
            chunk_crc=chunk_crc,
            index_crc=index_crc,
            chunk_key=lambda shard: metadata.encode_chunk_key((shard, 0)),
            guard=guard,
        )

    @property
    def chunk_rows(self) -> int:
        return self._chunk_rows

    def read_into(self, start: int, stop: int, out: memoryview) -> None:
        """Fill ``out`` (``(stop - start) * row_bytes`` bytes) with rows ``[start, stop)``.

        Raises:
            CorruptStoreError: a checksum fails, or a shard file or chunk is missing or short.
        """
        row = start
        while row < stop:
            shard = row // self._shard_rows
            shard_stop = min(stop, (shard + 1) * self._shard_rows)
            begin = (row - start) * self._row_bytes
            self._read_shard(shard, row, shard_stop, out[begin : begin + (shard_stop - row)
                                                         * self._row_bytes])
            row = shard_stop

    def _read_shard(self, shard: int, start: int, stop: int, out: memoryview) -> None:
        path = self._directory / self._chunk_key(shard)
        if self._guard is not None:
            self._guard.check(path, caller="ZarrStore")
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptStoreError(
                f"shard file {path} (rows [{shard * self._shard_rows}, "
                f"{(shard + 1) * self._shard_rows})) is missing"
            ) from None
        try:
            index = self._index(fd, shard, path)
            first_chunk = shard * self._chunks_per_shard
            run: list[tuple[int, int, int]] = []  # (chunk row start, rows, file offset)
            for chunk in range(start // self._chunk_rows, (stop - 1) // self._chunk_rows + 1):
                chunk_start = chunk * self._chunk_rows
                offset, length = index[chunk - first_chunk]
                rows = min(self._chunk_rows, self._n_rows - chunk_start)
                self._check_chunk(offset, length, chunk_start, path)
                if start <= chunk_start and chunk_start + rows <= stop and rows == self._chunk_rows:
                    if run and run[-1][2] + self._stored_bytes() != int(offset):
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

    def _stored_bytes(self) -> int:
        return self._chunk_rows * self._row_bytes + (_CRC if self._chunk_crc else 0)

    def _check_chunk(self, offset, length, chunk_start: int, path: Path) -> None:
        if offset == _MISSING or int(length) != self._stored_bytes():
            raise CorruptStoreError(
                f"chunk of rows [{chunk_start}, {chunk_start + self._chunk_rows}) in {path} is "
                f"missing or has the wrong size ({int(length)} bytes, expected "
                f"{self._stored_bytes()})"
            )

    def _read_run(self, fd: int, run: list[tuple[int, int, int]], start: int,
                  out: memoryview, path: Path) -> None:
        """One ``preadv`` for chunks that follow each other in the file: data into ``out``."""
        if not run:
            return
        data_bytes = self._chunk_rows * self._row_bytes
        crcs = bytearray(_CRC * len(run)) if self._chunk_crc else bytearray()
        buffers: list[memoryview] = []
        for i, (chunk_start, _, _) in enumerate(run):
            begin = (chunk_start - start) * self._row_bytes
            buffers.append(out[begin : begin + data_bytes])
            if self._chunk_crc:
                buffers.append(memoryview(crcs)[i * _CRC : (i + 1) * _CRC])
        for part in range(0, len(buffers), 1024):  # IOV_MAX
            self._preadv(fd, buffers[part : part + 1024],
                         run[0][2] + self._offset_of(part), path, run[0][0])
        if self._chunk_crc:
            for i, (chunk_start, _, _) in enumerate(run):
                begin = (chunk_start - start) * self._row_bytes
                self._verify(out[begin : begin + data_bytes], crcs[i * _CRC : (i + 1) * _CRC],
                             chunk_start, path)

    def _offset_of(self, buffer_number: int) -> int:
        per_chunk = 2 if self._chunk_crc else 1
        return (buffer_number // per_chunk) * self._stored_bytes()

    def _read_partial(self, fd: int, offset: int, chunk_start: int, start: int, stop: int,
                      out: memoryview, path: Path) -> None:
        stored = bytearray(self._stored_bytes())
        self._preadv(fd, [memoryview(stored)], offset, path, chunk_start)
        data = memoryview(stored)[: self._chunk_rows * self._row_bytes]
        if self._chunk_crc:
            self._verify(data, stored[-_CRC:], chunk_start, path)
        lo, hi = max(start, chunk_start), min(stop, chunk_start + self._chunk_rows)
        out[(lo - start) * self._row_bytes : (hi - start) * self._row_bytes] = data[
            (lo - chunk_start) * self._row_bytes : (hi - chunk_start) * self._row_bytes
        ]

    def _preadv(self, fd: int, buffers: list[memoryview], offset: int, path: Path,
                chunk_start: int) -> None:
        expected = sum(len(b) for b in buffers)
        got = os.preadv(fd, buffers, offset)
        if got != expected:
            raise CorruptStoreError(
                f"{path} is truncated: rows from {chunk_start} on could not be read "
                f"({got} of {expected} bytes)"
            )

    def _verify(self, data: memoryview, stored_crc, chunk_start: int, path: Path) -> None:
        computed = crc32c(data)
        if computed != int.from_bytes(stored_crc, "little"):
            raise CorruptStoreError(
                f"checksum mismatch in the chunk of rows [{chunk_start}, "
                f"{chunk_start + self._chunk_rows}) of {path}"
            )

    def _index(self, fd: int, shard: int, path: Path) -> np.ndarray:
        index = self._indices.get(shard)
        if index is not None:
            return index
        size = self._chunks_per_shard * 16 + (_CRC if self._index_crc else 0)
        file_size = os.fstat(fd).st_size
        raw = os.pread(fd, size, file_size - size) if file_size >= size else b""
        if len(raw) != size:
            raise CorruptStoreError(f"shard file {path} is too short to hold its index")
        if self._index_crc and crc32c(raw[:-_CRC]) != int.from_bytes(
            raw[-_CRC:], "little"
        ):
            raise CorruptStoreError(f"checksum mismatch in the shard index of {path}")
        index = np.frombuffer(raw, dtype="<u8", count=self._chunks_per_shard * 2).reshape(-1, 2)
        with self._lock:
            self._indices[shard] = index
        return index


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
