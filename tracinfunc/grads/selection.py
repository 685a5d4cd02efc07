"""Layer selection: differentiate a chosen subset of the parameters, the rest held constant.

A selection is one of

- a parameter name, a module name (all its parameters) or a glob pattern over parameter
  names (``"fc2.weight"``, ``"fc2"``, ``"layer4.*"``), or a list of those;
- :func:`last_layers` ``(n)``: the parameters of the last ``n`` layers, a layer being a module
  that owns parameters directly, in the order of the params dict (``named_parameters`` order,
  which is the order modules were registered; for ``nn.Sequential``, the forward order).

Selection is resolved against the parameter names alone, so train and test gradients made
with the same selection and checkpoints cover the same subset; the projection and the store
metadata (its layout) cover only that subset.
"""

from __future__ import annotations

import fnmatch
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from torch import Tensor, nn

from tracinfunc._validate import current_caller, entry_point
from tracinfunc.errors import InvalidTypeError, ParameterSelectionError
from tracinfunc.types import Params

__all__ = ["LastLayers", "Selection", "check_select", "last_layers", "select_params",
           "selected_names"]


@dataclass(frozen=True)
class LastLayers:
    """The parameters of the last ``n`` layers; make it with :func:`last_layers`."""

    n: int
    model: nn.Module | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        try:
            n = operator.index(self.n)
        except TypeError:
            n = None
        if n is None or isinstance(self.n, bool) or n < 1:
            raise ParameterSelectionError(
                f"last_layers: n must be a positive int, got {self.n!r}; e.g. last_layers(1) "
                "for the output layer."
            )
        object.__setattr__(self, "n", n)


Selection: TypeAlias = str | Sequence[str] | LastLayers
"""A parameter/module name or glob pattern, a list of them, or :func:`last_layers`."""


def last_layers(n: int, *, model: nn.Module | None = None) -> LastLayers:
    """Select the parameters of the last ``n`` layers (modules owning parameters directly).

    Args:
        n: How many layers, counted from the output.
        model: The model the parameters come from. Needed for tied weights: a language
            model's output head tied to its token embedding has no parameter name of its own
            (``named_parameters`` lists the weight once, as ``transformer.wte.weight``), so
            from names alone ``last_layers(1)`` is the final norm. With ``model``, layers are
            the modules in registration order and a shared weight belongs to the last
            module using it, so ``last_layers(1, model=gpt2)`` is the tied head.

    Example:
        >>> fn = projected_grads(loss, Projection(dim=512), select=last_layers(2))
        >>> select_params(params, last_layers(1, model=gpt2))   # {"transformer.wte.weight"}
    """
    if model is not None and not isinstance(model, nn.Module):
        raise InvalidTypeError(
            f"last_layers: model must be the nn.Module the parameters come from, got "
            f"{type(model).__name__}."
        )
    return LastLayers(n, model)


def check_select(select: Any) -> tuple[str, ...] | LastLayers | None:
    """Validate a selection before any work: ``None``, patterns (as a tuple) or LastLayers."""
    if select is None or isinstance(select, LastLayers):
        return select
    patterns = (select,) if isinstance(select, str) else select
    if not isinstance(patterns, Sequence) or not all(isinstance(p, str) for p in patterns):
        raise InvalidTypeError(
            f"{current_caller()}: select must be a name or glob pattern, a list of them, or "
            f"last_layers(n); got {select!r}. E.g. select=['fc.*'] or select=last_layers(1)."
        )
    if not patterns:
        raise ParameterSelectionError(
            f"{current_caller()}: select=[] selects no parameters; name at least one parameter, "
            "module or pattern (e.g. select=['fc.*']), or pass select=None for all parameters."
        )
    return tuple(patterns)


def selected_names(params: Params, select: Any) -> tuple[str, ...]:
    """The names ``select`` picks from ``params``, in the params' order.

    Raises:
        ParameterSelectionError: a pattern matches no parameter, or nothing is selected.
    """
    select = check_select(select)
    names = list(params)
    if select is None:
        return tuple(names)
    if isinstance(select, LastLayers):
        layers = (_layers_by_name(names) if select.model is None
                  else _layers_of_model(select.model, names))
        return _last_layers(names, layers, select.n)
    unmatched = [p for p in select if not any(_matches(name, p) for name in names)]
    if unmatched:
        shown = ", ".join(names[:8]) + (f", … ({len(names)} in all)" if len(names) > 8 else "")
        raise ParameterSelectionError(
            f"{current_caller()}: select entries {unmatched} match no parameter; the parameters "
            f"are [{shown}].{_prefix_hint(unmatched, names)} Use parameter names, module names "
            "or glob patterns such as 'fc.*'."
        )
    return tuple(name for name in names if any(_matches(name, p) for p in select))


@entry_point("select_params")
def select_params(params: Params, select: Selection | None) -> dict[str, Tensor]:
    """The subset of ``params`` that ``select`` picks, e.g. to compute its layout.

    Example:
        >>> canonical_layout(select_params(ckpt.params, last_layers(1)))
    """
    names = selected_names(params, select)
    return {name: params[name] for name in names}


def _prefix_hint(unmatched: list[str], names: list[str]) -> str:
    """' Did you mean ...?' for patterns that match under a wrapper's prefix (HF's ``bert.``,
    peft's ``base_model.model.``), else ''."""
    hints = []
    for pattern in unmatched:
        prefixes = {name[:len(name) - len(tail)] for name in names
                    for tail in _tails(name) if _matches(tail, pattern)}
        if prefixes:
            hints.append(f"{min(prefixes, key=len)}{pattern}")
    return f" Did you mean {hints}? The names have a prefix." if hints else ""


def _tails(name: str) -> list[str]:
    """``a.b.c`` -> ``["b.c", "c"]``: the name without each leading run of components."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(1, len(parts))]


def _matches(name: str, pattern: str) -> bool:
    """A parameter name matches its own name, a glob, or the name of a module holding it."""
    return fnmatch.fnmatchcase(name, pattern) or name.startswith(pattern + ".")


def _layer_of(name: str) -> str:
    return name.rpartition(".")[0]


def _layers_by_name(names: list[str]) -> list[set[str]]:
    layers: dict[str, set[str]] = {}
    for name in names:
        layers.setdefault(_layer_of(name), set()).add(name)
    return list(layers.values())


def _layers_of_model(model: nn.Module, names: list[str]) -> list[set[str]]:
    """Parameter names per module, in registration order; a shared weight goes to its last
    user (the tied output head, registered after the embedding)."""
    canonical = {id(value): name for name, value in model.named_parameters()}
    owner: dict[str, int] = {}
    modules = list(model.named_modules(remove_duplicate=False))
    for index, (_, module) in enumerate(modules):
        for value in module.parameters(recurse=False):
            name = canonical.get(id(value))
            if name in names:
                owner[name] = index
    layers: dict[int, set[str]] = {}
    for name, index in sorted(owner.items(), key=lambda item: item[1]):
        layers.setdefault(index, set()).add(name)
    return list(layers.values())


def _last_layers(names: list[str], layers: list[set[str]], n: int) -> tuple[str, ...]:
    if n > len(layers):
        raise ParameterSelectionError(
            f"{current_caller()}: last_layers({n}) asks for more layers than the parameters have "
            f"({len(layers)}); use last_layers({len(layers)}) or select=None."
        )
    chosen = set().union(*layers[-n:])
    return tuple(name for name in names if name in chosen)
