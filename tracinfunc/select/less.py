"""Choosing training data from TracIn scores: LESS's last step, and a plain top-k.

LESS (Xia et al., 2024, "LESS: Selecting Influential Data for Targeted Instruction Tuning")
scores every training example against a few validation examples of each target task with
cosine, optimizer-aware TracIn (``tif.score(store, val_grads, normalize=True)`` on a store
built with an Adam :class:`~tracinfunc.Preconditioner`), then selects the training examples
with the highest

    max over tasks j of ( mean over the validation examples z' of task j of score(z, z') )

and trains on the top fraction (5% in the paper). The mean inside a task is the paper's
inner product with the task's average validation gradient (and what its released code does:
``scores.reshape(n_train, n_tasks, -1).mean(-1).max(-1)``); the max across tasks keeps
examples that help any one task, rather than a little of each.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tracinfunc._validate import check_int, current_caller, entry_point
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError
from tracinfunc.select._inputs import as_python_real, check_finite, task_labels
from tracinfunc.select.top_examples import TopExamples, dataset_length

__all__ = ["DataSelection", "less_scores", "select_training_data"]


@dataclass(frozen=True)
class DataSelection:
    """The chosen training rows, best first.

    Attributes:
        indices: Training rows ``[n_selected]``, int64, by decreasing score (ties: lower row
            first).
        scores: Their scores ``[n_selected]`` (the aggregated LESS score for a score matrix).
        n_train: How many training rows were ranked.
    """

    indices: Tensor
    scores: Tensor
    n_train: int

    def examples(self, dataset: Any, **kwargs: Any) -> TopExamples:
        """The chosen rows as ``dataset``'s items (see :class:`~tracinfunc.TopExamples`).

        Raises:
            InvalidArgumentError: ``dataset`` has another length than the ``n_train`` rows
                ranked (other data, or a subset, would be indexed silently).
        """
        top = TopExamples(self.scores[None], self.indices[None], dataset, **kwargs)
        if (n := dataset_length(dataset)) != self.n_train:
            raise InvalidArgumentError(
                f"DataSelection.examples: the selection ranked {self.n_train} training rows "
                f"but the dataset has {n} items; pass the training data the scores were "
                "computed for, in its order."
            )
        return top


@entry_point("less_scores")
def less_scores(scores: Tensor, *, tasks: Sequence[Hashable] | None = None) -> Tensor:
    """LESS's score of each training example: per task, the mean over the task's validation
    examples; then the max over tasks.

    Args:
        scores: Validation-by-training scores ``[n_test, n_train]`` (``tif.score``; LESS uses
            ``normalize=True``), a tensor or NumPy/JAX array, finite.
        tasks: The task of each validation row (``n_test`` labels, e.g. ``["mmlu", "bbh",
            ...]``): a list or tuple, or a 1-D NumPy, torch or JAX array, of ints (whole
            floats count as ints) or strs. Every spelling of the same labels groups the same
            rows. ``None``: one task.

    Returns:
        ``[n_train]`` scores, in the dtype of ``scores`` (averaged in float64).

    Raises:
        InvalidArgumentError: ``scores`` is not 2-D, holds NaN or +-inf (named by position),
            or ``tasks`` has another length or is not 1-D.
        InvalidTypeError: a label that is not an int or str (a list, None, a bool, 0.5).
    """
    scores = _as_scores(scores, dims=(2,))
    wide = scores.to(torch.float64)  # means of float32/16 cannot overflow
    if tasks is None:
        return wide.mean(0).to(scores.dtype)
    groups: dict[int | str, list[int]] = {}
    for row, task in enumerate(task_labels(tasks, scores.shape[0])):
        groups.setdefault(task, []).append(row)
    per_task = torch.stack([wide[rows].mean(0) for rows in groups.values()])  # [n_task, n_train]
    return per_task.max(0).values.to(scores.dtype)


@entry_point("select_training_data")
def select_training_data(scores: Tensor, *, fraction: float | None = None,
                         k: int | None = None,
                         tasks: Sequence[Hashable] | None = None) -> DataSelection:
    """The training rows to keep: the top ``k`` or top ``fraction`` by score.

    A score matrix ``[n_test, n_train]`` is first reduced with :func:`less_scores` (LESS's
    aggregation over validation tasks); a vector ``[n_train]`` (self-influence, your own
    aggregate) is ranked as it is.

    Args:
        scores: ``[n_test, n_train]`` or ``[n_train]``, a tensor or NumPy/JAX array, finite
            (NaN and +-inf are refused, named by position: they have no rank).
        fraction: Keep ``floor(fraction * n_train)`` rows (at least 1), ``0 < fraction <= 1``;
            LESS keeps 0.05. A Python, NumPy, JAX or 0-d torch number.
        k: Keep ``k`` rows, ``1 <= k <= n_train`` (more is refused, not truncated). A Python,
            NumPy, JAX or 0-d torch integer. Give ``k`` or ``fraction``, not both.
        tasks: With a matrix: the task of each validation row (see :func:`less_scores`).

    Returns:
        A :class:`DataSelection`; ``.indices`` are the rows to train on.

    Raises:
        InvalidArgumentError: scores empty, misshaped or not finite; ``k``/``fraction``
            missing, both given or out of range; ``tasks`` with a vector (see
            :func:`less_scores` for the labels).

    Example:
        >>> scores = tif.score(store, val_grads, normalize=True)      # [n_val, n_train]
        >>> chosen = tif.select_training_data(scores, fraction=0.05, tasks=val_tasks)
        >>> subset = [train_texts[i] for i in chosen.indices.tolist()]
    """
    scores = _as_scores(scores, dims=(1, 2))
    if scores.dim() == 2:
        scores = less_scores(scores, tasks=tasks)
    elif tasks is not None:
        raise InvalidArgumentError(
            "select_training_data: tasks= groups the rows of a score matrix [n_test, n_train] "
            f"but the scores are a vector [{scores.shape[0]}]; pass the matrix or leave tasks out."
        )
    check_finite(scores, "training rows")  # a float64 mean of huge float64s overflows
    n_keep = _count(scores.shape[0], as_python_real(fraction), k)  # check_int takes any int scalar
    order = torch.sort(scores, descending=True, stable=True).indices[:n_keep]
    return DataSelection(indices=order.to(torch.int64), scores=scores[order],
                         n_train=scores.shape[0])


def _as_scores(scores: Any, *, dims: tuple[int, ...]) -> Tensor:
    try:
        scores = torch.as_tensor(scores)
    except (TypeError, ValueError, RuntimeError) as error:
        raise InvalidTypeError(
            f"{current_caller()}: scores must be a tensor or array, got "
            f"{type(scores).__name__} ({error})."
        ) from error
    shapes = " or ".join({1: "[n_train]", 2: "[n_test, n_train]"}[d] for d in dims)
    if scores.dim() not in dims or not scores.is_floating_point() or scores.numel() == 0:
        raise InvalidArgumentError(
            f"{current_caller()}: scores must be float {shapes} with rows, got "
            f"{scores.dtype} {list(scores.shape)}; pass tif.score(...)'s output."
        )
    check_finite(scores, "[test row, training row]" if scores.dim() == 2 else "training rows")
    return scores


def _count(n_train: int, fraction: float | None, k: int | None) -> int:
    if (fraction is None) == (k is None):
        raise InvalidArgumentError(
            f"select_training_data: give k (rows) or fraction (of {n_train} rows), exactly "
            f"one; got k={k!r}, fraction={fraction!r}. E.g. fraction=0.05 as in LESS."
        )
    if k is not None:
        return check_int(k, "k", maximum=n_train,
                         fix=f"pass at most n_train={n_train} training rows, or fraction=...")
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not (
            0 < fraction <= 1):  # NaN fails the range too
        raise InvalidArgumentError(
            f"select_training_data: fraction must be in (0, 1], got {fraction!r}; e.g. 0.05."
        )
    return max(1, int(fraction * n_train))
