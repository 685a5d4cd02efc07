"""Per-example gradients in JAX: ``jax.vmap(jax.grad(loss))``, projected like the torch path.

The conventions are those of :mod:`tracinfunc.grads`: ``loss(params, example) -> scalar``
with ``params`` any pytree and ``example`` one slice of a batch (no batch dimension);
transforms return functions; ``has_aux`` as in ``jax.grad``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax import lax, tree_util

from tracinfunc._validate import check_int, current_caller, entry_point
from tracinfunc.errors import InvalidArgumentError
from tracinfunc.interop import to_framework
from tracinfunc.jax.layout import ParamMapping
from tracinfunc.jax.precision import float32_jit
from tracinfunc.jax.projection import Projector, make_projector
from tracinfunc.projection import Projection
from tracinfunc.projection.spec import check_projection

__all__ = ["as_jax_tree", "pad_rows", "per_sample_grads", "projected_grads"]


@entry_point("tracinfunc.jax.per_sample_grads")
def per_sample_grads(
    loss: Callable, *, has_aux: bool = False, chunk_size: int | None = None
) -> Callable[..., Any]:
    """Per-example gradients of ``loss``: ``jax.vmap(jax.grad(loss))`` over the batch only.

    Args:
        loss: ``loss(params, example) -> scalar`` (``(scalar, aux)`` with ``has_aux``), or
            ``loss(params, state, example)`` for a model with state (BatchNorm statistics):
            only ``params`` is differentiated.
        has_aux: The loss also returns auxiliary data, returned batched beside the grads.
        chunk_size: Examples differentiated at once (``None``: the whole batch). Results do
            not change; smaller values bound memory.

    Returns:
        ``fn(params, batch)`` (or ``fn(params, state, batch)``) -> gradients with the
        structure of ``params``, each leaf ``[b, *shape]`` (``(grads, aux)`` with
        ``has_aux``). Torch tensors in the arguments are imported through DLPack. Compiled
        once per argument shapes (padded chunks never recompile).
    """
    chunk_size = check_int(chunk_size, "chunk_size", optional=True)
    batched = _held(loss, ("per-sample", has_aux, chunk_size), lambda: float32_jit(
        partial(_batched, jax.grad(weakly(loss), has_aux=has_aux), chunk_size)))

    def per_sample_grads_fn(params: Any, *args: Any, _loss: Callable = loss) -> Any:
        # _loss: this function keeps the loss alive, so its held program can trace it
        params, args = as_jax_tree(params), as_jax_tree(_check_args(args))
        return batched(params, args[:-1], args[-1])

    return per_sample_grads_fn


@entry_point("tracinfunc.jax.projected_grads")
def projected_grads(
    loss: Callable, projection: Projection, *, mapping: ParamMapping | None = None,
    has_aux: bool = False, chunk_size: int | None = None,
) -> Callable[..., Any]:
    """Per-example gradients mapped to torch names/layout and projected to ``[b, k]``.

    The projection matrices are those of the torch path bit for bit (keyed by torch name and
    shape), so these rows and torch's :func:`tracinfunc.projected_grads` rows for the same
    weights agree up to float rounding and can share a store.

    The compiled program is shared by every function made for the same ``(loss, projection,
    mapping, has_aux, chunk_size)`` and reused for every checkpoint of the same shapes: the
    projection blocks are arguments, never constants, so calling ``projected_grads`` again
    (each ``tracinfunc.jax.build_store`` does) costs no compilation.

    Args:
        loss: ``loss(params, example) -> scalar``, or ``loss(params, state, example)``.
        projection: The spec, e.g. ``store.projection``.
        mapping: How the params tree maps to torch names and shapes (default:
            ``ParamMapping.identity(params)``; Flax: ``ParamMapping.flax(params)``).
        has_aux: As in :func:`per_sample_grads`; returns ``(rows, aux)``.
        chunk_size: Examples differentiated at once; bounds memory, results do not change.

    Returns:
        ``fn(params, batch)`` (or ``fn(params, state, batch)``) ``-> [b, k]`` jax.Array in
        the params' dtype.
    """
    check_projection(projection)
    chunk_size = check_int(chunk_size, "chunk_size", optional=True)

    return _held_programs(loss, projection, mapping, has_aux, chunk_size, checks=False)


def checked_projected_grads(loss: Callable, projection: Projection, *,
                            mapping: ParamMapping | None, chunk_size: int | None
                            ) -> Callable[..., tuple[Any, Any, Any]]:
    """:func:`projected_grads` for a build: ``fn(params, batch) -> (rows [b, k], norms [b],
    finite [b] bool)``, the rows' norms (as :func:`tracinfunc._norms.row_norms`) and
    finiteness computed in the same compiled program, so the build loop does no pass over
    the rows of its own."""
    return _held_programs(loss, projection, mapping, False, chunk_size, checks=True)


def _held_programs(loss, projection, mapping, has_aux, chunk_size, *, checks: bool):
    held: dict[Any, Callable] = {}  # this function's programs by parameter structure

    def program_for(params: Any) -> Callable[[Any, tuple, Any], Any]:
        """The compiled ``program(params, state_args, batch)`` for trees shaped like
        ``params`` (JAX arrays): what a build calls per batch, skipping the conversions
        and checks of ``projected_grads_fn``."""
        leaves, treedef = tree_util.tree_flatten(params)
        key = (treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves))
        if key not in held:
            mapped = mapping or ParamMapping.identity(params)
            project = _projector(projection, mapped, jnp.result_type(*leaves))
            held[key] = partial(_program(loss, has_aux, chunk_size, mapped, project, checks),
                                project.blocks)
        return held[key]

    def projected_grads_fn(params: Any, *args: Any) -> Any:
        params, args = as_jax_tree(params), as_jax_tree(_check_args(args))
        return program_for(params)(params, args[:-1], args[-1])

    projected_grads_fn.program_for = program_for
    return projected_grads_fn


def torch_layout_grads(loss: Callable, mapping: ParamMapping, chunk_size: int | None
                       ) -> Callable[..., dict[str, jax.Array]]:
    """``fn(*args, batch) -> {torch name: [b, *torch shape]}``: per-example gradients mapped
    to torch names and layout in one compiled program, held as long as ``loss`` is (a dense
    curvature's rows, fitted or preconditioned, call it once per batch and checkpoint)."""
    def make() -> Callable:
        one = jax.grad(weakly(loss))

        def program(params, args, batch):
            return jax.vmap(mapping.to_torch)(_batched(one, chunk_size, params, args, batch))
        return float32_jit(program)

    compiled = _held(loss, ("torch layout", chunk_size, mapping), make)

    def torch_layout_grads_fn(params: Any, *args: Any, _loss: Callable = loss
                              ) -> dict[str, jax.Array]:
        params, args = as_jax_tree(params), as_jax_tree(_check_args(args))
        return compiled(params, args[:-1], args[-1])

    return torch_layout_grads_fn


def weakly(fn: Callable) -> Callable:
    """``fn`` called through a weak reference (``fn`` itself when it has none).

    Programs are cached under their loss as a weak key; a program that referenced the loss
    strongly would keep its own key alive and never be freed. Every function handed to a
    user keeps its loss alive itself, so a held program can always trace it again. A bound
    method is referenced through its object (``weakref.WeakMethod``): the method object
    itself is made anew at every attribute access.
    """
    try:
        ref = weakref.WeakMethod(fn) if inspect.ismethod(fn) else weakref.ref(fn)
    except TypeError:
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        return ref()(*args, **kwargs)

    return call


def held_slot(cache: weakref.WeakKeyDictionary, fn: Callable) -> dict | None:
    """The dict ``cache`` keeps for ``fn`` while ``fn`` lives, or ``None``: nothing is kept
    across calls for it.

    Only plain functions and ``functools.partial`` objects are kept. A callable object or a
    bound method reads attributes that can change between calls without changing its
    identity, so a program traced from it is never reused by a later call (it is traced
    again, as a new function would be).
    """
    if not isinstance(fn, types.FunctionType | functools.partial):
        return None
    try:
        return cache.setdefault(fn, {})
    except TypeError:
        return None


def _held(loss: Callable, key: Any, make: Callable[[], Callable]) -> Callable:
    """The program ``make()`` built for ``loss`` and ``key``, made once and kept as long as
    ``loss`` lives (a loss that cannot be weakly referenced gets a new one each time).
    ``make`` must reach the loss only through :func:`weakly`."""
    programs = held_slot(_PROGRAMS, loss)
    if programs is None:
        return make()
    if key not in programs:
        programs[key] = make()
    return programs[key]


def row_norms(rows: jax.Array) -> jax.Array:
    """``[..., k] -> [...]`` Euclidean norms of rows rescaled by a power of two near their
    largest entry (exact, so no underflow or overflow), as :func:`tracinfunc._norms.row_norms`
    computes them in torch (equal up to the summation order).

    The power of two ``2**e`` and its inverse are built from the peak's exponent bits (a few
    integer ops; ``frexp`` compiles to many), with ``e`` kept where both are normal numbers:
    XLA on the CPU flushes subnormals to zero, so dividing by ``2**127`` (a subnormal
    reciprocal) would give 0.
    """
    info = jnp.finfo(rows.dtype)
    as_int = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[rows.dtype.itemsize]
    bias, mantissa = info.maxexp - 1, info.nmant  # float32: 127, 23
    peak = jnp.max(jnp.abs(rows), axis=-1, keepdims=True)  # [..., 1]; NaN propagates
    exponent = (lax.bitcast_convert_type(peak, as_int) >> mantissa) & (2 * bias + 1)
    exponent = jnp.clip(exponent, 1, 2 * bias - 1).astype(as_int)
    scale = lax.bitcast_convert_type(exponent << mantissa, rows.dtype)  # 2**(e - bias)
    inverse = lax.bitcast_convert_type((2 * bias - exponent) << mantissa, rows.dtype)
    return jnp.sqrt(jnp.sum(jnp.square(rows * inverse), axis=-1)) * scale[..., 0]


def as_jax_tree(tree: Any) -> Any:
    """``tree`` with torch tensors imported through DLPack and other arrays as jax.Array."""
    def convert(leaf):
        if isinstance(leaf, torch.Tensor):
            return to_framework(leaf, "jax")
        return leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf)

    return tree_util.tree_map(convert, tree)


# Programs compiled for a loss live as long as the loss does (a weak key): a second
# build_store with the same loss reuses them; a dropped loss frees them.
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PROJECTORS: OrderedDict = OrderedDict()  # a few recent projectors' blocks, reused across calls
_PROJECTOR_CACHE = 8
_IN_MAPPING_ORDER = "<all weights, in mapping order>"  # the key of a reordered stacked matrix


def _program(loss: Callable, has_aux: bool, chunk_size: int | None, mapping: ParamMapping,
             project: Projector, checks: bool = False) -> Callable:
    """``jit(fn(blocks, params, args, batch) -> [b, k])``, one per loss and static settings
    (``-> (rows, norms [b], finite [b])`` with ``checks``)."""
    key = (has_aux, chunk_size, mapping, project.plan.projection, project.layout,
           str(project.dtype), frozenset(project.blocks), checks)
    return _held(loss, key, partial(_make_program, loss, has_aux, chunk_size, mapping, project,
                                    checks))


def _make_program(loss: Callable, has_aux: bool, chunk_size: int | None,
                  mapping: ParamMapping, project: Projector, checks: bool) -> Callable:
    project = copy.copy(project)  # the program holds the rules, never the blocks: they
    project.blocks = {}  # are arguments, and the cache must not keep gigabytes alive
    loss = weakly(loss)  # cached under the loss: never keep it alive

    def one_example(blocks, params, *args_example):
        out = jax.grad(loss, has_aux=has_aux)(params, *args_example)
        grads, aux = out if has_aux else (out, None)
        if _IN_MAPPING_ORDER in blocks:  # the gradients as they come, no transposes
            leaves = mapping._leaves_of(grads)
            dtype = jnp.result_type(*leaves)
            flat = jnp.concatenate([jnp.ravel(leaf).astype(dtype) for leaf in leaves])
            rows = jnp.matmul(flat, blocks[_IN_MAPPING_ORDER], precision=lax.Precision.HIGHEST)
            rows = rows * jnp.asarray(project.plan.scale, dtype)
        else:
            rows = project.apply(blocks, mapping.to_torch(grads))
        return (rows, aux) if has_aux else rows

    def batched(blocks, params, args, batch):
        rows = _batched(partial(one_example, blocks), chunk_size, params, args, batch)
        if not checks:
            return rows
        norms = row_norms(rows)  # NaN/inf in a row make its norm NaN/inf: the flag
        return rows, norms, jnp.isfinite(norms)

    return float32_jit(batched)


def _projector(projection: Projection, mapping: ParamMapping, dtype: Any) -> Projector:
    """``make_projector`` with its blocks kept for the next few calls with the same spec.

    When the Rademacher blocks are stacked into one ``[p, k]`` matrix, its rows are put in
    the mapping's leaf order and JAX layouts once (``Projector._reordered``), so the
    program multiplies the gradients as ``jax.grad`` returns them: a Flax kernel's
    transpose to torch layout would otherwise run for every example (the same product,
    only the float summation order differs).
    """
    key = (projection, mapping, str(jnp.dtype(dtype)))
    if key in _PROJECTORS:
        _PROJECTORS.move_to_end(key)
        return _PROJECTORS[key]
    project = make_projector(projection, mapping.layout, dtype=dtype)
    reordered = project._reordered([(leaf.name, leaf.axes) for leaf in mapping.leaves])
    if reordered is not None:
        project.blocks = {_IN_MAPPING_ORDER: reordered}  # the only copy kept
    _PROJECTORS[key] = project
    while len(_PROJECTORS) > _PROJECTOR_CACHE:
        _PROJECTORS.popitem(last=False)
    return project


def _batched(one: Callable, chunk_size: int | None, params: Any, args: tuple, batch: Any
             ) -> Any:
    """``vmap(one)`` over ``batch``; with ``chunk_size``, ``lax.map`` over padded chunks."""
    vmapped = jax.vmap(lambda example: one(params, *args, example))
    b = tree_util.tree_leaves(batch)[0].shape[0]
    if chunk_size is None or chunk_size >= b:
        return vmapped(batch)
    n_chunks = -(-b // chunk_size)
    chunks = tree_util.tree_map(
        lambda leaf: pad_rows(leaf, n_chunks * chunk_size).reshape(
            n_chunks, chunk_size, *leaf.shape[1:]), batch)
    out = lax.map(vmapped, chunks)
    return tree_util.tree_map(lambda leaf: leaf.reshape(-1, *leaf.shape[2:])[:b], out)


def pad_rows(leaf: jax.Array, size: int) -> jax.Array:
    """``leaf`` ``[b, ...]`` padded to ``[size, ...]`` by repeating its last row (a real
    example, so the padding never produces NaN); the padded rows' results are dropped."""
    extra = size - leaf.shape[0]
    if extra <= 0:
        return leaf
    return jnp.concatenate([leaf, jnp.repeat(leaf[-1:], extra, axis=0)])


def _check_args(args: tuple) -> tuple:
    """``(batch,)`` or ``(state, batch)``: a batch of arrays with a leading dimension last."""
    if not args:
        raise InvalidArgumentError(
            f"{current_caller('tracinfunc.jax')}: call fn(params, batch) (or fn(params, "
            "state, batch) for a loss that takes state), got no batch."
        )
    leaves = tree_util.tree_leaves(args[-1])
    if not leaves or any(getattr(leaf, "ndim", 0) == 0 for leaf in leaves):
        raise InvalidArgumentError(
            f"{current_caller('tracinfunc.jax')}: a batch must be a pytree of arrays with a "
            "leading batch dimension, got leaf shapes "
            f"{[list(getattr(leaf, 'shape', ())) for leaf in leaves]}."
        )
    if len({leaf.shape[0] for leaf in leaves}) != 1:
        raise InvalidArgumentError(
            f"{current_caller('tracinfunc.jax')}: all arrays of a batch need the same leading "
            f"(batch) dimension, got shapes {[list(leaf.shape) for leaf in leaves]}."
        )
    return args
