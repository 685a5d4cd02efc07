"""Convenience properties and conversions shared by the built-in stores (a mixin).

Derived from ``self.meta`` only; the conversion methods are thin aliases of the free functions
in :mod:`tracinfunc.store.convert`, imported when called (convert imports every store class).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from tracinfunc.projection.spec import Projection
from tracinfunc.store.meta import StoreMeta

if TYPE_CHECKING:
    from tracinfunc.store.memory import MemoryStore
    from tracinfunc.store.pinned import PinnedStore
    from tracinfunc.store.zarr import ZarrStore

__all__ = ["StoreProperties"]


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

    def to_memory(self, *, dtype: torch.dtype | str | None = None) -> MemoryStore:
        """A :class:`MemoryStore` copy of this store (see :func:`tracinfunc.to_memory`)."""
        from tracinfunc.store.convert import to_memory

        return to_memory(self, dtype=dtype)

    def to_pinned(self, *, dtype: torch.dtype | str | None = None) -> PinnedStore:
        """A :class:`PinnedStore` copy of this store (see :func:`tracinfunc.to_pinned`)."""
        from tracinfunc.store.convert import to_pinned

        return to_pinned(self, dtype=dtype)

    def to_zarr(self, path: str | os.PathLike[str], **options: Any) -> ZarrStore:
        """Write this store to a new Zarr directory (see :func:`tracinfunc.save_store`)."""
        from tracinfunc.store.convert import save_store

        return save_store(self, path, **options)

    def __repr__(self) -> str:
        meta = self.meta
        names = ", ".join(c.name for c in meta.checkpoints)
        quantized = "" if meta.quantization is None else f" (stored as {meta.quantization})"
        return (
            f"{type(self).__name__}(n_ckpt={meta.n_ckpt}, n_train={meta.n_train}, k={meta.k}, "
            f"dtype={meta.dtype}{quantized}, projection={meta.projection}, "
            f"checkpoints=[{names}])"
        )
