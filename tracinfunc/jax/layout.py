"""Map a JAX parameter tree (Flax, Equinox, plain dicts) onto torch names and layouts.

A projection is keyed by parameter *name* and *shape*, and store metadata records the torch
layout, so JAX gradients must be named and shaped as the torch model's are before they are
projected. :class:`ParamMapping` is that bridge, a frozen value built once from a parameter
tree:

* ``ParamMapping.identity(tree)`` names each leaf by its path joined with ``"."``
  (``{"fc": {"weight": w}}`` -> ``"fc.weight"``; an Equinox model partitioned with
  ``eqx.partition(model, eqx.is_array)`` -> ``"layers.0.weight"``) and keeps shapes.
  Equinox ``Linear``/``Conv`` weights are already ``[out, in, ...]`` like torch's.
* ``ParamMapping.flax(variables)`` follows Flax's conventions: the ``"params"`` collection is
  dropped, ``nn.Sequential``'s ``layers_<i>`` becomes ``<i>``, ``kernel`` becomes ``weight``
  transposed to torch's layout (Dense ``[in, out]`` -> Linear ``[out, in]``; Conv
  ``[*spatial, in, out]`` -> ``[out, in, *spatial]``), LayerNorm/BatchNorm ``scale`` becomes
  ``weight`` and Embed ``embedding`` becomes ``weight``.

Either takes ``rename=`` (a dict or a function of the torch name) for names that differ.
Transposes are linear, so the gradient of the torch-layout leaf is the transposed gradient:
:meth:`ParamMapping.to_torch` applies equally to parameters and to per-example gradients.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax import tree_util

from tracinfunc._validate import current_caller, entry_point
from tracinfunc.errors import IncompatibleGradientsError, InvalidArgumentError, InvalidTypeError
from tracinfunc.interop import to_framework
from tracinfunc.jax.state import is_nnx_module, is_nnx_state, param_tree
from tracinfunc.projection import Layout, canonical_layout
from tracinfunc.store.meta import layout_differences

__all__ = ["LeafMap", "ParamMapping", "path_name"]

_SEQUENTIAL = re.compile(r"^layers_(\d+)$")
_FLAX_LEAVES = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}


@dataclass(frozen=True)
class LeafMap:
    """How one JAX leaf becomes one torch parameter.

    Attributes:
        path: The leaf's path in the JAX tree, joined with ``"/"`` (``"params/layers_0/kernel"``).
        name: The torch name (``"0.weight"``).
        axes: Permutation taking the JAX array to torch's layout (``jnp.transpose(x, axes)``),
            or ``None`` when the layouts agree.
        shape: The torch shape.
    """

    path: str
    name: str
    axes: tuple[int, ...] | None
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ParamMapping:
    """A frozen mapping between one JAX parameter tree structure and torch names/shapes.

    Build it with :meth:`identity` or :meth:`flax`; apply it with :meth:`to_torch`
    (parameters or gradients, works under ``jit``/``vmap``/``grad``) and invert it with
    :meth:`from_torch`.

    Attributes:
        treedef: The JAX tree structure it was built from.
        leaves: One :class:`LeafMap` per leaf, in the tree's leaf order.
    """

    treedef: Any
    leaves: tuple[LeafMap, ...]

    def __post_init__(self) -> None:
        names = [leaf.name for leaf in self.leaves]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise InvalidArgumentError(
                f"ParamMapping: several leaves map to the torch names {dups}; give them "
                "distinct names with rename=."
            )

    @classmethod
    def identity(cls, tree: Any, *, rename: Mapping[str, str] | Callable[[str], str] | None = None
                 ) -> ParamMapping:
        """Names from tree paths joined with ``"."``, layouts unchanged.

        An NNX ``State`` or ``Module`` is mapped by its ``nnx.Param`` variables, named by
        their attribute path (``"linear1.kernel"``, the Variable's ``.value`` dropped).
        """
        nnx = is_nnx_state(tree) or is_nnx_module(tree)
        tree = param_tree(tree)  # linen variables with state: their "params" only
        return cls._build(tree, lambda path, shape: (".".join(_strip_value(path, nnx)), None),
                          rename)

    @classmethod
    def flax(cls, variables: Any, *, collection: str = "params",
             rename: Mapping[str, str] | Callable[[str], str] | None = None) -> ParamMapping:
        """Flax conventions (see the module docs): kernels transposed, ``layers_i`` -> ``i``.

        Linen ``variables``, an NNX ``State`` and an NNX ``Module`` map the same way, by their
        parameters only: other linen collections (``batch_stats``, ``cache``) and non-``Param``
        NNX variables are state, never mapped nor differentiated.

        Args:
            variables: ``model.init(...)`` output or its ``["params"]`` subtree; an
                ``nnx.State`` (``nnx.split(model, nnx.Param, ...)[1]``, or the whole
                ``nnx.state(model)``) or the ``nnx.Module`` itself.
            collection: Leading key to drop when present.
            rename: Extra renames applied to the resulting torch names.
        """
        nnx = is_nnx_state(variables) or is_nnx_module(variables)
        tree = param_tree(variables)
        _check_collection(tree, collection)
        return cls._build(tree, lambda path, shape: _flax_rule(_strip_value(path, nnx), shape,
                                                                collection), rename)

    @classmethod
    def _build(cls, tree, rule, rename) -> ParamMapping:
        paths_leaves, treedef = tree_util.tree_flatten_with_path(tree)
        if not paths_leaves:
            raise InvalidArgumentError("ParamMapping: the parameter tree has no leaves.")
        leaves, raw_names = [], []
        _check_rename_type(rename)
        for key_path, leaf in paths_leaves:
            if not hasattr(leaf, "shape"):
                raise InvalidTypeError(
                    f"ParamMapping: leaf {path_name(key_path)!r} is a {type(leaf).__name__}, "
                    "not an array; keep only arrays in the tree (for Equinox: "
                    "params, static = eqx.partition(model, eqx.is_array))."
                )
            parts = tuple(_key_str(key) for key in key_path)
            name, axes = rule(parts, tuple(leaf.shape))
            raw_names.append(name)
            name = _apply_rename(name, rename)
            shape = tuple(int(s) for s in leaf.shape)
            torch_shape = tuple(shape[a] for a in axes) if axes else shape
            leaves.append(LeafMap("/".join(parts), name, axes, torch_shape))
        if isinstance(rename, Mapping):
            _check_rename_keys(rename, raw_names)
        return cls(treedef, tuple(leaves))

    @property
    def layout(self) -> Layout:
        """Torch names and shapes sorted by name, as store metadata records them."""
        return canonical_layout({leaf.name: leaf.shape for leaf in self.leaves})

    @property
    def names(self) -> dict[str, str]:
        """``{jax path: torch name}``, in leaf order."""
        return {leaf.path: leaf.name for leaf in self.leaves}

    @entry_point("ParamMapping.to_torch")
    def to_torch(self, tree: Any) -> dict[str, jax.Array]:
        """``{torch name: array in torch layout}`` from a tree of this structure.

        Raises:
            IncompatibleGradientsError: the tree's structure or shapes differ.
        """
        values = self._leaves_of(tree)
        return {
            leaf.name: jnp.transpose(value, leaf.axes) if leaf.axes else value
            for leaf, value in zip(self.leaves, values, strict=True)
        }

    @entry_point("ParamMapping.from_torch")
    def from_torch(self, params: Mapping[str, Any]) -> Any:
        """The JAX tree from ``{torch name: array}`` (torch tensors are converted by DLPack)."""
        self.check(params)
        values = []
        for leaf in self.leaves:
            value = params[leaf.name]
            if isinstance(value, torch.Tensor):
                value = to_framework(value, "jax")
            value = jnp.asarray(value)
            inverse = tuple(sorted(range(len(leaf.axes)), key=leaf.axes.__getitem__)) if (
                leaf.axes) else None
            values.append(jnp.transpose(value, inverse) if inverse else value)
        return tree_util.tree_unflatten(self.treedef, values)

    def check(self, params: Mapping[str, Any] | Layout) -> None:
        """Raise unless ``params`` (torch ``{name: tensor or shape}`` or a layout) match.

        Raises:
            IncompatibleGradientsError: naming every missing, extra or mis-shaped parameter.
        """
        theirs = dict(params)  # a mapping, or a layout of (name, shape) pairs
        theirs = {name: tuple(getattr(v, "shape", v)) for name, v in theirs.items()}
        problems = layout_differences(self.layout, tuple(sorted(theirs.items())))
        if problems:
            raise IncompatibleGradientsError(
                f"{current_caller('ParamMapping.check')}: the JAX parameters mapped to torch do "
                f"not match: {problems}. Build "
                "the mapping for this model (ParamMapping.flax for Flax trees) and add "
                "rename= for names that differ."
            )

    def _leaves_of(self, tree: Any) -> list[Any]:
        leaves, treedef = tree_util.tree_flatten(tree)
        if treedef != self.treedef and not _same_params(treedef, self.treedef):
            raise IncompatibleGradientsError(
                f"{current_caller()}: the tree's structure differs from the one the mapping was "
                f"built from ({treedef} vs {self.treedef}); build the mapping from this tree."
            )
        bad = [f"{leaf.path} is {list(value.shape)}, expected {list(_jax_shape(leaf))}"
               for leaf, value in zip(self.leaves, leaves, strict=True)
               if tuple(value.shape) != _jax_shape(leaf)]
        if bad:
            raise IncompatibleGradientsError(
                f"{current_caller()}: leaf shapes differ from the mapping's: {'; '.join(bad)}."
            )
        return leaves


def _same_params(one: Any, other: Any) -> bool:
    """Two structures that differ only by linen's ``{"params": ...}`` wrapper (same leaves,
    same order): ``variables`` and ``variables["params"]`` map alike."""
    def wrapped(treedef: Any) -> Any:
        try:
            return tree_util.tree_structure({"params": tree_util.tree_unflatten(
                treedef, [0] * treedef.num_leaves)})
        except Exception:  # a custom node that cannot hold placeholders: not comparable
            return None

    return wrapped(one) == other or wrapped(other) == one


def _strip_value(path: tuple[str, ...], nnx: bool) -> tuple[str, ...]:
    """An NNX Variable's leaf path ends in its ``.value`` attribute: not part of the name."""
    return path[:-1] if nnx and len(path) > 1 and path[-1] == "value" else path


def path_name(key_path: tuple, *, sep: str = "/") -> str:
    """A JAX key path as text: ``(DictKey('params'), DictKey('fc'))`` -> ``"params/fc"``."""
    return sep.join(_key_str(key) for key in key_path)


def _key_str(key: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _jax_shape(leaf: LeafMap) -> tuple[int, ...]:
    if not leaf.axes:
        return leaf.shape
    shape = [0] * len(leaf.axes)
    for torch_dim, jax_dim in enumerate(leaf.axes):
        shape[jax_dim] = leaf.shape[torch_dim]
    return tuple(shape)


def _flax_rule(path: tuple[str, ...], shape: tuple[int, ...], collection: str):
    if path and path[0] == collection:
        path = path[1:]
    *modules, leaf = path
    modules = [_SEQUENTIAL.sub(r"\1", part) for part in modules]
    torch_leaf = _FLAX_LEAVES.get(leaf, leaf)
    axes = None
    if leaf == "kernel" and len(shape) >= 2:
        n = len(shape)  # [*spatial, in, out] -> [out, in, *spatial]; Dense: [in, out] -> [out, in]
        axes = (n - 1, n - 2, *range(n - 2))
    return ".".join([*modules, torch_leaf]), axes


def _apply_rename(name: str, rename) -> str:
    if rename is None:
        return name
    new = rename.get(name, name) if isinstance(rename, Mapping) else rename(name)
    if not isinstance(new, str):
        raise InvalidTypeError(
            f"ParamMapping: rename must give each parameter a torch name that is a str, got "
            f"{type(new).__name__} ({new!r}) for {name!r}; return the new name as text."
        )
    if not new:
        raise InvalidArgumentError(
            f"ParamMapping: rename gave {name!r} the empty name ''; a torch parameter name "
            "must be non-empty (e.g. 'fc1.weight')."
        )
    return new


def _check_rename_type(rename) -> None:
    if rename is not None and not isinstance(rename, Mapping) and not callable(rename):
        raise InvalidTypeError(
            f"ParamMapping: rename must be a dict or a function of the torch name, got "
            f"{type(rename).__name__}."
        )


def _check_rename_keys(rename: Mapping, names: list[str]) -> None:
    """A rename key matching no parameter is a typo that would silently keep the old name."""
    unknown = sorted(str(key) for key in rename if key not in names)
    if unknown:
        raise InvalidArgumentError(
            f"ParamMapping: rename= names {unknown}, which match no parameter; the names "
            f"before renaming are {names}. Fix the keys (they are the names before rename)."
        )


def _check_collection(tree: Any, collection: str) -> None:
    """An explicitly named collection must be there: else the whole tree would be mapped."""
    if collection == "params":  # the default: dropped when present, the params subtree accepted
        return
    keys = sorted(str(key) for key in tree) if isinstance(tree, Mapping) else None
    if keys is None or collection not in tree:
        raise InvalidArgumentError(
            f"ParamMapping.flax: collection={collection!r} is not a top-level key of the "
            f"parameter tree (its keys: {keys}); state collections such as 'batch_stats' are "
            "never mapped (only 'params' is). Pass the tree holding that collection, or leave "
            "collection='params'."
        )
