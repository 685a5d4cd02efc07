"""Per-example gradients in JAX: ``jax.vmap(jax.grad(loss))``, projected like the torch path.

The conventions are those of :mod:`tracinfunc.grads`: ``loss(params, example) -> scalar``
with ``params`` any pytree and ``example`` one slice of a batch (no batch dimension);
transforms return functions; ``has_aux`` as in ``jax.grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax import tree_util

from tracinfunc._validate import check_int, entry_point
from tracinfunc.errors import InvalidArgumentError
from tracinfunc.interop import to_framework
from tracinfunc.jax.layout import ParamMapping
from tracinfunc.jax.projection import Projector, make_projector
from tracinfunc.projection import Projection
from tracinfunc.projection.spec import check_projection

__all__ = ["as_jax_tree", "per_sample_grads", "projected_grads"]


@entry_point("tracinfunc.jax.per_sample_grads")
def per_sample_grads(
    loss: Callable, *, has_aux: bool = False, chunk_size: int | None = None
) -> Callable[[Any, Any], Any]:
    """Per-example gradients of ``loss``: ``jax.vmap(jax.grad(loss), in_axes=(None, 0))``.

    Args:
        loss: ``loss(params, example) -> scalar`` (``(scalar, aux)`` with ``has_aux``).
        has_aux: The loss also returns auxiliary data, returned batched beside the grads.
        chunk_size: Examples differentiated at once (``None``: the whole batch). Results do
            not change; smaller values bound memory.

    Returns:
        ``fn(params, batch)`` -> gradients with the structure of ``params``, each leaf
        ``[b, *shape]`` (``(grads, aux)`` with ``has_aux``). Torch tensors in ``params`` or
        ``batch`` are imported through DLPack.
    """
    check_int(chunk_size, "chunk_size", optional=True)
    batched = jax.jit(jax.vmap(jax.grad(loss, has_aux=has_aux), in_axes=(None, 0)))

    def per_sample_grads_fn(params: Any, batch: Any) -> Any:
        return _in_chunks(batched, as_jax_tree(params), as_jax_tree(batch), chunk_size)

    return per_sample_grads_fn


@entry_point("tracinfunc.jax.projected_grads")
def projected_grads(
    loss: Callable, projection: Projection, *, mapping: ParamMapping | None = None,
    has_aux: bool = False, chunk_size: int | None = None,
) -> Callable[[Any, Any], Any]:
    """Per-example gradients mapped to torch names/layout and projected to ``[b, k]``.

    The projection matrices are those of the torch path bit for bit (keyed by torch name and
    shape), so these rows and torch's :func:`tracinfunc.projected_grads` rows for the same
    weights agree up to float rounding and can share a store.

    Args:
        loss: ``loss(params, example) -> scalar``.
        projection: The spec, e.g. ``store.projection``.
        mapping: How the params tree maps to torch names and shapes (default:
            ``ParamMapping.identity(params)``; Flax: ``ParamMapping.flax(params)``).
        has_aux: As in :func:`per_sample_grads`; returns ``(rows, aux)``.
        chunk_size: Examples differentiated at once; bounds memory, results do not change.

    Returns:
        ``fn(params, batch) -> [b, k]`` jax.Array in the params' dtype.
    """
    check_projection(projection)
    check_int(chunk_size, "chunk_size", optional=True)
    compiled: dict[Any, tuple[Projector, Callable]] = {}

    def compile_for(params: Any) -> tuple[Projector, Callable]:
        leaves, treedef = tree_util.tree_flatten(params)
        key = (treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves))
        if key not in compiled:
            mapped = mapping or ParamMapping.identity(params)
            dtype = jnp.result_type(*leaves)
            project = make_projector(projection, mapped.layout, dtype=dtype)

            def one_example(blocks, params, example):
                out = jax.grad(loss, has_aux=has_aux)(params, example)
                grads, aux = out if has_aux else (out, None)
                rows = project.apply(blocks, mapped.to_torch(grads))
                return (rows, aux) if has_aux else rows

            compiled[key] = project, jax.jit(jax.vmap(one_example, in_axes=(None, None, 0)))
        return compiled[key]

    def projected_grads_fn(params: Any, batch: Any) -> Any:
        params, batch = as_jax_tree(params), as_jax_tree(batch)
        project, batched = compile_for(params)
        return _in_chunks(lambda p, b: batched(project.blocks, p, b), params, batch,
                          chunk_size)

    return projected_grads_fn


def as_jax_tree(tree: Any) -> Any:
    """``tree`` with torch tensors imported through DLPack and other arrays as jax.Array."""
    def convert(leaf):
        if isinstance(leaf, torch.Tensor):
            return to_framework(leaf, "jax")
        return leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf)

    return tree_util.tree_map(convert, tree)


def _in_chunks(fn: Callable, params: Any, batch: Any, chunk_size: int | None) -> Any:
    leaves = tree_util.tree_leaves(batch)
    if not leaves or any(leaf.ndim == 0 for leaf in leaves):
        raise InvalidArgumentError(
            "tracinfunc.jax: a batch must be a pytree of arrays with a leading batch "
            f"dimension, got leaf shapes {[list(leaf.shape) for leaf in leaves]}."
        )
    b = leaves[0].shape[0]
    if chunk_size is None or chunk_size >= b:
        return fn(params, batch)
    parts = [fn(params, tree_util.tree_map(lambda leaf, s=start: leaf[s : s + chunk_size],
                                           batch))
             for start in range(0, b, chunk_size)]
    return tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *parts)


