"""Stores by path: open, read metadata, verify, remove. The operations the CLI and users need.

``open_store`` is the one way to reopen a finished store.
"""

from __future__ import annotations

import os

import torch

from tracinfunc._artifacts import check_removable
from tracinfunc._validate import current_caller, entry_point
from tracinfunc.errors import StoreNotFoundError
from tracinfunc.progress import ProgressArg, progress_bar
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import GradientStore, _set_opener, aligned_rows, store_meta
from tracinfunc.store.zarr.layout import open_group, read_meta
from tracinfunc.store.zarr.lock import RemoteLock, WriterLock
from tracinfunc.store.zarr.store import ZarrStore
from tracinfunc.store.zarr.urls import exists, is_url, location, remove

__all__ = ["open_store", "read_store_meta", "remove_store", "verify_store"]

_VERIFY_BYTES = 64 * 2**20  # rows read at once by verify_store


@entry_point("open_store")
def open_store(path: str | os.PathLike[str], *, allow_unsealed: bool = False) -> ZarrStore:
    """Reopen a finished Zarr gradient store read-only, in any process.

    Args:
        path: Directory written by ``build_store(..., store=path)`` or ``save_store``.
        allow_unsealed: Open a finished store that has no seal (written before seals, or
            with its seal removed), with a warning: its metadata and file placement are then
            unchecked. Re-save it with :func:`~tracinfunc.save_store` to seal it.

    Returns:
        A read-only :class:`~tracinfunc.store.zarr.store.ZarrStore`.

    Raises:
        StoreNotFoundError: no store at ``path``.
        IncompleteStoreError: the build that wrote it was interrupted (resume it).
        CorruptStoreError: the metadata or arrays do not describe a valid store.
    """
    return ZarrStore(path, allow_unsealed=allow_unsealed)


_set_opener(open_store)  # GradientStore.open is this function (one implementation)


def read_store_meta(path: str | os.PathLike[str], *, allow_unsealed: bool = False) -> StoreMeta:
    """The metadata of the store at ``path``, finished or not, without opening its arrays.

    ``allow_unsealed``: as for :func:`open_store`.

    Raises:
        StoreNotFoundError: no ``zarr.json`` at ``path``.
        CorruptStoreError: a zarr group that is not a (readable) tracinfunc store.
    """
    path = location(path)  # a directory or an fsspec URL
    if not exists(path, "zarr.json"):
        raise StoreNotFoundError(
            f"{current_caller('read_store_meta')}: no gradient store at {str(path)!r} (no "
            "zarr.json there); build one "
            f"with tif.build_store(..., store={str(path)!r}) or 'tracinfunc build --out {path}'."
        )
    return read_meta(open_group(path, mode="r"), path, allow_unsealed=allow_unsealed)


@entry_point("verify_store")
def verify_store(store: GradientStore | str | os.PathLike[str], *,
                 progress: ProgressArg = None) -> None:
    """Read every row and every norm of every checkpoint once.

    ``store``: a GradientStore, or the path (or URL) of one, opened with :func:`open_store`.

    Zarr stores check each chunk's crc32c as it is read, so a damaged chunk raises
    :class:`~tracinfunc.errors.CorruptStoreError` naming its checkpoint and rows. Reads are whole
    stored chunks, so none is read twice.
    """
    if isinstance(store, str | bytes | os.PathLike):
        store = open_store(store)
    meta = store_meta(store)
    step = aligned_rows(store, max(1, _VERIFY_BYTES // (meta.k * meta.torch_dtype.itemsize)))
    buffer = torch.empty(min(step, meta.n_train), meta.k, dtype=meta.torch_dtype)
    with progress_bar(progress, total=meta.n_ckpt * meta.n_train, desc="verify",
                      unit="row") as bar:
        for ckpt in range(meta.n_ckpt):
            for start in range(0, meta.n_train, step):
                stop = min(meta.n_train, start + step)
                store.read_rows(ckpt, start, stop, out=buffer)
                store.read_norms(ckpt, start, stop)  # own chunks, own checksums
                bar.update(stop - start)


@entry_point("remove_store")
def remove_store(path: str | os.PathLike[str]) -> None:
    """Delete the gradient store at ``path``, finished or not; never anything else.

    ``path`` is resolved first, as every writer's path is: a symbolic link to a store removes
    the store it points to, then the link (so no dangling link is left).

    Raises:
        StoreNotFoundError, CorruptStoreError: ``path`` is not a tracinfunc store (nothing
            is deleted).
        ForeignArtifactError: ``path`` lies inside another artefact, or is the file system
            root, the home or the working directory (nothing is deleted).
        StoreLockedError: a build or save is writing the store (nothing is deleted).
    """
    where = location(path)  # str, bytes, ~ and file:// URLs decoded in one place
    link = None
    if not is_url(where):
        resolved = check_removable(where, "gradient store")  # not inside another artefact
        link = where if where.is_symlink() else None  # removed too: nothing left dangling
        where = resolved
    read_store_meta(where)  # refuses anything that is not one of ours
    # Taken before deleting anything: a build in progress keeps its store.
    lock = RemoteLock(where) if is_url(where) else WriterLock(where)
    try:
        remove(where)
    finally:
        lock.release()
    if link is not None:
        link.unlink()
