"""tracinfunc for JAX: per-example gradients with ``jax.vmap(jax.grad(loss))``, projected with
the torch path's matrices (bit for bit), written to the same stores torch code scores.

Optional: install with ``pip install "tracinfunc[jax]"``. ``import tracinfunc`` never imports
JAX; only ``import tracinfunc.jax`` does.

Example:
    >>> import tracinfunc as tif, tracinfunc.jax as tj
    >>> mapping = tj.ParamMapping.flax(params)           # Dense kernel [in, out] -> [out, in]
    >>> ckpts = [tj.Checkpoint(p, lr=0.1, name=f"epoch-{e}") for e, p in enumerate(snapshots)]
    >>> store = tj.build_store(loss, ckpts, (x, y), projection=tif.Projection(dim=512),
    ...                        mapping=mapping)
    >>> tif.score(store, test_store)                     # torch code, same store format

A Flax model with state (BatchNorm): ``tj.Checkpoint.flax(variables_or_nnx_model, lr=...)``
and ``loss(params, state, example)``; state is never differentiated.
"""

try:
    import jax as _jax  # noqa: F401  (fail here, with the install command, not deep inside)
except ImportError as _error:  # pragma: no cover - exercised only without jax installed
    raise ImportError(
        "tracinfunc.jax needs JAX, which is not installed; install it with "
        '`pip install "tracinfunc[jax]"` (or `pip install jax`).'
    ) from _error

from tracinfunc.jax.build import Checkpoint, build_store, iter_batches
from tracinfunc.jax.curvature import preconditioned_test_grads
from tracinfunc.jax.fit import classification_sampler, fit_curvature
from tracinfunc.jax.grads import as_jax_tree, per_sample_grads, projected_grads
from tracinfunc.jax.layout import LeafMap, ParamMapping, path_name
from tracinfunc.jax.projection import (
    Projector,
    kronecker_factors,
    make_projector,
    rademacher_block,
    sjlt_block,
)

__all__ = [
    "Checkpoint",
    "LeafMap",
    "ParamMapping",
    "Projector",
    "as_jax_tree",
    "build_store",
    "classification_sampler",
    "fit_curvature",
    "iter_batches",
    "kronecker_factors",
    "make_projector",
    "path_name",
    "per_sample_grads",
    "preconditioned_test_grads",
    "projected_grads",
    "rademacher_block",
    "sjlt_block",
]
