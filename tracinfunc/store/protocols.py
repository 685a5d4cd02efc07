"""The GradientStore protocol, its optional abilities, and the checks every store shares.

A protocol file: it imports no implementation (optax ``_src/base.py``). Optional abilities are
separate ``Protocol``s (zarr ``storage/_protocols.py``) that code tests with ``isinstance``.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from tracinfunc._validate import calling, current_caller
from tracinfunc.errors import (
    IncompatibleGradientsError,
    InvalidArgumentError,
    InvalidTypeError,
    NonFiniteGradientError,
    RowRangeError,
    TracInFuncError,
)
from tracinfunc.store.meta import StoreMeta

__all__ = [
    "GradientStore",
    "StoreWriter",
    "SupportsChunkAlignment",
    "SupportsCodeViews",
    "SupportsQuantizedRows",
    "SupportsRowViews",
    "aligned_rows",
    "check_block",
    "check_block_shape",
    "check_out_buffer",
    "check_row_range",
    "store_meta",
]


# The function behind GradientStore.open. The Zarr backend registers it when it is imported;
# importing this module imports the tracinfunc.store package first, which imports the backend,
# so it is always set before anyone can call GradientStore.open.
_OPENER: Callable[..., Any] | None = None


def _set_opener(opener: Callable[..., Any]) -> None:
    global _OPENER
    _OPENER = opener


class _OpenableProtocol(type(Protocol)):  # type: ignore[misc]
    """The metaclass that gives ``GradientStore`` its ``open``: defined on the metaclass, the
    opener is an attribute of the class object only. It is not a protocol member (those come
    from the class body), so ``isinstance(store, GradientStore)`` still asks for ``meta``,
    ``read_rows`` and ``read_norms`` alone, and stores never inherit an ``open`` method."""

    def open(cls, path: str | os.PathLike[str], *, allow_unsealed: bool = False) -> Any:
        """Reopen a finished gradient store read-only: a local directory or a URL
        (``s3://bucket/grads.zarr``), in any process.

        Args:
            path: Where ``build_store(..., store=path)``, ``save_store`` or ``tracinfunc
                build --out`` wrote the store.
            allow_unsealed: Open a finished store that has no seal (written before seals,
                or with its seal removed), with a warning: its metadata and file placement
                are then unchecked. Re-save it with :func:`~tracinfunc.save_store`.

        Returns:
            A read-only :class:`~tracinfunc.store.ZarrStore` ``[n_ckpt, n_train, k]``.

        Raises:
            StoreNotFoundError: no store at ``path``.
            IncompleteStoreError: the build that wrote it was interrupted (resume it).
            CorruptStoreError: the metadata or arrays do not describe a valid store.
        """
        if _OPENER is None:  # unreachable through any import of tracinfunc.store
            raise TracInFuncError("GradientStore.open: the Zarr backend did not register")
        with calling("GradientStore.open"):  # errors name the door the user used
            return _OPENER(path, allow_unsealed=allow_unsealed)


@runtime_checkable
class GradientStore(Protocol, metaclass=_OpenableProtocol):
    """Read-only projected training gradients, ``[n_ckpt, n_train, k]``, plus row norms.

    ``GradientStore.open("grads.zarr")`` reopens a store written to disk or object storage
    (see :meth:`_OpenableProtocol.open`); the store's metadata is checked on every query, so
    a mismatched query fails loudly.

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
class SupportsMappedRows(Protocol):
    """Optional ability: whole stored chunks can be lent without a copy, as views of a
    mapped file (a ZarrStore of local, uncompressed shard files).

    Streaming readers on the CPU then multiply the page cache's own pages: pieces of one
    stored chunk each, no buffers, no background thread.
    """

    @property
    def mapped_chunk_rows(self) -> int | None:
        """Rows per lendable piece (one stored chunk), or ``None`` when rows are not lent."""
        ...

    def map_rows(self, ckpt: int, start: int, stop: int
                 ) -> tuple[Tensor, Callable[[], None]] | None:
        """Rows ``[start, stop)`` (one stored chunk) of checkpoint ``ckpt`` as a view,
        ``[stop - start, k]``, with ``release`` to call once done with it (it raises if the
        rows changed meanwhile); ``None`` where they cannot be lent: read them instead."""
        ...

    def lend_rows(self, pieces: Iterable[tuple[int, int, int]]
                  ) -> Iterator[tuple[Tensor, Callable[[], None]] | None]:
        """What :meth:`map_rows` gives for each ``(ckpt, start, stop)`` piece, in order, lent
        through one pass (files and mappings shared by its pieces until the generator is
        closed); a lent view is valid until the next piece is asked for."""
        ...


@runtime_checkable
class SupportsQuantizedRows(Protocol):
    """Optional ability: rows are stored quantised (``meta.quantization`` is set), and the
    stored codes can be read as they are: conversions copy them bit for bit, and readers
    can move a quarter (int8) or a 32nd (sign) of the bytes and dequantise on arrival
    (:func:`tracinfunc.store.codes.dequantize`, which is what ``read_rows`` returns)."""

    def read_codes(self, ckpt: int, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Codes ``[stop - start, width]`` (int8, or uint8 packed signs) and per-row scales
        ``[stop - start]`` float32 of rows ``[start, stop)`` of checkpoint ``ckpt``, as
        tensors the caller owns."""
        ...


@runtime_checkable
class SupportsCodeViews(Protocol):
    """Optional ability: a quantised store in memory lends its codes and scales as views,
    which streaming sends to a device without a staging copy."""

    def view_codes(self, ckpt: int, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Codes ``[stop - start, width]`` and scales ``[stop - start]`` of rows
        ``[start, stop)`` of checkpoint ``ckpt``, as views of the store's memory; the caller
        must not write to them."""
        ...


@runtime_checkable
class SupportsChunkAlignment(Protocol):
    """Optional ability: rows are stored in chunks, and reads aligned to them are fastest."""

    @property
    def chunk_rows(self) -> int:
        """Rows per stored chunk."""
        ...


def store_meta(store: object, name: str = "store") -> StoreMeta:
    """The metadata of ``store``, checked to be a :class:`GradientStore` instance first (the
    store check every function taking a store runs before reading it).

    Raises:
        InvalidTypeError: ``store`` is not a GradientStore instance (a class, a path, an
            object whose ``meta`` is not a StoreMeta or whose readers are not methods).
    """
    ok = (not isinstance(store, type) and isinstance(store, GradientStore)
          and callable(store.read_rows) and callable(store.read_norms))
    meta = store.meta if ok else None
    if not isinstance(meta, StoreMeta):
        what = (f"the class {store.__name__}" if isinstance(store, type)
                else f"{type(store).__name__} {_short(store)}")
        hint = _store_hint(store)
        raise InvalidTypeError(
            f"{current_caller()}: {name} must be a GradientStore instance (a meta StoreMeta, "
            f"read_rows and read_norms methods), such as tif.GradientStore.open(path) or "
            f"build_store's result; got {what}{hint}.")
    return meta


@runtime_checkable
class _ContrastLike(Protocol):
    """The shape of a contrastive query (``tif.Contrast``), known here without importing
    the query layer: test and control gradients and a weight."""

    test: object
    control: object
    weight: float
    paired: bool


def _store_hint(store: object) -> str:
    """Why ``store`` is not a store, for the objects passed there by mistake."""
    if isinstance(store, str | bytes | os.PathLike):
        return " (a path: open it with tif.GradientStore.open(path))"
    if isinstance(store, _ContrastLike):
        return ("; the store comes first; a Contrast goes where test_grads go, e.g. "
                "tif.score(store, tif.Contrast(test_grads, control))")
    if hasattr(store, "shape") and hasattr(store, "dtype"):
        return ("; the store comes first; an array of test gradients [n_ckpt, n_test, k] goes "
                "where test_grads go, e.g. tif.score(store, test_grads)")
    return ""


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def aligned_rows(store: GradientStore, rows: int) -> int:
    """``rows`` rounded down to whole stored chunks (at least one) for chunked stores."""
    stored = store.chunk_rows if isinstance(store, SupportsChunkAlignment) else 1
    if isinstance(stored, int) and stored > 1:
        return max(stored, rows // stored * stored)
    return rows


def check_row_range(meta: StoreMeta, ckpt: int, start: int, stop: int) -> tuple[int, int, int]:
    """``(ckpt, start, stop)`` as Python ints; raise unless ``0 <= ckpt < n_ckpt`` and
    ``0 <= start <= stop <= n_train``.

    Readers use the ints returned, never the arguments: a NumPy ``uint8`` bound (or any
    fixed-width integer) overflows in byte offsets (``start * row_bytes``), and a 0-d tensor
    prints as ``tensor(0)`` in a file name.
    """
    for name, value in (("ckpt", ckpt), ("start", start), ("stop", stop)):
        if isinstance(value, bool) or not _is_index(value):  # a bool would index every ckpt
            raise InvalidTypeError(f"{current_caller()}: {name} must be an integer, got "
                                   f"{type(value).__name__} {value!r}; e.g. {current_caller()}(0, "
                                   "0, 10).")
    ckpt, start, stop = operator.index(ckpt), operator.index(start), operator.index(stop)
    if not 0 <= ckpt < meta.n_ckpt:
        raise RowRangeError(
            f"{current_caller()}: checkpoint index {ckpt} out of range [0, {meta.n_ckpt})."
        )
    if not 0 <= start <= stop <= meta.n_train:
        raise RowRangeError(
            f"{current_caller()}: row range [{start}, {stop}) is not within [0, {meta.n_train}]."
        )
    return ckpt, start, stop


def _is_index(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_out_buffer(out: Tensor, rows: int, meta: StoreMeta) -> Tensor:
    """Validate a caller's ``out`` buffer and return the ``[rows, k]`` view to fill."""
    if out.dtype != meta.torch_dtype or out.ndim != 2 or out.shape[1] != meta.k:
        raise InvalidArgumentError(
            f"{current_caller()}: out must be [>= {rows}, {meta.k}] {meta.torch_dtype}, got "
            f"{list(out.shape)} {out.dtype}."
        )
    if out.shape[0] < rows:
        raise InvalidArgumentError(
            f"{current_caller()}: out has {out.shape[0]} rows, {rows} are needed."
        )
    return out[:rows]


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


def check_block(meta: StoreMeta, rows: Tensor, norms: Tensor) -> None:
    """Raise unless ``rows`` is ``[n_ckpt, b, k]`` and ``norms`` ``[n_ckpt, b]``, all finite.

    Raises:
        IncompatibleGradientsError: (a ``ValueError``) the block does not fit the store.
        NonFiniteGradientError: a value is NaN or inf.
    """
    check_block_shape(meta, rows, norms)
    if rows.numel() and norms.numel():  # one pass, no [n_ckpt, b, k] mask: NaN propagates
        low, high = torch.aminmax(rows)
        if bool(torch.isfinite(low) & torch.isfinite(high) & torch.isfinite(norms).all()):
            return
    finite = torch.isfinite(rows).all(dim=-1) & torch.isfinite(norms)  # [n_ckpt, b]
    if not bool(finite.all()):
        ckpt, row = (~finite).nonzero()[0].tolist()
        raise NonFiniteGradientError(
            f"{current_caller()}: the block holds NaN/inf values (checkpoint index {ckpt}, row "
            f"{row} of "
            "the block first); they would rank as the strongest proponents. Check the loss and "
            "the checkpoint weights on those examples, or drop them."
        )


def check_block_shape(meta: StoreMeta, rows: Tensor, norms: Tensor) -> None:
    """:func:`check_block` without its pass over the values, for a block whose norms the
    caller has already found finite (a finite norm means a finite row): the build loop's.

    Raises:
        IncompatibleGradientsError: (a ``ValueError``) the block does not fit the store.
    """
    if rows.ndim != 3 or rows.shape[0] != meta.n_ckpt or rows.shape[2] != meta.k:
        raise IncompatibleGradientsError(
            f"{current_caller()}: rows must be [n_ckpt={meta.n_ckpt}, b, k={meta.k}], got "
            f"{list(rows.shape)}; write one row of k values per example and checkpoint, "
            "made with the store's projection."
        )
    if tuple(norms.shape) != tuple(rows.shape[:2]):
        raise IncompatibleGradientsError(
            f"{current_caller()}: norms must be [n_ckpt, b] = {list(rows.shape[:2])}, got "
            f"{list(norms.shape)}; pass rows.norm(dim=-1) of the unrounded rows."
        )
    if not (rows.is_floating_point() and norms.is_floating_point()):
        raise InvalidTypeError(
            f"{current_caller()}: rows and norms must be floating point, got {rows.dtype} and "
            f"{norms.dtype}; pass the projected gradients as computed (e.g. float32)."
        )
