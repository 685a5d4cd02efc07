"""LDS from files on disk: the entry point of a ``tracinfunc evaluate`` command."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tracinfunc.errors import InvalidArgumentError
from tracinfunc.evaluate.harness import load_retrain
from tracinfunc.evaluate.lds import LDSResult, lds

__all__ = ["evaluate_lds_from_files"]

SCORE_SUFFIXES = (".npy", ".pt")


def evaluate_lds_from_files(
    scores_path: str | Path,
    retrain_path: str | Path,
    *,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> LDSResult:
    """LDS of saved scores against a saved retraining run.

    Args:
        scores_path: Scores ``[n_test, n_train]`` in a ``.npy`` file (as ``tracinfunc score
            --output scores.npy`` writes) or a ``.pt`` file holding one tensor.
        retrain_path: The Zarr group of a finished
            :func:`~tracinfunc.evaluate.retrain_subsets` run.
        n_bootstrap: Bootstrap resamples, as in :func:`~tracinfunc.evaluate.lds`.
        confidence: Level of the interval, as in :func:`~tracinfunc.evaluate.lds`.
        seed: Seed of the resampling, as in :func:`~tracinfunc.evaluate.lds`.

    Returns:
        An :class:`~tracinfunc.evaluate.LDSResult`.

    Raises:
        InvalidArgumentError: A file is missing or of an unknown kind, or the run is unfinished.
    """
    scores = _load_scores(Path(scores_path))
    run = load_retrain(retrain_path)
    return lds(scores, run.subsets, run.outputs, n_bootstrap=n_bootstrap,
               confidence=confidence, seed=seed)


def _load_scores(path: Path) -> torch.Tensor:
    if path.suffix not in SCORE_SUFFIXES or not path.is_file():
        raise InvalidArgumentError(
            f"evaluate_lds_from_files: expected an existing {' or '.join(SCORE_SUFFIXES)} file "
            f"of scores [n_test, n_train], got {str(path)!r}; write one with "
            "`tracinfunc score ... --output scores.npy`."
        )
    if path.suffix == ".npy":
        return torch.from_numpy(np.load(path, allow_pickle=False))
    scores = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(scores, torch.Tensor):
        raise InvalidArgumentError(
            f"evaluate_lds_from_files: expected {str(path)!r} to hold one tensor [n_test, "
            f"n_train], got {type(scores).__name__}; save it with torch.save(scores, path)."
        )
    return scores
