"""The on-disk layout of a Zarr gradient store: creating it, reading and checking its metadata.

Sizes measured with zarr 3.1 on the development machine: inner chunks of ~4 MiB read at
close to the disk's speed while chunks >= 32 MiB read 3-6x slower; shards of ~256 MiB keep
the file count low; compression gains ~7% on projected gradients (Gaussian-like noise).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from tracinfunc._jsonfile import check_json_file
from tracinfunc._validate import current_caller
from tracinfunc.errors import (
    CorruptStoreError,
    IncompatibleGradientsError,
    InvalidArgumentError,
    StoreExistsError,
    StoreWriteError,
    TracInFuncError,
)
from tracinfunc.store.codes import code_width, stored_empty
from tracinfunc.store.meta import FORMAT_VERSION, StoreMeta, norm_dtype
from tracinfunc.store.zarr.integrity import INTEGRITY_KEY, check_digest
from tracinfunc.store.zarr.urls import is_url

if TYPE_CHECKING:
    import zarr

__all__ = ["ATTRS_KEY", "buffer_rows", "check_rerun", "check_resumable", "chunk_files",
           "create_layout", "norms_numpy", "open_group", "pending_buffers", "read_meta",
           "rows_dtype", "sealed_files", "to_numpy", "writable_arrays", "writable_scales",
           "write_errors", "write_pending"]

ATTRS_KEY = "tracinfunc"
CHUNK_BYTES = 4 * 2**20
SHARD_BYTES = 256 * 2**20
# A writer buffers one whole shard per checkpoint (sub-shard writes cost 10-40x): with many
# checkpoints the shards shrink so that the buffers together stay under this.
WRITER_BUFFER_BYTES = 2**30
# Empty (all-zero) chunks are written too, so a missing chunk always means damage, never zeros.
# zarr keeps this as a runtime setting, not in the metadata: every writer must ask for it.
WRITE_CONFIG = {"write_empty_chunks": True}

_NUMPY = {"float64": "float64", "float32": "float32", "float16": "float16",
          "bfloat16": "uint16"}
_CODES_NUMPY = {"int8": "int8", "sign": "uint8"}  # quantised rows: codes, packed sign bits


def rows_dtype(meta: StoreMeta) -> np.dtype:
    """The zarr (numpy) dtype of the rows arrays: bfloat16 is kept as its uint16 bits;
    quantised rows are int8 codes or uint8 packed sign bits."""
    if meta.quantization is not None:
        return np.dtype(_CODES_NUMPY[meta.quantization])
    return np.dtype(_NUMPY[meta.dtype])


def to_numpy(rows: Tensor) -> np.ndarray:
    """A CPU tensor as the numpy array zarr stores (bfloat16 -> its uint16 bits)."""
    if rows.dtype == torch.bfloat16:
        return rows.contiguous().view(torch.int16).numpy().view(np.uint16)
    return rows.contiguous().numpy()


def default_rows(meta: StoreMeta, chunk_rows: int | None,
                 shard_rows: int | None) -> tuple[int, int]:
    """``(chunk_rows, shard_rows)``: ~4 MiB chunks; shards of ~256 MiB, smaller when
    ``n_ckpt`` shards would not fit :data:`WRITER_BUFFER_BYTES` together; unless given.
    Given only one of them, the other is chosen to fit (shards a multiple of chunks; chunks
    the largest divisor of the shards up to ~4 MiB).

    Sized by the rows as read (``meta.torch_dtype``): a quantised store has the row counts
    of a float32 store of the same ``k``, so a chunk dequantises into ~4 MiB and its codes
    are 4x (int8) or 32x (sign) smaller on disk."""
    row_bytes = meta.k * meta.torch_dtype.itemsize
    chunk = chunk_rows or max(1, CHUNK_BYTES // row_bytes)
    if shard_rows and not chunk_rows and shard_rows > 0:  # only shards given: chunks divide them
        chunk = _largest_divisor(shard_rows, chunk)
    shard_bytes = min(SHARD_BYTES, WRITER_BUFFER_BYTES // max(1, meta.n_ckpt))
    # At most 1024 chunks per shard: zarr writes the whole index (16 bytes a chunk) per shard.
    shard = shard_rows or chunk * min(1024, max(1, shard_bytes // (chunk * row_bytes)))
    if chunk < 1 or shard < chunk or shard % chunk:
        raise InvalidArgumentError(
            f"ZarrWriter: shard_rows must be a positive multiple of chunk_rows, got "
            f"chunk_rows={chunk}, shard_rows={shard}; pass e.g. shard_rows="
            f"{chunk * max(1, shard // max(1, chunk))}, or give only one of them and the "
            "other is chosen to fit."
        )
    return chunk, shard


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is at most ``at_most`` (>= 1)."""
    best, d = 1, 1
    while d * d <= n:
        if n % d == 0:
            for divisor in (d, n // d):
                if best < divisor <= at_most:
                    best = divisor
        d += 1
    return best


def create_layout(path: Path, meta: StoreMeta, *, chunk_rows: int | None,
                  shard_rows: int | None, compression: str | None) -> zarr.Group:
    """Create the group and its empty (0-row) arrays, exclusively; return the group."""
    import zarr
    from zarr.codecs import Crc32cCodec, ZstdCodec
    if compression not in (None, "zstd"):
        raise InvalidArgumentError(
            f"ZarrWriter: compression must be None or 'zstd', got {compression!r}; None "
            "(raw chunks) reads fastest, 'zstd' saves ~7% on projected gradients."
        )
    chunk, shard = default_rows(meta, chunk_rows, shard_rows)
    codecs = [ZstdCodec(level=3), Crc32cCodec()] if compression else [Crc32cCodec()]
    group = zarr.open_group(path, mode="w-")  # exclusive create: never clobbers a store
    width = code_width(meta)
    per_row = {"norms": norms_numpy(meta)}  # one value per row: norms, and scales of codes
    if meta.quantization is not None:
        per_row["scales"] = np.dtype("float32")
    rows = group.require_group("rows")
    for c in range(meta.n_ckpt):
        rows.create_array(str(c), shape=(0, width), dtype=rows_dtype(meta),
                          chunks=(chunk, width), shards=(shard, width), filters=None,
                          compressors=codecs, fill_value=0, config=WRITE_CONFIG)
        # Sharded like the rows: an edge chunk is stored whole, so one chunk per shard would
        # spend a shard's worth of norms (16 MiB at k=16) on a store of a few rows.
        for kind, dtype in per_row.items():
            group.require_group(kind).create_array(
                str(c), shape=(0,), dtype=dtype, chunks=(chunk,), shards=(shard,),
                filters=None, compressors=[Crc32cCodec()], fill_value=0, config=WRITE_CONFIG)
    group.attrs[ATTRS_KEY] = meta.replace(n_train=0, complete=False).to_dict()
    return group


def writable_arrays(group: zarr.Group, kind: str, n_ckpt: int) -> list[zarr.Array]:
    """The ``kind`` ("rows" or "norms") arrays of ``group``, set to write empty chunks."""
    try:
        return [group[f"{kind}/{c}"].with_config(WRITE_CONFIG) for c in range(n_ckpt)]
    except RecursionError:  # an unsealed (incomplete) store's array zarr.json, crafted deep
        raise CorruptStoreError(
            f"{current_caller()}: the metadata of an array under {kind}/ in {group.store} is "
            "nested deeper than Python can parse (crafted or damaged); delete the incomplete "
            "store and build it again.") from None


def writable_scales(group: zarr.Group, meta: StoreMeta) -> list[zarr.Array]:
    """The per-row scale arrays of a quantised store (none for float rows)."""
    return writable_arrays(group, "scales", meta.n_ckpt) if meta.quantization else []


def pending_buffers(meta: StoreMeta, shard_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """A Zarr writer's shard buffers: rows as stored ``[n_ckpt, shard_rows, width]``,
    scales (``[n_ckpt, shard_rows]`` float32, empty for float rows) and norms."""
    scales = torch.empty(meta.n_ckpt, shard_rows if meta.quantization else 0)
    return (stored_empty(meta, shard_rows), scales,
            torch.empty(meta.n_ckpt, shard_rows, dtype=norm_dtype(meta)))


def buffer_rows(writer: Any, stored: Tensor, scales: Tensor | None, norms: Tensor) -> None:
    """Copy a block as stored (:func:`~tracinfunc.store.codes.to_stored`: float rows
    ``[n_ckpt, b, k]``, or codes and their ``scales``) and its ``norms`` into a Zarr writer's
    shard buffers (``_pending``, ``_pending_scales``, ``_pending_norms``, ``_filled`` of
    ``_shard_rows``), calling its ``_flush()`` each time a whole shard is buffered: writes
    are whole shards only."""
    done = 0
    while done < stored.shape[1]:
        take = min(stored.shape[1] - done, writer._shard_rows - writer._filled)
        into = slice(writer._filled, writer._filled + take)
        writer._pending[:, into] = stored[:, done : done + take]  # cast as it is copied
        writer._pending_norms[:, into] = norms[:, done : done + take]
        if scales is not None:
            writer._pending_scales[:, into] = scales[:, done : done + take]
        writer._filled += take
        done += take
        if writer._filled == writer._shard_rows:
            writer._flush()


def write_pending(writer: Any, start: int, *, resize: bool) -> list[zarr.Array]:
    """Write a Zarr writer's ``_filled`` buffered rows, scales and norms to rows
    ``[start, start + _filled)`` of its arrays (``_rows``, ``_scales``, ``_norms``), resized
    to end there first when ``resize``; returns the arrays written."""
    n = writer._filled
    columns = [(writer._rows, writer._pending), (writer._scales, writer._pending_scales),
               (writer._norms, writer._pending_norms)]
    for arrays, pending in columns:
        for c, array in enumerate(arrays):
            if resize:
                array.resize((start + n, *array.shape[1:]))
            array[start : start + n] = to_numpy(pending[c, :n])
    return writer._rows + writer._scales + writer._norms


def chunk_files(array: zarr.Array, start: int, stop: int) -> list[Path]:
    """The chunk (or shard) files that rows ``[start, stop)`` of ``array`` are read from.

    zarr reads a missing or empty file as the fill value (zeros); every tracinfunc writer
    writes each chunk, so the caller checks these files before zarr's own (non-raw) reads.
    """
    rows_per_file = (array.shards or array.chunks)[0]
    tail = (0,) * (array.ndim - 1)
    root = Path(array.store.root) / array.path
    return [root / array.metadata.encode_chunk_key((i, *tail))
            for i in range(start // rows_per_file, (stop - 1) // rows_per_file + 1)
            ] if stop > start else []


@contextmanager
def write_errors(path: Path, rows_stored: int) -> Iterator[None]:
    """Turn an OSError while writing (disk full, I/O error) into one that says what to do."""
    try:
        yield
    except TracInFuncError:
        raise
    except OSError as error:
        raise StoreWriteError(
            error.errno,
            f"ZarrWriter: writing to {str(path)!r} failed ({error.strerror or error}); the "
            f"first {rows_stored} rows are safely stored and the rest will be redone. Free "
            "space (or fix the device), then resume: call build_store again with the same "
            "arguments and store=path ('tracinfunc build ... --resume').",
        ) from error


def open_group(path: Path, *, mode: str) -> zarr.Group:
    """``zarr.open_group`` with a CorruptStoreError naming the file for malformed metadata
    (crafted JSON nested too deep or too large for zarr's parser included)."""
    import zarr
    if not is_url(path):
        check_json_file(Path(path) / "zarr.json", what="store metadata")
    try:
        return zarr.open_group(path, mode=mode, zarr_format=3)
    except (ValueError, TypeError, KeyError, RecursionError) as error:  # JSONDecodeError: Value
        raise CorruptStoreError(
            f"{current_caller()}: {_join(path, 'zarr.json')!r} is not valid zarr v3 group metadata "
            f"({error}); the store is damaged or was edited. Rebuild it or restore it from a "
            "copy."
        ) from error


def read_meta(group: zarr.Group, path: Path, *, allow_unsealed: bool = False) -> StoreMeta:
    """The store's :class:`StoreMeta`, validated, and checked against its seal once finished.

    A finished store without its seal is refused unless ``allow_unsealed``: the seal cannot be
    switched off by editing a field (``format_version``) or dropping the block.
    """
    data = group.attrs.get(ATTRS_KEY)
    where = _join(path, "zarr.json")
    if not isinstance(data, dict):
        raise CorruptStoreError(
            f"{current_caller()}: {str(path)!r} is a zarr group but not a tracinfunc store (no "
            f"{ATTRS_KEY!r} attribute in {where!r}); open it with zarr directly."
        )
    version = data.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= \
            FORMAT_VERSION:
        raise CorruptStoreError(
            f"{current_caller()}: {where!r} gives store format version {version!r}; this "
            "tracinfunc "
            f"reads versions 1 to {FORMAT_VERSION}. Upgrade tracinfunc, or the metadata was "
            "edited or damaged."
        )
    try:
        meta = StoreMeta.from_dict(data)
    except (KeyError, TypeError, ValueError) as error:
        raise CorruptStoreError(
            f"{current_caller()}: the metadata in {where!r} is malformed ({error!r}); it was "
            "edited or damaged. Rebuild the store or restore it from a copy."
        ) from error
    if meta.dtype not in _NUMPY:
        raise CorruptStoreError(
            f"{current_caller()}: the metadata in {where!r} gives storage dtype {meta.dtype!r}; "
            f"stores hold one of {sorted(_NUMPY)}. The metadata was edited or damaged."
        )
    # Stores on object storage carry a checksum of their metadata only (no file manifest);
    # zarr's crc32c checks every chunk there. The seal is checked whenever it is there, whatever
    # the version or `complete` says (only finishing writes one), so an edited field cannot
    # switch it off.
    if INTEGRITY_KEY in data:
        check_digest(data, path)
    elif meta.complete:
        _unsealed(where, allow_unsealed)
    return meta


def _unsealed(where: str, allowed: bool) -> None:
    """A finished store without a seal: refused, or opened with a warning when asked."""
    if not allowed:
        raise CorruptStoreError(
            f"{current_caller()}: {where!r} describes a finished store without its seal (no "
            f"metadata checksum, no '{INTEGRITY_KEY}' block): it predates seals (format 1) or "
            "the seal was removed "
            "by an edit, so neither its metadata nor its files can be checked. If you trust "
            "it, open it with tif.open_store(path, allow_unsealed=True) and re-save it with "
            "tif.save_store to seal it; otherwise rebuild it."
        )
    warnings.warn(
        f"opening the unsealed store {where!r}: its metadata (learning rates, projection, "
        "order) and the placement of its files are not checked; re-save it with "
        "tif.save_store to seal it.", UserWarning, stacklevel=4)


def _join(path: Path | str, name: str) -> str:
    """``path/name`` for a local path or an fsspec URL."""
    return f"{str(path).rstrip('/')}/{name}" if is_url(path) else str(Path(path) / name)


def sealed_files(group: zarr.Group) -> dict[str, list] | None:
    """The sealed file manifest of a finished store; ``None`` for format 1 stores."""
    block = group.attrs[ATTRS_KEY].get(INTEGRITY_KEY)
    return block["files"] if isinstance(block, dict) else None


def check_resumable(existing: StoreMeta, requested: StoreMeta, path: Path) -> None:
    """Raise unless an incomplete store was started with the same arguments."""
    difference = first_difference(existing, requested)
    if difference is not None:
        error = IncompatibleGradientsError(
            f"build_store: cannot resume the incomplete store at {str(path)!r}: {difference}. "
            "Call build_store with the same arguments as the interrupted build, or delete the "
            "directory (or use another path) to start over."
        )
        # What the command line needs to name its flag: the store, and the projection it
        # holds where that is what differs (the first field compared).
        error.path = str(path)
        error.difference = difference
        if existing.projection != requested.projection:
            error.recorded_projection = existing.projection
        raise error


def check_rerun(existing: StoreMeta, requested: StoreMeta, path: Path) -> None:
    """Raise unless a finished store was made with the arguments of this (repeated) call."""
    difference = first_difference(existing, requested)
    if difference is not None:
        raise StoreExistsError(
            f"build_store: a finished store already exists at {str(path)!r} and was made "
            f"differently: {difference}. Stores are immutable: open it with "
            "tif.open_store(path), choose another path, or pass overwrite=True (e.g. "
            "store=functools.partial(tif.store.ZarrWriter, path, overwrite=True)) to replace it."
        )


def first_difference(existing: StoreMeta, requested: StoreMeta) -> str | None:
    """``"its X is A but this call asks for B"`` for the first differing argument, or None."""
    fields = {
        "projection": (existing.projection, requested.projection),
        "parameter layout": (existing.layout, requested.layout),
        "storage dtype": (existing.dtype, requested.dtype),
        "quantization": (existing.quantization, requested.quantization),
        "k": (existing.k, requested.k),
        "checkpoints (names, lrs, fingerprints)": (existing.checkpoints, requested.checkpoints),
        "dataset fingerprint": (existing.dataset_fingerprint, requested.dataset_fingerprint),
        "preconditioner": (existing.preconditioner, requested.preconditioner),
    }
    for what, (theirs, ours) in fields.items():
        if theirs != ours:
            return f"its {what} is {_short(theirs)} but this call asks for {_short(ours)}"
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) < 160 else text[:157] + "..."


def norms_numpy(meta: StoreMeta) -> np.dtype:
    """The zarr (numpy) dtype of the norms arrays: float32, float64 for float64 stores."""
    return np.dtype("float64" if meta.dtype == "float64" else "float32")
