"""ZarrStore: projected gradients on disk as a zarr v3 group, reopened read-only anywhere.

Layout of a store directory (zarr v3; readable by any zarr v3 implementation)::

    grads.zarr/
      zarr.json            group; attributes["tracinfunc"] = StoreMeta.to_dict() (JSON)
      rows/<c>/            one array per checkpoint c: [n_train, k], storage dtype
      norms/<c>/           one array per checkpoint c: [n_train], float32 row norms

``rows`` arrays are row-chunked: uncompressed inner chunks of ~4 MiB inside shards of
~256 MiB, each inner chunk and shard index ending with a crc32c checksum. bfloat16 (which
zarr has no type for) is stored as its uint16 bits; the logical dtype is in the metadata.
Projected gradients are close to Gaussian noise, so compression would save little (~7%)
and cost read speed; ``compression="zstd"`` exists for the rare case it pays.

Writers (:class:`~tracinfunc.store.zarr.writer.ZarrWriter`, :class:`~tracinfunc.store.MemoryWriter`,
:class:`~tracinfunc.store.PinnedWriter`) share one interface, which any frontend (torch's
``build_store``, a JAX one) can drive::

    writer.rows_written   -> int   rows already stored (after a resume: the resumed ones)
    writer.append(rows, norms)     rows [n_ckpt, b, k] float tensor, norms [n_ckpt, b]
    writer.finish()       -> store read-only store; the writer is unusable afterwards

The Zarr writer buffers rows into whole shards (writing part of a shard would make zarr
read, modify and rewrite it) and records the committed row count in the group metadata after
each shard, so an interrupted build can be resumed: open a writer on the same path with the
same metadata and it continues from the last completed shard (see ``build_store``).
"""

from __future__ import annotations

import hashlib
import os
import re
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from tracinfunc._artifacts import enclosing_artifact
from tracinfunc._validate import current_caller, entry_point
from tracinfunc.errors import (
    CorruptStoreError,
    InvalidArgumentError,
    ReadOnlyStoreError,
    StoreNotFoundError,
)
from tracinfunc.store.codes import code_dtype, code_width, dequantize
from tracinfunc.store.meta import StoreMeta, norm_dtype
from tracinfunc.store.properties import StoreProperties
from tracinfunc.store.protocols import check_out_buffer, check_row_range
from tracinfunc.store.zarr.incomplete import incomplete_error
from tracinfunc.store.zarr.integrity import FileGuard
from tracinfunc.store.zarr.layout import (
    chunk_files,
    norms_numpy,
    open_group,
    read_meta,
    rows_dtype,
    sealed_files,
)
from tracinfunc.store.zarr.local_maps import ShardMaps
from tracinfunc.store.zarr.local_reads import ShardReader
from tracinfunc.store.zarr.object_integrity import ObjectGuard
from tracinfunc.store.zarr.object_reads import object_store_for_reads
from tracinfunc.store.zarr.raw_layout import RawLayout
from tracinfunc.store.zarr.remote_reads import RemoteShardReader
from tracinfunc.store.zarr.urls import chunk_keys, exists, is_url, location

if TYPE_CHECKING:
    import zarr

__all__ = ["ZarrStore"]


class ZarrStore(StoreProperties):
    """Read-only gradients in a zarr v3 directory; see the module docstring for the layout.

    Usually obtained from ``tif.open_store(path)`` or ``build_store(..., store=path)``.
    Uncompressed stores are read with raw ``preadv`` into the caller's buffer and verified
    against their crc32c checksums; other codecs go through zarr.

    Args:
        path: A finished store directory.

    Raises:
        FileNotFoundError: nothing at ``path``.
        IncompleteStoreError: the build that wrote it did not finish (resume it).
        CorruptStoreError: a read hits a checksum mismatch or missing data.
    """

    __slots__ = ("_group", "_guard", "_maps", "_meta", "_norm_readers", "_norms", "_path",
                 "_readers", "_rows", "_scale_readers", "_scales")

    @entry_point("ZarrStore")
    def __init__(self, path: str | os.PathLike[str], *, allow_unsealed: bool = False) -> None:
        path = location(path)  # a local directory, or an fsspec URL such as s3://b/grads.zarr
        if not exists(path, "zarr.json"):
            raise StoreNotFoundError(
                f"{current_caller()}: no zarr store at {str(path)!r}; write one with "
                "tif.build_store(..., store=path) or tif.save_store(store, path)."
            )
        _check_not_inside(path)
        identity = _identity(path)  # before reading: a later change is then always seen
        group = open_group(path, mode="r")
        meta = read_meta(group, path, allow_unsealed=allow_unsealed)
        if not meta.complete:
            raise incomplete_error(path, group, meta)
        # Array metadata as sealed before zarr parses it; shard files (or objects) on their
        # first read.
        guard = _guard(path, group, meta, allow_unsealed)
        guard.check_metadata_files()
        rows, norms = _arrays(group, "rows", meta, path), _arrays(group, "norms", meta, path)
        scales = _arrays(group, "scales", meta, path) if meta.quantization else []
        expected = [(a, (meta.n_train, code_width(meta)), rows_dtype(meta)) for a in rows]
        expected += [(a, (meta.n_train,), norms_numpy(meta)) for a in norms]
        expected += [(a, (meta.n_train,), np.dtype("float32")) for a in scales]
        for array, shape, dtype in expected:
            if tuple(array.shape) != shape or array.dtype != dtype:
                raise CorruptStoreError(
                    f"{current_caller()}: array {array.path} of {str(path)!r} is {array.shape} "
                    f"{array.dtype}, the metadata says {shape} {dtype}; the store is "
                    "damaged or was edited by hand."
                )
        if isinstance(guard, FileGuard) and guard.files is not None:
            _check_declared_bytes(path, meta, rows, guard.files)
        byte_store = object_store_for_reads(path) if is_url(path) else None  # one for all

        def readers(arrays: list[zarr.Array]) -> list:
            """One raw reader per checkpoint's array (``None`` where zarr must decode it)."""
            return [shard_reader(array, guard=guard, byte_store=byte_store) for array in arrays]

        for name, value in (("_path", path), ("_identity", identity),
                            ("_group", group), ("_meta", meta),
                            ("_rows", rows), ("_norms", norms), ("_scales", scales),
                            ("_guard", guard), ("_readers", readers(rows)),
                            ("_norm_readers", readers(norms)),
                            ("_scale_readers", readers(scales)),
                            ("_maps",
                             _maps(path, rows, guard, meta, _weak(self._check_identity)))):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise ReadOnlyStoreError(
            f"ZarrStore is read-only: cannot set {name!r}. Build a new store instead."
        )

    @property
    def meta(self) -> StoreMeta:
        return self._meta

    @property
    def path(self) -> Path | str:
        """The store's directory, or its URL (text) for remote stores."""
        return self._path

    @property
    def chunk_rows(self) -> int:
        """Rows per stored chunk; reads aligned to it are the fastest."""
        return int(self._rows[0].chunks[0]) if self._rows else 1

    @property
    def raw_reads(self) -> bool:
        """Whether rows are read with the raw fast path (uncompressed chunks, local or remote)."""
        return all(reader is not None for reader in self._readers)

    @property
    def mapped_chunk_rows(self) -> int | None:
        """Rows per stored chunk when whole chunks can be lent as mapped views of local,
        uncompressed shard files (:meth:`map_rows`); ``None`` otherwise."""
        return self.chunk_rows if self._maps and all(self._maps) else None

    @entry_point("ZarrStore.map_rows")
    def map_rows(self, ckpt: int, start: int, stop: int
                 ) -> tuple[Tensor, Callable[[], None]] | None:
        """Rows ``[start, stop)`` of one whole stored chunk as a view of a private mapping of
        the shard file made for this lend alone, ``[stop - start, k]`` (a write into it
        reaches neither the file nor later reads or scores; the mapping goes when the view
        does), and ``release`` to call once done with them
        (it raises :class:`CorruptStoreError` if the file changed meanwhile); ``None`` where
        the rows cannot be lent (not one stored chunk, not mappable): read them instead.
        See :mod:`tracinfunc.store.zarr.local_maps`.

        Raises:
            InvalidTypeError, RowRangeError: as :meth:`read_rows` does, for arguments that
                are not integers or rows not in the store.
        """
        ckpt, start, stop = check_row_range(self._meta, ckpt, start, stop)
        maps = self._maps[ckpt]
        return None if maps is None else self._lend(maps.view, "map_rows", ckpt, start, stop)

    def lend_rows(self, pieces: Iterable[tuple[int, int, int]]
                  ) -> Iterator[tuple[Tensor, Callable[[], None]] | None]:
        """For each piece ``(ckpt, start, stop)`` (one whole stored chunk), in order, what
        :meth:`map_rows` gives, lent through one pass: each shard file is mapped in windows of
        up to 64 MiB shared by the chunks they hold (each chunk lent once per window, so a
        write into one lend reaches no other) and kept open until the generator is closed;
        each lend and ``release`` check the file's identity as :meth:`map_rows` does
        (:class:`~tracinfunc.store.zarr.local_maps.ChunkLender`). A lent view is valid until
        the next piece is asked for (it stays readable, but its window may be dropped).

        Raises:
            InvalidTypeError, RowRangeError: a piece that is not integers or not in the store.
            CorruptStoreError: as :meth:`map_rows`.
        """
        meta, lenders = self._meta, {}
        try:
            for ckpt, start, stop in pieces:
                # Python ints in range pass at once (check_row_range: ~25 us a piece, ~1% of
                # a warm query); anything else gets its full check and its ints.
                if not (type(ckpt) is type(start) is type(stop) is int
                        and 0 <= ckpt < meta.n_ckpt and 0 <= start <= stop <= meta.n_train):
                    ckpt, start, stop = check_row_range(meta, ckpt, start, stop)  # or raises
                maps = self._maps[ckpt]
                if maps is None:
                    yield None
                    continue
                lender = lenders.get(ckpt) or lenders.setdefault(ckpt, maps.lender())
                yield self._lend(lender.view, "lend_rows", ckpt, start, stop)
        finally:
            for lender in lenders.values():
                lender.close()

    def _lend(self, view: Callable, method: str, ckpt: int, start: int, stop: int
              ) -> tuple[Tensor, Callable[[], None]] | None:
        """``view(start, stop)``'s bytes as rows ``[stop - start, k]`` and a release, errors
        said as the store's."""
        try:  # the store's identity is checked whenever a file is mapped (again)
            lent = view(start, stop)
        except _ReplacedError:
            raise
        except (CorruptStoreError, ValueError, OSError) as error:
            raise self._corrupt(method, ckpt, start, stop, error) from error
        if lent is None:
            return None
        data, release = lent
        rows = torch.frombuffer(data, dtype=self._meta.torch_dtype).view(stop - start, -1)

        def checked_release() -> None:
            try:
                release()
            except (CorruptStoreError, ValueError, OSError) as error:
                raise self._corrupt(method, ckpt, start, stop, error) from error

        return rows, checked_release

    @entry_point("ZarrStore.read_rows")
    def read_rows(self, ckpt: int, start: int, stop: int, *, out: Tensor | None = None) -> Tensor:
        ckpt, start, stop = check_row_range(self._meta, ckpt, start, stop)
        if out is None:
            target = torch.empty(stop - start, self._meta.k, dtype=self._meta.torch_dtype)
        else:
            target = check_out_buffer(out, stop - start, self._meta)
        if stop == start:
            return target
        if self._meta.quantization is not None:  # codes and scales, dequantised into target
            codes, scales = self.read_codes(ckpt, start, stop)
            return dequantize(codes, scales, self._meta.quantization, self._meta.k, out=target)
        self._read_stored(ckpt, start, stop, target)
        return target

    @entry_point("ZarrStore.read_codes")
    def read_codes(self, ckpt: int, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Codes ``[stop - start, width]`` and scales ``[stop - start]`` float32 of a quantised
        store, read as stored (:class:`~tracinfunc.store.protocols.SupportsQuantizedRows`)."""
        ckpt, start, stop = check_row_range(self._meta, ckpt, start, stop)
        if self._meta.quantization is None:
            raise InvalidArgumentError(
                f"ZarrStore.read_codes: the store at {str(self._path)!r} holds "
                f"{self._meta.dtype} rows, not codes (quantization=None); read them with "
                "read_rows, or convert the store with tif.save_store(store, path, dtype='int8')."
            )
        codes = torch.empty(stop - start, code_width(self._meta), dtype=code_dtype(self._meta))
        if stop > start:
            self._read_stored(ckpt, start, stop, codes)
        return codes, self._read_per_row(self._scales, self._scale_readers, "read_codes", ckpt,
                                         start, stop)

    def _check_identity(self) -> None:
        """Refuse to read a store that was replaced at this path after it was opened: its
        files would be read under this object's metadata, cached indices and checks.

        Two ``stat`` calls per read: the directory's ``(device, inode)`` (a store swapped in
        by rename) and its ``zarr.json``'s ``(inode, size, mtime, ctime)``; when the latter
        changed, the file's contents are compared with those read at open (contents replaced
        in place, or a store rebuilt at a reused inode: its metadata and seal differ)."""
        if self._identity is None:
            return
        directory, stat, digest = self._identity
        now_directory, now_stat = _stats(self._path)
        if (now_directory, now_stat) == (directory, stat):
            return
        if now_directory == directory and now_stat is not None and \
                _digest(Path(self._path) / "zarr.json") == digest:
            # Touched or copied over with the same contents: still this store.
            object.__setattr__(self, "_identity", (directory, now_stat, digest))
            return
        raise _ReplacedError(
            f"{current_caller()}: the store at {str(self._path)!r} was replaced (overwritten "
            "or rebuilt) after this ZarrStore opened it, so its rows would be read under "
            f"the old metadata; reopen it with tif.open_store({str(self._path)!r})."
        )

    def _read_stored(self, ckpt: int, start: int, stop: int, target: Tensor) -> None:
        """Rows ``[start, stop)`` of the ``rows`` array as stored (floats or codes) into
        ``target``: raw shard reads when possible, else zarr's own path."""
        self._check_identity()
        try:
            reader = self._readers[ckpt]
            if reader is not None and target.is_contiguous():
                reader.read_into(start, stop, _bytes_of(target))
            else:
                _check_chunk_files(self._guard, self._rows[ckpt], start, stop)
                target.copy_(_from_numpy(self._rows[ckpt][start:stop], target.dtype))
        except (CorruptStoreError, ValueError, OSError) as error:
            raise self._corrupt("read_rows", ckpt, start, stop, error) from error

    @entry_point("ZarrStore.read_norms")
    def read_norms(self, ckpt: int, start: int, stop: int) -> Tensor:
        ckpt, start, stop = check_row_range(self._meta, ckpt, start, stop)
        values = self._read_per_row(self._norms, self._norm_readers, "read_norms", ckpt, start,
                                    stop)
        return values.to(norm_dtype(self._meta))

    def _read_per_row(self, arrays: list[zarr.Array], readers: list, method: str, ckpt: int,
                      start: int, stop: int) -> Tensor:
        """Values ``[stop - start]`` of a one-value-per-row array (norms, scales), checked:
        raw shard reads when its chunks are raw (every query reads a checkpoint's norms
        whole: through zarr's codec pipeline, 50,000 of them took ~30 ms, a tenth of a warm
        query's matmul at k=4096), else zarr's own path."""
        self._check_identity()
        try:
            reader = readers[ckpt]
            if reader is not None:
                values = np.empty(stop - start, dtype=arrays[ckpt].dtype)
                if stop > start:
                    reader.read_into(start, stop, memoryview(values).cast("B"))
                return torch.from_numpy(values)
            _check_chunk_files(self._guard, arrays[ckpt], start, stop)
            values = arrays[ckpt][start:stop]
        except (CorruptStoreError, ValueError, OSError) as error:
            raise self._corrupt(method, ckpt, start, stop, error) from error
        return torch.from_numpy(np.ascontiguousarray(values))

    def _corrupt(self, method: str, ckpt: int, start: int, stop: int,
                 error: Exception) -> CorruptStoreError:
        """``error`` (what was found) said once, under the caller's name, with the fix."""
        name, caller = self._meta.checkpoints[ckpt].name, current_caller(f"ZarrStore.{method}")
        found = str(error).removeprefix(f"{caller}: ")
        found = _FIX.sub("", found).rstrip(". ")
        # which array: a damaged norms file is not a damaged rows file
        what = "the norms of rows" if method == "read_norms" else "rows"
        return CorruptStoreError(
            f"{caller}: checkpoint {name!r} (index {ckpt}), {what} [{start}, {stop}) of "
            f"{str(self._path)!r} cannot be read: {found}. The store is damaged on disk; "
            "rebuild it (or restore it from a copy) instead of trusting its scores."
        )


# The fix an inner error already states, dropped where the store states its own.
_FIX = re.compile(r"[;.]\s*(the store is damaged\.\s*)?rebuild (it|the store) or restore it "
                  r"from a copy\.?\s*$", re.IGNORECASE)


def _weak(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` called through a weak reference: the store's own parts (its shard maps)
    must not keep it alive, so ``del store`` frees it (and its files) without the cycle
    collector."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


class _ReplacedError(CorruptStoreError):
    """The store at a ZarrStore's path is not the one it opened (its message says so)."""


def _guard(path: Path | str, group: zarr.Group, meta: StoreMeta,
           allow_unsealed: bool) -> FileGuard | ObjectGuard:
    """What checks the store's files (or objects) against its sealed manifest."""
    files = sealed_files(group)
    if not is_url(path):
        return FileGuard(path, files)
    if files == {} and meta.n_ckpt:  # sealed before stores on object storage had manifests
        if not allow_unsealed:
            raise CorruptStoreError(
                f"{current_caller()}: "
                f"{str(path)!r} was sealed without a manifest of its objects (by "
                "tracinfunc before 0.2, or the manifest was removed), so the placement of its "
                "shard objects and its array metadata cannot be checked. If you trust it, open "
                "it with tif.open_store(path, allow_unsealed=True) and re-save it with "
                "tif.save_store to seal it; otherwise rebuild it."
            )
        files = None
    return ObjectGuard(group.store, path, files)


def _maps(path: Path | str, rows: list[zarr.Array], guard: FileGuard | ObjectGuard,
          meta: StoreMeta, before_map: Callable[[], None]) -> list[ShardMaps | None]:
    """Mapped chunk views per checkpoint's rows: local, uncompressed float rows only."""
    from zarr.storage import LocalStore
    if meta.quantization is not None or is_url(path):
        return [None] * len(rows)
    maps = []
    for array in rows:
        layout = RawLayout.of(array)
        local = layout is not None and isinstance(array.store, LocalStore)
        maps.append(ShardMaps(Path(array.store.root) / array.path, layout, guard=guard,
                              before_map=before_map) if local else None)
    return maps


def shard_reader(array, *, guard=None, byte_store=None):
    """The raw reader for ``array``: local files, or any other zarr store (object storage).

    ``None`` when its chunks are not raw (compression, other codecs): read through zarr.
    ``guard``: an optional :class:`~tracinfunc.store.zarr.integrity.FileGuard` checking each
    local shard file before its first read. ``byte_store``: a zarr store with the same root
    as the array's to read remote bytes through instead (``object_reads.py``)."""
    from zarr.storage import LocalStore
    layout = RawLayout.of(array)
    if layout is None:
        return None
    if isinstance(array.store, LocalStore):
        return ShardReader(Path(array.store.root) / array.path, layout, guard=guard)
    return RemoteShardReader(byte_store or array.store, array.path, layout, guard=guard)


def _check_chunk_files(guard: FileGuard | ObjectGuard, array: zarr.Array, start: int,
                       stop: int) -> None:
    """Check the files (or objects) rows ``[start, stop)`` of ``array`` are read from, before
    zarr reads them (zarr reads a missing one as zeros)."""
    if isinstance(guard, ObjectGuard):
        for key in chunk_keys(array, start, stop):
            guard.check(key)
        return
    for path in chunk_files(array, start, stop):
        guard.check(path)


# The most a shard of rows can be compressed (zstd stores at least ~3 bytes per 128 KiB block;
# 2**16 leaves room): a crafted store declaring 10**12 rows over a few kilobytes is refused.
_MAX_RATIO = 2**16


def _check_declared_bytes(path: Path | str, meta: StoreMeta, rows: list[zarr.Array],
                          files: dict[str, list]) -> None:
    """Raise unless each checkpoint's sealed shard files can hold the rows the metadata
    declares.

    Every shard is written (``write_empty_chunks``), so the sealed sizes of the shard files
    bound the rows: a store whose metadata and array shapes were both edited (and resealed)
    to claim far more rows than its files hold is refused at open, before a query sizes a
    result by it. Sizes come from the manifest, not the disk: a missing file is reported at
    its first read, and the rest of the store stays readable.
    """
    if meta.n_train == 0:
        return
    needed = meta.n_train * code_width(meta) * rows_dtype(meta).itemsize
    for array in rows:
        compressed = any("zstd" in type(codec).__name__.lower() for codec in array.compressors)
        prefix = f"{array.path}/c/"
        stored = sum(int(size) for name, (size, *_) in files.items() if name.startswith(prefix))
        if stored * (_MAX_RATIO if compressed else 1) < needed:
            raise CorruptStoreError(
                f"ZarrStore: the metadata of {str(path)!r} declares {meta.n_train} rows of "
                f"{needed // meta.n_train} bytes in {array.path}, but its shard files hold "
                f"{stored} bytes; the metadata was crafted or edited, or shard files are "
                "missing. Rebuild the store or restore it from a copy."
            )


def _arrays(group: zarr.Group, kind: str, meta: StoreMeta, path: Path) -> list[zarr.Array]:
    try:
        return [group[f"{kind}/{c}"] for c in range(meta.n_ckpt)]
    except (KeyError, ValueError, TypeError, RecursionError) as error:
        raise CorruptStoreError(
            f"{current_caller()}: "
            f"{str(path)!r} lacks a readable zarr v3 array {kind}/<c> for each of "
            f"its {meta.n_ckpt} checkpoints ({error!r}); the store is damaged. Rebuild it."
        ) from error


def _identity(path: Path | str) -> tuple | None:
    """What a local store directory is: its ``(device, inode)``, its ``zarr.json``'s
    ``(inode, size, mtime, ctime)`` and a digest of that file. A store swapped in by rename,
    or whose contents were replaced in place (its metadata and seal then differ), has
    another. ``None`` for object storage (see the stores page)."""
    if is_url(path):
        return None
    directory, stat = _stats(path)
    return directory, stat, _digest(Path(path) / "zarr.json")


def _stats(path: Path | str) -> tuple[tuple[int, int], tuple[int, ...] | None]:
    """``(directory (device, inode), zarr.json (inode, size, mtime, ctime))``."""
    try:
        directory = os.stat(path)
        meta = os.stat(Path(path) / "zarr.json")
    except FileNotFoundError:
        return (-1, -1), None  # gone: differs from any identity taken at open
    return ((directory.st_dev, directory.st_ino),
            (meta.st_ino, meta.st_size, meta.st_mtime_ns, meta.st_ctime_ns))


def _digest(file: Path) -> str | None:
    try:
        return hashlib.blake2b(file.read_bytes(), digest_size=16).hexdigest()
    except FileNotFoundError:
        return None


def _check_not_inside(path: Path | str) -> None:
    """Refuse a path inside a store (``g.zarr/rows/0``, an array), naming the store to open."""
    if is_url(path):
        return
    found = enclosing_artifact(path)
    if found is not None and found[1] != Path(path).resolve():
        raise StoreNotFoundError(
            f"{current_caller()}: {str(path)!r} is not a store but lies inside the "
            f"{found[0]} at {str(found[1])!r}; open that instead: "
            f"tif.GradientStore.open({str(found[1])!r})."
        )


def _bytes_of(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable memoryview."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B") if tensor.numel() else \
        memoryview(bytearray())


def _from_numpy(values: np.ndarray, dtype: torch.dtype) -> Tensor:
    if dtype == torch.bfloat16:  # stored as uint16 bits
        return torch.from_numpy(np.ascontiguousarray(values).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(values))


def read_back_rows(meta: StoreMeta, rows: list[zarr.Array], scales: list[zarr.Array],
                   start: int, stop: int) -> Tensor:
    """Rows ``[n_ckpt, stop - start, k]`` of a store being written, as stored (dequantised
    for a quantised store): what a resumed writer compares recomputed rows with."""
    if meta.quantization is not None:
        return torch.stack([dequantize(torch.from_numpy(codes[start:stop]),
                                       torch.from_numpy(values[start:stop]),
                                       meta.quantization, meta.k)
                            for codes, values in zip(rows, scales, strict=True)])
    return torch.stack([_from_numpy(a[start:stop], meta.torch_dtype) for a in rows])
