"""Conversions between store kinds, as free functions over the GradientStore protocol.

They work for any store, including user-written ones: each reads rows through ``read_rows``
(in bounded pieces) and writes them with the target kind's writer, so the copy is bit-exact.
Quantised stores are copied as their codes (``read_codes``), bit-exact too. ``dtype=``
changes the storage on the way (float32 to int8, int8 to float32, ...); norms are copied as
they are, so they stay the norms of the rows as first computed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from tracinfunc._artifacts import check_writable
from tracinfunc._devices import check_allocation
from tracinfunc._validate import entry_point
from tracinfunc.errors import (
    CorruptStoreError,
    InvalidArgumentError,
    StoreExistsError,
    StoreNotFoundError,
)
from tracinfunc.progress import ProgressArg, progress_bar
from tracinfunc.store.codes import check_storable, storage_of
from tracinfunc.store.memory.dense import MemoryStore, MemoryWriter
from tracinfunc.store.memory.pinned import PinnedStore, PinnedWriter, QuantizedPinnedStore
from tracinfunc.store.memory.quantized import QuantizedMemoryStore
from tracinfunc.store.meta import StoreMeta, dtype_name, norm_dtype
from tracinfunc.store.protocols import GradientStore, SupportsQuantizedRows
from tracinfunc.store.zarr.lock import WriterLock
from tracinfunc.store.zarr.paths import read_store_meta
from tracinfunc.store.zarr.store import ZarrStore
from tracinfunc.store.zarr.urls import exists, is_url, location
from tracinfunc.store.zarr.writer import ZarrWriter

__all__ = ["save_store", "to_memory", "to_pinned"]

_PIECE_BYTES = 64 * 2**20


@entry_point("to_memory")
def to_memory(store: GradientStore, *, dtype: torch.dtype | str | None = None,
              progress: ProgressArg = None) -> MemoryStore | QuantizedMemoryStore:
    """Copy ``store`` into ordinary CPU memory. Bit-exact; the result is independent of it.

    Args:
        store: Any store.
        dtype: Store the copy as this instead (a float dtype, ``torch.int8``/``"int8"`` or
            ``"sign"``, as for ``build_store``); ``None`` keeps the store's own.
        progress: A bar over rows (``None``: on a terminal after 2 s; ``True``; ``False``).

    Returns:
        A :class:`MemoryStore`, or a :class:`QuantizedMemoryStore` for quantised storage.
    """
    meta = _target_meta(store.meta, dtype)
    _check_host_copy(meta)
    if meta != store.meta or meta.quantization is not None:
        return _copy_rows(store, MemoryWriter(meta.replace(n_train=0, complete=False)), meta,
                          progress=progress, desc="to_memory")
    rows = torch.empty(meta.n_ckpt, meta.n_train, meta.k, dtype=meta.torch_dtype)
    norms = torch.empty(meta.n_ckpt, meta.n_train, dtype=norm_dtype(meta))
    bar = progress_bar(progress, total=meta.n_ckpt * meta.n_train, desc="to_memory", unit="row")
    for ckpt, start, stop in _pieces(store):
        store.read_rows(ckpt, start, stop, out=rows[ckpt, start:stop])
        norms[ckpt, start:stop] = store.read_norms(ckpt, start, stop)
        bar.update(stop - start)
    bar.close()
    return MemoryStore._from_owned(meta.replace(complete=True), rows, norms)


@entry_point("to_pinned")
def to_pinned(store: GradientStore, *, dtype: torch.dtype | str | None = None,
              progress: ProgressArg = None) -> PinnedStore | QuantizedPinnedStore:
    """Copy ``store`` into page-locked host memory (ordinary memory without CUDA).

    ``dtype``, ``progress``: as in :func:`to_memory`.
    """
    meta = _target_meta(store.meta, dtype)
    _check_host_copy(meta)
    writer = PinnedWriter(meta.replace(n_train=0, complete=False), n_train=meta.n_train)
    return _copy_rows(store, writer, meta, progress=progress, desc="to_pinned")


@entry_point("save_store")
def save_store(store: GradientStore, path: str | os.PathLike[str], *,
               dtype: torch.dtype | str | None = None, progress: ProgressArg = None,
               overwrite: bool = False, **options: Any) -> ZarrStore:
    """Write any store to a new Zarr directory and return it reopened read-only.

    Args:
        store: The store to copy (memory, pinned, another Zarr store, a user's).
        path: Directory to create; an existing finished store there is refused.
        dtype: As in :func:`to_memory`.
        progress: As in :func:`to_memory`.
        overwrite: Replace a gradient store at ``path``. The copy is written beside it and
            swapped in only once complete, so ``store`` may be the store at ``path`` itself
            and a failed copy leaves the old store as it was.
        **options: Passed to :class:`~tracinfunc.store.zarr.writer.ZarrWriter` (``chunk_rows``,
            ``shard_rows``, ``compression``).

    Raises:
        StoreExistsError: something is at ``path`` (without ``overwrite``), or it is not a
            tracinfunc store (never replaced).
        ForeignArtifactError: ``path`` is, lies inside, or holds an artefact of another
            kind (a store, index, curvature, recording...; see docs/concepts/stores.md).
    """
    path = location(path)  # a URL stays text: Path("s3://b/x") would be a local "s3:/b/x"
    check_writable(path, "gradient store", overwrite=overwrite)
    meta = _target_meta(store.meta, dtype).replace(n_train=0, complete=False)
    if overwrite and is_url(path):
        raise InvalidArgumentError(
            f"save_store: overwrite=True replaces a store by renaming a complete copy over it, "
            f"which object storage cannot do atomically, so it is refused for the URL "
            f"{path!r}; call tif.remove_store({path!r}) first, or save to a new URL."
        )
    if exists(path):
        if overwrite:
            return _replace_store(store, path, meta, progress=progress, options=options)
        raise StoreExistsError(
            f"save_store: {str(path)!r} already exists; save_store writes new stores only. "
            "Pass overwrite=True to replace a store there, or choose another path."
        )
    writer = ZarrWriter(path, meta, **options)
    if writer.rows_written:  # another process started a build there since the check above
        raise InvalidArgumentError(
            f"save_store: {str(path)!r} holds an incomplete store; save_store writes new "
            "stores only. Delete it or choose another path."
        )
    return _copy_rows(store, writer, meta, progress=progress, desc="save_store")


def _replace_store(store: GradientStore, path: Path, meta: StoreMeta, *,
                   progress: ProgressArg, options: dict[str, Any]) -> ZarrStore:
    """Copy into a sibling directory, then swap it for the store at ``path`` (two renames)."""
    try:
        read_store_meta(path)
    except (StoreNotFoundError, CorruptStoreError) as error:
        raise StoreExistsError(
            f"save_store: {str(path)!r} exists and is not a tracinfunc store, so overwrite=True "
            "will not delete it; choose another path."
        ) from error
    lock = WriterLock(path)  # no build or other save may be writing there while we swap
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.resolve().parent))
    try:
        fresh = scratch / path.name
        writer = ZarrWriter(fresh, meta, **options)
        _copy_rows(store, writer, meta, progress=progress, desc="save_store")
        os.rename(path, scratch / "replaced")  # only now is the old store let go
        os.rename(fresh, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        lock.release()
    return ZarrStore(path)


def _copy_rows(store: GradientStore, writer: Any, target: StoreMeta, *, progress: ProgressArg,
               desc: str) -> Any:
    """Append every row of ``store`` (all checkpoints at once, in bounded pieces) to ``writer``
    (a built-in one, writing ``target``): as codes when both hold the same quantisation (a
    bit-exact copy; requantising dequantised rows could move a scale by an ulp), else as
    float rows."""
    meta = store.meta
    codes = (meta.quantization is not None and target.quantization == meta.quantization
             and isinstance(store, SupportsQuantizedRows))
    step = _piece_rows(meta)
    bar = progress_bar(progress, total=meta.n_train, desc=desc, unit="row")
    for start in range(0, meta.n_train, step):
        stop = min(start + step, meta.n_train)
        norms = torch.stack([store.read_norms(c, start, stop) for c in range(meta.n_ckpt)])
        if codes:
            pairs = [store.read_codes(c, start, stop) for c in range(meta.n_ckpt)]
            writer.append_codes(torch.stack([codes for codes, _ in pairs]),
                                torch.stack([scales for _, scales in pairs]), norms)
        else:
            rows = torch.stack([store.read_rows(c, start, stop) for c in range(meta.n_ckpt)])
            check_storable(rows, target, first_row=start)  # float16 from float32: no inf
            writer.append(rows, norms)
        bar.update(stop - start)
    bar.close()
    return writer.finish()


def _check_host_copy(meta: StoreMeta) -> None:
    """A copy that cannot fit in this machine's memory is refused before allocating it (a
    crafted store may declare any size)."""
    nbytes = meta.n_ckpt * meta.n_train * (meta.k * meta.torch_dtype.itemsize + 4)
    check_allocation("cpu", nbytes, what=f"a copy of {meta.n_train} rows",
                     fix="keep the store on disk and read it in row ranges (tif.score streams).")


def _target_meta(meta: StoreMeta, dtype: torch.dtype | str | None) -> StoreMeta:
    """``meta`` stored as ``dtype`` (``None``: unchanged)."""
    if dtype is None:
        return meta
    read_dtype, quantization = storage_of(dtype)
    return meta.replace(dtype=dtype_name(read_dtype), quantization=quantization)


def _piece_rows(meta) -> int:
    row_bytes = max(1, meta.n_ckpt * meta.k * meta.torch_dtype.itemsize)
    return max(1, _PIECE_BYTES // row_bytes)


def _pieces(store: GradientStore):
    meta = store.meta
    step = _piece_rows(meta)
    for ckpt in range(meta.n_ckpt):
        for start in range(0, meta.n_train, step):
            yield ckpt, start, min(start + step, meta.n_train)
