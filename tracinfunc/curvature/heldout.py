"""Damping chosen by held-out loss change: no retraining, one gradient pass and a few forwards.

A curvature-aware score ``g_test^T (H + lambda I)^-1 g_train`` is the first-order change of the
test loss under the damped Newton step ``delta = -(H + lambda I)^-1 g_train``: the response to
the training data that the score assumes. That step is also the exact minimiser of the
quadratic model of the training loss plus the proximity term ``lambda / 2 ||delta||^2``
(the proximal response influence functions approximate; Bae et al., 2022, "If influence
functions are the answer, then what is the question?"). ``lambda`` thus plays the part of a
ridge penalty, and the classic way to choose a ridge penalty is by held-out loss:

    criterion(s) = sum_c [ L_val(w_c + delta_c(s)) - L_val(w_c) ],
    delta_c(s) = -(H_c + s * mean_eig(H_c) I)^-1 mean_i g_train_i(w_c)

for every candidate multiple ``s`` of the mean eigenvalue (the default rule's own scale), and
the ``s`` whose step lowers the validation loss most is kept. Too little damping takes steps
along directions the curvature barely constrains, which overfit the training sample and raise
the held-out loss; too much shrinks the step towards a plain gradient step of vanishing length.
On a quadratic loss (linear least squares, where the Gauss-Newton matrix is exact) the criterion
is exactly ridge regression's validation error, a checkable reference (``tests/curvature``).

For ``"projected"`` the step is the one the projected scores imply,
``-P^T (F + lambda I)^-1 P g`` (``P^T`` by the projection's vector-Jacobian product).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.func import vjp, vmap

from tracinfunc._validate import current_caller, entry_point
from tracinfunc.batches import iter_batches
from tracinfunc.build.loop import checkpoint_list
from tracinfunc.checkpoint import Checkpoint, loss_at
from tracinfunc.curvature.binding import check_checkpoints, check_curvature
from tracinfunc.curvature.damping import Damping
from tracinfunc.curvature.value import Curvature
from tracinfunc.errors import (
    EmptyDataError,
    IllConditionedError,
    InvalidArgumentError,
    NonFiniteGradientError,
)
from tracinfunc.grads import per_sample_grads
from tracinfunc.grads.options import GradientOptions
from tracinfunc.loss import holds_loss_modules
from tracinfunc.projection import make_projector
from tracinfunc.store.meta import CheckpointMeta
from tracinfunc.types import Batch, LossFn, Params

__all__ = ["CANDIDATE_SCALES", "DampingChoice", "choose_damping"]

# Multiples of the mean eigenvalue tried by default: the range measured on digits
# (docs/curvature.md), where every kind's best lies between 0.1x and 10x.
CANDIDATE_SCALES = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


@dataclass(frozen=True)
class DampingChoice:
    """The damping chosen among candidate multiples of the mean eigenvalue, and the curve.

    Attributes:
        scale: The chosen multiple.
        scales: The candidates, in the order given.
        values: Per candidate, the criterion (lower is better for ``"heldout"``: the summed
            validation loss change; higher for ``"lds"``: the mean LDS), ``[n_scales]``.
        curvature: The curvature re-damped with ``Damping(scale)``.
        criterion: ``"heldout"`` or ``"lds"``.
        per_checkpoint: ``"heldout"`` only: the loss change per candidate and checkpoint,
            ``[n_scales, n_ckpt]`` float64 (``None`` for ``"lds"``).
        details: ``"lds"`` only: the :class:`~tracinfunc.evaluate.LDSResult` per candidate.
    """

    scale: float
    scales: tuple[float, ...]
    values: tuple[float, ...]
    curvature: Curvature
    criterion: str
    per_checkpoint: Tensor | None = None
    details: tuple[Any, ...] = ()


@entry_point("choose_damping")
@holds_loss_modules  # a hand-written loss swaps tensors into its module: one thread at a time
def choose_damping(
    curvature: Curvature,
    loss: LossFn,
    checkpoints: Sequence[Checkpoint],
    train_data: Batch | Iterable[Batch],
    validation_data: Batch | Iterable[Batch],
    *,
    scales: Sequence[float] = CANDIDATE_SCALES,
    chunk_size: int | None = None,
) -> DampingChoice:
    """Choose ``curvature``'s damping by the held-out loss change of its damped Newton step.

    Args:
        curvature: From :func:`~tracinfunc.fit_curvature` at ``checkpoints`` (any kind).
        loss: The per-example loss (training and validation examples keep their labels).
        checkpoints: The checkpoints the curvature was fitted at.
        train_data: Training batches (or a sample) whose mean gradient is stepped along.
        validation_data: Held-out batches, disjoint from ``train_data``.
        scales: Candidate multiples of each checkpoint's mean eigenvalue, positive.
        chunk_size: Examples differentiated at once inside vmap.

    Returns:
        A :class:`DampingChoice`; ``.curvature`` is ``curvature.with_damping(Damping(scale))``.

    Raises:
        IncompatibleGradientsError: the curvature was fitted at other checkpoints.
        InvalidArgumentError: no candidate, a candidate that is not a positive number, or no
            candidate with a finite loss change (ill-conditioned ones are skipped, their
            value NaN).
        NonFiniteGradientError: a training example's gradient or a validation example's
            loss is NaN/inf (named by its index in the data, with the checkpoint).
        EmptyDataError: no training or no validation examples.
    """
    curvature = check_curvature(curvature)
    checkpoints = checkpoint_list(checkpoints, Checkpoint, name="tracinfunc.Checkpoint")
    check_checkpoints(curvature, [CheckpointMeta(c.name or f"checkpoint-{i}", c.lr,
                                                 c.fingerprint)
                                  for i, c in enumerate(checkpoints)])
    candidates = [Damping(scale) for scale in check_scales(scales)]
    damped, refused = damped_candidates(curvature, candidates)
    names = [name for name, _ in curvature.layout]
    changes = torch.full((len(candidates), len(checkpoints)), torch.nan, dtype=torch.float64)
    for c, ckpt in enumerate(checkpoints):
        ckpt_loss, params = loss_at(loss, ckpt), dict(ckpt.params)
        mean_grad = _mean_grad(ckpt_loss, params, names, train_data, chunk_size, c)
        before = _mean_loss(ckpt_loss, params, validation_data, check=c)
        for j, candidate in enumerate(damped):
            if candidate is None:
                continue
            step = _newton_step(candidate, c, ckpt.name, mean_grad)
            moved = {**params, **{n: params[n] + step[n].to(params[n]) for n in names}}
            changes[j, c] = _mean_loss(ckpt_loss, moved, validation_data) - before
    # A step that makes the loss NaN/inf is the worst possible outcome, never the best; with
    # no finite candidate there is nothing to choose (argmin over all-inf would take the first).
    totals = torch.nan_to_num(changes.sum(1), nan=torch.inf, posinf=torch.inf)
    if not bool(torch.isfinite(totals).any()):
        tried = [j for j, d in enumerate(damped) if d is not None]
        hopeless = [c for c in range(len(checkpoints))
                    if tried and not bool(changes[tried, c].isfinite().any())]
        where = "" if not hopeless else (
            "; at checkpoint(s) " + ", ".join(
                f"{checkpoints[c].name or f'checkpoint-{c}'!r} (mean eigenvalue "
                f"{curvature.mean_eigenvalues()[c]:.3g})" for c in hopeless)
            + " no candidate's step gives a finite loss: a damping relative to a (nearly) "
            "zero estimate is tiny against the gradients there; give every checkpoint one "
            "fixed damping instead of choosing one (curvature.with_damping(lambda)), or "
            "rebuild the store and the fit without it")
        raise InvalidArgumentError(
            f"{current_caller()}: no candidate damping gives a finite validation loss change "
            f"(scales {[d.scale for d in candidates]}: changes "
            f"{[float(v) for v in changes.sum(1)]}{refused}){where}; otherwise try larger "
            "scales, e.g. scales=(1, 10, 100, 1000)."
        )
    best = int(torch.argmin(totals))
    return DampingChoice(scale=candidates[best].scale, scales=tuple(d.scale for d in candidates),
                         values=tuple(float(v) for v in changes.sum(1)),
                         curvature=damped[best], criterion="heldout", per_checkpoint=changes)


def damped_candidates(curvature: Curvature, candidates: list[Damping]
            ) -> tuple[list[Curvature | None], str]:
    """Each candidate's curvature, ``None`` where its solve is ill-conditioned (never chosen:
    its value is NaN), and a note naming those for an error message."""
    out, refused = [], []
    for candidate in candidates:
        try:
            out.append(curvature.with_damping(candidate))
        except IllConditionedError:
            out.append(None)
            refused.append(candidate.scale)
        except InvalidArgumentError as error:
            if getattr(error, "checkpoint", None) is None:
                raise
            raise InvalidArgumentError(
                f"{current_caller()}: every candidate scale multiplies each checkpoint's mean "
                f"eigenvalue, which is zero at checkpoint {error.checkpoint!r} (the estimate "
                "is zero there: the model's predictions are certain), so no scale can be "
                "chosen. Give every checkpoint one fixed damping instead of choosing one "
                "(curvature.with_damping(lambda); curvature.damping holds the fitted ones), or "
                "rebuild the store and the fit without that checkpoint.") from error
    note = f"; ill-conditioned, so not tried: scales {refused}" if refused else ""
    return out, note


def check_scales(scales: object) -> list[float]:
    """``scales`` as a non-empty list of positive finite floats, else raise."""
    try:
        values = list(scales)  # type: ignore[call-overload]
    except TypeError:
        values = None
    if not values:
        raise InvalidArgumentError(
            f"{current_caller()}: scales must be a non-empty sequence of positive multiples "
            f"of the mean eigenvalue, got {scales!r}; e.g. scales=(0.1, 1.0, 10.0)."
        )
    for value in values:
        Damping(value)  # raises with the fix for a non-positive or non-number
    return [float(v) for v in values]


def _newton_step(curvature: Curvature, ckpt: int, name: str | None,
                 grad: dict[str, Tensor]) -> dict[str, Tensor]:
    """``-(H_c + lambda_c I)^-1 g`` (``-P^T (F_c + lambda_c I)^-1 P g`` for ``"projected"``),
    ``{name: [*shape]}`` float64."""
    batched = {n: g[None].double() for n, g in grad.items()}  # [1, *shape]
    if curvature.kind != "projected":
        return {n: -v[0] for n, v in curvature.precondition(ckpt, batched).items()}
    projection = curvature.projection.for_checkpoint(name or f"checkpoint-{ckpt}")
    project = make_projector(projection, curvature.layout, dtype=torch.float64)
    row, pull_back = vjp(project, {n: g.double() for n, g in grad.items()})  # [k]
    solved = curvature.precondition_rows(ckpt, row[None])[0]
    (step,) = pull_back(solved)
    return {n: -v for n, v in step.items()}


def _mean_grad(loss: LossFn, params: Params, names: list[str], data, chunk_size,
               ckpt: int) -> dict[str, Tensor]:
    """Mean per-example gradient ``{name: [*shape]}`` (float64) over ``data``.

    Raises:
        NonFiniteGradientError: an example's gradient is NaN/inf (names it by its index in
            ``data`` and the checkpoint): one such example makes every candidate's step NaN.
    """
    psg = per_sample_grads(loss, options=GradientOptions(select=names, chunk_size=chunk_size))
    total, seen = None, 0
    for batch in iter_batches(data):
        grads = psg(params, batch)
        finite = torch.stack([g.reshape(g.shape[0], -1).isfinite().all(1)
                              for g in grads.values()]).all(0)  # [b]
        _check_finite(finite, seen, ckpt, "train_data", "gradient")
        part = {n: g.double().sum(0) for n, g in grads.items()}
        total = part if total is None else {n: total[n] + part[n] for n in part}
        seen += next(iter(grads.values())).shape[0]
    if total is None:
        raise EmptyDataError(f"{current_caller()}: train_data holds no examples.")
    return {n: v / seen for n, v in total.items()}


def _mean_loss(loss: LossFn, params: Params, data, *, check: int | None = None) -> float:
    """Mean per-example loss over ``data`` (float64); with ``check`` (a checkpoint index),
    a NaN/inf example's loss is refused by name."""
    total, seen = 0.0, 0
    for batch in iter_batches(data):
        values = vmap(loss, in_dims=(None, 0))(params, batch)
        if check is not None:
            _check_finite(values.isfinite(), seen, check, "validation_data", "loss")
        total += float(values.double().sum())
        seen += values.shape[0]
    if not seen:
        raise EmptyDataError(f"{current_caller()}: validation_data holds no examples.")
    return total / seen


def _check_finite(finite: Tensor, offset: int, ckpt: int, where: str, what: str) -> None:
    """Raise naming the examples (indices in ``where``) whose ``what`` is NaN/inf."""
    if bool(finite.all()):
        return
    bad = (torch.nonzero(~finite).reshape(-1) + offset).tolist()
    shown = ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else "")
    raise NonFiniteGradientError(
        f"{current_caller()}: the {what} of {where} example(s) {shown} is NaN or infinite at "
        f"checkpoint {ckpt}; one such example makes every candidate's criterion NaN. Remove "
        "or fix those examples (check their inputs for NaN/inf)."
    )
