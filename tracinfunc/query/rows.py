"""A row range of a store as a store: how workers each score their part of one store.

``score``/``top_k``/``self_influence`` take ``rows=(start, stop)`` and scan only
:func:`row_range` of the store; in a process group, :func:`tracinfunc.distributed.rank_rows`
gives each rank its range.
"""

from __future__ import annotations

import operator

from torch import Tensor

from tracinfunc._validate import current_caller, entry_point
from tracinfunc.errors import RowRangeError
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import (
    GradientStore,
    SupportsChunkAlignment,
    SupportsRowViews,
    check_row_range,
)

__all__ = ["RowRange", "RowRangeViews", "check_rows", "row_range"]


def check_rows(rows: object, n_train: int) -> tuple[int, int]:
    """``rows`` as ``(start, stop)`` with ``0 <= start < stop <= n_train``, or a clear error.

    Each bound is any integer scalar (``int``, NumPy or 0-d torch integers, as
    ``np.array_split`` gives): taken by ``operator.index``; floats and bools are refused.
    """
    bounds = _integer_pair(rows)
    if bounds is None or not 0 <= bounds[0] < bounds[1] <= n_train:
        raise RowRangeError(
            f"{current_caller()}: rows must be (start, stop) with 0 <= start < stop <= n_train="
            f"{n_train}, got {rows!r}; e.g. rows=tif.distributed.rank_rows(n_train) for this "
            "rank's part."
        )
    return bounds


def _integer_pair(rows: object) -> tuple[int, int] | None:
    if not isinstance(rows, tuple | list) or len(rows) != 2:
        return None
    out = []
    for v in rows:
        if isinstance(v, bool) or "bool" in str(getattr(v, "dtype", "")):
            return None
        try:
            out.append(operator.index(v))
        except TypeError:
            return None
    return out[0], out[1]


class RowRange:
    """Rows ``[start, stop)`` of ``store`` read through it: ``[n_ckpt, stop - start, k]``.

    Row ``i`` of the range is row ``start + i`` of the store; its ``meta.n_train`` is
    ``stop - start``.
    """

    __slots__ = ("_meta", "start", "stop", "store")

    def __init__(self, store: GradientStore, start: int, stop: int) -> None:
        self.store, self.start, self.stop = store, start, stop
        self._meta: StoreMeta = store.meta.replace(n_train=stop - start)

    @property
    def meta(self) -> StoreMeta:
        return self._meta

    @property
    def chunk_rows(self) -> int:
        """The store's chunk rows when the range starts on a chunk, else 1 (no alignment)."""
        stored = self.store.chunk_rows if isinstance(self.store, SupportsChunkAlignment) else 1
        return stored if self.start % stored == 0 else 1

    @entry_point("RowRange.read_rows")
    def read_rows(self, ckpt: int, start: int, stop: int, *, out: Tensor | None = None) -> Tensor:
        ckpt, start, stop = check_row_range(self._meta, ckpt, start, stop)
        return self.store.read_rows(ckpt, self.start + start, self.start + stop, out=out)

    @entry_point("RowRange.read_norms")
    def read_norms(self, ckpt: int, start: int, stop: int) -> Tensor:
        ckpt, start, stop = check_row_range(self._meta, ckpt, start, stop)
        return self.store.read_norms(ckpt, self.start + start, self.start + stop)


class RowRangeViews(RowRange):
    """A :class:`RowRange` of a store that lends views of its rows (in-memory and pinned
    stores), so a worker's part streams without a copy, as the whole store does."""

    __slots__ = ()

    @entry_point("RowRange.view_rows")
    def view_rows(self, ckpt: int, start: int, stop: int) -> Tensor:
        ckpt, start, stop = check_row_range(self._meta, ckpt, start, stop)
        return self.store.view_rows(ckpt, self.start + start, self.start + stop)


def row_range(store: GradientStore, rows: object) -> RowRange:
    """Rows ``rows=(start, stop)`` of ``store`` as a store (see :class:`RowRange`)."""
    start, stop = check_rows(rows, store.meta.n_train)
    views = isinstance(store, SupportsRowViews)
    return (RowRangeViews if views else RowRange)(store, start, stop)
