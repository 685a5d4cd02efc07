"""The writer interface every store kind shares, and choosing a writer from ``store=``.

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

import os
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from torch import Tensor

from tracinfunc.errors import InvalidTypeError
from tracinfunc.store.base import GradientStore
from tracinfunc.store.memory import MemoryStore, MemoryWriter
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.pinned import PinnedStore, PinnedWriter
from tracinfunc.store.zarr import ZarrStore
from tracinfunc.store.zarr_writer import ZarrWriter

__all__ = ["StoreTarget", "StoreWriter", "make_writer"]


@runtime_checkable
class StoreWriter(Protocol):
    """Consumes blocks of rows; returns an opened, read-only store from :meth:`finish`."""

    @property
    def rows_written(self) -> int:
        """Rows stored so far (including those of a resumed build)."""
        ...

    def append(self, rows: Tensor, norms: Tensor) -> None:
        """Add ``rows`` ``[n_ckpt, b, k]`` (any float dtype) and ``norms`` ``[n_ckpt, b]``."""
        ...

    def finish(self) -> GradientStore:
        """Seal the store and return it, read-only."""
        ...


StoreTarget = str | os.PathLike[str] | type | Callable[[StoreMeta], StoreWriter] | None

_KINDS: dict[object, Callable[[StoreMeta], StoreWriter]] = {
    None: MemoryWriter,
    "memory": MemoryWriter,
    MemoryStore: MemoryWriter,
    "pinned": PinnedWriter,
    PinnedStore: PinnedWriter,
}


def make_writer(target: StoreTarget, meta: StoreMeta, *, caller: str = "build_store"
                ) -> StoreWriter:
    """The writer for ``store=target``.

    Args:
        target: ``None``/``"memory"``/``MemoryStore`` (memory), ``"pinned"``/``PinnedStore``
            (page-locked memory), a path (a new Zarr store there, or the resumption of an
            interrupted one), or a callable ``meta -> writer``, e.g.
            ``functools.partial(tif.ZarrWriter, "grads.zarr", shard_rows=4096)``.
        meta: Metadata of the store to write (``n_train=0``, ``complete=False``).
    """
    if isinstance(target, str | None | type) and target in _KINDS:
        return _KINDS[target](meta)
    if target is ZarrStore or target == "zarr":
        raise InvalidTypeError(
            f"{caller}: a Zarr store needs a path: pass store='grads.zarr' (a directory to "
            "create), not the class or 'zarr'."
        )
    if isinstance(target, str | os.PathLike):
        return ZarrWriter(target, meta)
    if callable(target) and not isinstance(target, type):
        writer = target(meta)
        if not isinstance(writer, StoreWriter):
            raise InvalidTypeError(
                f"{caller}: store= factory returned {type(writer).__name__}, which lacks "
                "rows_written/append/finish; return a writer such as tif.ZarrWriter."
            )
        return writer
    raise InvalidTypeError(
        f"{caller}: store must be None, 'memory', 'pinned', tif.MemoryStore, tif.PinnedStore, "
        f"a path for a Zarr store, or a callable meta -> writer; got {target!r}."
    )
