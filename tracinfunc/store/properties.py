"""Convenience properties shared by the built-in stores (a mixin), derived from ``self.meta``.

Conversions are free functions over the protocol (:mod:`tracinfunc.store.convert`), never
methods here: a base class must not depend on its subclasses.
"""

from __future__ import annotations

import torch

from tracinfunc.projection.spec import Projection
from tracinfunc.store.meta import StoreMeta

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

    def __repr__(self) -> str:
        meta = self.meta
        names = ", ".join(c.name for c in meta.checkpoints)
        quantized = "" if meta.quantization is None else f" (stored as {meta.quantization})"
        return (
            f"{type(self).__name__}(n_ckpt={meta.n_ckpt}, n_train={meta.n_train}, k={meta.k}, "
            f"dtype={meta.dtype}{quantized}, projection={meta.projection}, "
            f"checkpoints=[{names}])"
        )
