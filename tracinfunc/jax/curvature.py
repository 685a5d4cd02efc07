"""Curvature-aware test gradients from JAX: twin of :func:`tracinfunc.preconditioned_test_grads`.

A :class:`~tracinfunc.Curvature` is bound to the store's checkpoints (fingerprints of the
torch-layout weights), the torch layout and, for ``"projected"``, the projection; a JAX-written
store records exactly these (:mod:`tracinfunc.jax.build`), so one curvature serves the torch and
the JAX frontends alike:

- ``"projected"``: nothing JAX-specific is needed, ``tif.score(jax_store, jax_test_store,
  curvature=c)`` preconditions the plain projected test rows itself;
- ``"dense"``, ``"kfac"``, ``"ekfac"`` act on full gradients before the projection: the test
  gradients come from :func:`preconditioned_test_grads` here (JAX per-example gradients,
  mapped to torch names and layout, preconditioned and projected with the torch path's
  matrices), marked with the curvature's digest as the torch path marks them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tracinfunc._validate import current_caller, entry_point
from tracinfunc.build.loop import new_store_meta
from tracinfunc.curvature.binding import check_bound, check_curvature
from tracinfunc.curvature.test_grads import GradientPreconditioner, marked_store
from tracinfunc.errors import EmptyDataError
from tracinfunc.jax.build import (
    Checkpoint,
    _batch_size,
    _check_checkpoints,
    checked_devices,
    device_check,
    host_tensor,
    iter_batches,
)
from tracinfunc.jax.grads import projected_grads, torch_layout_grads
from tracinfunc.jax.layout import ParamMapping
from tracinfunc.projection import Projection
from tracinfunc.projection.spec import check_projection
from tracinfunc.store.memory.dense import MemoryStore

__all__ = ["preconditioned_test_grads"]


@entry_point("tracinfunc.jax.preconditioned_test_grads")
def preconditioned_test_grads(
    loss: Any,
    checkpoints: Sequence[Checkpoint],
    data: Any,
    curvature: Any,
    *,
    projection: Projection,
    mapping: ParamMapping | None = None,
    chunk_size: int | None = None,
) -> MemoryStore:
    """JAX test gradients preconditioned by ``curvature``, then projected: ``P (H_c + l I)^-1 g``.

    Args:
        loss: ``loss(params, example) -> scalar`` in JAX (the test examples keep their
            labels), or ``loss(params, state, example)`` for checkpoints with state.
        checkpoints: The :class:`~tracinfunc.jax.Checkpoint` values the store was built from.
        data: Test batches (as :func:`tracinfunc.jax.build_store` takes them).
        curvature: From :func:`~tracinfunc.fit_curvature` (or :func:`~tracinfunc.load_curvature`)
            at these checkpoints, any kind.
        projection: The store's projection (``store.projection``).
        mapping: The store's :class:`~tracinfunc.jax.ParamMapping` (default: identity).
        chunk_size: Examples differentiated at once inside vmap.

    Returns:
        A :class:`~tracinfunc.store.MemoryStore` ``[n_ckpt, n_test, k]`` (float32 for float32
        parameters) to pass with ``curvature=`` to :func:`~tracinfunc.query.score`, ``top_k``,
        ``score_chunks`` or ``indexed_top_k``.

    Raises:
        IncompatibleGradientsError: the curvature was fitted at other checkpoints, over
            other parameters (names, torch shapes), or in another projected space.
        EmptyDataError: ``data`` holds no examples.
        NonFiniteGradientError: a test example's gradient is NaN/inf (named by its index).
    """
    curvature = check_curvature(curvature)
    check_projection(projection)
    checkpoints = _check_checkpoints(checkpoints)
    mapping = mapping or ParamMapping.identity(checkpoints[0].params)
    meta = new_store_meta(
        [(c.name, c.lr, c._fingerprint(mapping)) for c in checkpoints],
        mapping.layout, projection, torch.float32, None)
    check_bound(curvature, meta)
    batches = [batch for batch in checked_devices(iter_batches(data), device_check(checkpoints))
               if _batch_size(batch)]
    if not batches:
        raise EmptyDataError(f"{current_caller()}: data holds no test examples.")
    per_ckpt = []
    for c, (ckpt, ckpt_meta) in enumerate(zip(checkpoints, meta.checkpoints, strict=True)):
        rows_of = _rows_fn(loss, curvature, c, projection.for_checkpoint(ckpt_meta.name),
                           mapping, chunk_size)
        per_ckpt.append(torch.cat([rows_of(*ckpt.args, batch) for batch in batches]))
    return marked_store(meta, per_ckpt, curvature)


def _rows_fn(loss: Any, curvature: Any, ckpt: int, projection: Projection,
             mapping: ParamMapping, chunk_size: int | None):
    """``fn(params, batch) -> [b, k]`` torch rows, preconditioned at checkpoint ``ckpt``."""
    if curvature.kind == "projected":
        project = projected_grads(loss, projection, mapping=mapping, chunk_size=chunk_size)
        return lambda *args: curvature.precondition_rows(ckpt, host_tensor(project(*args)))
    mapped = torch_layout_grads(loss, mapping, chunk_size)  # {name: [b, *torch shape]}
    precondition = GradientPreconditioner(curvature, ckpt, projection, chunk_size)

    def rows(*args: Any) -> torch.Tensor:
        grads = mapped(*args)
        return precondition({name: host_tensor(value) for name, value in grads.items()})

    return rows
