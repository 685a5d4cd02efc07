"""Damping ``lambda_c`` of each checkpoint's curvature, chosen from its own spectrum.

Curvature-aware TracIn solves ``(H_c + lambda_c I) x = g`` per checkpoint. Measured on digits
(``benchmarks/curvature.py``, ``docs/curvature.md``), LDS depends on ``lambda_c`` as much as on
the curvature itself, and the best absolute value differs by model and checkpoint by orders of
magnitude; relative to the mean eigenvalue ``tr(H_c) / dim`` it is far more stable. The default
is therefore ``lambda_c = scale * tr(H_c) / dim`` with the ``scale`` measured best for the kind
(``DEFAULT_SCALES``): the block-diagonal K-FAC kinds want less damping than the full matrices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tracinfunc._validate import as_real, current_caller
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["DEFAULT_SCALES", "RANK_DEFAULT_SCALES", "Damping", "check_damping"]

# Measured on digits LR and MLP (benchmarks/curvature.py, docs/curvature.md): per kind, the
# multiple of the mean eigenvalue with the best LDS averaged over the two models (and k = 256,
# 1024 for "projected"); exact-store LDS at these: dense 0.958 / 0.892, projected-1024
# 0.932 / 0.871, kfac 0.950 / 0.847, ekfac 0.950 / 0.857 (LR / MLP).
DEFAULT_SCALES = {"dense": 3.0, "projected": 1.0, "kfac": 0.1, "ekfac": 0.3}


# The same for the mean over the rank (``over="rank"``): the dimension rule's multiples for now.
# Issue 33's reduced runs (benchmarks/RESULTS.md) measured the curves of both rules but did not
# settle a better default; "kfac" above was measured while it was pi-damped (see kfac.py).
RANK_DEFAULT_SCALES = {"dense": 3.0, "projected": 1.0, "kfac": 0.1, "ekfac": 0.3}

OVER = ("dimension", "rank")


@dataclass(frozen=True)
class Damping:
    """``lambda_c = scale * mean eigenvalue of H_c``, per checkpoint.

    Attributes:
        scale: The multiple, a positive finite float; ``None`` (default): the measured best
            for the curvature's kind and ``over`` (``DEFAULT_SCALES``, ``RANK_DEFAULT_SCALES``).
        over: ``"dimension"`` (default): the mean is ``tr(H_c) / dim``; ``"rank"``:
            ``tr(H_c) / rank(H_c)``, the mean of the non-zero eigenvalues, which a
            rank-deficient estimate (``k`` above ``p``, fewer samples than dimensions) does
            not pull down.
    """

    scale: float | None = None
    over: str = "dimension"

    def __post_init__(self) -> None:
        if self.over not in OVER:
            raise InvalidArgumentError(
                f"Damping: over must be one of {list(OVER)}, got {self.over!r}; e.g. "
                "Damping(over='rank') for the mean eigenvalue over the estimate's rank."
            )
        scale = self.scale
        if scale is None:
            return
        scale = as_real(scale)  # NumPy scalars, 0-d arrays of any framework: a float
        if scale is None or not math.isfinite(scale) or scale <= 0:
            raise InvalidArgumentError(
                f"Damping: scale must be a positive finite number (a multiple of the mean "
                f"eigenvalue), got {self.scale!r}; e.g. Damping(scale=3.0), or Damping() for the "
                "measured default."
            )
        object.__setattr__(self, "scale", float(scale))

    def scale_for(self, kind: str) -> float:
        """The multiple used for a curvature of ``kind``."""
        if kind not in DEFAULT_SCALES:
            raise InvalidArgumentError(
                f"Damping: kind must be one of {sorted(DEFAULT_SCALES)}, got {kind!r}.")
        if self.scale is not None:
            return self.scale
        return (RANK_DEFAULT_SCALES if self.over == "rank" else DEFAULT_SCALES)[kind]

    def value(self, mean_eigenvalue: float, kind: str) -> float:
        """``lambda`` for a ``kind`` curvature whose mean eigenvalue is ``mean_eigenvalue``
        (:func:`resolve` refuses a zero mean)."""
        return self.scale_for(kind) * mean_eigenvalue

    def describe(self, kind: str) -> str:
        over = "" if self.over == "dimension" else " over the rank"
        return f"{self.scale_for(kind):g} x mean eigenvalue{over}"


def check_damping(damping: object) -> Damping | float:
    """``damping`` if it is a :class:`Damping` or a non-negative finite float, else raise."""
    if isinstance(damping, Damping):
        return damping
    value = as_real(damping)  # NumPy scalars, 0-d arrays of any framework: a float
    if value is None:
        raise InvalidTypeError(
            f"{current_caller()}: damping must be a tracinfunc.curvature.Damping (relative to "
            f"each checkpoint's spectrum) or a float (the same lambda for every checkpoint), "
            f"got {type(damping).__name__}; e.g. damping=Damping(scale=3.0) or damping=1e-3."
        )
    if not math.isfinite(value) or value < 0:
        raise InvalidArgumentError(
            f"{current_caller()}: damping must be a finite float >= 0, got {damping!r}; "
            "e.g. damping=1e-3, or Damping() to choose it from the data."
        )
    return value


def resolve(damping: Damping | float, mean_eigenvalue: float, kind: str,
            checkpoint: str | None = None) -> float:
    """The ``lambda`` of one checkpoint (named ``checkpoint`` in errors) of a ``kind``
    curvature: finite, and for a :class:`Damping` from a positive mean eigenvalue, else raise
    (the zero-estimate refusal's error carries ``checkpoint``)."""
    value = damping.value(mean_eigenvalue, kind) if isinstance(damping, Damping) else damping
    if not math.isfinite(value):
        raise InvalidArgumentError(
            f"{current_caller()}: {damping!r} gives lambda = {value} for a mean eigenvalue of "
            f"{mean_eigenvalue:.3g}; a damping must be finite: use a smaller Damping(scale=...)"
            " (or check the estimate: a non-finite mean eigenvalue means non-finite data)."
        )
    if isinstance(damping, Damping) and mean_eigenvalue <= 0:
        # A zero estimate: every sampled gradient is zero (the model's predictions are
        # certain there, so every drawn label is the predicted one), while the gradients of
        # other labels need not be; a multiple of zero would leave the solve undamped.
        at = f" at checkpoint {checkpoint!r}" if checkpoint is not None else ""
        error = InvalidArgumentError(
            f"{current_caller()}: {damping!r} ({damping.describe(kind)}) takes lambda from the "
            f"mean eigenvalue, which is zero{at}: the estimate is zero (every sampled gradient "
            "vanishes: the model's predictions are certain at that checkpoint), so there is "
            "nothing to be relative to, while other gradients need not vanish. Give every "
            "checkpoint one fixed damping (with_damping(lambda); curvature.damping holds the "
            "others' lambdas), or rebuild the store and the fit without that checkpoint."
        )
        error.checkpoint = checkpoint
        raise error
    return value
