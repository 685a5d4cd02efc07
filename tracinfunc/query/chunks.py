"""The one streaming loop under every exact query: scores of a prepared query, chunk by chunk.

For each row chunk of the store, :func:`stream_scores` accumulates
``sum_c (lr_c test_c) @ train_c.T`` over checkpoints in float32 (float64 for float64 stores)
and yields the ``[n_test, rows]`` block to a reduction (``score`` writes it into the full
matrix, ``top_k`` merges a running top-k). Rows come from
:func:`tracinfunc.query.stream.stream_rows` (background reads into reusable buffers,
asynchronous copies to a GPU), so extra memory is a few chunks plus the output.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from tracinfunc._devices import canonical_device, full_float32
from tracinfunc._norms import directions, has_small_norms
from tracinfunc._validate import check_int, entry_point
from tracinfunc.curvature.value import Curvature
from tracinfunc.errors import InvalidArgumentError
from tracinfunc.progress import ProgressArg, progress_bar
from tracinfunc.query.checks import norm_divisors
from tracinfunc.query.overflow import OverflowWatch
from tracinfunc.query.prepared import PreparedQuery, fits, prepare_query, scale_products
from tracinfunc.query.rows import row_range
from tracinfunc.query.stream import compute_threads, stream_rows
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import (
    GradientStore,
    SupportsMappedRows,
    SupportsRowViews,
    aligned_rows,
)

__all__ = ["score_chunks", "stream_scores"]

# Bytes of one chunk's train rows plus its [n_test, rows] score block; keeps the working set
# in cache-friendly, bounded pieces whatever the store's size.
_CHUNK_BUDGET_BYTES = 64 * 2**20
# Stores read through buffers (Zarr, or any store on a GPU) use smaller pieces: the buffers
# are fresh memory per pass, and first-touch page faults cost more than the matmul on VMs.
_STREAM_BUDGET_BYTES = 16 * 2**20
_MIN_CHUNK_ROWS = 256
# bfloat16 stores on the CPU could be multiplied in bfloat16 when few test rows make the
# matmul memory-bound (measured 1.13x faster than upcasting at n_test=64, 0.68x at 512), but
# each checkpoint's block is then rounded to bfloat16, so a test row's scores (and top-k)
# depended on how many rows were scored with it. Off: accumulation is float32, as documented.
_CPU_BF16_MATMUL = False
_CPU_BF16_MAX_TEST = 128


@entry_point("score_chunks")
def score_chunks(
    store: GradientStore,
    test_grads: GradientStore | Tensor,
    *,
    normalize: bool = False,
    device: torch.device | str | None = None,
    chunk_rows: int | None = None,
    progress: ProgressArg = None,
    rows: tuple[int, int] | None = None,
    curvature: Curvature | None = None,
    out: Tensor | None = None,
) -> Iterator[tuple[int, Tensor]]:
    """Stream TracIn scores chunk by chunk: the loop under :func:`score` and :func:`top_k`.

    Rows are read by a background thread (chunk i+1 while chunk i is multiplied) into
    reusable buffers, copied to a GPU asynchronously on a side stream, and accumulated over
    checkpoints in float32; float16 and bfloat16 rows are upcast to float32 first, so a test
    row's scores never depend on the other test rows scored with it.

    There is no ``output=``/``like=``: the blocks are torch tensors that live only until the
    next one is requested (with ``out``, views of it), for a reduction written in torch;
    convert what the reduction keeps.

    Args:
        store: As in :func:`score`.
        test_grads: As in :func:`score`.
        normalize: As in :func:`score`.
        device: As in :func:`score`.
        chunk_rows: As in :func:`score`.
        progress: As in :func:`score`.
        rows: ``(start, stop)``: score only training rows ``[start, stop)``; ``start`` of
            each block is still a row of the whole store.
        curvature: As in :func:`score`: the blocks are curvature-aware scores.
        out: Optional ``[n_test, n_rows]`` tensor (``n_rows`` the rows scored; float32,
            float64 for float64 gradients, on ``device``); blocks are then written into it
            (``block`` is a view of ``out[:, i:i + rows]``) instead of allocated per chunk.

    Yields:
        ``(start, block)`` with ``block`` ``[n_test, rows]`` the scores of training rows
        ``[start, start + rows)``. Write your own reduction over it; without ``out``,
        ``block`` is new for every chunk.
    """
    query = prepare_query(store, test_grads, normalize=normalize, device=device,
                          curvature=curvature)
    offset = 0
    if rows is not None:
        store = row_range(store, rows)
        offset = store.start
    for start, block in stream_scores(store, query, chunk_rows=chunk_rows, out=out,
                                      progress=progress):
        yield start + offset, block


def stream_scores(store: GradientStore, query: PreparedQuery, *, chunk_rows: int | None,
                  progress: ProgressArg, out: Tensor | None = None,
                  watch: OverflowWatch | None = None) -> Iterator[tuple[int, Tensor]]:
    """``(start, block [n_test, rows])`` for every row chunk of ``store``, ``start`` a row of
    ``store``; ``query`` was prepared for it (or for the store it is a row range of).

    Overflowed scores are recorded in ``watch`` (its owner warns: one warning for a query
    streamed in parts), else in a watch of this stream that warns when the stream ends or
    is closed."""
    if watch is None:
        own = OverflowWatch(store, query)
        try:
            yield from stream_scores(store, query, chunk_rows=chunk_rows, progress=progress,
                                     out=out, watch=own)
        finally:
            own.warn()
        return
    meta, device, dtype = store.meta, query.device, query.dtype
    matmul_dtype = _matmul_dtype(meta.torch_dtype, dtype, device, n_test=query.n_test)
    test = query.rows.to(device, matmul_dtype)  # [n_ckpt, n_test, k]
    rows_per_chunk = _chunk_rows(store, chunk_rows, meta, query.n_test)
    divisors = tiny = None
    if query.normalize:  # [n_ckpt, n_train]: 1/k of the store, read once
        divisors = torch.stack([
            norm_divisors(store.read_norms(c, 0, meta.n_train).to(device, dtype))
            for c in range(meta.n_ckpt)
        ])
        if not divisors.is_meta:  # (the tests' stand-in device holds no values)
            tiny = has_small_norms(divisors, dtype).cpu()  # rows made unit before the product
    upcast = None
    if meta.torch_dtype != matmul_dtype:  # float16 (or bf16 on GPU) rows -> float32 matmul
        upcast = torch.empty(rows_per_chunk, meta.k, dtype=matmul_dtype, device=device)
    pieces = [
        (ckpt, start, min(start + rows_per_chunk, meta.n_train))
        for start in range(0, meta.n_train, rows_per_chunk)
        for ckpt in range(meta.n_ckpt)
    ]
    _check_out(out, (query.n_test, meta.n_train), dtype, device)
    threads = compute_threads(store, device, pieces)
    block = torch.empty(0)
    bar = progress_bar(progress, total=meta.n_train, desc="score", unit="row")
    for (ckpt, start, stop), train_rows in stream_rows(store, pieces, device=device,
                                                        max_rows=rows_per_chunk):
        if ckpt == 0:
            block = (out[:, start:stop] if out is not None else
                     torch.empty(query.n_test, stop - start, dtype=dtype, device=device))
        divisor = None if divisors is None else divisors[ckpt, start:stop]
        with threads, full_float32():  # no TF32 whatever the process set
            train = train_rows if upcast is None else upcast[: stop - start].copy_(train_rows)
            if tiny is not None and bool(tiny[ckpt, start:stop].any()):
                train, divisor = _unit_tiny_rows(train, divisor)
            _accumulate(block, test[ckpt], train, divisor, first=ckpt == 0,
                        scale=query.scale(ckpt))
        if ckpt == meta.n_ckpt - 1:
            if watch is not None:
                watch.check(start, block)
            bar.update(stop - start)
            yield start, block
    bar.close()


def _unit_tiny_rows(train: Tensor, divisor: Tensor) -> tuple[Tensor, Tensor]:
    """``train`` ``[rows, k]`` with its rows of small norm made unit from their own entries
    (:func:`~tracinfunc._norms.directions`: their products, and their norms, would be
    subnormal), and ``divisor`` 1 for them; new tensors."""
    small = has_small_norms(divisor, train.dtype)
    train = train.clone()  # a store's own memory, or a reused buffer: never written
    train[small] = directions(train[small], divisor[small])
    return train, torch.where(small, torch.ones_like(divisor), divisor)


def _accumulate(block: Tensor, test: Tensor, train: Tensor, divisor: Tensor | None, *,
                first: bool, scale: float = 1.0) -> None:
    """``block (=|+=) scale * test @ train.T`` (over ``divisor`` per column), in ``block``'s
    dtype (``scale``: :attr:`PreparedQuery.scales`, 1.0 but where ``lr_c`` did not fit the rows).

    ``first``: overwrite ``block`` (uninitialised memory; ``beta=0`` ignores it, NaN included).
    """
    if divisor is None and test.dtype == block.dtype and fits(scale, block.dtype):
        block.addmm_(test, train.T, beta=0 if first else 1, alpha=scale)  # [n_test, k] @ [k, rows]
        return
    product = scale_products(test @ train.T, scale)  # [n_test, rows], bf16 on the CPU bf16 path
    if divisor is not None:
        product = product.div_(divisor)  # its own new tensor
    if first:
        block.copy_(product)
    else:
        block.add_(product)


def _check_out(out: Tensor | None, shape: tuple[int, int], dtype: torch.dtype,
               device: torch.device) -> None:
    if out is None:
        return
    device = canonical_device(device)  # "cuda" is the current GPU, not any GPU
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise InvalidArgumentError(
            f"score_chunks: out must be {list(shape)} {dtype} on {device}, got "
            f"{list(out.shape)} {out.dtype} on {out.device}."
        )


def _matmul_dtype(storage: torch.dtype, compute: torch.dtype, device: torch.device, *,
                  n_test: int) -> torch.dtype:
    """The dtype rows are multiplied in: bfloat16 for bf16 stores on the CPU when it pays."""
    if (storage == torch.bfloat16 and device.type == "cpu" and _CPU_BF16_MATMUL
            and n_test <= _CPU_BF16_MAX_TEST):
        return torch.bfloat16
    return compute


def _chunk_rows(store: GradientStore, chunk_rows: int | None, meta: StoreMeta,
                n_test: int) -> int:
    if chunk_rows is not None:
        chunk_rows = check_int(chunk_rows, "chunk_rows", optional=True,
                  fix="pass None to let it choose from its memory budget")
        return min(chunk_rows, max(1, meta.n_train))
    lent = store.mapped_chunk_rows if isinstance(store, SupportsMappedRows) else None
    if lent and lent >= min(_MIN_CHUNK_ROWS, meta.n_train):
        # Lent whole, in place. Smaller stored chunks are read into pieces of the usual
        # size instead: a piece of a few rows is its own small matmul (BLAS then sums in
        # another order: scores 1 ulp off the memory copy's) and its own score block.
        return min(lent, max(1, meta.n_train))
    in_memory = isinstance(store, SupportsRowViews)
    budget = _CHUNK_BUDGET_BYTES if in_memory else _STREAM_BUDGET_BYTES
    rows = _default_chunk_rows(meta.k, n_test, meta.n_train, budget)
    if rows < meta.n_train:  # whole stored chunks read fastest (no partial-chunk copies)
        rows = aligned_rows(store, rows)
    return min(rows, max(1, meta.n_train))


def _default_chunk_rows(k: int, n_test: int, n_train: int,
                        budget: int = _CHUNK_BUDGET_BYTES) -> int:
    rows = budget // (4 * (k + n_test))
    return max(1, min(n_train, max(_MIN_CHUNK_ROWS, rows)))
