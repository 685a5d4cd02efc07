"""Damping chosen by LDS, when retraining is affordable: the curve over candidate multiples.

:func:`~tracinfunc.curvature.choose_damping` needs no retraining (held-out loss change of the
damped Newton step). Where a :func:`~tracinfunc.evaluate.retrain_subsets` run exists, the
damping can be chosen by what it is meant to improve: LDS against the retrained models, one
score pass per candidate over the same store (the store and, for ``"projected"``, the test
gradients never change; only the curvature's damping does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from tracinfunc._validate import current_caller, entry_point
from tracinfunc.curvature.binding import check_curvature
from tracinfunc.curvature.damping import Damping
from tracinfunc.curvature.heldout import (
    CANDIDATE_SCALES,
    DampingChoice,
    check_scales,
    damped_candidates,
)
from tracinfunc.curvature.value import Curvature
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError
from tracinfunc.evaluate.harness import RetrainResult
from tracinfunc.evaluate.lds import lds
from tracinfunc.query.score import score
from tracinfunc.store.protocols import GradientStore

__all__ = ["choose_damping_by_lds"]

TestGrads = GradientStore | Tensor | Callable[[Curvature], GradientStore | Tensor]


@entry_point("choose_damping_by_lds")
def choose_damping_by_lds(
    curvature: Curvature,
    store: GradientStore,
    test_grads: TestGrads,
    retrained: RetrainResult,
    *,
    scales: Sequence[float] = CANDIDATE_SCALES,
    normalize: bool = False,
    n_bootstrap: int = 0,
    device: torch.device | str | None = None,
) -> DampingChoice:
    """The damping multiple with the best LDS against retrained models, and the LDS curve.

    Args:
        curvature: Fitted for ``store`` (any kind); its damping is replaced per candidate.
        store: The training store ``[n_ckpt, n_train, k]`` the subsets index.
        test_grads: For ``"projected"``: the plain test gradients (a store or a tensor, as
            :func:`~tracinfunc.query.score` takes them). For the full-space kinds, whose test
            gradients depend on the damping: a function ``curvature -> test gradients``, e.g.
            ``lambda c: tif.preconditioned_test_grads(loss, ckpts, test, c,
            projection=store.projection)``.
        retrained: From :func:`~tracinfunc.evaluate.retrain_subsets` on this training set and
            the test examples of ``test_grads`` (``subsets [m, n_train]``, ``outputs
            [m, n_test]``).
        scales: Candidate multiples of each checkpoint's mean eigenvalue, positive.
        normalize: Score with cosine TracIn, as :func:`~tracinfunc.query.score`.
        n_bootstrap: Bootstrap resamples of each candidate's LDS interval (0: none).
        device: Where to score.

    Returns:
        A :class:`~tracinfunc.curvature.DampingChoice` (``criterion="lds"``): ``values`` the
        mean LDS per candidate (the curve), ``details`` each candidate's
        :class:`~tracinfunc.evaluate.LDSResult`, ``curvature`` re-damped with the best.

    Raises:
        IncompatibleGradientsError: the curvature or the test gradients belong to another
            store (as :func:`~tracinfunc.query.score`).
        InvalidArgumentError: bad candidates, subsets/outputs that do not fit the scores
            (as :func:`~tracinfunc.evaluate.lds`), or no candidate with a finite LDS
            (ill-conditioned candidates are skipped: value NaN, details ``None``).
    """
    curvature = check_curvature(curvature)
    if not isinstance(retrained, RetrainResult):
        raise InvalidTypeError(
            f"{current_caller()}: retrained must be a tracinfunc.evaluate.RetrainResult (from "
            f"retrain_subsets or load_retrain), got {type(retrained).__name__}."
        )
    candidates = [Damping(scale) for scale in check_scales(scales)]
    damped, refused = damped_candidates(curvature, candidates)
    results = []
    for candidate in damped:
        if candidate is None:  # ill-conditioned: never scored, never chosen
            results.append(None)
            continue
        queries = (test_grads if isinstance(test_grads, GradientStore | Tensor)
                   else test_grads(candidate))
        scores = score(store, queries, curvature=candidate, normalize=normalize, device=device,
                       progress=False)
        results.append(lds(scores, retrained.subsets, retrained.outputs,
                           n_bootstrap=n_bootstrap))
    means = [math.nan if result is None else result.mean for result in results]
    finite = [j for j, mean in enumerate(means) if math.isfinite(mean)]
    if not finite:  # max over all-NaN would silently take the first candidate
        raise InvalidArgumentError(
            f"{current_caller()}: no candidate damping has a finite LDS (scales "
            f"{[d.scale for d in candidates]}: LDS {means}{refused}); LDS is NaN when the "
            "scores or the retrained outputs are constant or non-finite: check retrained.outputs"
            " and the scores, or try other scales."
        )
    best = max(finite, key=lambda j: means[j])  # first of equals: less damping
    return DampingChoice(scale=candidates[best].scale,
                         scales=tuple(d.scale for d in candidates), values=tuple(means),
                         curvature=damped[best], criterion="lds", details=tuple(results))
