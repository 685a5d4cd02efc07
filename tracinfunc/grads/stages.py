"""A model as a sequence of stages: the unit of checkpointing, offloading and frozen prefixes.

``Stages`` describes ``loss(params, (x, y)) = criterion(stage_n(... stage_1(x)), y)``. Each
stage is a pure function ``fn(params, h [n, ...]) -> [n, ...]`` of its own parameters and the
previous stage's output, with a leading batch dimension of any size (1 for one example, ``b``
for a batch). :func:`model_stages` derives stages from an ``nn.Sequential`` or from a list of
submodule names; since a model's ``forward`` may do more than chain those submodules, the
gradient transforms check on the first batch that the stages reproduce the model's output
and loss (:func:`check_stages`) and refuse them otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import vmap

from tracinfunc._validate import current_caller, entry_point
from tracinfunc.errors import InvalidTypeError, StageMismatchError
from tracinfunc.loss import ModuleLoss, check_eval_mode, swapped_call
from tracinfunc.types import Batch, LossFn, Params

__all__ = ["Stage", "Stages", "check_stages", "model_stages", "run_stages", "split_batch"]

# Relative Frobenius difference above which stages "do not reproduce" the model. Float32
# batched-vs-per-example rounding is ~1e-6; a wrong stage list changes outputs by O(1).
_MISMATCH_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Stage:
    """One piece of the network.

    Attributes:
        fn: ``fn(params, h) -> h'``; ``params`` holds (at most) ``param_names``, ``h`` has a
            leading batch dimension, and rows must not interact (eval-mode layers).
        param_names: The global names of the parameters this stage uses.
        name: A label for error messages.
    """

    fn: Callable[[Params, Any], Tensor]
    param_names: tuple[str, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_names", tuple(self.param_names))


@dataclass(frozen=True)
class Stages:
    """A model as ``criterion(stage_n(... stage_1(inputs)), targets)``; batches are
    ``(inputs, targets)``.

    Attributes:
        stages: The stages in forward order.
        criterion: ``criterion(outputs [1, ...], target [1, ...]) -> scalar``, as for
            :func:`~tracinfunc.loss_from_module`.
        forward: Optional ``forward(params, inputs) -> outputs`` of the whole model, used
            only to check that the stages reproduce it.
        tied: Parameters used by several stages (an LM head tied to the embedding); their
            per-example gradient is the sum of the stages' contributions. Any other
            parameter belongs to exactly one stage.
    """

    stages: tuple[Stage, ...]
    criterion: Callable[[Tensor, Tensor], Tensor]
    forward: Callable[[Params, Any], Tensor] | None = None
    tied: frozenset[str] = frozenset()
    # model_stages': ``loss -> stages`` reading that loss's buffers (a checkpoint's), or None
    at_buffers_of: Callable[[LossFn], Stages] | None = field(default=None, compare=False,
                                                             repr=False)

    def __post_init__(self) -> None:
        stages = tuple(self.stages)
        if not stages or not all(isinstance(s, Stage) for s in stages):
            raise InvalidTypeError(
                "Stages: stages must be a non-empty sequence of tracinfunc.grads.Stage, got "
                f"{[type(s).__name__ for s in stages]}; use model_stages(model, criterion)."
            )
        object.__setattr__(self, "tied", frozenset(self.tied))
        owners: dict[str, int] = {}
        for index, stage in enumerate(stages):
            for name in stage.param_names:
                if name in owners and name not in self.tied:
                    raise StageMismatchError(
                        f"Stages: parameter {name!r} belongs to stage {owners[name]} and to "
                        f"stage {index}; every parameter must belong to exactly one stage "
                        "unless listed in tied=."
                    )
                owners[name] = index
        object.__setattr__(self, "stages", stages)

    def owner(self, name: str) -> int | None:
        """Index of the first stage that uses parameter ``name`` (``None``: no stage does)."""
        return next((i for i, s in enumerate(self.stages) if name in s.param_names), None)

    def owners(self, name: str) -> list[int]:
        """Indices of every stage that uses parameter ``name`` (several only if tied)."""
        return [i for i, s in enumerate(self.stages) if name in s.param_names]


@entry_point("model_stages")
def model_stages(
    model: nn.Module,
    criterion: Callable[[Tensor, Tensor], Tensor],
    *,
    names: Sequence[str | Callable[[Any], Any]] | None = None,
    buffers: Mapping[str, Tensor] | None = None,
) -> Stages:
    """Stages from an ``nn.Sequential`` (its children) or from submodule names in forward order.

    For a Sequential, each child with parameters starts a stage and parameterless children
    (activations, ``Flatten``) join the stage before them, so boundaries sit after each
    nonlinearity. With ``names``, each submodule name is a stage; a callable in the list is
    functional glue that ``forward`` applies between submodules (``torch.flatten`` before a
    ResNet's ``fc``, ``lambda out: out[0]`` after a block returning a tuple) and joins the stage
    before it. A weight shared by several submodules (an LM head tied to the token embedding)
    is used by each of their stages under its ``named_parameters`` name, and its gradient is
    the sum of theirs (``Stages.tied``).

    Args:
        model: The model, in eval mode.
        criterion: As for :func:`~tracinfunc.loss_from_module`.
        names: Submodule names whose composition is ``model.forward`` (checked on first use).
        buffers: Non-trainable state, used when the stages run with a loss that has no
            buffers of these names (default: a copy of the model's buffers). A loss that has
            them (a checkpoint's, given by ``build_store`` or
            :func:`~tracinfunc.checkpoint.loss_at`) replaces them.

    Returns:
        :class:`Stages` whose ``forward`` is the whole model, for the reproduction check.

    Example:
        >>> stages = model_stages(model, F.cross_entropy)               # nn.Sequential
        >>> stages = model_stages(resnet, F.cross_entropy, names=["stem", "body", "head"])
        >>> stages = model_stages(resnet, F.cross_entropy,
        ...                       names=["features", lambda h: h.flatten(1), "fc"])
    """
    check_eval_mode(model)
    if buffers is None:
        buffers = {key: value.detach().clone() for key, value in model.named_buffers()}
    buffers = dict(buffers)
    groups = _named_groups(model, names)
    canonical = {id(value): name for name, value in model.named_parameters()}
    stages = tuple(_module_stage(model, group, buffers, canonical) for group in groups)
    owned = {name for stage in stages for name in stage.param_names}
    orphans = [name for name, _ in model.named_parameters() if name not in owned]
    if orphans:
        raise StageMismatchError(
            f"model_stages: parameters {orphans[:6]} are in none of the stages "
            f"{[s.name for s in stages]}; list the submodules that own them in names."
        )

    def forward(params: Params, inputs: Any) -> Tensor:
        return swapped_call(model, {**buffers, **params}, (inputs,))

    counts: dict[str, int] = {}
    for stage in stages:
        for name in stage.param_names:
            counts[name] = counts.get(name, 0) + 1
    tied = frozenset(name for name, count in counts.items() if count > 1)

    def at_buffers_of(loss: LossFn) -> Stages:
        # the same stages with a checkpoint's buffers: build_store gives each checkpoint's
        # loss its own BatchNorm statistics (loss_at), which these stages' copy would shadow
        # by name: stages from a copy of the loss's model (copy.deepcopy) read them too
        if not isinstance(loss, ModuleLoss) or set(loss.buffers) != set(buffers) \
                or all(loss.buffers[name] is value for name, value in buffers.items()):
            return built
        return model_stages(model, criterion, names=names, buffers=loss.buffers)

    built = Stages(stages=stages, criterion=criterion, forward=forward, tied=tied,
                   at_buffers_of=at_buffers_of)
    return built


def _named_groups(model: nn.Module, names: Sequence[str] | None) -> list[list[str]]:
    if names is not None:
        if isinstance(names, str) or not names:
            raise InvalidTypeError(
                f"model_stages: names must be a non-empty list of submodule names, got "
                f"{names!r}; e.g. ['features', 'classifier']."
            )
        for name in names:
            if callable(name):
                continue
            try:
                model.get_submodule(name)
            except AttributeError:
                children = [n for n, _ in model.named_children()]
                raise StageMismatchError(
                    f"model_stages: {type(model).__name__} has no submodule {name!r}; its "
                    f"children are {children}."
                ) from None
        groups: list[list] = []
        for name in names:
            if callable(name) and groups:
                groups[-1].append(name)  # glue joins the stage before it
            else:
                groups.append([name])
        return groups
    if not isinstance(model, nn.Sequential):
        raise InvalidTypeError(
            f"model_stages: without names the model must be an nn.Sequential, got "
            f"{type(model).__name__}; pass the submodule names in forward order, e.g. "
            "model_stages(model, criterion, names=['features', 'classifier'])."
        )
    groups: list[list[str]] = []
    # every child as Sequential.forward runs them: named_children() would skip a layer
    # applied twice (the same module at two positions)
    for child_name, child in model._modules.items():
        if child is None:
            continue
        has_params = any(True for _ in child.parameters())
        if has_params or not groups:
            groups.append([child_name])
        else:
            groups[-1].append(child_name)
    return groups


def _module_stage(model: nn.Module, group: list, buffers: dict[str, Tensor],
                  canonical: dict[int, str]) -> Stage:
    """A stage applying the submodules (names) and glue (callables) of ``group`` in order.

    Each submodule's parameters are named as ``model.named_parameters()`` names them, so a
    tied weight appears under one name in every stage that uses it.
    """
    parts = []
    param_names: list[str] = []
    for part in group:
        if callable(part):
            parts.append(part)
            continue
        module = model.get_submodule(part)
        # local name -> global name (for a tied weight, the name it is listed under)
        names = {local: canonical[id(value)] for local, value
                 in module.named_parameters(remove_duplicate=False)}
        local_buffers = {n[len(part) + 1:]: v for n, v in buffers.items()
                         if n.startswith(part + ".")}
        parts.append((module, names, local_buffers))
        param_names += [name for name in dict.fromkeys(names.values())
                        if name not in param_names]

    def fn(params: Params, h: Any) -> Tensor:
        for part in parts:
            if callable(part) and not isinstance(part, tuple):
                h = part(h)
                continue
            module, names, local_buffers = part
            local = {n: params[g] for n, g in names.items() if g in params}
            # under the whole model's lock: another thread's forward swaps into these too
            h = swapped_call(module, {**local_buffers, **local}, (h,), owner=model)
        return h

    label = "+".join(p if isinstance(p, str) else getattr(p, "__name__", "glue") for p in group)
    return Stage(fn=fn, param_names=tuple(param_names), name=label)


def split_batch(batch: Batch) -> tuple[Any, Tensor]:
    """``(inputs, targets)`` of a batch, as stages expect."""
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        raise InvalidTypeError(
            f"{current_caller()}: with stages=, a batch must be (inputs, targets), got "
            f"{type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, tuple | list) else "")
            + "; wrap other layouts in a loss without stages."
        )
    return batch[0], batch[1]


def stage_params(stage: Stage, params: Params) -> dict[str, Tensor]:
    """The entries of ``params`` that ``stage`` uses (absent ones fall back to the module)."""
    return {name: params[name] for name in stage.param_names if name in params}


def run_stages(stages: Stages, params: Params, inputs: Any) -> Tensor:
    """The composed forward ``stage_n(... stage_1(inputs))`` on a batch (no autograd here)."""
    h = inputs
    for index, stage in enumerate(stages.stages):
        try:
            h = stage.fn(stage_params(stage, params), h)
        except (RuntimeError, TypeError, ValueError) as error:
            raise StageMismatchError(
                f"{current_caller()}: stage {index} ({stage.name or 'unnamed'}) failed on the "
                f"output of the stage before it: {error}. The stages must be the model's pieces in "
                "forward order; check model_stages(..., names=...) against model.forward."
            ) from error
    return h


def check_stages(stages: Stages, loss: LossFn, params: Params, batch: Batch) -> None:
    """Refuse stages whose outputs or losses differ from the model's on ``batch``.

    Raises:
        StageMismatchError: outputs differ from ``stages.forward`` or per-example losses from
            ``loss`` by more than a relative 1e-3 (rounding is ~1e-6 in float32).
    """
    inputs, targets = split_batch(batch)
    with torch.no_grad():
        outputs = run_stages(stages, params, inputs)
        if stages.forward is not None:
            _compare(outputs, stages.forward(params, inputs), "output")
        staged = vmap(lambda o, t: stages.criterion(o.unsqueeze(0), t.unsqueeze(0)))(
            outputs, targets)
        _compare(staged, vmap(loss, in_dims=(None, 0))(dict(params), batch), "loss")


def _compare(got: Tensor, expected: Tensor, what: str) -> None:
    if got.shape != expected.shape:
        raise StageMismatchError(
            f"{current_caller()}: the stages give a {what} of shape {list(got.shape)} but the "
            f"model gives {list(expected.shape)}; the stages must compose to model.forward."
        )
    expected = expected.to(got.dtype)
    # Entries non-finite in both, alike (a loss of inf for some example), say nothing about
    # the stages: compare the rest, and leave those examples to the build's own checks.
    finite = torch.isfinite(got) & torch.isfinite(expected)
    alike = (got == expected) | (torch.isnan(got) & torch.isnan(expected))
    if bool((finite | alike).all()):
        got, expected = got[finite], expected[finite]
    error = float((got - expected).norm() / expected.norm().clamp_min(1e-30))
    if not error <= _MISMATCH_TOLERANCE:
        raise StageMismatchError(
            f"{current_caller()}: the stages do not reproduce the model's {what} on the first "
            f"batch (relative difference {error:.3g}, allowed {_MISMATCH_TOLERANCE}); list every "
            "submodule that model.forward uses, in forward order, with nothing else between "
            "them (a reshape or residual in forward needs its own Stage)."
        )
