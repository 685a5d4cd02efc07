"""build_store from JAX: the same store, metadata and checks as :func:`tracinfunc.build_store`.

Rows are projected with the torch path's matrices in torch names and layout (through a
:class:`~tracinfunc.jax.layout.ParamMapping`), and the checkpoint fingerprints hash the
torch-layout weights, so a store written here is scored by torch code against torch-made
test gradients (and vice versa) whenever the weights are the same.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import tree_util
from torch.utils.data import DataLoader

from tracinfunc import checkpoint as torch_checkpoint
from tracinfunc._validate import calling, current_caller, entry_point
from tracinfunc.batches import check_ordered, expected_rows
from tracinfunc.build.calls import CallSite, numbered
from tracinfunc.build.loop import RowBlock, checkpoint_list, fill_store, new_store_meta
from tracinfunc.errors import (
    IncompatibleGradientsError,
    InvalidArgumentError,
    InvalidTypeError,
    LossFunctionError,
)
from tracinfunc.interop import as_tensor
from tracinfunc.jax.grads import as_jax_tree, checked_projected_grads, held_slot, pad_rows
from tracinfunc.jax.layout import ParamMapping, path_name
from tracinfunc.jax.precision import float32_matmuls
from tracinfunc.jax.state import (
    is_nnx_module,
    refuse_params_in_state,
    refuse_state,
    split_params,
)
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
    """One JAX model snapshot ``w_c`` (a parameter pytree), its state and TracIn weight ``lr_c``.

    Args:
        params: The parameter tree (a Flax ``variables["params"]``, the ``nnx.Param`` state of
            an NNX model, an Equinox array partition, a dict); it is not copied (JAX arrays
            are immutable). It must hold parameters only: a tree holding Flax state
            (``batch_stats``, ``nnx.BatchStat``) is refused with the fix.
        lr: The checkpoint's weight in the TracIn sum: a real scalar of any framework
            (``0.1``, ``np.float32(0.1)``, an optax ``schedule(step)``).
        name: A label for store metadata (``"checkpoint-<i>"`` when ``None``).
        state: This snapshot's non-trainable state (BatchNorm statistics), any pytree, or
            ``None``. With state, the loss is called ``loss(params, state, example)`` and
            only ``params`` is differentiated, so each checkpoint is differentiated with its
            own statistics (as torch checkpoints carry their buffers).
    """

    params: Any
    lr: float = 1.0
    name: str | None = None
    state: Any = None
    # Fingerprints by mapping, kept when the arrays are JAX's own (immutable): a store built
    # again from this checkpoint skips re-hashing its weights. Arrays that came from torch
    # share the tensor's memory, which can change in place, so theirs are never kept.
    _fingerprints: dict = field(default_factory=dict, init=False, repr=False)

    @entry_point("tracinfunc.jax.Checkpoint")
    def __post_init__(self) -> None:
        lr = check_lr(self.lr)
        if any(isinstance(leaf, torch.Tensor)
               for leaf in tree_util.tree_leaves((self.params, self.state))):
            object.__setattr__(self, "_fingerprints", None)
        if self.name is not None and not isinstance(self.name, str):
            raise InvalidTypeError(f"tracinfunc.jax.Checkpoint: name must be a str or None, got "
                            f"{self.name!r}.")
        with calling("tracinfunc.jax.Checkpoint"):
            refuse_state(self.params)
            if self.state is not None:
                refuse_params_in_state(self.state)
        if self.state is not None and is_nnx_module(self.state):
            raise InvalidTypeError(
                "tracinfunc.jax.Checkpoint: state must be a pytree of arrays (the nnx.State "
                "of non-Param variables), got an nnx.Module; use "
                "tracinfunc.jax.Checkpoint.flax(model, lr=...)."
            )
        object.__setattr__(self, "params", as_jax_tree(self.params))
        _refuse_integer_leaves(self.params)
        if self.state is not None:
            object.__setattr__(self, "state", as_jax_tree(self.state))
        object.__setattr__(self, "lr", lr)

    @classmethod
    @entry_point("tracinfunc.jax.Checkpoint.flax")
    def flax(cls, model: Any, *, lr: Any = 1.0, name: str | None = None) -> Checkpoint:
        """A checkpoint of a Flax model: its parameters differentiated, the rest as state.

        Args:
            model: Linen ``variables`` (``{"params": ..., "batch_stats": ...}``), an NNX
                ``Module`` or an NNX ``State``.
            lr, name: As for :class:`Checkpoint`.

        Returns:
            ``Checkpoint(params, lr, name, state)``: linen ``variables["params"]`` and the other
            collections; NNX ``nnx.split(model, nnx.Param, ...)``'s two states (``state`` is
            ``None`` when there is nothing but parameters).
        """
        params, state = split_params(model)
        return cls(params, lr=lr, name=name, state=state)

    @property
    def args(self) -> tuple[Any, ...]:
        """The loss's leading arguments: ``(params,)``, or ``(params, state)`` with state."""
        return (self.params,) if self.state is None else (self.params, self.state)

    def _fingerprint(self, mapping: ParamMapping) -> str:
        """The fingerprint a store built from this checkpoint with ``mapping`` records."""
        cached = self._fingerprints
        if cached is not None and mapping in cached:
            return cached[mapping]
        value = self.to_torch(mapping).fingerprint
        if cached is not None:
            cached[mapping] = value
        return value

    @entry_point("Checkpoint.to_torch")
    def to_torch(self, mapping: ParamMapping | None = None) -> torch_checkpoint.Checkpoint:
        """The torch :class:`tracinfunc.Checkpoint` with the same weights in torch layout.

        Tensors share memory with the JAX arrays where no transpose was needed; floating
        state leaves become its buffers (``"state/<path>"``). Its fingerprint is the one a
        store built from this checkpoint records.
        """
        mapping = mapping or ParamMapping.identity(self.params)
        params = {name: host_tensor(value)
                  for name, value in mapping.to_torch(self.params).items()}
        buffers = {f"state/{path_name(path)}": host_tensor(leaf)
                   for path, leaf in tree_util.tree_flatten_with_path(self.state)[0]
                   if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating)}
        return torch_checkpoint.Checkpoint(params=params, lr=self.lr, name=self.name,
                                           buffers=buffers)


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

    One XLA program is compiled per (loss, shapes, projection) and reused for every
    checkpoint, every batch (a smaller last batch is padded, never recompiled) and every
    later call with the same loss.

    Args:
        loss: ``loss(params, example) -> scalar`` in JAX, one example (no batch dimension);
            ``loss(params, state, example)`` when the checkpoints carry ``state``.
        checkpoints: :class:`Checkpoint` values (``n_ckpt`` of them), same tree structure.
        data: One batch (an array or a tuple/dict of arrays with a leading batch dimension:
            JAX, including arrays sharded over devices, NumPy or torch) or an iterable of
            batches.
        projection: The spec, e.g. ``Projection(dim=512, seed=0)`` or ``store.projection``.
        mapping: Tree -> torch names/shapes (default ``ParamMapping.identity``; Flax:
            ``ParamMapping.flax(variables)``). The store's layout is the mapped one.
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
    check_ordered(data)
    mapping = mapping or ParamMapping.identity(checkpoints[0].params)
    meta = new_store_meta(
        [(c.name, c.lr, c._fingerprint(mapping)) for c in checkpoints],
        mapping.layout, projection, _storage_dtype(dtype), dataset_fingerprint)
    same = not projection.per_checkpoint  # one function (one program, one projector) for all
    grads_fns = [checked_projected_grads(loss, projection.for_checkpoint(c.name),
                                         mapping=mapping, chunk_size=chunk_size)
                 for c in meta.checkpoints[:1 if same else None]]
    grads_fns = grads_fns * len(checkpoints) if same else grads_fns
    # Checkpoints share one structure (checked): each one's program is looked up once, and
    # batches (JAX trees from iter_batches) go straight to it.
    programs = [fn.program_for(c.params) for fn, c in zip(grads_fns, checkpoints, strict=True)]
    on_devices = device_check(checkpoints)  # before the writer: overwrite=True deletes
    writer = make_writer(store, meta)
    padded_to: list[int] = []  # the first batch's size: smaller batches are padded to it

    def rows_of(batch: Any) -> RowBlock:  # [n_ckpt, b, k], norms and flags [n_ckpt, b]
        b = _batch_size(batch)
        size = padded_to[0] if padded_to and b < padded_to[0] else b
        padded_to[:] = padded_to or [b]
        batch = tree_util.tree_map(lambda leaf: pad_rows(leaf, size), batch)
        # Dispatch every checkpoint before reading any (the programs run asynchronously),
        # then cut the padding on the host side: views, no device op.
        outs = [program(ckpt.params, ckpt.args[1:], batch)
                for program, ckpt in zip(programs, checkpoints, strict=True)]
        return RowBlock(*(torch.stack([host_tensor(out[part])[:b] for out in outs])
                          for part in range(3)))

    site = CallSite(rows_of)  # a failing call is named (batch index, data rows)
    pairs = site.follow(numbered(checked_devices(iter_batches(data), on_devices),
                                  merged=False, batch_size=None))
    return fill_store(writer, pairs, site, meta=meta,
                      check_first=lambda batch: _check_loss(loss, checkpoints[0], batch),
                      progress=progress, total=known_rows(data))


def host_tensor(array: Any) -> torch.Tensor:
    """A torch tensor of a JAX array: shared through DLPack, or gathered to the host first
    when the array is sharded over several devices (DLPack exports one buffer only; the
    gathered copy is made writable, as torch.from_numpy expects)."""
    if isinstance(array, jax.Array) and len(array.sharding.device_set) > 1:
        host = np.asarray(array)
        return torch.from_numpy(host if host.flags.writeable else host.copy())
    return as_tensor(array)


def _refuse_integer_leaves(params: Any) -> None:
    """Gradients need floating parameters; integer leaves (a step counter) belong in state."""
    bad = [f"{path_name(path)} ({jnp.asarray(leaf).dtype})"
           for path, leaf in tree_util.tree_flatten_with_path(params)[0]
           if not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.inexact)]
    if bad:
        raise InvalidTypeError(
            f"tracinfunc.jax.Checkpoint: the parameter leaves {bad} are not floating point; "
            "only floating leaves can be differentiated. Move them to state= (with "
            "loss(params, state, example)), or drop them from params (Equinox: "
            "eqx.partition(model, eqx.is_inexact_array))."
        )


def _batch_size(batch: Any) -> int:
    return tree_util.tree_leaves(batch)[0].shape[0]


def known_rows(data: Any) -> int | None:
    """Examples in ``data`` when cheap to know: one batch, or a list of batches (the progress
    bar's total; an in-memory store then writes its rows in place). ``None`` otherwise, or
    where a batch has no leading dimension (``iter_batches`` reports it)."""
    if isinstance(data, list):
        sizes = [known_rows(batch) for batch in data]
        return None if None in sizes else sum(sizes)
    if not isinstance(data, tuple | Mapping | np.ndarray | jax.Array | torch.Tensor):
        return expected_rows(data) if isinstance(data, DataLoader) else None
    leaves = tree_util.tree_leaves(data)
    shape = getattr(leaves[0], "shape", ()) if leaves else ()
    return int(shape[0]) if len(shape) else None


def iter_batches(data: Any) -> Iterator[Any]:
    """One batch (array, tuple or dict of arrays) or each batch of an iterable, as JAX trees."""
    one = isinstance(data, tuple | Mapping | np.ndarray | jax.Array | torch.Tensor)
    if not one and not isinstance(data, Iterable):
        raise InvalidTypeError(
            "tracinfunc.jax.build_store: data must be a batch (an array, a tuple or dict of "
            f"arrays) or an iterable of batches, got {type(data).__name__}."
        )
    for index, batch in enumerate([data] if one else data):
        batch = as_jax_tree(batch)
        _refuse_traced(batch, "data" if one else f"batch {index} of data")
        sizes = {leaf.shape[0] if leaf.ndim else None for leaf in tree_util.tree_leaves(batch)}
        if len(sizes) != 1 or None in sizes:
            raise InvalidArgumentError(
                "tracinfunc.jax.build_store: all arrays of a batch need the same leading "
                f"(batch) dimension, got shapes "
                f"{[list(x.shape) for x in tree_util.tree_leaves(batch)]} in "
                f"{'data' if one else f'batch {index} of data'}."
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


_PART = {"params": "parameter", "state": "state"}


def _refuse_traced(tree: Any, what: str) -> None:
    """Refuse traced values (``tree`` reached through ``jax.jit``, ``vmap`` or ``grad``): the
    builds and fits compile their own programs and write rows to the host, which a trace
    cannot do (a traced array has no values to write)."""
    if any(isinstance(leaf, jax.core.Tracer) for leaf in tree_util.tree_leaves(tree)):
        raise InvalidArgumentError(
            f"{current_caller()} was called inside jax.jit, jax.vmap or jax.grad ({what} "
            "holds traced values). It compiles its own programs and writes rows to the host, "
            "which a trace cannot do; call it outside the transformation, on concrete arrays.")


def _check_checkpoints(checkpoints: Sequence[Checkpoint]) -> list[Checkpoint]:
    checkpoints = checkpoint_list(checkpoints, Checkpoint, name="tracinfunc.jax.Checkpoint")
    # Inside jax.jit every array op is staged, concrete inputs or not: a new array is a tracer.
    _refuse_traced(jnp.zeros(()), "every array made in it")
    for index, checkpoint in enumerate(checkpoints):
        _refuse_traced((checkpoint.params, checkpoint.state), f"checkpoint {index}")
    for part in ("params", "state"):
        trees = [getattr(c, part) for c in checkpoints]
        structures = {tree_util.tree_structure(tree) for tree in trees}
        shapes = {tuple(x.shape for x in tree_util.tree_leaves(tree)) for tree in trees}
        if len(structures) > 1 or len(shapes) > 1:
            with_state = sum(c.state is not None for c in checkpoints)
            hint = (f"{with_state} of {len(checkpoints)} checkpoints carry state; give every "
                    "checkpoint its own state, or none" if part == "state" and
                    0 < with_state < len(checkpoints) else
                    "all checkpoints must be snapshots of the same model")
            raise IncompatibleGradientsError(
                f"tracinfunc.jax.build_store: checkpoints differ in {_PART[part]} structure or "
                f"shapes; {hint}."
            )
    return checkpoints


def device_check(checkpoints: Sequence[Checkpoint]) -> Callable[[Any, str], None]:
    """``check(batch, where)``: refuse arrays committed to different devices before a
    compiled program does; the checkpoints among themselves are checked at once.

    JAX runs a program on the devices its *committed* arguments live on (placed by an
    explicit ``jax.device_put(x, device)``, a sharding, or DLPack from a torch tensor, which
    keeps the tensor's device), in one order; uncommitted arrays (``jnp.asarray``) follow
    them. Committed arguments on two device lists fail inside the program, where the error
    would read as the loss failing on the batch. Every checkpoint's rows of a batch are
    also stacked into one block, so the checkpoints share their devices too. The
    checkpoints' leaves are read once; a batch costs a few attribute reads per leaf, no
    device work. ``where`` names the batch (``"batch 3"``: its index in the data).

    Raises:
        InvalidArgumentError: the checkpoints' arrays are committed to different devices.
    """
    parts = [(f"checkpoint {c.name or f'checkpoint-{i}'!r}"
              + (" state" if part == "state" else ""), tree)
             for i, c in enumerate(checkpoints)
             for part, tree in (("params", c.params), ("state", c.state))]
    known = _placed(parts, {})
    _refuse_placed(known, "the checkpoints' rows of each batch are computed and stacked "
                   "together")

    def check(batch: Any, where: str) -> None:
        _refuse_placed(_placed([(f"{where} of data", batch)], dict(known)),
                       "a JAX program runs on one device list, in one order")

    return check


def _refuse_placed(placed: dict[tuple, tuple[str, str]], why: str) -> None:
    if len(placed) < 2:
        return
    found = "; ".join(f"{what} on {', '.join(map(str, devices))}"
                      + (f" ({leaf})" if leaf else "")
                      for devices, (what, leaf) in placed.items())
    raise InvalidArgumentError(
        f"{current_caller('tracinfunc.jax.build_store')}: arrays are committed to different "
        f"devices ({found}); {why}. Put them on the same device(s): "
        "jax.device_put(checkpoint.params, device), jax.device_put(checkpoint.state, device) "
        "or jax.device_put(batch, device) (arrays converted from torch tensors stay on the "
        "tensor's device), or pass uncommitted arrays (jnp.asarray), which follow the "
        "committed ones."
    )


def _placed(parts: list[tuple[str, Any]], placed: dict) -> dict[tuple, tuple[str, str]]:
    """``placed`` updated with ``{device list: (part, leaf path)}`` of the first committed
    array of each part on each device list."""
    for what, tree in parts:
        for path, leaf in tree_util.tree_flatten_with_path(tree)[0]:
            if isinstance(leaf, jax.Array) and leaf.committed:
                placed.setdefault(_device_list(leaf), (what, path_name(path)))
    return placed


def _device_list(array: jax.Array) -> tuple:
    """The devices an array's program must run on, in the sharding's order (JAX compares
    the order too); the sorted set where a sharding does not expose it."""
    order = getattr(array.sharding, "_device_assignment", None)
    if order is None:
        order = sorted(array.sharding.device_set, key=lambda device: device.id)
    return tuple(order)


def checked_devices(batches: Iterable[Any], check: Callable[[Any, str], None]
                    ) -> Iterator[Any]:
    """``batches``, each passed to ``check`` (a :func:`device_check`) as it is handed on,
    named by its index in the data."""
    for index, batch in enumerate(batches):
        check(batch, f"batch {index}")
        yield batch


def _check_loss(loss: Any, checkpoint: Checkpoint, batch: Any) -> None:
    """Trace the loss on the first example (no compilation, no computation), so mistakes
    fail before any real work. A loss that passed for the same argument shapes and dtypes
    passes again without tracing (each trace costs milliseconds per build)."""
    example = tree_util.tree_map(lambda leaf: leaf[0], batch)
    signature = tuple(
        (tree_util.tree_structure(tree),
         tuple((leaf.shape, leaf.dtype) for leaf in tree_util.tree_leaves(tree)))
        for tree in (*checkpoint.args, example))
    passed = held_slot(_CHECKED_LOSSES, loss)  # None: not weak-referenceable, always check
    if passed is not None and signature in passed:
        return
    _trace_loss(loss, checkpoint, example)
    if passed is not None:
        passed[signature] = True


# Losses whose trace passed, by argument signature; a dropped loss drops its entry.
_CHECKED_LOSSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _trace_loss(loss: Any, checkpoint: Checkpoint, example: Any) -> None:
    call = ("loss(params, state, example)" if checkpoint.state is not None else
            "loss(params, example)")
    try:
        with float32_matmuls():  # traced as every program traces it (jax/precision.py)
            value = jax.eval_shape(loss, *checkpoint.args, example)
    except Exception as error:
        takes = ("the checkpoint's parameter tree, its state and one example" if
                 checkpoint.state is not None else
                 "the checkpoint's parameter tree and one example")
        raise LossFunctionError(
            f"tracinfunc.jax.build_store: {call} failed on the first example "
            f"with {type(error).__name__}: {error}. Check that the loss takes {takes} "
            "without a batch dimension."
        ) from error
    if not hasattr(value, "shape") or math.prod(value.shape) != 1:
        got = list(value.shape) if hasattr(value, "shape") else type(value).__name__
        raise LossFunctionError(
            f"tracinfunc.jax.build_store: {call} must return a scalar, got "
            f"{got}; reduce it (e.g. with .sum()) for one example."
        )
