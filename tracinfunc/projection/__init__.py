"""Seeded random projections of per-example gradients, reproducible bit for bit.

:mod:`~tracinfunc.projection.spec` says what a projection is (pure Python: the spec, the
parameter layout, the hash keys); :mod:`~tracinfunc.projection.torch` computes it with torch.
The JAX frontend (:mod:`tracinfunc.jax.projection`) computes the same matrix from the same spec.
"""

from tracinfunc.projection.spec import (
    Layout,
    Projection,
    ProjectionPlan,
    block_seed,
    canonical_layout,
    check_kronecker_args,
    kronecker_seeds,
    kronecker_split,
    plan_projection,
)
from tracinfunc.projection.torch import (
    Projector,
    kronecker_factors,
    make_projector,
    rademacher_block,
    sjlt_block,
)

__all__ = [
    "Layout",
    "Projection",
    "ProjectionPlan",
    "Projector",
    "block_seed",
    "canonical_layout",
    "check_kronecker_args",
    "kronecker_factors",
    "kronecker_seeds",
    "kronecker_split",
    "make_projector",
    "plan_projection",
    "rademacher_block",
    "sjlt_block",
]
