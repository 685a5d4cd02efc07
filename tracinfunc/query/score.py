"""TracIn scores over a gradient store: one chunked streaming loop, several reductions.

Every reduction walks the store in row chunks; for each chunk it accumulates
``sum_c lr_c * test_c @ train_c.T`` over checkpoints in float32 (float64 for float64 stores)
and hands the ``[n_test, rows]`` block to a reduction (write into the full matrix, merge a
running top-k, ...). Rows are streamed by :func:`tracinfunc.query.stream.stream_rows`
(background reads into reusable buffers, asynchronous copies to a GPU), so extra memory is a
few chunks plus the output, never the store.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from tracinfunc._devices import canonical_device, check_device_memory, full_float32
from tracinfunc._validate import check_int, entry_point
from tracinfunc.curvature.queries import curvature_self_influence, precondition_test_grads
from tracinfunc.curvature.value import Curvature
from tracinfunc.errors import (
    InvalidArgumentError,
)
from tracinfunc.interop import resolve_output, tensor_if_array, to_framework
from tracinfunc.progress import ProgressArg, progress_bar
from tracinfunc.query.merge import merge_top_k
from tracinfunc.query.prepared import (
    check_not_empty,
    check_test_shape,
    check_test_type,
    compute_dtype,
    query_matrix,
)
from tracinfunc.query.rows import row_range
from tracinfunc.query.stream import compute_threads, stream_rows
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import GradientStore, SupportsRowViews, aligned_rows

__all__ = ["score", "score_chunks", "self_influence", "top_k"]

# Bytes of one chunk's train rows plus its [n_test, rows] score block; keeps the working set
# in cache-friendly, bounded pieces whatever the store's size.
_CHUNK_BUDGET_BYTES = 64 * 2**20
# Stores read through buffers (Zarr, or any store on a GPU) use smaller pieces: the buffers
# are fresh memory per pass, and first-touch page faults cost more than the matmul on VMs.
_STREAM_BUDGET_BYTES = 16 * 2**20
_MIN_CHUNK_ROWS = 256
# top_k holds a [n_test, chunk] score block and its sort (float32 values + int64 order):
# 16 bytes per query and row. Above this many test rows (256 MiB at 256-row chunks) it scans
# the store once per block of queries instead of letting that block grow without bound.
_MAX_QUERY_BLOCK = 65_536
# bfloat16 stores on the CPU could be multiplied in bfloat16 when few test rows make the
# matmul memory-bound (measured 1.13x faster than upcasting at n_test=64, 0.68x at 512), but
# each checkpoint's block is then rounded to bfloat16, so a test row's scores (and top-k)
# depended on how many rows were scored with it. Off: accumulation is float32, as documented.
_CPU_BF16_MATMUL = False
_CPU_BF16_MAX_TEST = 128


@entry_point("score")
def score(
    store: GradientStore,
    test_grads: GradientStore | Tensor,
    *,
    normalize: bool = False,
    device: torch.device | str | None = None,
    chunk_rows: int | None = None,
    progress: ProgressArg = None,
    output: str | None = None,
    like: object = None,
    rows: tuple[int, int] | None = None,
    curvature: Curvature | None = None,
) -> Tensor:
    """TracIn scores: ``sum over checkpoints c of lr_c * <test_c, train_c>``.

    Args:
        store: Projected training gradients, ``[n_ckpt, n_train, k]``.
        test_grads: A GradientStore built with ``projection=store.projection`` and the same
            checkpoints, or an array ``[n_ckpt, n_test, k]`` made the same way: a tensor or
            any ``__dlpack__`` array (JAX, NumPy, CuPy), imported without a copy. An array
            carries no metadata, so only its shape can be checked.
        normalize: Use per-checkpoint cosine similarity (unit-normalised gradients) instead of
            inner products. A zero gradient has cosine 0 with everything.
        device: Where to compute. Default: the test tensor's accelerator, else CUDA when
            available, else CPU.
        chunk_rows: Training rows per streamed chunk (default: sized to ~64 MiB).
        progress: A progress bar over training rows: ``None`` (default) shows one on a
            terminal once scoring has run for 2 s, ``True`` always, ``False`` never.
        output: Framework of the result: ``"torch"`` (default), ``"numpy"``, ``"jax"`` or
            ``"cupy"``, shared through DLPack without a copy where possible (see
            :mod:`tracinfunc.interop`).
        like: An array whose framework the result takes (e.g. ``like=test_grads``);
            exclusive with ``output``.
        rows: ``(start, stop)``: score only training rows ``[start, stop)`` (a worker's part
            of the store; see :func:`tracinfunc.distributed.rank_rows`).
        curvature: Curvature-aware TracIn, ``sum_c lr_c <(H_c + l_c I)^-1 test_c, train_c>``:
            a :class:`~tracinfunc.Curvature` fitted for this store (``docs/curvature.md``).

    Returns:
        Scores ``[n_test, n_train]`` (``[n_test, stop - start]`` with ``rows``), float32
        (float64 for float64 gradients), on ``device``.

    Raises:
        IncompatibleGradientsError: projection, checkpoints, layout or k differ from the store's.
        MemoryBudgetError: the score matrix would not fit in the device's free memory (use
            ``top_k``, ``rows=``, ``score_chunks`` or ``device="cpu"``).
    """
    framework = resolve_output(output, like)
    test_grads = tensor_if_array(test_grads)
    test_grads = precondition_test_grads(store, test_grads, curvature)
    if rows is not None:
        store = row_range(store, rows)
    meta = store.meta
    check_not_empty(meta)
    device = _resolve_device(device, test_grads)
    check_test_type(test_grads)
    if isinstance(test_grads, Tensor):  # values are checked once, in score_chunks
        check_test_shape(meta, test_grads)
    n_test = test_grads.shape[1] if isinstance(test_grads, Tensor) else test_grads.meta.n_train
    dtype = compute_dtype(meta.torch_dtype, _dtype_of(test_grads))
    _check_room(device, n_test, meta, dtype)
    # Blocks are written straight into the output: no per-chunk allocation or copy.
    out = torch.empty(n_test, meta.n_train, dtype=dtype, device=device)
    for _ in score_chunks(store, test_grads, normalize=normalize, device=device,
                          chunk_rows=chunk_rows, out=out, progress=progress):
        pass
    return to_framework(out, framework)


@entry_point("top_k")
def top_k(
    store: GradientStore,
    test_grads: GradientStore | Tensor,
    k: int = 10,
    *,
    largest: bool = True,
    normalize: bool = False,
    device: torch.device | str | None = None,
    chunk_rows: int | None = None,
    progress: ProgressArg = None,
    output: str | None = None,
    like: object = None,
    rows: tuple[int, int] | None = None,
    curvature: Curvature | None = None,
) -> tuple[Tensor, Tensor]:
    """The ``k`` most (``largest=True``: proponents) or least (opponents) influential rows.

    Never materialises ``[n_test, n_train]``: each streamed chunk is merged into a running
    top-k of ``[n_test, k]``. Query sets of more than 65,536 test rows are split into blocks
    of that many, one scan of the store each, so the per-chunk score block stays bounded.

    Args:
        store: As in :func:`score`.
        test_grads: As in :func:`score`.
        k: How many training examples per test example.
        largest: ``True`` for the highest scores (proponents), ``False`` for the lowest
            (opponents).
        normalize: As in :func:`score`.
        device: As in :func:`score`.
        chunk_rows: As in :func:`score`.
        progress: As in :func:`score`.
        output: As in :func:`score`.
        like: As in :func:`score`.
        rows: ``(start, stop)``: scan only training rows ``[start, stop)``; the partial
            results of workers merge exactly with :func:`tracinfunc.distributed.merge_top_k`
            (or :func:`tracinfunc.distributed.gather_top_k` under torchrun).
        curvature: As in :func:`score`.

    Returns:
        ``(values, indices)``, both ``[n_test, k]``, sorted best first, equal scores by row;
        indices are rows of the store (int64), also with ``rows``.
    """
    framework = resolve_output(output, like)
    test_grads = tensor_if_array(test_grads)
    test_grads = precondition_test_grads(store, test_grads, curvature)
    check_not_empty(store.meta)
    offset = 0
    if rows is not None:
        store = row_range(store, rows)
        offset = store.start
    n_train = store.meta.n_train
    check_int(k, "k", maximum=n_train, maximum_label="n_train",
              fix="for every training example use tif.score and sort")
    options = {"largest": largest, "normalize": normalize, "device": device,
               "chunk_rows": chunk_rows, "progress": progress}
    n_test = _n_test(test_grads)
    if n_test <= _MAX_QUERY_BLOCK:
        values, indices = _exact_top_k(store, test_grads, k, offset, **options)
    else:  # one scan per block of queries; the blocks' results stack row for row
        parts = [_exact_top_k(store, _query_rows(test_grads, lo, lo + _MAX_QUERY_BLOCK), k,
                              offset, **options) for lo in range(0, n_test, _MAX_QUERY_BLOCK)]
        values, indices = (torch.cat(list(column)) for column in zip(*parts, strict=True))
    return to_framework(values, framework), to_framework(indices, framework)


def _n_test(test_grads: object) -> int:
    """Test rows in ``test_grads`` (0 for what score_chunks will reject with its own error)."""
    if isinstance(test_grads, GradientStore):
        return test_grads.meta.n_train
    return test_grads.shape[1] if isinstance(test_grads, Tensor) and test_grads.ndim == 3 else 0


def _query_rows(test_grads: GradientStore | Tensor, lo: int, hi: int) -> GradientStore | Tensor:
    """Test rows ``[lo, min(hi, n_test))``: a tensor slice, or a row-range view of the store."""
    if isinstance(test_grads, Tensor):
        return test_grads[:, lo:hi]
    return row_range(test_grads, (lo, min(hi, test_grads.meta.n_train)))


def _exact_top_k(store: GradientStore, test_grads: GradientStore | Tensor, k: int,
                 offset: int, *, largest: bool, normalize: bool,
                 device: torch.device | str | None, chunk_rows: int | None,
                 progress: ProgressArg) -> tuple[Tensor, Tensor]:
    """One scan of ``store``: the running ``[n_test, k]`` top-k over its streamed chunks."""
    best_values: Tensor | None = None
    best_indices: Tensor | None = None
    for start, block in score_chunks(
        store, test_grads, normalize=normalize, device=device, chunk_rows=chunk_rows,
        progress=progress,
    ):
        # A stable sort, not topk: equal scores keep row order, so any split of the rows
        # (chunks here, workers with rows=) merges into the same result.
        values, order = block.sort(dim=1, descending=largest, stable=True)
        part = (values[:, :k], order[:, :k] + (start + offset))
        parts = [part] if best_values is None else [(best_values, best_indices), part]
        best_values, best_indices = merge_top_k(parts, k, largest=largest)
    return best_values, best_indices


@entry_point("self_influence")
def self_influence(
    store: GradientStore,
    *,
    device: torch.device | str | None = None,
    output: str | None = None,
    like: object = None,
    rows: tuple[int, int] | None = None,
    curvature: Curvature | None = None,
) -> Tensor:
    """Self-influence ``sum_c lr_c * ||train_c||^2`` of every training row.

    Computed from the store's row norms, so it costs nothing beyond reading them. High
    self-influence flags mislabelled or atypical examples.

    Args:
        store: Projected training gradients.
        device: Where to compute (default: CUDA when available, else CPU).
        output: Framework of the result, as in :func:`score`.
        like: As in :func:`score`.
        rows: ``(start, stop)``: only training rows ``[start, stop)``.
        curvature: A ``"projected"`` :class:`~tracinfunc.Curvature` of this store:
            ``sum_c lr_c train_c^T (F_c + l_c I)^-1 train_c`` (reads the rows).

    Returns:
        ``[n_train]`` (``[stop - start]`` with ``rows``), float32 (float64 for float64
        stores), on ``device``.
    """
    framework = resolve_output(output, like)
    if rows is not None:
        store = row_range(store, rows)
    if curvature is not None:
        return to_framework(curvature_self_influence(store, curvature,
                                                     _resolve_device(device, None)), framework)
    meta = store.meta
    dtype = compute_dtype(meta.torch_dtype)
    device = _resolve_device(device, None)
    total = torch.zeros(meta.n_train, dtype=dtype, device=device)
    for ckpt, info in enumerate(meta.checkpoints):
        norms = store.read_norms(ckpt, 0, meta.n_train).to(device, dtype)
        total += info.lr * norms.square()
    return to_framework(total, framework)


@entry_point("score_chunks")
def score_chunks(
    store: GradientStore,
    test_grads: GradientStore | Tensor,
    *,
    normalize: bool = False,
    device: torch.device | str | None = None,
    chunk_rows: int | None = None,
    out: Tensor | None = None,
    progress: ProgressArg = None,
    curvature: Curvature | None = None,
) -> Iterator[tuple[int, Tensor]]:
    """Stream TracIn scores chunk by chunk: the loop under :func:`score` and :func:`top_k`.

    Rows are read by a background thread (chunk i+1 while chunk i is multiplied) into
    reusable buffers, copied to a GPU asynchronously on a side stream, and accumulated over
    checkpoints in float32; float16 and bfloat16 rows are upcast to float32 first, so a test
    row's scores never depend on the other test rows scored with it.

    Args:
        store: As in :func:`score`.
        test_grads: As in :func:`score`.
        normalize: As in :func:`score`.
        device: As in :func:`score`.
        chunk_rows: As in :func:`score`.
        progress: As in :func:`score`.
        out: Optional ``[n_test, n_train]`` tensor (float32, float64 for float64 gradients,
            on ``device``); blocks are then written into it (``block`` is a view of
            ``out[:, start:start + rows]``) instead of being allocated per chunk.
        curvature: As in :func:`score`: the blocks are curvature-aware scores.

    Yields:
        ``(start, block)`` with ``block`` ``[n_test, rows]`` the scores of training rows
        ``[start, start + rows)``. Write your own reduction over it; without ``out``,
        ``block`` is new for every chunk.
    """
    test_grads = tensor_if_array(test_grads)
    test_grads = precondition_test_grads(store, test_grads, curvature)
    meta = store.meta
    device = _resolve_device(device, test_grads)
    test, test_norms = query_matrix(meta, test_grads, device=device)
    dtype = compute_dtype(meta.torch_dtype, test.dtype)
    # Fold lr_c (and the test side of the cosine) into the test rows once, not per chunk.
    lrs = torch.tensor(meta.lrs, dtype=dtype, device=device)
    scale = lrs[:, None, None]
    if normalize:
        scale = scale * _safe_reciprocal(test_norms.to(dtype))[..., None]
    matmul_dtype = _matmul_dtype(meta.torch_dtype, dtype, device, n_test=test.shape[1])
    test = (test.to(dtype) * scale).to(device, matmul_dtype)  # [n_ckpt, n_test, k]
    rows_per_chunk = _chunk_rows(store, chunk_rows, meta, test.shape[1])
    inverse_norms = None
    if normalize:  # [n_ckpt, n_train]: 1/k of the store, read once
        inverse_norms = torch.stack([
            _safe_reciprocal(store.read_norms(c, 0, meta.n_train).to(device, dtype))
            for c in range(meta.n_ckpt)
        ])
    upcast = None
    if meta.torch_dtype != matmul_dtype:  # float16 (or bf16 on GPU) rows -> float32 matmul
        upcast = torch.empty(rows_per_chunk, meta.k, dtype=matmul_dtype, device=device)
    pieces = [
        (ckpt, start, min(start + rows_per_chunk, meta.n_train))
        for start in range(0, meta.n_train, rows_per_chunk)
        for ckpt in range(meta.n_ckpt)
    ]
    _check_out(out, (test.shape[1], meta.n_train), dtype, device)
    threads = compute_threads(store, device)
    block = torch.empty(0)
    bar = progress_bar(progress, total=meta.n_train, desc="score", unit="row")
    for (ckpt, start, stop), rows in stream_rows(store, pieces, device=device,
                                                  max_rows=rows_per_chunk):
        if ckpt == 0:
            block = (out[:, start:stop] if out is not None else
                     torch.empty(test.shape[1], stop - start, dtype=dtype, device=device))
        inverse = None if inverse_norms is None else inverse_norms[ckpt, start:stop]
        with threads, full_float32():  # no TF32 whatever the process set
            train = rows if upcast is None else upcast[: stop - start].copy_(rows)
            _accumulate(block, test[ckpt], train, inverse, first=ckpt == 0)
        if ckpt == meta.n_ckpt - 1:
            bar.update(stop - start)
            yield start, block
    bar.close()


def _accumulate(block: Tensor, test: Tensor, train: Tensor, inverse: Tensor | None, *,
                first: bool) -> None:
    """``block (=|+=) test @ train.T`` (times ``inverse`` per column), in ``block``'s dtype.

    ``first``: overwrite ``block`` (uninitialised memory; ``beta=0`` ignores it, NaN included).
    """
    if inverse is None and test.dtype == block.dtype:
        block.addmm_(test, train.T, beta=0 if first else 1)  # [n_test, k] @ [k, rows]
        return
    product = test @ train.T  # [n_test, rows], bfloat16 on the CPU bf16 path
    if inverse is not None:
        product = product * inverse
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


def _check_room(device: torch.device, n_test: int, meta: StoreMeta, dtype: torch.dtype) -> None:
    """Refuse, before any work, a score matrix (plus the test rows) that cannot fit."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = (n_test * meta.n_train + meta.n_ckpt * n_test * meta.k) * itemsize
    check_device_memory(
        device, nbytes, what=f"the [{n_test}, {meta.n_train}] score matrix",
        fix="use tif.top_k (never forms the matrix), score part of the rows with "
            "rows=(start, stop), reduce blocks yourself with tif.score_chunks, or score "
            "on the CPU with device='cpu'.")


def _dtype_of(test_grads: GradientStore | Tensor) -> torch.dtype:
    if isinstance(test_grads, Tensor):
        return test_grads.dtype
    return test_grads.meta.torch_dtype


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
        check_int(chunk_rows, "chunk_rows", optional=True,
                  fix="pass None to let it choose from its memory budget")
        return min(chunk_rows, max(1, meta.n_train))
    in_memory = isinstance(store, SupportsRowViews)
    budget = _CHUNK_BUDGET_BYTES if in_memory else _STREAM_BUDGET_BYTES
    rows = _default_chunk_rows(meta.k, n_test, meta.n_train, budget)
    if rows < meta.n_train:  # whole stored chunks read fastest (no partial-chunk copies)
        rows = aligned_rows(store, rows)
    return min(rows, max(1, meta.n_train))


def _safe_reciprocal(norms: Tensor) -> Tensor:
    return torch.where(norms > 0, norms.reciprocal(), torch.zeros_like(norms))


def _default_chunk_rows(k: int, n_test: int, n_train: int,
                        budget: int = _CHUNK_BUDGET_BYTES) -> int:
    rows = budget // (4 * (k + n_test))
    return max(1, min(n_train, max(_MIN_CHUNK_ROWS, rows)))


def _resolve_device(device: torch.device | str | None, test_grads: object) -> torch.device:
    if device is not None:
        return torch.device(device)
    if isinstance(test_grads, Tensor) and test_grads.device.type != "cpu":
        return test_grads.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
