"""TracIn scores over a gradient store: one chunked streaming loop, several reductions.

Every reduction walks the store in row chunks; for each chunk it accumulates
``sum_c lr_c * test_c @ train_c.T`` over checkpoints in float32 (float64 for float64 stores)
and hands the ``[n_test, rows]`` block to a reduction (write into the full matrix, merge a
running top-k, ...). Extra memory is a few chunks, never the store.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from tracinfunc.errors import IncompatibleGradientsError, NonFiniteGradientError
from tracinfunc.interop import resolve_output, tensor_if_array, to_framework
from tracinfunc.store.base import GradientStore
from tracinfunc.store.meta import StoreMeta, check_compatible

__all__ = ["score", "score_chunks", "self_influence", "top_k"]

# Bytes of one chunk's train rows plus its [n_test, rows] score block; keeps the working set
# in cache-friendly, bounded pieces whatever the store's size.
_CHUNK_BUDGET_BYTES = 64 * 2**20
_MIN_CHUNK_ROWS = 256


def score(
    store: GradientStore,
    test_grads: GradientStore | Tensor,
    *,
    normalize: bool = False,
    device: torch.device | str | None = None,
    chunk_rows: int | None = None,
    output: str | None = None,
    like: object = None,
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
        output: Framework of the result: ``"torch"`` (default), ``"numpy"``, ``"jax"`` or
            ``"cupy"``, shared through DLPack without a copy where possible (see
            :mod:`tracinfunc.interop`).
        like: An array whose framework the result takes (e.g. ``like=test_grads``);
            exclusive with ``output``.

    Returns:
        Scores ``[n_test, n_train]``, float32 (float64 for float64 gradients), on ``device``.

    Raises:
        IncompatibleGradientsError: projection, checkpoints, layout or k differ from the store's.
    """
    framework = resolve_output(output, like, caller="score")
    test_grads = tensor_if_array(test_grads, caller="score")
    _check_not_empty(store.meta, caller="score")
    out: Tensor | None = None
    for start, block in score_chunks(
        store, test_grads, normalize=normalize, device=device, chunk_rows=chunk_rows
    ):
        if out is None:
            out = block.new_empty(block.shape[0], store.meta.n_train)
        out[:, start : start + block.shape[1]] = block
    return to_framework(out, framework)


def top_k(
    store: GradientStore,
    test_grads: GradientStore | Tensor,
    k: int = 10,
    *,
    largest: bool = True,
    normalize: bool = False,
    device: torch.device | str | None = None,
    chunk_rows: int | None = None,
    output: str | None = None,
    like: object = None,
) -> tuple[Tensor, Tensor]:
    """The ``k`` most (``largest=True``: proponents) or least (opponents) influential rows.

    Never materialises ``[n_test, n_train]``: each streamed chunk is merged into a running
    top-k of ``[n_test, k]``.

    Args:
        store, test_grads, normalize, device, chunk_rows, output, like: As in
            :func:`score`.
        k: How many training examples per test example.
        largest: ``True`` for the highest scores (proponents), ``False`` for the lowest
            (opponents).

    Returns:
        ``(values, indices)``, both ``[n_test, k]``, sorted best first; indices are rows of the
        store (int64).
    """
    framework = resolve_output(output, like, caller="top_k")
    test_grads = tensor_if_array(test_grads, caller="top_k")
    _check_not_empty(store.meta, caller="top_k")
    n_train = store.meta.n_train
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_train:
        raise ValueError(f"top_k: k must be an int in [1, n_train={n_train}], got {k!r}.")
    best_values: Tensor | None = None
    best_indices: Tensor | None = None
    for start, block in score_chunks(
        store, test_grads, normalize=normalize, device=device, chunk_rows=chunk_rows
    ):
        take = min(k, block.shape[1])
        values, indices = block.topk(take, dim=1, largest=largest, sorted=False)
        indices = indices + start
        if best_values is not None:
            values = torch.cat([best_values, values], dim=1)
            indices = torch.cat([best_indices, indices], dim=1)
        keep = min(k, values.shape[1])
        values, order = values.topk(keep, dim=1, largest=largest, sorted=True)
        best_values, best_indices = values, indices.gather(1, order)
    return to_framework(best_values, framework), to_framework(best_indices, framework)


def self_influence(
    store: GradientStore,
    *,
    device: torch.device | str | None = None,
    output: str | None = None,
    like: object = None,
) -> Tensor:
    """Self-influence ``sum_c lr_c * ||train_c||^2`` of every training row.

    Computed from the store's row norms, so it costs nothing beyond reading them. High
    self-influence flags mislabelled or atypical examples.

    Args:
        store: Projected training gradients.
        device: Where to compute (default: CUDA when available, else CPU).
        output, like: Framework of the result, as in :func:`score`.

    Returns:
        ``[n_train]``, float32 (float64 for float64 stores), on ``device``.
    """
    framework = resolve_output(output, like, caller="self_influence")
    meta = store.meta
    dtype = _compute_dtype(meta.torch_dtype)
    device = _resolve_device(device, None)
    total = torch.zeros(meta.n_train, dtype=dtype, device=device)
    for ckpt, info in enumerate(meta.checkpoints):
        norms = store.read_norms(ckpt, 0, meta.n_train).to(device, dtype)
        total += info.lr * norms.square()
    return to_framework(total, framework)


def score_chunks(
    store: GradientStore,
    test_grads: GradientStore | Tensor,
    *,
    normalize: bool = False,
    device: torch.device | str | None = None,
    chunk_rows: int | None = None,
) -> Iterator[tuple[int, Tensor]]:
    """Stream TracIn scores chunk by chunk: the loop under :func:`score` and :func:`top_k`.

    Yields:
        ``(start, block)`` with ``block`` ``[n_test, rows]`` the scores of training rows
        ``[start, start + rows)``. Write your own reduction over it.
    """
    test_grads = tensor_if_array(test_grads, caller="score_chunks")
    meta = store.meta
    device = _resolve_device(device, test_grads)
    test, test_norms = _test_matrix(meta, test_grads, caller="score")
    dtype = _compute_dtype(meta.torch_dtype, test.dtype)
    # Fold lr_c (and the test side of the cosine) into the test rows once, not per chunk.
    lrs = torch.tensor(meta.lrs, dtype=dtype)
    scale = lrs[:, None, None]
    if normalize:
        scale = scale * _safe_reciprocal(test_norms.to(dtype))[..., None]
    test = (test.to(dtype) * scale).to(device)  # [n_ckpt, n_test, k]
    rows_per_chunk = chunk_rows or _default_chunk_rows(meta.k, test.shape[1], meta.n_train)
    if rows_per_chunk < 1:
        raise ValueError(f"score: chunk_rows must be >= 1, got {chunk_rows}.")
    for start in range(0, meta.n_train, rows_per_chunk):
        stop = min(start + rows_per_chunk, meta.n_train)
        block = torch.zeros(test.shape[1], stop - start, dtype=dtype, device=device)
        for ckpt in range(meta.n_ckpt):
            train = store.read_rows(ckpt, start, stop).to(device, dtype, non_blocking=True)
            if normalize:
                inv = _safe_reciprocal(store.read_norms(ckpt, start, stop).to(device, dtype))
                block.addmm_(test[ckpt], train.T * inv)  # [n_test, k] @ [k, rows]
            else:
                block.addmm_(test[ckpt], train.T)
        yield start, block


def _test_matrix(
    meta: StoreMeta, test_grads: GradientStore | Tensor, *, caller: str
) -> tuple[Tensor, Tensor]:
    """Test gradients ``[n_ckpt, n_test, k]`` and their norms ``[n_ckpt, n_test]``, validated."""
    if isinstance(test_grads, Tensor):
        _check_test_tensor(meta, test_grads, caller=caller)
        return test_grads, test_grads.to(_compute_dtype(test_grads.dtype)).norm(dim=-1)
    if not isinstance(test_grads, GradientStore):
        raise TypeError(
            f"{caller}: test_grads must be a GradientStore or a tensor [n_ckpt, n_test, k], "
            f"got {type(test_grads).__name__}."
        )
    check_compatible(meta, test_grads.meta, caller=caller)
    n_test = test_grads.meta.n_train
    rows = torch.stack([test_grads.read_rows(c, 0, n_test) for c in range(meta.n_ckpt)])
    norms = torch.stack([test_grads.read_norms(c, 0, n_test) for c in range(meta.n_ckpt)])
    return rows, norms


def _check_test_tensor(meta: StoreMeta, test: Tensor, *, caller: str) -> None:
    if test.ndim != 3 or test.shape[0] != meta.n_ckpt or test.shape[2] != meta.k:
        raise IncompatibleGradientsError(
            f"{caller}: test gradients must be [n_ckpt={meta.n_ckpt}, n_test, k={meta.k}], got "
            f"{list(test.shape)}; build them with projection=store.projection and the store's "
            "checkpoints (e.g. tif.build_store(loss, checkpoints, test_batch, "
            "projection=store.projection))."
        )
    if not test.is_floating_point():
        raise TypeError(f"{caller}: test gradients must be floating point, got {test.dtype}.")
    if not bool(torch.isfinite(test).all()):
        raise NonFiniteGradientError(
            f"{caller}: test gradients contain NaN or inf; check the loss on those examples."
        )


def _check_not_empty(meta: StoreMeta, *, caller: str) -> None:
    if meta.n_train < 1:
        raise ValueError(f"{caller}: the store holds no rows (n_train=0); nothing to score.")


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    # float32 accumulation always; float64 only when asked for by float64 inputs (exactness).
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _safe_reciprocal(norms: Tensor) -> Tensor:
    return torch.where(norms > 0, norms.reciprocal(), torch.zeros_like(norms))


def _default_chunk_rows(k: int, n_test: int, n_train: int) -> int:
    rows = _CHUNK_BUDGET_BYTES // (4 * (k + n_test))
    return max(1, min(n_train, max(_MIN_CHUNK_ROWS, rows)))


def _resolve_device(device: torch.device | str | None, test_grads: object) -> torch.device:
    if device is not None:
        return torch.device(device)
    if isinstance(test_grads, Tensor) and test_grads.device.type != "cpu":
        return test_grads.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
