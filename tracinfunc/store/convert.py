"""Conversions between store kinds, as free functions over the GradientStore protocol.

They work for any store, including user-written ones: each reads rows through ``read_rows``
(in bounded pieces) and writes them with the target kind's writer, so the copy is bit-exact.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from tracinfunc.errors import (
    CorruptStoreError,
    InvalidArgumentError,
    StoreExistsError,
    StoreNotFoundError,
)
from tracinfunc.progress import ProgressArg, progress_bar
from tracinfunc.store.base import GradientStore
from tracinfunc.store.memory import MemoryStore, norm_dtype
from tracinfunc.store.paths import read_store_meta
from tracinfunc.store.pinned import PinnedStore, PinnedWriter
from tracinfunc.store.zarr import ZarrStore, ZarrWriter

__all__ = ["save_store", "to_memory", "to_pinned"]

_PIECE_BYTES = 64 * 2**20


def to_memory(store: GradientStore, *, progress: ProgressArg = None) -> MemoryStore:
    """Copy ``store`` into ordinary CPU memory. Bit-exact; the result is independent of it.

    ``progress``: a bar over rows (``None``: on a terminal after 2 s; ``True``; ``False``).
    """
    meta = store.meta
    rows = torch.empty(meta.n_ckpt, meta.n_train, meta.k, dtype=meta.torch_dtype)
    norms = torch.empty(meta.n_ckpt, meta.n_train, dtype=norm_dtype(meta))
    bar = progress_bar(progress, total=meta.n_ckpt * meta.n_train, desc="to_memory", unit="row")
    for ckpt, start, stop in _pieces(store):
        store.read_rows(ckpt, start, stop, out=rows[ckpt, start:stop])
        norms[ckpt, start:stop] = store.read_norms(ckpt, start, stop)
        bar.update(stop - start)
    bar.close()
    return MemoryStore._from_owned(meta.replace(complete=True), rows, norms)


def to_pinned(store: GradientStore, *, progress: ProgressArg = None) -> PinnedStore:
    """Copy ``store`` into page-locked host memory (ordinary memory without CUDA).

    ``progress``: as in :func:`to_memory`.
    """
    meta = store.meta
    writer = PinnedWriter(meta.replace(n_train=0, complete=False), n_train=meta.n_train)
    return _copy_rows(store, writer, progress=progress, desc="to_pinned")


def save_store(store: GradientStore, path: str | os.PathLike[str], *,
               progress: ProgressArg = None, overwrite: bool = False,
               **options: Any) -> ZarrStore:
    """Write any store to a new Zarr directory and return it reopened read-only.

    Args:
        store: The store to copy (memory, pinned, another Zarr store, a user's).
        path: Directory to create; an existing finished store there is refused.
        progress: As in :func:`to_memory`.
        overwrite: Replace a gradient store at ``path``. The copy is written beside it and
            swapped in only once complete, so ``store`` may be the store at ``path`` itself
            and a failed copy leaves the old store as it was.
        **options: Passed to :class:`~tracinfunc.store.zarr.ZarrWriter` (``chunk_rows``,
            ``shard_rows``, ``compression``).

    Raises:
        StoreExistsError: something is at ``path`` (without ``overwrite``), or it is not a
            tracinfunc store (never replaced).
    """
    path = Path(path)
    if overwrite and path.exists():
        return _replace_store(store, path, progress=progress, options=options)
    writer = ZarrWriter(path, store.meta.replace(n_train=0, complete=False), **options)
    if writer.rows_written:
        raise InvalidArgumentError(
            f"save_store: {str(path)!r} holds an incomplete store; save_store writes new "
            "stores only. Delete it or choose another path."
        )
    return _copy_rows(store, writer, progress=progress, desc="save_store")


def _replace_store(store: GradientStore, path: Path, *, progress: ProgressArg,
                   options: dict[str, Any]) -> ZarrStore:
    """Copy into a sibling directory, then swap it for the store at ``path`` (two renames)."""
    try:
        read_store_meta(path, caller="save_store")
    except (StoreNotFoundError, CorruptStoreError) as error:
        raise StoreExistsError(
            f"save_store: {str(path)!r} exists and is not a tracinfunc store, so overwrite=True "
            "will not delete it; choose another path."
        ) from error
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.resolve().parent))
    try:
        fresh = scratch / path.name
        writer = ZarrWriter(fresh, store.meta.replace(n_train=0, complete=False), **options)
        _copy_rows(store, writer, progress=progress, desc="save_store")
        os.rename(path, scratch / "replaced")  # only now is the old store let go
        os.rename(fresh, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return ZarrStore(path)


def _copy_rows(store: GradientStore, writer: Any, *, progress: ProgressArg, desc: str) -> Any:
    """Append every row of ``store`` (all checkpoints at once, in bounded pieces) to ``writer``."""
    meta = store.meta
    step = _piece_rows(meta)
    bar = progress_bar(progress, total=meta.n_train, desc=desc, unit="row")
    for start in range(0, meta.n_train, step):
        stop = min(start + step, meta.n_train)
        rows = torch.stack([store.read_rows(c, start, stop) for c in range(meta.n_ckpt)])
        norms = torch.stack([store.read_norms(c, start, stop) for c in range(meta.n_ckpt)])
        writer.append(rows, norms)
        bar.update(stop - start)
    bar.close()
    return writer.finish()


def _piece_rows(meta) -> int:
    row_bytes = max(1, meta.n_ckpt * meta.k * meta.torch_dtype.itemsize)
    return max(1, _PIECE_BYTES // row_bytes)


def _pieces(store: GradientStore):
    meta = store.meta
    step = _piece_rows(meta)
    for ckpt in range(meta.n_ckpt):
        for start in range(0, meta.n_train, step):
            yield ckpt, start, min(start + step, meta.n_train)
