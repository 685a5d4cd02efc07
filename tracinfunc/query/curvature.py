"""Curvature at query time: ``sum_c lr_c <(H_c + l_c I)^-1 test_c, train_c>`` is plain TracIn
between the stored training rows and preconditioned test rows, so the store stays as built.

- ``kind="projected"`` acts on projected rows: plain test gradients are preconditioned here.
- ``"dense"``, ``"kfac"`` and ``"ekfac"`` act on full gradients, before the projection:
  :func:`tracinfunc.preconditioned_test_grads` makes those test gradients, marked with the
  curvature's digest, which is checked here.

Private to :mod:`tracinfunc.query`: :func:`~tracinfunc.query.prepared.prepare_query` is the one
caller of :func:`precondition_queries`, ``self_influence`` of :func:`curvature_self_influence`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tracinfunc._validate import current_caller
from tracinfunc.curvature.binding import check_bound, check_curvature
from tracinfunc.curvature.test_grads import MARK
from tracinfunc.curvature.value import Curvature
from tracinfunc.errors import IncompatibleGradientsError, NonFiniteGradientError
from tracinfunc.query.checks import query_matrix
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import GradientStore

__all__ = ["curvature_self_influence", "precondition_queries"]


def precondition_queries(meta: StoreMeta, test_grads: GradientStore | Tensor,
                         curvature: Curvature | None) -> GradientStore | Tensor:
    """``test_grads`` made curvature-aware for the store described by ``meta``.

    ``None`` returns ``test_grads`` unchanged; test gradients already preconditioned by this
    curvature (:func:`~tracinfunc.preconditioned_test_grads`) pass through; plain ones are
    preconditioned in the projected space by a ``"projected"`` curvature.

    Returns:
        ``test_grads``, or the preconditioned rows ``[n_ckpt, n_test, k]`` where the test
        gradients were (a store's on the CPU).

    Raises:
        IncompatibleGradientsError: the curvature belongs to another store (named
            difference), the test gradients were preconditioned by another curvature, or a
            full-space curvature (``"dense"``, ``"kfac"``, ``"ekfac"``) meets plain projected
            test gradients.
    """
    if curvature is None:
        return test_grads
    curvature = check_curvature(curvature)
    check_bound(curvature, meta)
    mark = test_grads.meta.extra.get(MARK) if isinstance(test_grads, GradientStore) else None
    if mark is not None:
        if mark.get("plain") == curvature.digest:  # refined rows, their plain curvature
            raise IncompatibleGradientsError(
                f"{current_caller()}: the test gradients were preconditioned by another "
                "curvature: this one refined (Curvature.with_refinement), so they are not its "
                "answers. A refined curvature cannot be saved, but the refinement is already "
                "in these rows: score them as they are (omit curvature=; on the CLI omit "
                "--curvature), pass the refined curvature (in Python), or let the CLI refine "
                "(score --spec ... --curvature PATH --refine-steps N)."
            )
        if mark.get("digest") != curvature.digest:
            raise IncompatibleGradientsError(
                f"{current_caller()}: the test gradients were preconditioned by another "
                f"curvature ({mark.get('kind')!r}, digest {str(mark.get('digest'))[:12]}…) "
                f"than the one given ({curvature.kind!r}, {curvature.digest[:12]}…); pass the "
                "curvature they were made with, or make them again with this one."
            )
        return test_grads
    if curvature.kind != "projected":
        raise IncompatibleGradientsError(
            f"{current_caller()}: a {curvature.kind!r} curvature preconditions gradients before "
            "they are projected, so it cannot be applied to projected test gradients; make "
            "them with tif.preconditioned_test_grads(loss, checkpoints, test_data, curvature, "
            "projection=store.projection), or fit kind='projected'."
        )
    # Validated (shape, finite, compatible store), left where the test gradients are.
    where = test_grads.device if isinstance(test_grads, Tensor) else torch.device("cpu")
    rows, _ = query_matrix(meta, test_grads, device=where)
    if rows.dtype == torch.float64:
        return torch.stack([curvature.precondition_rows(c, rows[c])
                            for c in range(meta.n_ckpt)])
    try:
        return torch.stack([curvature.precondition_rows(c, rows[c])
                            for c in range(meta.n_ckpt)])
    except NonFiniteGradientError as error:
        # finite rows (checked above) whose preconditioned values overflow their dtype (rows
        # near float32's largest): float64 holds them, and the query then computes in it;
        # unless the solve itself multiplies them beyond float32's whole range (a damping
        # tiny against a (nearly) zero estimate), which the first refusal names
        wide = rows.double()
        out = []
        for c in range(meta.n_ckpt):
            solved = curvature.precondition_rows(c, wide[c])
            if float(solved.abs().max()) > _WHOLE_RANGE * float(wide[c].abs().max()):
                raise error from None
            out.append(solved)
        return torch.stack(out)


# float32's largest over its smallest normal number: a solve that multiplies rows by more has
# a damping tiny against the estimate's scale (a saturated softmax), not merely large rows.
_WHOLE_RANGE = torch.finfo(torch.float32).max / torch.finfo(torch.float32).tiny


def curvature_self_influence(store: GradientStore, curvature: Curvature,
                             device: torch.device, *, chunk_rows: int,
                             done: Callable[[int], object] | None = None) -> Tensor:
    """``sum_c lr_c row_c^T (F_c + lambda_c I)^-1 row_c`` per training row, ``[n_train]``.

    ``done(rows)`` (if given) is called after each chunk of rows (a progress bar's update).

    Raises:
        IncompatibleGradientsError: not a ``"projected"`` curvature (the store holds no
            full-space gradients to precondition), or one for another store.
    """
    curvature = check_curvature(curvature)
    meta = store.meta
    check_bound(curvature, meta)
    if curvature.kind != "projected":
        raise IncompatibleGradientsError(
            f"{current_caller()}: curvature-aware self-influence from a store needs a "
            f"'projected' curvature, got {curvature.kind!r}: the store holds projected rows, "
            "not the full gradients a dense or K-FAC curvature acts on. Fit "
            "kind='projected' with projection=store.projection."
        )
    dtype = torch.float64 if meta.torch_dtype == torch.float64 else torch.float32
    total = torch.zeros(meta.n_train, dtype=torch.float64, device=device)
    for start in range(0, meta.n_train, chunk_rows):
        stop = min(start + chunk_rows, meta.n_train)
        for c, lr in enumerate(meta.lrs):
            rows = store.read_rows(c, start, stop).to(device, torch.float64)
            total[start:stop] += lr * (curvature.precondition_rows(c, rows) * rows).sum(1)
        if done is not None:
            done(stop - start)
    return total.to(dtype)

