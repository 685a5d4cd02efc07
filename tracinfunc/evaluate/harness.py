"""A retraining harness for models that train in seconds: the ground truth LDS compares to.

``retrain_subsets`` draws seeded random subsets, calls the user's ``train_fn`` on each and
keeps the measurements in a Zarr group (see :mod:`tracinfunc.evaluate.runs`), so an
interrupted run resumes where it stopped and a damaged saved row is trained again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from tracinfunc.errors import CorruptStoreError, InvalidArgumentError, InvalidTypeError
from tracinfunc.evaluate.runs import (
    ATTRS_KEY,
    check_run_json,
    checked_rows,
    open_run,
    read_run,
    save_row,
)
from tracinfunc.progress import ProgressArg, progress_bar

__all__ = ["RetrainResult", "draw_subsets", "load_retrain", "retrain_subsets"]

TrainFn = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class RetrainResult:
    """Retrained models' measurements, the input of :func:`~tracinfunc.evaluate.lds`.

    Attributes:
        subsets: ``[m, n_train]`` bool masks.
        outputs: ``[m, n_test]`` float64, ``train_fn`` of each subset.
        alpha: Fraction of the training set in each subset.
        seed: Seed the subsets were drawn from.
    """

    subsets: Tensor
    outputs: Tensor
    alpha: float
    seed: int


def draw_subsets(n_train: int, n_subsets: int, *, alpha: float = 0.5, seed: int = 0) -> Tensor:
    """``n_subsets`` random subsets of ``round(alpha * n_train)`` examples each, seeded.

    Returns:
        ``[n_subsets, n_train]`` bool masks; a function of the arguments only.
    """
    _check_sizes(n_train, n_subsets, alpha, seed)
    size = round(alpha * n_train)
    generator = torch.Generator().manual_seed(seed)
    masks = torch.zeros(n_subsets, n_train, dtype=torch.bool)
    for j in range(n_subsets):
        masks[j, torch.randperm(n_train, generator=generator)[:size]] = True
    return masks


def retrain_subsets(
    train_fn: TrainFn,
    n_train: int,
    n_subsets: int,
    *,
    alpha: float = 0.5,
    seed: int = 0,
    path: str | Path | None = None,
    progress: ProgressArg = None,
) -> RetrainResult:
    """Retrain on ``n_subsets`` random subsets and measure each model on the test examples.

    Args:
        train_fn: ``train_fn(indices) -> [n_test]``: trains a model on the training examples
            ``indices`` (``[round(alpha * n_train)]`` int64, ascending) and returns one
            measurement per test example (e.g. the correct-class margin). Seed any randomness
            inside it from the indices or a constant so a resumed run is reproducible.
        n_train: Training set size.
        n_subsets: ``m``, how many subsets to retrain on (LDS uses 50-100).
        alpha: Fraction of the training set in each subset, in (0, 1).
        seed: Seed of the subsets.
        path: A Zarr group to keep results in. If it exists with the same ``n_train``,
            ``n_subsets``, ``alpha`` and ``seed``, only the subsets not yet done are trained.
        progress: A bar over subsets (see :func:`tracinfunc.progress.progress_bar`).

    Returns:
        A :class:`RetrainResult`.

    Raises:
        InvalidArgumentError: A size or fraction is out of range, ``path`` holds a run made
            with other settings, or ``train_fn`` returns a wrong shape or non-finite values.
    """
    subsets = draw_subsets(n_train, n_subsets, alpha=alpha, seed=seed)
    config = {"n_train": n_train, "n_subsets": n_subsets, "alpha": alpha, "seed": seed}
    group = None if path is None else open_run(Path(path), config)
    outputs, done = read_run(group, n_subsets)
    with progress_bar(progress, total=n_subsets, desc="retrain_subsets", unit="subset") as bar:
        bar.update(int(done.sum()))
        for j in np.flatnonzero(~done):
            measured = _measure(train_fn, subsets[j].nonzero().squeeze(1), outputs)
            if outputs is None:
                outputs = np.full((n_subsets, len(measured)), np.nan)
            outputs[j] = measured
            if group is not None:
                save_row(group, subsets.numpy(), outputs, j)
            bar.update(1)
    return RetrainResult(subsets=subsets, outputs=torch.from_numpy(outputs), alpha=alpha, seed=seed)


def load_retrain(path: str | Path) -> RetrainResult:
    """The results a finished :func:`retrain_subsets` run kept in the Zarr group ``path``.

    Raises:
        InvalidArgumentError: ``path`` holds no retraining run, or the run is unfinished.
        CorruptStoreError: saved outputs fail their checksums (a deleted or damaged chunk),
            or the saved subsets are not those the run's settings draw.
    """
    import zarr
    path = Path(path)
    check_run_json(path)
    try:
        group = zarr.open_group(path, mode="r")
        config = dict(group.attrs[ATTRS_KEY])
    except (FileNotFoundError, KeyError) as error:
        raise InvalidArgumentError(
            f"load_retrain: expected a Zarr group written by retrain_subsets at {path}, got "
            f"none ({type(error).__name__}); run tracinfunc.evaluate.retrain_subsets(..., "
            "path=...) first."
        ) from None
    if "done" not in group:
        done, damaged = np.zeros(config["n_subsets"], bool), []
    else:
        outputs, done, damaged = checked_rows(group)
    if damaged:
        raise CorruptStoreError(
            f"load_retrain: the saved outputs of subsets {damaged} at {path} do not match "
            "their checksums (deleted or damaged files); call retrain_subsets with the same "
            "settings to train them again."
        )
    if not done.all():
        raise InvalidArgumentError(
            f"load_retrain: expected a finished run of {config['n_subsets']} subsets at {path}, "
            f"got {int(done.sum())} done; call retrain_subsets with the same settings to resume."
        )
    subsets = torch.from_numpy(group["subsets"][:])
    if not torch.equal(subsets, draw_subsets(config["n_train"], config["n_subsets"],
                                             alpha=config["alpha"], seed=config["seed"])):
        raise CorruptStoreError(
            f"load_retrain: the subsets saved at {path} are not the ones its settings "
            f"{config} draw (damaged or edited); call retrain_subsets with those settings "
            "and another path to measure them again."
        )
    return RetrainResult(subsets=subsets, outputs=torch.from_numpy(outputs),
                         alpha=config["alpha"], seed=config["seed"])


def _measure(train_fn: TrainFn, indices: Tensor, outputs: np.ndarray | None) -> np.ndarray:
    measured = train_fn(indices)
    if not isinstance(measured, Tensor | np.ndarray):
        raise InvalidTypeError(
            f"retrain_subsets: train_fn must return a tensor [n_test], got "
            f"{type(measured).__name__}; return one measurement per test example."
        )
    measured = torch.as_tensor(measured).detach().cpu().double().numpy()
    expected = "[n_test]" if outputs is None else f"[{outputs.shape[1]}]"
    if measured.ndim != 1 or (outputs is not None and len(measured) != outputs.shape[1]):
        raise InvalidArgumentError(
            f"retrain_subsets: train_fn must return shape {expected} for every subset, got "
            f"{list(measured.shape)}; return one measurement per test example."
        )
    if not np.isfinite(measured).all():
        raise InvalidArgumentError(
            "retrain_subsets: expected finite measurements from train_fn, got NaN or inf; "
            "lower the learning rate or clip the measurement."
        )
    return measured


def _check_sizes(n_train: object, n_subsets: object, alpha: object, seed: object) -> None:
    for name, value, low, example in (("n_train", n_train, 2, 1000),
                                      ("n_subsets", n_subsets, 1, 100), ("seed", seed, 0, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InvalidArgumentError(
                f"retrain_subsets: {name} must be an int >= {low}, got {value!r}; pass a "
                f"plain Python int, e.g. {name}={example}."
            )
    proper = isinstance(alpha, float) and 0 < alpha < 1 and 1 <= round(alpha * n_train) < n_train
    if not proper:
        raise InvalidArgumentError(
            f"retrain_subsets: alpha must be a float in (0, 1) leaving a non-empty proper "
            f"subset of {n_train} examples, got {alpha!r}; e.g. alpha=0.5."
        )
