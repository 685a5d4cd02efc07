"""The layout of a sharded build: created once, by whichever part comes first.

The first part creates the store at its final size and marks it ready for the others
(``tracinfunc_parts`` in the root ``zarr.json``). Creation is serialised by a lock beside
the store (:func:`creation_lock`), so no part ever waits for a marker: holding the lock a
part finds the marker (it opens the store), nothing (it creates it), a layout half made by
a part killed before its marker (no live process holds it: made again), or something else
(refused at once, named). See ``parts.py`` for the parts themselves.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tracinfunc.errors import StoreExistsError, StoreLockedError, StoreWriteError
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.zarr.layout import (
    ATTRS_KEY,
    check_resumable,
    create_layout,
    default_rows,
    writable_arrays,
    writable_scales,
)
from tracinfunc.store.zarr.lock import RemoteLock, WriterLock
from tracinfunc.store.zarr.urls import Location, exists, is_url, remove

if TYPE_CHECKING:
    import zarr

__all__ = ["PARTS_KEY", "balanced_rows", "creation_lock", "open_or_create"]

PARTS_KEY = "tracinfunc_parts"
_CREATE_WAIT_S = 120.0  # on object storage: how long a part waits for another's creation lock


def balanced_rows(meta: StoreMeta, count: int, chunk_rows: int | None,
                  shard_rows: int | None) -> tuple[int, int]:
    """``(chunk_rows, shard_rows)`` of a store built in ``count`` parts: the defaults, made
    small enough that there are about four shards per part, so the parts (whole shards each)
    share the work evenly even for stores that would be one shard. Given values are kept."""
    chunk, shard = default_rows(meta, chunk_rows, shard_rows)
    if shard_rows is not None:
        return chunk, shard
    target = max(1, -(-meta.n_train // (4 * count)))  # rows per shard for ~4 shards a part
    if chunk_rows is None:
        chunk = min(chunk, target)
    shard = min(shard, chunk * max(1, -(-target // chunk)))
    return chunk, shard


def open_or_create(path: Location, meta: StoreMeta, count: int, **layout) -> zarr.Group:
    """The sharded store's group: created at full size by the first part, else opened.

    Creation is serialised by a lock beside the store (:func:`creation_lock`), so a part
    never waits for a marker: holding the lock it finds the marker (open), nothing (create),
    a layout half made by a part killed before its marker (no live process holds it: made
    again), or something else (refused at once, named)."""
    layout["chunk_rows"], layout["shard_rows"] = balanced_rows(
        meta, count, layout.get("chunk_rows"), layout.get("shard_rows"))
    with creation_lock(path):
        group = _existing(path, meta, count)
        if group is not None:
            return group
        try:
            group = create_layout(path, meta, **layout)
            arrays = [*writable_arrays(group, "rows", meta.n_ckpt),
                      *writable_arrays(group, "norms", meta.n_ckpt),
                      *writable_scales(group, meta)]
            for array in arrays:
                array.resize((meta.n_train, *array.shape[1:]))
            # One write: the full-size metadata and the marker that the layout is ready.
            group.attrs.update({ATTRS_KEY: meta.replace(complete=False).to_dict(),
                                PARTS_KEY: {"count": count}})
        except OSError as error:
            raise StoreWriteError(
                error.errno,
                f"build_store: cannot create the sharded store layout at {str(path)!r}: "
                f"{error.strerror or error}. Fix the cause (a read-only file system, a full "
                "disk, permissions) or choose another path, then run the part again.",
            ) from error
    return group


def _existing(path: Location, meta: StoreMeta, count: int) -> zarr.Group | None:
    """The group of the sharded build at ``path`` (checked against this part's arguments),
    or ``None`` when there is none yet (nothing, an empty directory, or a half-made layout,
    which is removed). Called holding the creation lock."""
    import zarr
    if not exists(path) or (isinstance(path, Path) and path.is_dir()
                            and not any(path.iterdir())):
        return None
    try:
        group = zarr.open_group(path, mode="r+", zarr_format=3)
        attrs = dict(group.attrs)
    except Exception:
        group, attrs = None, None
    existing = None if attrs is None else attrs.get(ATTRS_KEY)
    if attrs is None or (existing is None and attrs):
        raise StoreExistsError(
            f"build_store: {str(path)!r} exists and is not a tracinfunc store ({_listing(path)}); "
            "a sharded build needs a new path or the path of an interrupted sharded build. "
            "Choose another path (nothing there was changed)."
        )
    if isinstance(existing, dict) and existing.get("complete"):
        raise StoreExistsError(
            f"build_store: a finished store already exists at {str(path)!r}; stores are "
            "immutable. Open it with tif.open_store(path) or choose another path."
        )
    parts = attrs.get(PARTS_KEY)
    if parts is None:
        if existing is None and not _layout_only(group):  # someone's zarr group: keep it
            raise StoreExistsError(
                f"build_store: {str(path)!r} exists and is not a tracinfunc store (a zarr group "
                f"holding {sorted(group.keys())[:5]}); choose another path (nothing there was "
                "changed)."
            )
        _half_made(path, existing)
        return None
    if parts.get("count") != count:
        raise StoreExistsError(
            f"build_store: the store at {str(path)!r} is split into {parts.get('count')} parts, "
            f"this call asks for part of {count}; use the same count (or another path)."
        )
    check_resumable(StoreMeta.from_dict(existing), meta, path)
    if StoreMeta.from_dict(existing).n_train != meta.n_train:
        raise StoreExistsError(
            f"build_store: the store at {str(path)!r} is sized for "
            f"{StoreMeta.from_dict(existing).n_train} rows but this call has {meta.n_train} "
            "examples; every part must see the same data."
        )
    return group


def _half_made(path: Location, existing: dict | None) -> None:
    """Remove a layout without its marker that no live process is making (the creation lock
    is held): a first part was killed before marking it. A one-process build's store (rows
    stored, or its writer alive) is never removed: it is named instead."""
    rows = existing.get("n_train") if isinstance(existing, dict) else 0
    try:
        held = None if is_url(path) else WriterLock(path)  # a live one-process writer?
    except StoreLockedError:
        held = False
    if rows or held is False:
        raise StoreExistsError(
            f"build_store: {str(path)!r} holds a one-process build "
            f"({'in progress' if held is False else f'interrupted after {rows} rows'}), not a "
            "sharded one; resume it without shard=, or choose another path for the sharded "
            "build."
        )
    try:
        remove(path)
    finally:
        if held is not None:
            held.release()


def _layout_only(group: zarr.Group) -> bool:
    """Whether ``group`` holds nothing but (part of) a store's layout: groups ``rows``,
    ``norms``, ``scales`` of arrays named by checkpoint numbers."""
    import zarr
    for name, member in group.members():
        if name not in ("rows", "norms", "scales") or not isinstance(member, zarr.Group):
            return False
        if not all(key.isdigit() for key, _ in member.members()):
            return False
    return True


def _listing(path: Location) -> str:
    if not isinstance(path, Path) or not path.is_dir():
        return "not a zarr v3 group"
    names = sorted(p.name for p in path.iterdir())
    return "it holds " + ", ".join(repr(n) for n in names[:5]) + (", ..." if len(names) > 5
                                                                  else "")


@contextlib.contextmanager
def creation_lock(path: Location) -> Iterator[None]:
    """Held while a part looks at (and maybe creates) the layout at ``path``.

    Locally a blocking ``flock`` on ``.<name>.create.lock`` beside the store: a part waits
    only while another live part creates the layout (the kernel drops a killed holder's
    lock). On object storage a lock object, polled for at most :data:`_CREATE_WAIT_S`; a
    killed holder leaves it, and the error names it."""
    if is_url(path):
        deadline = time.monotonic() + _CREATE_WAIT_S
        while True:
            try:
                lock = RemoteLock(f"{path}.create")
                break
            except StoreLockedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        try:
            yield
        finally:
            lock.release()
        return
    lock_file = path.parent / f".{path.name}.create.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise StoreWriteError(
            error.errno,
            f"build_store: cannot create the sharded store at {str(path)!r}: "
            f"{error.strerror or error} (in {str(path.parent)!r}); choose a writable path.",
        ) from error
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if its holder dies
        yield
    finally:
        os.close(fd)
