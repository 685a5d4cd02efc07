"""Self-influence ``sum_c lr_c ||train_c||^2`` of every training row, from its norms."""

from __future__ import annotations

import torch

from tracinfunc._devices import check_allocation
from tracinfunc._validate import check_int, entry_point
from tracinfunc.curvature.value import Curvature
from tracinfunc.interop import Array, resolve_output, to_framework
from tracinfunc.progress import ProgressArg, progress_bar
from tracinfunc.query.checks import check_not_empty, compute_dtype, resolve_device
from tracinfunc.query.curvature import curvature_self_influence
from tracinfunc.query.overflow import warn_self_influence_overflow
from tracinfunc.query.rows import row_range
from tracinfunc.store.protocols import GradientStore, store_meta

__all__ = ["self_influence"]

_NORM_CHUNK_ROWS = 1 << 20  # norms are 4 bytes a row: 4 MiB per checkpoint and chunk
_CURVATURE_CHUNK_ROWS = 4096  # rows read and preconditioned at once (float64)


@entry_point("self_influence")
def self_influence(
    store: GradientStore,
    *,
    device: torch.device | str | None = None,
    chunk_rows: int | None = None,
    progress: ProgressArg = None,
    rows: tuple[int, int] | None = None,
    curvature: Curvature | None = None,
    output: str | None = None,
    like: object = None,
) -> Array:
    """Self-influence ``sum_c lr_c * ||train_c||^2`` of every training row.

    Computed from the store's row norms, so it costs nothing beyond reading them. High
    self-influence flags mislabelled or atypical examples. There are no test gradients, so
    there is no ``normalize`` (a unit row's self-influence is ``sum_c lr_c``).

    Args:
        store: Projected training gradients.
        device: Where to compute (default: CUDA when available, else CPU).
        chunk_rows: Training rows read at once (default: 1,048,576 norms; 4,096 rows with
            ``curvature``).
        progress: A progress bar over training rows, as in :func:`score`.
        rows: ``(start, stop)``: only training rows ``[start, stop)``.
        curvature: A ``"projected"`` :class:`~tracinfunc.Curvature` of this store:
            ``sum_c lr_c train_c^T (F_c + l_c I)^-1 train_c`` (reads the rows).
        output: Framework of the result, as in :func:`score`.
        like: As in :func:`score`.

    Returns:
        ``[n_train]`` (``[stop - start]`` with ``rows``), float32 (float64 for float64
        stores), on ``device``: a ``torch.Tensor``, or an array of the framework
        ``output``/``like`` name.
    """
    framework = resolve_output(output, like)
    check_not_empty(store_meta(store))
    chunk_rows = check_int(chunk_rows, "chunk_rows", optional=True,
              fix="pass None to let it choose")
    first_row = 0
    if rows is not None:
        store = row_range(store, rows)
        first_row = store.start
    device = resolve_device(device, None)
    meta = store.meta
    # The result's size comes from the store's metadata: a crafted or unsealed store claiming
    # 10**12 rows is refused with the sizes, before the allocator fails.
    check_allocation(device, meta.n_train * 8, what=f"the [{meta.n_train}] self-influence",
                     fix="check the store (tracinfunc info --verify), or pass rows=(start, stop)")
    bar = progress_bar(progress, total=meta.n_train, desc="self-influence", unit="row")
    if curvature is not None:
        total = curvature_self_influence(store, curvature, device,
                                         chunk_rows=chunk_rows or _CURVATURE_CHUNK_ROWS,
                                         done=bar.update)
    else:
        step = chunk_rows or _NORM_CHUNK_ROWS
        total = torch.zeros(meta.n_train, dtype=compute_dtype(meta.torch_dtype), device=device)
        for start in range(0, meta.n_train, step):
            stop = min(start + step, meta.n_train)
            # Summed in float64 (norms only: cheap): lr_c |row|^2 fits float32 even where
            # |row|^2 alone would not (a norm of 2.5e19 at lr 0.5).
            part = torch.zeros(stop - start, dtype=torch.float64, device=device)
            for ckpt, info in enumerate(meta.checkpoints):
                norms = store.read_norms(ckpt, start, stop).to(device, torch.float64)
                part += info.lr * norms.square()
            total[start:stop] = part
            bar.update(stop - start)
    bar.close()
    warn_self_influence_overflow(total, store, first_row=first_row,
                                 curvature=curvature is not None)
    return to_framework(total, framework)
