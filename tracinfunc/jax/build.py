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
from tracinfunc._version import __version__
from tracinfunc.build import _check_finite
from tracinfunc.errors import (
    EmptyDataError,
    IncompatibleGradientsError,
    InvalidArgumentError,
    InvalidTypeError,
    LossFunctionError,
)
from tracinfunc.interop import as_tensor
from tracinfunc.jax.grads import as_jax_tree, projected_grads
from tracinfunc.jax.layout import ParamMapping
from tracinfunc.progress import ProgressArg, progress_bar
from tracinfunc.projection import Projection
from tracinfunc.store.base import GradientStore
from tracinfunc.store.meta import CheckpointMeta, StoreMeta, dtype_name
from tracinfunc.store.writer import StoreTarget, make_writer

__all__ = ["Checkpoint", "build_store"]


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

    def __post_init__(self) -> None:
        if isinstance(self.lr, bool) or not isinstance(self.lr, int | float) or not (
                math.isfinite(self.lr)):
            raise InvalidTypeError(f"tracinfunc.jax.Checkpoint: lr must be a finite number, got "
                            f"{self.lr!r}.")
        if self.name is not None and not isinstance(self.name, str):
            raise InvalidTypeError(f"tracinfunc.jax.Checkpoint: name must be a str or None, got "
                            f"{self.name!r}.")
        object.__setattr__(self, "params", as_jax_tree(self.params))
        object.__setattr__(self, "lr", float(self.lr))

    def to_torch(self, mapping: ParamMapping | None = None) -> torch_checkpoint.Checkpoint:
        """The torch :class:`tracinfunc.Checkpoint` with the same weights in torch layout.

        Tensors share memory with the JAX arrays where no transpose was needed; its
        fingerprint is the one a store built from this checkpoint records.
        """
        mapping = mapping or ParamMapping.identity(self.params)
        params = {name: as_tensor(value, caller="Checkpoint.to_torch")
                  for name, value in mapping.to_torch(self.params).items()}
        return torch_checkpoint.Checkpoint(params=params, lr=self.lr, name=self.name)


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
        dtype: Storage dtype (torch dtype or its name): float32, float16, bfloat16, float64.
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
    if not isinstance(projection, Projection):
        raise InvalidTypeError(
            "tracinfunc.jax.build_store: projection must be a tracinfunc.Projection, got "
            f"{type(projection).__name__}; e.g. projection=Projection(dim=512, seed=0)."
        )
    mapping = mapping or ParamMapping.identity(checkpoints[0].params)
    meta = _initial_meta(checkpoints, mapping, projection, _storage_dtype(dtype),
                         dataset_fingerprint)
    grads_fn = projected_grads(loss, projection, mapping=mapping, chunk_size=chunk_size)
    writer = make_writer(store, meta, caller="tracinfunc.jax.build_store")
    resume_at = writer.rows_written  # > 0 when resuming an interrupted Zarr build
    seen = 0
    bar = progress_bar(progress, total=None, desc="jax.build_store", unit="ex")
    bar.update(resume_at)
    for batch in iter_batches(data):
        b = tree_util.tree_leaves(batch)[0].shape[0]
        seen += b
        if b == 0 or seen <= resume_at:  # stored before the interruption: no gradients
            continue
        if writer.rows_written == resume_at:
            _check_loss(loss, checkpoints[0].params, batch)
        rows = jnp.stack([grads_fn(ckpt.params, batch) for ckpt in checkpoints])  # [n_ckpt,b,k]
        # A batch straddling the resume point is computed whole, as in the first build, and
        # its already-stored head dropped, so the kept rows are the same bits.
        rows = rows[:, max(0, resume_at - (seen - b)) :]
        rows_t = as_tensor(rows, caller="tracinfunc.jax.build_store")
        _check_finite(rows_t, meta, first_row=writer.rows_written)
        writer.append(rows_t, as_tensor(jnp.linalg.norm(rows, axis=-1)))
        bar.update(rows.shape[1])
    bar.close()
    if seen < resume_at:
        raise EmptyDataError(
            f"tracinfunc.jax.build_store: the incomplete store already holds {resume_at} rows "
            f"but data has only {seen}; resume with the same data as the interrupted build."
        )
    if writer.rows_written == 0:
        raise EmptyDataError(
            "tracinfunc.jax.build_store: data holds no examples; pass a non-empty batch or an "
            "iterable of batches (arrays, or tuples/dicts of arrays)."
        )
    return writer.finish()


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


def _storage_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    try:
        return getattr(torch, name)
    except AttributeError:
        raise InvalidArgumentError(
            f"tracinfunc.jax.build_store: unsupported storage dtype {dtype!r}; use float32, "
            "float16, bfloat16 or float64."
        ) from None


def _check_checkpoints(checkpoints: Sequence[Checkpoint]) -> list[Checkpoint]:
    if isinstance(checkpoints, Checkpoint):
        checkpoints = [checkpoints]
    checkpoints = list(checkpoints)
    if not checkpoints or not all(isinstance(c, Checkpoint) for c in checkpoints):
        raise InvalidTypeError(
            "tracinfunc.jax.build_store: checkpoints must be a non-empty sequence of "
            "tracinfunc.jax.Checkpoint; e.g. [Checkpoint(params, lr=0.1, name='epoch-1')]."
        )
    structures = {tree_util.tree_structure(c.params) for c in checkpoints}
    shapes = {tuple(x.shape for x in tree_util.tree_leaves(c.params)) for c in checkpoints}
    if len(structures) > 1 or len(shapes) > 1:
        raise IncompatibleGradientsError(
            "tracinfunc.jax.build_store: checkpoints differ in parameter structure or shapes; "
            "all checkpoints must be snapshots of the same model."
        )
    return checkpoints


def _initial_meta(checkpoints, mapping, projection, dtype, dataset_fingerprint) -> StoreMeta:
    names = [c.name or f"checkpoint-{i}" for i, c in enumerate(checkpoints)]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(
            f"tracinfunc.jax.build_store: checkpoint names must be distinct, got {names}.")
    return StoreMeta(
        projection=projection,
        checkpoints=tuple(
            CheckpointMeta(name, c.lr, c.to_torch(mapping).fingerprint)
            for name, c in zip(names, checkpoints, strict=True)
        ),
        layout=mapping.layout,
        n_train=0,
        k=projection.output_dim(mapping.layout),
        dtype=dtype_name(dtype),
        complete=False,
        library_version=__version__,
        dataset_fingerprint=dataset_fingerprint,
    )


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
