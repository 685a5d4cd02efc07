"""MemoryStore: projected gradients held in ordinary (CPU) memory."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tracinfunc._host_memory import host_empty
from tracinfunc._norms import row_norms, smallest_plain_norm
from tracinfunc._validate import entry_point
from tracinfunc.errors import (
    InvalidArgumentError,
    ReadOnlyStoreError,
)
from tracinfunc.interop import as_tensor
from tracinfunc.store.codes import check_codes, code_dtype, code_width, stored_empty, to_stored
from tracinfunc.store.memory.quantized import QuantizedMemoryStore
from tracinfunc.store.meta import StoreMeta, norm_dtype
from tracinfunc.store.properties import StoreProperties
from tracinfunc.store.protocols import (
    check_block,
    check_block_shape,
    check_out_buffer,
    check_row_range,
)

__all__ = ["MemoryStore", "MemoryWriter"]


class MemoryStore(StoreProperties):
    """Read-only gradients in CPU memory: rows ``[n_ckpt, n_train, k]``, norms ``[n_ckpt, n_train]``

    Built by :func:`tracinfunc.build_store` (the default store) or by :class:`MemoryWriter`.
    Tensors handed out are copies, so nothing a caller does can change the store. Built by
    hand, ``norms`` are checked against ``rows``: a finite row's norm within 1% of its own (a
    factor 2 for rows of denormal-range entries; 0 where ``rows.norm()`` gives 0), a NaN or
    +inf norm for a row holding NaN or inf.
    """

    __slots__ = ("_meta", "_norms", "_rows")

    def __init__(self, meta: StoreMeta, rows: Tensor, norms: Tensor) -> None:
        expected = (meta.n_ckpt, meta.n_train, meta.k)
        if tuple(rows.shape) != expected or rows.dtype != meta.torch_dtype:
            raise InvalidArgumentError(
                f"MemoryStore: rows must be {list(expected)} {meta.torch_dtype}, got "
                f"{list(rows.shape)} {rows.dtype}."
            )
        if tuple(norms.shape) != expected[:2]:
            raise InvalidArgumentError(
                f"MemoryStore: norms must be {list(expected[:2])}, got {list(norms.shape)}."
            )
        _check_norms_fit(rows, norms, type(self).__name__)
        # Copy on ingest: the caller's tensors may be changed later; ours never are.
        self._adopt(meta, rows.detach().to("cpu", copy=True), norms.detach().to("cpu", copy=True))

    @classmethod
    def _from_owned(cls, meta: StoreMeta, rows: Tensor, norms: Tensor) -> MemoryStore:
        """Wrap tensors nobody else references (a writer's), skipping the defensive copy."""
        store = object.__new__(cls)
        store._adopt(meta, rows, norms)
        return store

    def _adopt(self, meta: StoreMeta, rows: Tensor, norms: Tensor) -> None:
        object.__setattr__(self, "_meta", meta.replace(complete=True))
        object.__setattr__(self, "_rows", rows)
        object.__setattr__(self, "_norms", norms)

    def __setattr__(self, name: str, value: object) -> None:
        raise ReadOnlyStoreError(
            f"MemoryStore is read-only: cannot set {name!r}. Build a new store instead."
        )

    @property
    def meta(self) -> StoreMeta:
        return self._meta

    @entry_point("MemoryStore.read_rows")
    def read_rows(self, ckpt: int, start: int, stop: int, *, out: Tensor | None = None) -> Tensor:
        ckpt, start, stop = check_row_range(self._meta, ckpt, start, stop)
        source = self._rows[ckpt, start:stop]
        if out is None:
            return source.clone()
        target = check_out_buffer(out, stop - start, self._meta)
        return target.copy_(source)

    @entry_point("MemoryStore.read_norms")
    def read_norms(self, ckpt: int, start: int, stop: int) -> Tensor:
        ckpt, start, stop = check_row_range(self._meta, ckpt, start, stop)
        return self._norms[ckpt, start:stop].clone()

    @entry_point("MemoryStore.view_rows")
    def view_rows(self, ckpt: int, start: int, stop: int) -> Tensor:
        """Rows ``[start, stop)`` as a view of the store's memory, ``[stop - start, k]``
        (:class:`~tracinfunc.store.protocols.SupportsRowViews`): no copy, so never write to it."""
        ckpt, start, stop = check_row_range(self._meta, ckpt, start, stop)
        return self._rows[ckpt, start:stop]


class MemoryWriter:
    """Collects blocks of rows and returns a :class:`MemoryStore` when finished (a
    :class:`~tracinfunc.store.memory.quantized.QuantizedMemoryStore` for a quantised ``meta``).

    Args:
        meta: Metadata of the store to write; ``n_train`` is filled in by :meth:`finish`.
    """

    def __init__(self, meta: StoreMeta) -> None:
        self._meta = meta
        self._rows: list[Tensor] = []  # as stored: the storage dtype, or codes
        self._scales: list[Tensor] = []  # per-row scales of quantised rows
        self._norms: list[Tensor] = []
        # Rows of a build of known size, written in place into their final tensor
        # (reserve_rows): ``finish`` then concatenates nothing, and the peak memory is the
        # store's size instead of twice it. ``_rows`` holds the blocks written before or past it.
        # (rows [n_ckpt, capacity, width] as stored, norms [n_ckpt, capacity])
        self._arena: tuple[Tensor, Tensor] | None = None
        self._arena_rows = 0
        # (start, rows) of the reserved rows lent to the build loop (next_rows_slot) and not
        # appended yet: no other slot is lent meanwhile
        self._lent: tuple[int, int] | None = None
        self._finished = False

    @property
    def rows_written(self) -> int:
        return self._arena_rows + sum(block.shape[1] for block in self._rows)

    @entry_point("MemoryWriter.append")
    def append(self, rows: Tensor, norms: Tensor) -> None:
        """Add ``rows`` ``[n_ckpt, b, k]`` (any float dtype) and their ``norms`` ``[n_ckpt, b]``.

        Both may be tensors or any ``__dlpack__`` arrays (JAX, NumPy, CuPy).
        """
        if self._finished:
            raise ReadOnlyStoreError("MemoryWriter.append: the store is already finished.")
        rows = as_tensor(rows)
        norms = as_tensor(norms)
        check_block(self._meta, rows, norms)
        self._add(*to_stored(rows.detach(), self._meta), norms.detach())

    @entry_point("MemoryWriter.append_codes")
    def append_codes(self, codes: Tensor, scales: Tensor, norms: Tensor) -> None:
        """Add a block of a quantised store as stored: ``codes`` ``[n_ckpt, b, width]``,
        ``scales`` and ``norms`` ``[n_ckpt, b]`` (a bit-exact copy of another store's)."""
        if self._finished:
            raise ReadOnlyStoreError("MemoryWriter.append_codes: the store is already finished.")
        check_codes(self._meta, codes, scales, norms)
        self._add(codes, scales, norms)

    def _add(self, stored: Tensor, scales: Tensor | None, norms: Tensor) -> None:
        # Copy on ingest: a block the caller changes after append must not change the store.
        if self._into_arena(stored, norms):
            return
        self._rows.append(stored.to("cpu", code_dtype(self._meta), copy=True))
        if scales is not None:
            self._scales.append(scales.to("cpu", torch.float32, copy=True))
        self._norms.append(norms.to("cpu", norm_dtype(self._meta), copy=True))

    def _into_arena(self, stored: Tensor, norms: Tensor) -> bool:
        """Copy ``stored`` ``[n_ckpt, b, width]`` and ``norms`` ``[n_ckpt, b]`` into the
        reserved rows where they fit; once a block does not fit, the rows so far become a
        block and every later one is kept as given (a size hint that was too small costs the
        concatenation it would have saved). The norms are reserved too: small tensors kept
        between the large temporaries of every call would fragment the heap."""
        if self._arena is None:
            return False
        rows, kept_norms = self._arena
        start, b = self._arena_rows, stored.shape[1]
        if start + b <= rows.shape[1]:
            rows[:, start:start + b].copy_(stored)
            kept_norms[:, start:start + b].copy_(norms)
            self._arena_rows += b
            return True
        if start:
            self._rows.append(rows[:, :start])
            self._norms.append(kept_norms[:, :start])
        self._arena, self._arena_rows = None, 0
        return False

    def finish(self) -> MemoryStore | QuantizedMemoryStore:
        """Seal the store; the writer cannot be used afterwards."""
        if self._finished:
            raise ReadOnlyStoreError("MemoryWriter.finish: the store is already finished.")
        self._finished = True
        meta = self._meta.replace(n_train=self.rows_written, complete=True)
        if self._arena is not None:  # rows in place: fewer than reserved are cut to size
            rows, norms = self._arena
            if self._arena_rows < rows.shape[1]:
                rows = rows[:, :self._arena_rows].clone()
                norms = norms[:, :self._arena_rows].clone()
            self._arena = None
        else:
            rows = _joined(self._rows) if self._rows else stored_empty(meta, 0)
            norms = _joined(self._norms) if self._norms else torch.empty(meta.n_ckpt, 0)
        norms = norms.to(norm_dtype(meta))
        scales = torch.cat(self._scales, dim=1) if self._scales else torch.empty(meta.n_ckpt, 0)
        self._rows, self._scales, self._norms = [], [], []
        if meta.quantization is not None:
            return QuantizedMemoryStore._from_owned(meta, rows, scales, norms)
        return MemoryStore._from_owned(meta, rows, norms)


def _check_norms_fit(rows: Tensor, norms: Tensor, owner: str = "MemoryStore") -> None:
    """Refuse norms that cannot be the rows': for a finite row, one not within 1% of the
    row's norm (not finite, negative, 0 for a nonzero row, a positive norm for a zero row, or
    just another row's); for a row holding NaN or inf, a finite or negative one (queries would
    not name it). 1% leaves room for norms of rows before a cast to float16 or bfloat16 (a
    store keeps those); a 0 is taken where ``rows.norm()`` itself gives 0 (squares that
    underflow). One pass over the rows (their norms, :func:`~tracinfunc._norms.row_norms`)."""
    finite = torch.isfinite(rows).all(dim=-1)
    true = row_norms(rows).to(torch.float64)
    given = norms.to(torch.float64)
    close = (given - true).abs() <= 1e-2 * true
    # Rows of tiny entries (squares that underflow: denormals) were often cast after their
    # norm was taken, and keep few bits: within a factor of 2
    tiny = true < smallest_plain_norm(rows.dtype)
    close |= tiny & (given >= 0.5 * true) & (given <= 2 * true)
    wrong = finite & ~(torch.isfinite(given) & close)
    wrong |= ~finite & (torch.isfinite(given) | (given < 0))
    if not bool(wrong.any()):
        return
    # torch's own norm of a row of tiny entries is 0 (their squares underflow): taken
    zero_by_torch = (given == 0) & finite & (rows.norm(dim=-1) == 0)
    wrong &= ~zero_by_torch
    if not bool(wrong.any()):
        return
    ckpt, row = (int(i) for i in wrong.nonzero()[0])
    # 7 digits, as a float (0.0, 1e-30), not the float32's rounding noise
    given_value = float(f"{float(norms[ckpt, row]):.7g}")
    true_value = float(f"{float(true[ckpt, row]):.7g}")
    where = f"{owner}: row {row} of checkpoint {ckpt}"
    if not bool(finite[ckpt, row]):
        raise InvalidArgumentError(
            f"{where} holds NaN or inf values but its norm is given as {given_value!r}; give "
            "such a row a NaN or +inf norm (queries then name it), or drop the row.")
    if not math.isfinite(true_value) and rows.dtype != torch.float64:
        raise InvalidArgumentError(
            f"{where} is finite but its norm does not fit {rows.dtype} (entries near its "
            "largest value): give float64 rows and norms (a float64 store), or scale the "
            "rows down.")
    raise InvalidArgumentError(
        f"{where} has norm {true_value!r} but its norm is given as {given_value!r}; give "
        "each row's own norm (e.g. rows.double().norm(dim=-1)).")


def append_fresh(writer: MemoryWriter, rows: Tensor, norms: Tensor) -> None:
    """``writer.append(rows, norms)`` for tensors no one else holds or changes (the build
    loop's own rows, whose every norm it has found finite and whose values it has found
    storable): a float store keeps them as they are when they already have its storage dtype
    and device, without the copy that protects a caller's tensors nor a second finiteness
    pass (two passes over every row fewer); a quantised store encodes them as ``append``
    does."""
    if writer._finished or writer._meta.quantization is not None:
        writer.append(rows, norms)
        return
    check_block_shape(writer._meta, rows, norms)  # finite: the loop checked every norm
    if _is_next_slot(writer, rows):  # computed straight into the reserved rows
        start, b = writer._arena_rows, rows.shape[1]
        writer._arena[1][:, start:start + b].copy_(norms)
        writer._arena_rows += b
        return
    if _fills_reservation(writer, rows):  # one call for the whole store: kept, not copied
        reserved_norms = writer._arena[1].copy_(norms)
        writer._arena, writer._arena_rows = (rows.detach(), reserved_norms), rows.shape[1]
        return
    if not writer._into_arena(rows.detach(), norms.detach()):
        writer._rows.append(rows.detach().to("cpu", code_dtype(writer._meta)))
        writer._norms.append(norms.detach().to("cpu", norm_dtype(writer._meta)))


def next_rows_slot(writer: MemoryWriter, b: int, dtype: torch.dtype) -> Tensor | None:
    """The reserved rows ``[n_ckpt, b, width]`` the next ``b`` rows will fill, for the build
    loop to compute them in place (:func:`append_fresh` then copies nothing), or ``None``:
    no reservation, too few rows left in it, or another storage dtype than ``dtype`` (rows
    are checked before any cast)."""
    if writer._finished or writer._arena is None or writer._meta.quantization is not None \
            or writer._lent is not None:  # one slot at a time: the next once it is appended
        return None
    rows, start = writer._arena[0], writer._arena_rows
    if rows.dtype != dtype or start + b > rows.shape[1]:
        return None
    writer._lent = (start, b)
    return rows[:, start:start + b]


def _is_next_slot(writer: MemoryWriter, rows: Tensor) -> bool:
    """Whether ``rows`` are the reserved rows :func:`next_rows_slot` gives now (the same
    memory, shape and strides)."""
    lent, writer._lent = writer._lent, None  # whatever comes next: a later slot may be lent
    if writer._arena is None or lent != (writer._arena_rows, rows.shape[1]):
        return False
    slot = writer._arena[0][:, lent[0]:lent[0] + lent[1]]
    return slot.data_ptr() == rows.data_ptr() and slot.dtype == rows.dtype and \
        slot.shape == rows.shape and slot.stride() == rows.stride()


def _fills_reservation(writer: MemoryWriter, rows: Tensor) -> bool:
    """Whether ``rows`` (the loop's own) are the whole reservation, as stored: the first
    block, exactly the reserved rows, in the storage dtype, contiguous on the CPU."""
    if writer._arena is None or writer._arena_rows:
        return False
    reserved = writer._arena[0]
    return rows.shape == reserved.shape and rows.dtype == reserved.dtype and \
        rows.device.type == "cpu" and rows.is_contiguous()


def reserve_rows(writer: MemoryWriter, rows: int) -> None:
    """Have ``writer`` (holding no rows yet) write its next ``rows`` rows into one tensor
    allocated now, so that ``finish`` concatenates nothing: a float store's build of known
    size peaks at the store's size, not twice it. A hint: more rows go on in blocks, fewer
    are cut to size at ``finish``. Pages of the allocation are only touched as rows arrive,
    so a hint too large costs address space, not memory; one that cannot be allocated is
    ignored (the blocks' concatenation will say what memory is short)."""
    if writer._meta.quantization is not None or writer.rows_written or writer._finished \
            or rows <= 0:
        return
    try:
        meta = writer._meta  # huge pages: the rows are first touched as they arrive
        writer._arena = (host_empty((meta.n_ckpt, rows, code_width(meta)), code_dtype(meta)),
                         torch.empty(meta.n_ckpt, rows, dtype=norm_dtype(meta)))
    except RuntimeError:  # more than the address space allows: the blocks as before
        writer._arena = None


def _joined(blocks: list[Tensor]) -> Tensor:
    """The blocks ``[n_ckpt, b_i, ...]`` as one ``[n_ckpt, sum b_i, ...]`` tensor (a lone
    contiguous block as it is: each was copied on ingest or handed over for good). The joined
    rows are new memory written once, in 2 MiB pages where the kernel allows (a build from a
    generator: 49 MB of rows joined ~12 ms faster on a 2-core AMD EPYC)."""
    if len(blocks) == 1:
        return blocks[0].contiguous()
    first = blocks[0]
    shape = (first.shape[0], sum(block.shape[1] for block in blocks), *first.shape[2:])
    return torch.cat(blocks, dim=1, out=host_empty(shape, first.dtype))
