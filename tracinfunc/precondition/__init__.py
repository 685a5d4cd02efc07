"""Optimizer-aware TracIn at build time: optimizer state -> a per-checkpoint ``Preconditioner``.

Not to be confused with :mod:`tracinfunc.curvature` (query-time curvature).
"""

from tracinfunc.precondition.optimizer import (
    AdamState,
    Preconditioner,
    optimizer_param_names,
    trainer_param_names,
)

__all__ = [
    "AdamState",
    "Preconditioner",
    "optimizer_param_names",
    "trainer_param_names",
]
