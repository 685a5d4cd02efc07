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
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from tracinfunc.errors import InvalidTypeError, StageMismatchError
from tracinfunc.loss import check_eval_mode
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
    """

    stages: tuple[Stage, ...]
    criterion: Callable[[Tensor, Tensor], Tensor]
    forward: Callable[[Params, Any], Tensor] | None = None

    def __post_init__(self) -> None:
        stages = tuple(self.stages)
        if not stages or not all(isinstance(s, Stage) for s in stages):
            raise InvalidTypeError(
                "Stages: stages must be a non-empty sequence of tracinfunc.Stage, got "
                f"{[type(s).__name__ for s in stages]}; use model_stages(model, criterion)."
            )
        owners: dict[str, int] = {}
        for index, stage in enumerate(stages):
            for name in stage.param_names:
                if name in owners:
                    raise StageMismatchError(
                        f"Stages: parameter {name!r} belongs to stage {owners[name]} and to "
                        f"stage {index}; every parameter must belong to exactly one stage."
                    )
                owners[name] = index
        object.__setattr__(self, "stages", stages)

    def owner(self, name: str) -> int | None:
        """Index of the stage that uses parameter ``name`` (``None``: no stage does)."""
        return next((i for i, s in enumerate(self.stages) if name in s.param_names), None)


def model_stages(
    model: nn.Module,
    criterion: Callable[[Tensor, Tensor], Tensor],
    *,
    names: Sequence[str] | None = None,
    buffers: Mapping[str, Tensor] | None = None,
) -> Stages:
    """Stages from an ``nn.Sequential`` (its children) or from submodule names in forward order.

    For a Sequential, each child with parameters starts a stage and parameterless children
    (activations, ``Flatten``) join the stage before them, so boundaries sit after each
    nonlinearity. With ``names``, stage ``i`` is ``model.get_submodule(names[i])``.

    Args:
        model: The model, in eval mode.
        criterion: As for :func:`~tracinfunc.loss_from_module`.
        names: Submodule names whose composition is ``model.forward`` (checked on first use).
        buffers: Non-trainable state (default: a copy of the model's buffers, taken now).

    Returns:
        :class:`Stages` whose ``forward`` is the whole model, for the reproduction check.

    Example:
        >>> stages = model_stages(model, F.cross_entropy)               # nn.Sequential
        >>> stages = model_stages(resnet, F.cross_entropy, names=["stem", "body", "head"])
    """
    check_eval_mode(model, caller="model_stages")
    if buffers is None:
        buffers = {key: value.detach().clone() for key, value in model.named_buffers()}
    buffers = dict(buffers)
    groups = _named_groups(model, names)
    stages = tuple(_module_stage(model, group, buffers) for group in groups)
    owned = {name for stage in stages for name in stage.param_names}
    orphans = [name for name, _ in model.named_parameters() if name not in owned]
    if orphans:
        raise StageMismatchError(
            f"model_stages: parameters {orphans[:6]} are in none of the stages "
            f"{[s.name for s in stages]}; list the submodules that own them in names."
        )

    def forward(params: Params, inputs: Any) -> Tensor:
        return functional_call(model, ({**buffers, **params},), (inputs,))

    return Stages(stages=stages, criterion=criterion, forward=forward)


def _named_groups(model: nn.Module, names: Sequence[str] | None) -> list[list[str]]:
    if names is not None:
        if isinstance(names, str) or not names:
            raise InvalidTypeError(
                f"model_stages: names must be a non-empty list of submodule names, got "
                f"{names!r}; e.g. ['features', 'classifier']."
            )
        for name in names:
            try:
                model.get_submodule(name)
            except AttributeError:
                children = [n for n, _ in model.named_children()]
                raise StageMismatchError(
                    f"model_stages: {type(model).__name__} has no submodule {name!r}; its "
                    f"children are {children}."
                ) from None
        return [[name] for name in names]
    if not isinstance(model, nn.Sequential):
        raise InvalidTypeError(
            f"model_stages: without names the model must be an nn.Sequential, got "
            f"{type(model).__name__}; pass the submodule names in forward order, e.g. "
            "model_stages(model, criterion, names=['features', 'classifier'])."
        )
    groups: list[list[str]] = []
    for child_name, child in model.named_children():
        has_params = any(True for _ in child.parameters())
        if has_params or not groups:
            groups.append([child_name])
        else:
            groups[-1].append(child_name)
    return groups


def _module_stage(model: nn.Module, group: list[str], buffers: dict[str, Tensor]) -> Stage:
    """A stage that applies the submodules ``group`` in order with ``functional_call``."""
    parts = []
    param_names: list[str] = []
    for prefix in group:
        module = model.get_submodule(prefix)
        own = [f"{prefix}.{n}" for n, _ in module.named_parameters()]
        local_buffers = {n[len(prefix) + 1:]: v for n, v in buffers.items()
                         if n.startswith(prefix + ".")}
        parts.append((prefix, module, local_buffers))
        param_names += own

    def fn(params: Params, h: Any) -> Tensor:
        for prefix, module, local_buffers in parts:
            start = len(prefix) + 1
            local = {n[start:]: v for n, v in params.items() if n.startswith(prefix + ".")}
            h = functional_call(module, ({**local_buffers, **local},), (h,))
        return h

    return Stage(fn=fn, param_names=tuple(param_names), name="+".join(group))


def split_batch(batch: Batch, *, caller: str) -> tuple[Any, Tensor]:
    """``(inputs, targets)`` of a batch, as stages expect."""
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        raise InvalidTypeError(
            f"{caller}: with stages=, a batch must be (inputs, targets), got "
            f"{type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, tuple | list) else "")
            + "; wrap other layouts in a loss without stages."
        )
    return batch[0], batch[1]


def stage_params(stage: Stage, params: Params) -> dict[str, Tensor]:
    """The entries of ``params`` that ``stage`` uses (absent ones fall back to the module)."""
    return {name: params[name] for name in stage.param_names if name in params}


def run_stages(stages: Stages, params: Params, inputs: Any, *, caller: str) -> Tensor:
    """The composed forward ``stage_n(... stage_1(inputs))`` on a batch (no autograd here)."""
    h = inputs
    for index, stage in enumerate(stages.stages):
        try:
            h = stage.fn(stage_params(stage, params), h)
        except (RuntimeError, TypeError, ValueError) as error:
            raise StageMismatchError(
                f"{caller}: stage {index} ({stage.name or 'unnamed'}) failed on the output of "
                f"the stage before it: {error}. The stages must be the model's pieces in "
                "forward order; check model_stages(..., names=...) against model.forward."
            ) from error
    return h


def check_stages(stages: Stages, loss: LossFn, params: Params, batch: Batch, *,
                 caller: str) -> None:
    """Refuse stages whose outputs or losses differ from the model's on ``batch``.

    Raises:
        StageMismatchError: outputs differ from ``stages.forward`` or per-example losses from
            ``loss`` by more than a relative 1e-3 (rounding is ~1e-6 in float32).
    """
    inputs, targets = split_batch(batch, caller=caller)
    with torch.no_grad():
        outputs = run_stages(stages, params, inputs, caller=caller)
        if stages.forward is not None:
            _compare(outputs, stages.forward(params, inputs), "output", caller)
        staged = vmap(lambda o, t: stages.criterion(o.unsqueeze(0), t.unsqueeze(0)))(
            outputs, targets)
        _compare(staged, vmap(loss, in_dims=(None, 0))(dict(params), batch), "loss", caller)


def _compare(got: Tensor, expected: Tensor, what: str, caller: str) -> None:
    if got.shape != expected.shape:
        raise StageMismatchError(
            f"{caller}: the stages give a {what} of shape {list(got.shape)} but the model "
            f"gives {list(expected.shape)}; the stages must compose to model.forward."
        )
    expected = expected.to(got.dtype)
    error = float((got - expected).norm() / expected.norm().clamp_min(1e-30))
    if not error <= _MISMATCH_TOLERANCE:
        raise StageMismatchError(
            f"{caller}: the stages do not reproduce the model's {what} on the first batch "
            f"(relative difference {error:.3g}, allowed {_MISMATCH_TOLERANCE}); list every "
            "submodule that model.forward uses, in forward order, with nothing else between "
            "them (a reshape or residual in forward needs its own Stage)."
        )
