"""TracIn scores of every training row: the full ``[n_test, n_train]`` matrix."""

from __future__ import annotations

import torch

from tracinfunc._devices import check_device_memory
from tracinfunc._validate import entry_point
from tracinfunc.curvature.value import Curvature
from tracinfunc.interop import Array, resolve_output, to_framework
from tracinfunc.progress import ProgressArg
from tracinfunc.query.checks import check_not_empty
from tracinfunc.query.chunks import stream_scores
from tracinfunc.query.prepared import prepare_query
from tracinfunc.query.rows import row_range
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import GradientStore

__all__ = ["score"]


@entry_point("score")
def score(
    store: GradientStore,
    test_grads: GradientStore | Array,
    *,
    normalize: bool = False,
    device: torch.device | str | None = None,
    chunk_rows: int | None = None,
    progress: ProgressArg = None,
    rows: tuple[int, int] | None = None,
    curvature: Curvature | None = None,
    output: str | None = None,
    like: object = None,
) -> Array:
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
        rows: ``(start, stop)``: score only training rows ``[start, stop)`` (a worker's part
            of the store; see :func:`tracinfunc.distributed.rank_rows`).
        curvature: Curvature-aware TracIn, ``sum_c lr_c <(H_c + l_c I)^-1 test_c, train_c>``:
            a :class:`~tracinfunc.Curvature` fitted for this store (``docs/curvature.md``).
        output: Framework of the result: ``"torch"`` (default), ``"numpy"``, ``"jax"`` or
            ``"cupy"``, shared through DLPack without a copy where possible (see
            :mod:`tracinfunc.interop`).
        like: An array whose framework the result takes (e.g. ``like=test_grads``);
            exclusive with ``output``.

    Returns:
        Scores ``[n_test, n_train]`` (``[n_test, stop - start]`` with ``rows``), float32
        (float64 for float64 gradients), on ``device``: a ``torch.Tensor``, or an array of
        the framework ``output``/``like`` name.

    Raises:
        IncompatibleGradientsError: projection, checkpoints, layout or k differ from the store's.
        NonFiniteGradientError: the test gradients hold NaN or inf.
        MemoryBudgetError: the score matrix would not fit in the device's free memory (use
            ``top_k``, ``rows=``, ``score_chunks`` or ``device="cpu"``).
    """
    framework = resolve_output(output, like)
    check_not_empty(store.meta)
    part = store if rows is None else row_range(store, rows)
    query = prepare_query(store, test_grads, normalize=normalize, device=device,
                          curvature=curvature)
    meta = part.meta
    _check_room(query.device, query.n_test, meta, query.dtype)
    # Blocks are written straight into the output: no per-chunk allocation or copy.
    out = torch.empty(query.n_test, meta.n_train, dtype=query.dtype, device=query.device)
    for _ in stream_scores(part, query, chunk_rows=chunk_rows, out=out, progress=progress):
        pass
    return to_framework(out, framework)


def _check_room(device: torch.device, n_test: int, meta: StoreMeta, dtype: torch.dtype) -> None:
    """Refuse, before any work, a score matrix (plus the test rows) that cannot fit."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = (n_test * meta.n_train + meta.n_ckpt * n_test * meta.k) * itemsize
    check_device_memory(
        device, nbytes, what=f"the [{n_test}, {meta.n_train}] score matrix",
        fix="use tif.top_k (never forms the matrix), score part of the rows with "
            "rows=(start, stop), reduce blocks yourself with tif.score_chunks, or score "
            "on the CPU with device='cpu'.")
