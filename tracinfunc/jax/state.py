"""Parameters versus state in JAX model trees (Flax linen variables, Flax NNX, plain pytrees).

TracIn differentiates parameters only. Flax keeps non-trainable state beside them: linen's
``variables = {"params": ..., "batch_stats": ...}`` holds collections, NNX's ``nnx.State``
holds ``nnx.Param`` and ``nnx.BatchStat`` (or ``Cache``, ``RngState``) variables. Differentiating
the statistics as if they were weights changes every row silently, so this module draws the
line once, for :class:`~tracinfunc.jax.Checkpoint` and :class:`~tracinfunc.jax.ParamMapping`:

* :func:`split_params` splits any of these into ``(params, state or None)``;
* :func:`refuse_state` raises, with the fix, when a tree passed *as parameters* holds state.

Flax is never imported here: a Flax object is recognised by its type's module, and ``nnx`` is
imported only when such an object was passed (so Flax is installed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax import tree_util

from tracinfunc._validate import current_caller
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["is_nnx_module", "is_nnx_state", "param_tree", "refuse_params_in_state",
           "refuse_state", "split_params"]

PARAMS = "params"
# Running statistics as Flax (linen batch_stats, NNX BatchStat) and torch name them; a dict of
# arrays holding a pair of these beside a BatchNorm's "scale"/"bias"/"weight" is a norm layer's
# statistics, not parameters (a pure-dict restore of a whole NNX state loses the Variable types).
_STAT_PAIRS = (("mean", "var"), ("running_mean", "running_var"))
_NORM_PARAMS = ("scale", "bias", "weight")


def _nnx_kind(obj: Any, name: str) -> bool:
    return any(base.__name__ == name and base.__module__.startswith("flax.nnx")
               for base in type(obj).__mro__)


def is_nnx_module(obj: Any) -> bool:
    """``obj`` is a Flax NNX ``Module`` (a graph node: split it before differentiating)."""
    return _nnx_kind(obj, "Module")


def is_nnx_state(obj: Any) -> bool:
    """``obj`` is a Flax NNX ``State`` (what ``nnx.split`` and ``nnx.state`` return), or a
    plain dict holding ``nnx.Variable`` leaves (what Flax says will replace ``State``)."""
    if _nnx_kind(obj, "State"):
        return True
    return isinstance(obj, Mapping) and any(
        _nnx_kind(leaf, "Variable")
        for leaf in tree_util.tree_leaves(obj, is_leaf=lambda x: _nnx_kind(x, "Variable")))


def _linen_collections(tree: Any) -> list[str]:
    """The collections beside ``"params"`` of linen ``variables``, or ``[]``."""
    if not isinstance(tree, Mapping) or PARAMS not in tree:
        return []
    return sorted(str(key) for key in tree if key != PARAMS)


def _nnx_split(obj: Any) -> tuple[Any, Any]:
    from flax import nnx  # present: obj is a Flax object

    if is_nnx_state(obj):
        state = obj if isinstance(obj, nnx.State) else nnx.State(obj)  # a dict of Variables
        params, rest = nnx.filter_state(state, nnx.Param, ...)
    else:
        _, params, rest = nnx.split(obj, nnx.Param, ...)
    return params, rest


def _nnx_state_kinds(state: Any) -> list[str]:
    """Sorted names of the non-``Param`` variable types in an NNX state."""
    from flax import nnx

    state = state if isinstance(state, nnx.State) else nnx.State(state)  # a dict of Variables
    _, rest = nnx.filter_state(state, nnx.Param, ...)
    kinds = set()
    for _, leaf in nnx.to_flat_state(rest):
        kind = getattr(leaf, "type", type(leaf))
        kinds.add(getattr(kind, "__name__", str(kind)))
    return sorted(kinds)


def split_params(obj: Any) -> tuple[Any, Any]:
    """``(params, state)`` of a Flax model tree; ``state`` is ``None`` when there is none.

    Args:
        obj: Linen ``variables`` (``{"params": ..., "batch_stats": ...}``), an NNX ``Module``
            or ``State``, or any other pytree (all parameters).

    Returns:
        Linen: ``variables["params"]`` and ``{other collection: tree}``. NNX: the
        ``nnx.Param`` state and the rest (``nnx.BatchStat``, ...) as ``nnx.State``, each ready
        for ``nnx.merge(graphdef, params, state)``. Other trees: ``(obj, None)``.
    """
    if is_nnx_module(obj) or is_nnx_state(obj):
        params, rest = _nnx_split(obj)
        return params, (rest if _has_leaves(rest) else None)
    others = _linen_collections(obj)
    if others:
        return obj[PARAMS], {key: obj[key] for key in obj if key != PARAMS}
    if isinstance(obj, Mapping) and PARAMS in obj and len(obj) == 1:
        return obj[PARAMS], None
    return obj, None


def param_tree(obj: Any) -> Any:
    """The tree holding only parameters (what :class:`ParamMapping` maps): see split_params.

    Linen ``variables`` holding only ``"params"`` are kept whole (the mapping drops the
    ``params`` prefix from names and accepts either form of the tree).
    """
    if is_nnx_module(obj) or is_nnx_state(obj):
        return _nnx_split(obj)[0]
    if _linen_collections(obj):
        return obj[PARAMS]
    return obj


def refuse_state(tree: Any) -> None:
    """Raise when ``tree``, passed as parameters, holds Flax state (or is an NNX Module).

    Raises:
        InvalidTypeError: an NNX ``Module`` (split it first).
        InvalidArgumentError: linen collections beside ``"params"``, or an NNX state holding
            non-``Param`` variables.
    """
    caller = current_caller()
    if is_nnx_module(tree):
        raise InvalidTypeError(
            f"{caller}: got an nnx.Module as parameters; split it into parameters and state: "
            "tracinfunc.jax.Checkpoint.flax(model, lr=...) (or graphdef, params, state = "
            "nnx.split(model, nnx.Param, ...)) and write loss(params, state, example) with "
            "nnx.merge(graphdef, params, state)."
        )
    others = _linen_collections(tree)
    if others:
        raise InvalidArgumentError(
            f"{caller}: the parameter tree holds the Flax collections {others} beside "
            "'params'; they are state (running statistics, caches), not parameters, and must "
            "not be differentiated. Use tracinfunc.jax.Checkpoint.flax(variables, lr=...) "
            "(params=variables['params'], state=the other collections) with "
            "loss(params, state, example), and build the mapping with "
            "ParamMapping.flax(variables)."
        )
    stats = [] if is_nnx_state(tree) else _running_stat_paths(tree)
    if stats:
        raise InvalidArgumentError(
            f"{caller}: the parameter tree holds BatchNorm running statistics {stats} (leaves "
            "named mean/var beside scale/bias, e.g. a pure dict of a whole nnx.state(model) "
            "as orbax restores it); they are state, not parameters, and must not be "
            "differentiated. Restore them into the model (nnx.replace_by_pure_dict(state, "
            "tree); nnx.update(model, state)) and use tracinfunc.jax.Checkpoint.flax(model, "
            "lr=...), or pass the statistics as state=."
        )
    if is_nnx_state(tree):
        kinds = _nnx_state_kinds(tree)
        if kinds:
            raise InvalidArgumentError(
                f"{caller}: the nnx.State holds {kinds} variables beside nnx.Param; they are "
                "state, not parameters. Use tracinfunc.jax.Checkpoint.flax(model_or_state, "
                "lr=...) (or nnx.split(model, nnx.Param, ...)) with loss(params, state, "
                "example)."
            )


def _has_leaves(tree: Any) -> bool:
    return bool(tree_util.tree_leaves(tree))


def refuse_params_in_state(state: Any) -> None:
    """Raise when ``state`` holds the differentiated parameters themselves.

    Linen ``variables`` passed whole as state would put a second ``"params"`` collection in
    the loss's ``{"params": params, **state}``, overriding the differentiated one: every
    gradient would be 0. An NNX state holding ``nnx.Param`` variables does the same.
    """
    caller = current_caller()
    if isinstance(state, Mapping) and PARAMS in state:
        raise InvalidArgumentError(
            f"{caller}: state holds the collection 'params'; state must not contain the "
            "differentiated parameters (in loss {'params': params, **state} its copy would "
            "override them and every gradient would be 0). Pass only the other collections, "
            "state={k: v for k, v in variables.items() if k != 'params'}, or use "
            "tracinfunc.jax.Checkpoint.flax(variables, lr=...)."
        )
    if is_nnx_state(state):
        from flax import nnx  # present: state is a Flax object

        params, _ = nnx.filter_state(state, nnx.Param, ...)
        if _has_leaves(params):
            raise InvalidArgumentError(
                f"{caller}: state holds nnx.Param variables; state must not contain the "
                "differentiated parameters. Use tracinfunc.jax.Checkpoint.flax(model, lr=...) "
                "(or nnx.split(model, nnx.Param, ...)'s two states)."
            )


def _running_stat_paths(tree: Any, prefix: str = "") -> list[str]:
    """Paths of the dicts (in nested dicts) holding a running-statistics pair of array leaves
    beside a norm layer's parameter: ``["bn"]`` for ``{"bn": {"mean", "var", "scale"}}``."""
    if not isinstance(tree, Mapping):
        return []
    found = []
    arrays = {key for key, value in tree.items() if hasattr(value, "shape")}
    if any(pair[0] in arrays and pair[1] in arrays for pair in _STAT_PAIRS) and any(
            key in arrays for key in _NORM_PARAMS):
        found.append(prefix or "<root>")
    for key, value in tree.items():
        found += _running_stat_paths(value, f"{prefix}.{key}" if prefix else str(key))
    return found
