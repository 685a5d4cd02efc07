"""build_store from JAX: the same store, metadata and checks as :func:`tracinfunc.build_store`.

Rows are projected with the torch path's matrices in torch names and layout (through a
:class:`~tracinfunc.jax.layout.ParamMapping`), and the checkpoint fingerprints hash the
torch-layout weights, so a store written here is scored by torch code against torch-made
test gradients (and vice versa) whenever the weights are the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import tree_util

from tracinfunc import checkpoint as torch_checkpoint
from tracinfunc._validate import entry_point
from tracinfunc.build.loop import checkpoint_list, fill_store, new_store_meta
from tracinfunc.errors import (
    IncompatibleGradientsError,
    InvalidArgumentError,
    InvalidTypeError,
    LossFunctionError,
)
from tracinfunc.interop import as_tensor
from tracinfunc.jax.grads import as_jax_tree, projected_grads
from tracinfunc.jax.layout import ParamMapping
from tracinfunc.progress import ProgressArg
from tracinfunc.projection import Projection
from tracinfunc.projection.spec import check_projection
from tracinfunc.store.meta import QUANTIZATIONS, check_lr
from tracinfunc.store.protocols import GradientStore
from tracinfunc.store.writer import StoreTarget, make_writer

__all__ = ["Checkpoint", "build_store"]

_CALLER = "tracinfunc.jax.build_store"


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """One JAX model snapshot ``w_c`` (any parameter pytree) and its TracIn weight ``lr_c``.

    Args:
        params: The parameter tree (a Flax ``variables["params"]``, an Equinox array
            partition, a dict); it is not copied (JAX arrays are immutable).
        lr: The checkpoint's weight in the TracIn sum.
        name: A label for store metadata (``"checkpoint-<i>"`` when ``None``).
    """

    params: Any
    lr: float = 1.0
    name: str | None = None

    @entry_point("tracinfunc.jax.Checkpoint")
    def __post_init__(self) -> None:
        lr = check_lr(self.lr)
        if self.name is not None and not isinstance(self.name, str):
            raise InvalidTypeError(f"tracinfunc.jax.Checkpoint: name must be a str or None, got "
                            f"{self.name!r}.")
        object.__setattr__(self, "params", as_jax_tree(self.params))
        object.__setattr__(self, "lr", lr)

    @entry_point("Checkpoint.to_torch")
    def to_torch(self, mapping: ParamMapping | None = None) -> torch_checkpoint.Checkpoint:
        """The torch :class:`tracinfunc.Checkpoint` with the same weights in torch layout.

        Tensors share memory with the JAX arrays where no transpose was needed; its
        fingerprint is the one a store built from this checkpoint records.
        """
        mapping = mapping or ParamMapping.identity(self.params)
        params = {name: as_tensor(value)
                  for name, value in mapping.to_torch(self.params).items()}
        return torch_checkpoint.Checkpoint(params=params, lr=self.lr, name=self.name)


@entry_point("tracinfunc.jax.build_store")
def build_store(
    loss: Any,
    checkpoints: Sequence[Checkpoint],
    data: Any,
    *,
    projection: Projection,
    mapping: ParamMapping | None = None,
    chunk_size: int | None = None,
    dtype: Any = torch.float32,
    store: StoreTarget = None,
    dataset_fingerprint: str | None = None,
    progress: ProgressArg = None,
) -> GradientStore:
    """Projected per-example gradients of a JAX loss at every checkpoint, into a store.

    Args:
        loss: ``loss(params, example) -> scalar`` in JAX, one example (no batch dimension).
        checkpoints: :class:`Checkpoint` values (``n_ckpt`` of them), same tree structure.
        data: One batch (an array or a tuple/dict of arrays with a leading batch dimension:
            JAX, NumPy or torch) or an iterable of batches.
        projection: The spec, e.g. ``Projection(dim=512, seed=0)`` or ``store.projection``.
        mapping: Tree -> torch names/shapes (default ``ParamMapping.identity``; Flax:
            ``ParamMapping.flax(params)``). The store's layout is the mapped one.
        chunk_size: Examples differentiated at once inside vmap.
        dtype: Storage dtype (torch dtype or its name): float32, float16, bfloat16, float64;
            or quantised, ``"int8"`` (``torch.int8``) or ``"sign"``, as for
            :func:`tracinfunc.build_store`.
        store: Where to write, exactly as :func:`tracinfunc.build_store`: ``None`` or
            ``"memory"``, ``"pinned"``, a path such as ``"grads.zarr"`` (the same Zarr
            format, metadata and checksums; an interrupted build resumes bit-identically
            when called again with the same arguments), or a writer factory
            ``meta -> writer``.
        dataset_fingerprint: Optional identifier of the data, recorded in the metadata.
        progress: A progress bar over examples, as in :func:`tracinfunc.build_store`.

    Returns:
        The finished, read-only store (``[n_ckpt, n_train, k]``), readable by torch code.

    Raises:
        EmptyDataError, LossFunctionError, NonFiniteGradientError,
        IncompatibleGradientsError: as :func:`tracinfunc.build_store`.
    """
    checkpoints = _check_checkpoints(checkpoints)
    check_projection(projection)
    mapping = mapping or ParamMapping.identity(checkpoints[0].params)
    meta = new_store_meta(
        [(c.name, c.lr, c.to_torch(mapping).fingerprint) for c in checkpoints],
        mapping.layout, projection, _storage_dtype(dtype), dataset_fingerprint)
    grads_fns = [projected_grads(loss, projection.for_checkpoint(c.name), mapping=mapping,
                                 chunk_size=chunk_size) for c in meta.checkpoints]
    writer = make_writer(store, meta)

    def rows_of(batch: Any) -> torch.Tensor:  # [n_ckpt, b, k]
        rows = jnp.stack([grads_fn(ckpt.params, batch)
                          for grads_fn, ckpt in zip(grads_fns, checkpoints, strict=True)])
        return as_tensor(rows)

    batches = ((tree_util.tree_leaves(batch)[0].shape[0], batch) for batch in iter_batches(data))
    return fill_store(writer, batches, rows_of, meta=meta,
                      check_first=lambda batch: _check_loss(loss, checkpoints[0].params, batch),
                      progress=progress)


def iter_batches(data: Any) -> Iterator[Any]:
    """One batch (array, tuple or dict of arrays) or each batch of an iterable, as JAX trees."""
    one = isinstance(data, tuple | Mapping | np.ndarray | jax.Array | torch.Tensor)
    if not one and not isinstance(data, Iterable):
        raise InvalidTypeError(
            "tracinfunc.jax.build_store: data must be a batch (an array, a tuple or dict of "
            f"arrays) or an iterable of batches, got {type(data).__name__}."
        )
    for batch in [data] if one else data:
        batch = as_jax_tree(batch)
        sizes = {leaf.shape[0] if leaf.ndim else None for leaf in tree_util.tree_leaves(batch)}
        if len(sizes) != 1 or None in sizes:
            raise InvalidArgumentError(
                "tracinfunc.jax.build_store: all arrays of a batch need the same leading "
                f"(batch) dimension, got shapes "
                f"{[list(x.shape) for x in tree_util.tree_leaves(batch)]}."
            )
        yield batch


def _storage_dtype(dtype: Any) -> torch.dtype | str:
    """A torch dtype, or a quantised storage's name (new_store_meta checks which are stored)."""
    if isinstance(dtype, torch.dtype) or (isinstance(dtype, str) and dtype in QUANTIZATIONS):
        return dtype
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    result = getattr(torch, name, None)  # torch.sign is a function, not a dtype
    if not isinstance(result, torch.dtype):
        raise InvalidArgumentError(
            f"tracinfunc.jax.build_store: unsupported storage dtype {dtype!r}; use float32, "
            "float16, bfloat16 or float64, or 'int8' or 'sign' for quantised rows."
        )
    return result


def _check_checkpoints(checkpoints: Sequence[Checkpoint]) -> list[Checkpoint]:
    checkpoints = checkpoint_list(checkpoints, Checkpoint, name="tracinfunc.jax.Checkpoint")
    structures = {tree_util.tree_structure(c.params) for c in checkpoints}
    shapes = {tuple(x.shape for x in tree_util.tree_leaves(c.params)) for c in checkpoints}
    if len(structures) > 1 or len(shapes) > 1:
        raise IncompatibleGradientsError(
            "tracinfunc.jax.build_store: checkpoints differ in parameter structure or shapes; "
            "all checkpoints must be snapshots of the same model."
        )
    return checkpoints


def _check_loss(loss: Any, params: Any, batch: Any) -> None:
    """Evaluate the loss on the first example, so mistakes fail before any real work."""
    example = tree_util.tree_map(lambda leaf: leaf[0], batch)
    try:
        value = loss(params, example)
    except Exception as error:
        raise LossFunctionError(
            f"tracinfunc.jax.build_store: loss(params, example) failed on the first example "
            f"with {type(error).__name__}: {error}. Check that the loss takes the checkpoint's "
            "parameter tree and one example without a batch dimension."
        ) from error
    if not hasattr(value, "shape") or math.prod(value.shape) != 1:
        got = list(value.shape) if hasattr(value, "shape") else type(value).__name__
        raise LossFunctionError(
            f"tracinfunc.jax.build_store: loss(params, example) must return a scalar, got "
            f"{got}; reduce it (e.g. with .sum()) for one example."
        )
