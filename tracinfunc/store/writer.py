"""Choosing the writer for a ``store=`` argument: the one place that argument is decoded.

A writer turns blocks of projected gradients into a read-only store. Frontends (torch's
``build_store``, the JAX one, a user's own loop) drive any writer the same way::

    writer = make_writer("grads.zarr", meta)       # or "memory", "pinned", a class, a factory
    for rows, norms in blocks:                     # rows [n_ckpt, b, k], norms [n_ckpt, b]
        writer.append(rows, norms)
    store = writer.finish()                        # read-only; the writer is done

``writer.rows_written`` counts the rows stored so far; a Zarr writer opened on an interrupted
build starts with the rows it already holds, and a frontend resumes by skipping that many
rows of its data (see ``build_store``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

from tracinfunc._validate import current_caller
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError
from tracinfunc.store.memory.dense import MemoryStore, MemoryWriter
from tracinfunc.store.memory.pinned import PinnedStore, PinnedWriter
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import StoreWriter
from tracinfunc.store.zarr.parts import PartWriter, check_shard
from tracinfunc.store.zarr.store import ZarrStore
from tracinfunc.store.zarr.writer import ZarrWriter

__all__ = ["StoreTarget", "make_part_writer", "make_writer", "writes_to_disk"]


StoreTarget = str | os.PathLike[str] | type | Callable[[StoreMeta], StoreWriter] | None

_KINDS: dict[object, Callable[[StoreMeta], StoreWriter]] = {
    None: MemoryWriter,
    "memory": MemoryWriter,
    MemoryStore: MemoryWriter,
    "pinned": PinnedWriter,
    PinnedStore: PinnedWriter,
}


def make_writer(target: StoreTarget, meta: StoreMeta) -> StoreWriter:
    """The writer for ``store=target``.

    Args:
        target: ``None``/``"memory"``/``MemoryStore`` (memory), ``"pinned"``/``PinnedStore``
            (page-locked memory), a path (a new Zarr store there, or the resumption of an
            interrupted one), or a callable ``meta -> writer``, e.g.
            ``functools.partial(tif.store.ZarrWriter, "grads.zarr", shard_rows=4096)``.
        meta: Metadata of the store to write (``n_train=0``, ``complete=False``).
    """
    if isinstance(target, str | None | type) and target in _KINDS:
        return _KINDS[target](meta)
    if target is ZarrStore or target == "zarr":
        raise InvalidTypeError(
            f"{current_caller('build_store')}: a Zarr store needs a path: pass store='grads.zarr' "
            "(a directory to create), not the class or 'zarr'."
        )
    if isinstance(target, str | os.PathLike):
        return ZarrWriter(target, meta)
    if callable(target) and not isinstance(target, type):
        writer = target(meta)
        if not isinstance(writer, StoreWriter):
            raise InvalidTypeError(
                f"{current_caller('build_store')}: store= factory returned "
                f"{type(writer).__name__}, which lacks "
                "rows_written/append/finish; return a writer such as tif.store.ZarrWriter."
            )
        return writer
    raise InvalidTypeError(
        f"{current_caller('build_store')}: store must be None, 'memory', 'pinned', "
        "tif.store.MemoryStore, tif.store.PinnedStore, "
        f"a path for a Zarr store, or a callable meta -> writer; got {target!r}."
    )


def writes_to_disk(target: StoreTarget) -> bool:
    """Whether ``store=target`` writes a Zarr store on disk, so that torchrun ranks split it
    into parts (in-memory stores, such as test gradients, are built whole by every rank).

    Decided by what the target writes, not by how it is spelled: a path, or a
    ``functools.partial`` (nested or not) of :class:`ZarrWriter` or :class:`PartWriter`. Any
    other callable is the user's own writer factory, which every rank calls.
    """
    if isinstance(target, str | os.PathLike):
        return target not in ("memory", "pinned")
    return _zarr_partial(target) is not None


def _zarr_partial(target: object) -> tuple[type, tuple, dict] | None:
    """``(writer class, positional args, keywords)`` of a partial, however deeply nested, of
    a Zarr writer class; ``None`` for anything else."""
    args: tuple = ()
    keywords: dict = {}
    while isinstance(target, functools.partial):  # partial(partial(f, a), b) == f(a, b)
        args, keywords = target.args + args, {**target.keywords, **keywords}
        target = target.func
    if isinstance(target, type) and issubclass(target, ZarrWriter | PartWriter):
        return target, args, keywords
    return None


def make_part_writer(target: StoreTarget, meta: StoreMeta, shard: object) -> PartWriter:
    """The writer of part ``shard = (index, count)`` of the Zarr store ``store=target``.

    Args:
        target: The store's path, or a ``functools.partial`` (nested or not) of
            :class:`ZarrWriter` (its options make the part writer) or of :class:`PartWriter`,
            e.g. ``functools.partial(tif.store.PartWriter, path, shard_rows=4096)``: what
            :func:`writes_to_disk` recognises as a store on disk, so a torchrun build and an
            explicit ``shard=`` split the same targets. In-memory targets and other
            callables (a user's own writer factory) are refused before anything is written.
        meta: Metadata of the whole store (``n_train`` the final size).
        shard: ``(index, count)``, checked here.
    """
    shard = check_shard(shard)
    if isinstance(target, str | os.PathLike) and writes_to_disk(target):
        return PartWriter(target, meta, shard)
    decoded = _zarr_partial(target)
    if decoded is None:
        memory = isinstance(target, str | None | type) and target in _KINDS
        raise InvalidArgumentError(
            f"{current_caller('build_store')}: shard= writes part of a Zarr store on disk, so "
            "store must be its path or a functools.partial of tif.store.ZarrWriter or "
            f"tif.store.PartWriter; got {target!r}"
            + (" (an in-memory store cannot be split into parts)" if memory else "")
            + ". E.g. build_store(..., store='grads.zarr', shard=(0, 4)), or drop shard= to "
            "build the whole store in one process.")
    cls, args, keywords = decoded
    if issubclass(cls, PartWriter):
        return target(meta, shard)
    # A whole-store writer's options make the part writer: the same store, split.
    if "path" in keywords:
        args = (keywords.pop("path"), *args)
    if keywords.pop("overwrite", False):
        raise InvalidArgumentError(
            f"{current_caller('build_store')}: a build split into parts (shard=, or "
            "torchrun) cannot overwrite a store; remove the old one first with "
            "tif.remove_store(path), then build."
        )
    return PartWriter(*args, meta, shard, **keywords)
