"""The GradientStore protocol and the few helpers every implementation shares."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from tracinfunc.errors import InvalidArgumentError, RowRangeError
from tracinfunc.projection import Projection
from tracinfunc.store.meta import StoreMeta

if TYPE_CHECKING:
    from tracinfunc.store.memory import MemoryStore
    from tracinfunc.store.pinned import PinnedStore
    from tracinfunc.store.zarr import ZarrStore

__all__ = ["GradientStore", "StoreProperties", "check_row_range"]


class _GradientStoreType(type(Protocol)):
    """Metaclass that gives ``GradientStore.open`` without making it a protocol member.

    A method in the protocol's own namespace would be one more member every user store must
    implement (``typing`` collects the class ``__dict__``); one on the metaclass is reachable
    as ``GradientStore.open(path)`` and invisible to ``isinstance`` checks.
    """

    def open(cls, path: str | os.PathLike[str]) -> ZarrStore:
        """Reopen a finished Zarr gradient store read-only, in any process.

        Args:
            path: Directory written by ``build_store(..., store=path)`` or ``save_store``.

        Returns:
            A read-only :class:`~tracinfunc.store.zarr.ZarrStore`.

        Raises:
            FileNotFoundError: nothing at ``path``.
            IncompleteStoreError: the build that wrote it was interrupted (resume it).
        """
        from tracinfunc.store.zarr import ZarrStore

        return ZarrStore(path)


@runtime_checkable
class GradientStore(Protocol, metaclass=_GradientStoreType):
    """Read-only projected training gradients, ``[n_ckpt, n_train, k]``, plus row norms.

    The protocol is deliberately small: metadata and reading a row range of one checkpoint.
    Everything else (scoring, conversions) is a free function over it, so bringing your own
    store means implementing three members, with no subclassing.
    """

    @property
    def meta(self) -> StoreMeta:
        """What the rows were made from (projection, checkpoints, layout, dtype, sizes)."""
        ...

    def read_rows(self, ckpt: int, start: int, stop: int, *, out: Tensor | None = None) -> Tensor:
        """Rows ``[start, stop)`` of checkpoint ``ckpt``: ``[stop - start, k]``.

        Returned in the storage dtype, on the CPU, as a tensor the caller owns: writing to it
        never changes the store. With ``out`` (``[>= stop - start, k]``, storage dtype) the
        rows are written into ``out[: stop - start]`` and that view is returned, so streaming
        readers can reuse one preallocated buffer.
        """
        ...

    def read_norms(self, ckpt: int, start: int, stop: int) -> Tensor:
        """L2 norms of the full-precision rows ``[start, stop)``: ``[stop - start]`` float."""
        ...


class StoreProperties:
    """Convenience properties derived from ``self.meta`` (for the built-in stores)."""

    meta: StoreMeta

    @property
    def projection(self) -> Projection:
        return self.meta.projection

    @property
    def n_train(self) -> int:
        return self.meta.n_train

    @property
    def n_ckpt(self) -> int:
        return self.meta.n_ckpt

    @property
    def k(self) -> int:
        return self.meta.k

    @property
    def dtype(self) -> torch.dtype:
        return self.meta.torch_dtype

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(n_ckpt, n_train, k)``."""
        return (self.meta.n_ckpt, self.meta.n_train, self.meta.k)

    def __len__(self) -> int:
        return self.meta.n_train

    def to_memory(self) -> MemoryStore:
        """A :class:`MemoryStore` copy of this store (see :func:`tracinfunc.to_memory`)."""
        from tracinfunc.store.convert import to_memory

        return to_memory(self)

    def to_pinned(self) -> PinnedStore:
        """A :class:`PinnedStore` copy of this store (see :func:`tracinfunc.to_pinned`)."""
        from tracinfunc.store.convert import to_pinned

        return to_pinned(self)

    def to_zarr(self, path: str | os.PathLike[str], **options: Any) -> ZarrStore:
        """Write this store to a new Zarr directory (see :func:`tracinfunc.save_store`)."""
        from tracinfunc.store.convert import save_store

        return save_store(self, path, **options)

    def __repr__(self) -> str:
        meta = self.meta
        names = ", ".join(c.name for c in meta.checkpoints)
        return (
            f"{type(self).__name__}(n_ckpt={meta.n_ckpt}, n_train={meta.n_train}, k={meta.k}, "
            f"dtype={meta.dtype}, projection={meta.projection}, checkpoints=[{names}])"
        )


def check_row_range(meta: StoreMeta, ckpt: int, start: int, stop: int, *, caller: str) -> None:
    """Raise ``IndexError`` unless ``0 <= ckpt < n_ckpt`` and ``0 <= start <= stop <= n_train``."""
    if not 0 <= ckpt < meta.n_ckpt:
        raise RowRangeError(f"{caller}: checkpoint index {ckpt} out of range [0, {meta.n_ckpt}).")
    if not 0 <= start <= stop <= meta.n_train:
        raise RowRangeError(
            f"{caller}: row range [{start}, {stop}) is not within [0, {meta.n_train}]."
        )


def check_out_buffer(out: Tensor, rows: int, meta: StoreMeta, *, caller: str) -> Tensor:
    """Validate a caller's ``out`` buffer and return the ``[rows, k]`` view to fill."""
    if out.dtype != meta.torch_dtype or out.ndim != 2 or out.shape[1] != meta.k:
        raise InvalidArgumentError(
            f"{caller}: out must be [>= {rows}, {meta.k}] {meta.torch_dtype}, got "
            f"{list(out.shape)} {out.dtype}."
        )
    if out.shape[0] < rows:
        raise InvalidArgumentError(f"{caller}: out has {out.shape[0]} rows, {rows} are needed.")
    return out[:rows]
