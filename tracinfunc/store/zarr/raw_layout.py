"""Where the rows of an uncompressed, sharded zarr v3 array are: the layout both raw readers use.

A chunk of such an array *is* its raw little-endian bytes (plus a 4-byte crc32c when the codec
chain has one), and a shard file ends with its index (``[chunks_per_shard, 2]`` uint64
offset/length pairs, itself followed by its crc32c). :class:`RawLayout` says whether an array
has that layout and where a row's bytes are; ``local_reads`` (files) and ``remote_reads``
(object storage) read it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tracinfunc.errors import CorruptStoreError

__all__ = ["CRC_BYTES", "RawLayout", "copy_chunk_rows", "crc32c"]

try:  # ~2x faster than google_crc32c here and releases the GIL on large buffers
    from crc32c import crc32c
except ImportError:  # zarr's own dependency, always there
    import google_crc32c

    def crc32c(data) -> int:
        return google_crc32c.value(np.frombuffer(data, dtype=np.uint8))

_MISSING = np.uint64(2**64 - 1)
CRC_BYTES = 4  # bytes of a crc32c checksum


@dataclass(frozen=True)
class RawLayout:
    """Where the bytes of rows are in a sharded array of raw chunks: 2-D ``[n_rows, k]``
    (rows), or 1-D ``[n_rows]`` (one value per row: norms, scales; a "row" is one value).

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
            or array.ndim not in (1, 2)
            or len(codecs) != 1
            or not isinstance(codecs[0], ShardingCodec)
            or codecs[0].index_location.value != "end"
        ):
            return None
        sharding = codecs[0]
        chunk_crc = _raw_chain(sharding.codecs, BytesCodec, Crc32cCodec)
        index_crc = _raw_chain(sharding.index_codecs, BytesCodec, Crc32cCodec)
        if chunk_crc is None or index_crc is None:
            return None
        n_rows, k = array.shape if array.ndim == 2 else (array.shape[0], 1)
        (chunk_rows, *chunk_k), (shard_rows, *shard_k) = sharding.chunk_shape, array.shards
        if chunk_k != shard_k or chunk_k not in ([], [k]):
            return None
        if array.metadata.data_type.to_native_dtype().byteorder == ">":
            return None
        metadata = array.metadata
        return cls(n_rows=n_rows, row_bytes=k * array.dtype.itemsize, chunk_rows=chunk_rows,
                   shard_rows=shard_rows, chunk_crc=chunk_crc, index_crc=index_crc,
                   chunk_key=lambda shard: metadata.encode_chunk_key((shard,) + (0,) * (
                       array.ndim - 1)))

    @property
    def chunks_per_shard(self) -> int:
        return self.shard_rows // self.chunk_rows

    @property
    def stored_bytes(self) -> int:
        """Bytes of one stored inner chunk: its rows, then its crc32c if it has one."""
        return self.chunk_rows * self.row_bytes + (CRC_BYTES if self.chunk_crc else 0)

    @property
    def index_bytes(self) -> int:
        return self.chunks_per_shard * 16 + (CRC_BYTES if self.index_crc else 0)

    def shards(self, start: int, stop: int) -> range:
        """Shard numbers holding rows ``[start, stop)`` (``stop > start``)."""
        return range(start // self.shard_rows, (stop - 1) // self.shard_rows + 1)

    def parse_index(self, raw: bytes, where: object) -> np.ndarray:
        """The ``[chunks_per_shard, 2]`` (offset, length) index from a shard's last bytes."""
        if len(raw) != self.index_bytes:
            raise CorruptStoreError(f"shard {where} is too short to hold its index")
        if self.index_crc and crc32c(raw[:-CRC_BYTES]) != int.from_bytes(
            raw[-CRC_BYTES:], "little"
        ):
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


def copy_chunk_rows(layout: RawLayout, stored: memoryview, chunk_start: int, start: int,
                    stop: int, out: memoryview, where: object) -> None:
    """Verify one stored chunk (``layout.stored_bytes``) and copy its rows that fall in
    ``[start, stop)`` to their place in ``out`` (which holds rows ``[start, stop)``)."""
    data = stored[: layout.chunk_rows * layout.row_bytes]
    if layout.chunk_crc:
        layout.verify(data, stored[-CRC_BYTES:], chunk_start, where)
    lo, hi = max(start, chunk_start), min(stop, chunk_start + layout.chunk_rows)
    out[(lo - start) * layout.row_bytes : (hi - start) * layout.row_bytes] = data[
        (lo - chunk_start) * layout.row_bytes : (hi - chunk_start) * layout.row_bytes
    ]


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
