"""TracIn scores of every training row: the full ``[n_test, n_train]`` matrix."""

from __future__ import annotations

import torch
from torch import Tensor

from tracinfunc._devices import check_device_memory, full_float32
from tracinfunc._host_memory import host_empty
from tracinfunc._validate import check_int, current_caller, entry_point
from tracinfunc.curvature.value import Curvature
from tracinfunc.errors import InvalidArgumentError
from tracinfunc.interop import Array, resolve_output, to_framework
from tracinfunc.progress import ProgressArg
from tracinfunc.query.candidates import (
    candidate_scores,
    check_candidate_rows,
    check_candidates,
)
from tracinfunc.query.checks import check_not_empty
from tracinfunc.query.chunks import stream_scores
from tracinfunc.query.overflow import nan_scores_error
from tracinfunc.query.prepared import prepare_query
from tracinfunc.query.rows import row_range
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import GradientStore, store_meta

__all__ = ["candidate_top_k", "score"]


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
    candidates: object = None,
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
        chunk_rows: Training rows per streamed chunk (default: sized to ~64 MiB; one
            stored chunk of 256 rows or more where a local Zarr store lends it in place).
            Two stores give bit-identical scores when they multiply the same pieces.
        progress: A progress bar over training rows: ``None`` (default) shows one on a
            terminal once scoring has run for 2 s, ``True`` always, ``False`` never.
        rows: ``(start, stop)``: score only training rows ``[start, stop)`` (a worker's part
            of the store; see :func:`tracinfunc.distributed.rank_rows`).
        curvature: Curvature-aware TracIn, ``sum_c lr_c <(H_c + l_c I)^-1 test_c, train_c>``:
            a :class:`~tracinfunc.Curvature` fitted for this store (``docs/curvature.md``).
        candidates: Score only these store rows per test example: ``[n_test, M]`` integer
            indices (torch, NumPy, JAX, or a list of ``n_test`` equal-length 1-D arrays), or
            the ``(values, indices)`` of an earlier ``top_k``/``indexed_top_k``/``rerank``.
            Only their union is read, once per checkpoint; indices out of ``[0, n_train)``,
            floats and a row repeated within one test example's candidates are refused
            (``docs/rerank.md``). Exclusive with ``rows``; ``chunk_rows`` and ``progress``
            do not apply.
        output: Framework of the result: ``"torch"`` (default), ``"numpy"``, ``"jax"`` or
            ``"cupy"``, shared through DLPack without a copy where possible (see
            :mod:`tracinfunc.interop`).
        like: An array whose framework the result takes (e.g. ``like=test_grads``);
            exclusive with ``output``.

    Returns:
        Scores ``[n_test, n_train]`` (``[n_test, stop - start]`` with ``rows``; with
        ``candidates``, ``[n_test, M]`` where ``[i, j]`` is the score of test example ``i``
        with store row ``candidates[i, j]``, in the order given), float32
        (float64 for float64 gradients), on ``device``: a ``torch.Tensor``, or an array of
        the framework ``output``/``like`` name.

    Raises:
        IncompatibleGradientsError: projection, checkpoints, layout or k differ from the store's.
        NonFiniteGradientError: the test gradients hold NaN or inf.
        MemoryBudgetError: the score matrix would not fit in the device's free memory (use
            ``top_k``, ``rows=``, ``score_chunks`` or ``device="cpu"``).
    """
    framework = resolve_output(output, like)
    check_not_empty(store_meta(store))
    if candidates is not None:
        return to_framework(_candidate_scores(store, test_grads, candidates, rows, normalize,
                                              device, curvature)[0], framework)
    part = store if rows is None else row_range(store, rows)
    query = prepare_query(store, test_grads, normalize=normalize, device=device,
                          curvature=curvature)
    meta = part.meta
    _check_room(query.device, query.n_test, meta, query.dtype)
    # Blocks are written straight into the output: no per-chunk allocation or copy (on the
    # CPU in huge pages: its first touch is a tenth of the dattri setting's query).
    out = host_empty((query.n_test, meta.n_train), query.dtype) if query.device.type == "cpu" \
        else torch.empty(query.n_test, meta.n_train, dtype=query.dtype, device=query.device)
    # IEEE float32 set once for the pass and held (no caller code runs between its chunks),
    # so each chunk's own full_float32 returns at once: setting and restoring the knobs per
    # chunk cost ~0.1x of a warm CPU pass (torch 2.13's defaults are not "ieee"), reading
    # them ~0.04x.
    with full_float32(hold=True):
        for _ in stream_scores(part, query, chunk_rows=chunk_rows, out=out,
                               progress=progress):
            pass
    return to_framework(out, framework)


def _candidate_scores(store: GradientStore, test_grads: object, candidates: object,
                      rows: object, normalize: bool, device: torch.device | str | None,
                      curvature: Curvature | None) -> tuple[Tensor, Tensor]:
    """Scores ``[n_test, M]`` of the checked ``candidates`` and those candidates (int64 on
    the scores' device): what ``score`` and ``top_k`` do with ``candidates=``."""
    check_candidates_alone(rows)
    chosen = check_candidates(candidates, store.meta.n_train)
    query = prepare_query(store, test_grads, normalize=normalize, device=device,
                          curvature=curvature)
    check_candidate_rows(chosen, query.n_test)
    return candidate_scores(store, query, chosen), chosen.to(query.device)


def check_candidates_alone(rows: object) -> None:
    if rows is not None:
        raise InvalidArgumentError(
            f"{current_caller()}: candidates= and rows= are exclusive: candidates already name "
            "the store rows to score; drop rows=, or keep only candidates within it.")


def _check_room(device: torch.device, n_test: int, meta: StoreMeta, dtype: torch.dtype) -> None:
    """Refuse, before any work, a score matrix (plus the test rows) that cannot fit."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = (n_test * meta.n_train + meta.n_ckpt * n_test * meta.k) * itemsize
    check_device_memory(
        device, nbytes, what=f"the [{n_test}, {meta.n_train}] score matrix",
        fix="use tif.top_k (never forms the matrix), score part of the rows with "
            "rows=(start, stop), reduce blocks yourself with tif.score_chunks, or score "
            "on the CPU with device='cpu'.")


def candidate_top_k(store: GradientStore, test_grads: object, k: int, candidates: object, *,
                    rows: object, largest: bool, normalize: bool,
                    device: torch.device | str | None, curvature: Curvature | None
                    ) -> tuple[Tensor, Tensor]:
    """``top_k`` among the candidates: ``(values, indices)`` ``[n_test, k]``, indices rows of
    the store; equal scores by row, as ``top_k`` over the whole store orders them."""
    check_candidates_alone(rows)
    chosen = check_candidates(candidates, store.meta.n_train)
    k = check_int(k, "k", maximum=chosen.shape[1], maximum_label="M",
              fix="candidates hold only M rows per test example; retrieve more or lower k")
    query = prepare_query(store, test_grads, normalize=normalize, device=device,
                          curvature=curvature)
    check_candidate_rows(chosen, query.n_test)
    chosen = chosen.sort(dim=1).values  # row order first, so equal scores resolve by row
    scores = candidate_scores(store, query, chosen)
    if bool(scores.isnan().any()):  # NaN sorts first: never "the best" candidate
        raise nan_scores_error()
    values, best = scores.sort(dim=1, descending=largest, stable=True)
    return values[:, :k], chosen.to(query.device).gather(1, best[:, :k])
