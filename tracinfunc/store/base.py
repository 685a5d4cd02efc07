"""The GradientStore protocol, its optional abilities, and the checks every store shares.

A protocol file: it imports no implementation (optax ``_src/base.py``). Optional abilities are
separate ``Protocol``s (zarr ``storage/_protocols.py``) that code tests with ``isinstance``.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from tracinfunc.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    RowRangeError,
    StoreNotFoundError,
)
from tracinfunc.store.meta import StoreMeta

__all__ = [
    "GradientStore",
    "SupportsChunkAlignment",
    "SupportsQuantizedRows",
    "SupportsRowViews",
    "aligned_rows",
    "check_out_buffer",
    "check_row_range",
]


class _GradientStoreType(type(Protocol)):
    """Metaclass that gives ``GradientStore.open`` without making it a protocol member.

    A method in the protocol's own namespace would be one more member every user store must
    implement (``typing`` collects the class ``__dict__``); one on the metaclass is reachable
    as ``GradientStore.open(path)`` and invisible to ``isinstance`` checks. The protocol knows
    no implementation: :mod:`tracinfunc.store.paths` (which does) registers the opener.
    """

    def open(cls, path: str | os.PathLike[str]) -> Any:
        """Reopen a finished Zarr gradient store read-only: :func:`tracinfunc.open_store`."""
        if _opener is None:
            raise StoreNotFoundError(
                "GradientStore.open: no store opener is registered; import tracinfunc (or "
                "tracinfunc.store) first, or call tracinfunc.open_store(path)."
            )
        return _opener(path)


# Module state, not a metaclass attribute: typing would read an annotated metaclass attribute
# as one more protocol member.
_opener: Callable[[str | os.PathLike[str]], Any] | None = None


def register_opener(opener: Callable[[str | os.PathLike[str]], Any]) -> None:
    """Make ``GradientStore.open(path)`` call ``opener(path)`` (done by ``store.paths``)."""
    global _opener
    _opener = opener


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

        Returned in ``meta.torch_dtype`` (the storage dtype; float32, dequantised, for a
        quantised store), on the CPU, as a tensor the caller owns: writing to it never
        changes the store. With ``out`` (``[>= stop - start, k]``, ``meta.torch_dtype``) the
        rows are written into ``out[: stop - start]`` and that view is returned, so
        streaming readers can reuse one preallocated buffer.
        """
        ...

    def read_norms(self, ckpt: int, start: int, stop: int) -> Tensor:
        """L2 norms of the full-precision rows ``[start, stop)``: ``[stop - start]`` float
        (taken before any cast or quantisation)."""
        ...


@runtime_checkable
class SupportsRowViews(Protocol):
    """Optional ability: rows are in memory and can be lent without a copy.

    Streaming readers use the views directly (no buffers, no background thread) and size
    their chunks for memory, not for I/O.
    """

    def view_rows(self, ckpt: int, start: int, stop: int) -> Tensor:
        """Rows ``[start, stop)`` of checkpoint ``ckpt`` as a view of the store's memory,
        ``[stop - start, k]``; the caller must not write to it."""
        ...


@runtime_checkable
class SupportsQuantizedRows(Protocol):
    """Optional ability: rows are stored quantised (``meta.quantization`` is set), and the
    stored codes can be read as they are: conversions copy them bit for bit, and readers
    can move a quarter (int8) or a 32nd (sign) of the bytes and dequantise on arrival
    (:func:`tracinfunc.store.quantize.dequantize`, which is what ``read_rows`` returns)."""

    def read_codes(self, ckpt: int, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Codes ``[stop - start, width]`` (int8, or uint8 packed signs) and per-row scales
        ``[stop - start]`` float32 of rows ``[start, stop)`` of checkpoint ``ckpt``, as
        tensors the caller owns."""
        ...


@runtime_checkable
class SupportsChunkAlignment(Protocol):
    """Optional ability: rows are stored in chunks, and reads aligned to them are fastest."""

    @property
    def chunk_rows(self) -> int:
        """Rows per stored chunk."""
        ...


def aligned_rows(store: GradientStore, rows: int) -> int:
    """``rows`` rounded down to whole stored chunks (at least one) for chunked stores."""
    stored = store.chunk_rows if isinstance(store, SupportsChunkAlignment) else 1
    if isinstance(stored, int) and stored > 1:
        return max(stored, rows // stored * stored)
    return rows


def check_row_range(meta: StoreMeta, ckpt: int, start: int, stop: int, *, caller: str) -> None:
    """Raise ``IndexError`` unless ``0 <= ckpt < n_ckpt`` and ``0 <= start <= stop <= n_train``."""
    for name, value in (("ckpt", ckpt), ("start", start), ("stop", stop)):
        if isinstance(value, bool) or not _is_index(value):  # a bool would index every ckpt
            raise InvalidTypeError(f"{caller}: {name} must be an integer, got "
                                   f"{type(value).__name__} {value!r}; e.g. {caller}(0, 0, 10).")
    if not 0 <= ckpt < meta.n_ckpt:
        raise RowRangeError(f"{caller}: checkpoint index {ckpt} out of range [0, {meta.n_ckpt}).")
    if not 0 <= start <= stop <= meta.n_train:
        raise RowRangeError(
            f"{caller}: row range [{start}, {stop}) is not within [0, {meta.n_train}]."
        )


def _is_index(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


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
