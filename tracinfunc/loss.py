"""Build a per-example ``loss(params, example)`` from an ``nn.Module`` and a criterion."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from torch import Tensor, nn
from torch.func import functional_call

from tracinfunc.errors import LossFunctionError, TrainModeError
from tracinfunc.types import Example, Params

__all__ = ["ModuleLoss", "check_eval_mode", "loss_from_module"]

_STATEFUL_IN_TRAIN_MODE = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


@dataclass(frozen=True, eq=False)
class ModuleLoss:
    """``loss(params, example)`` for one example, keeping the module it is made of.

    A plain :data:`~tracinfunc.types.LossFn` to every other function; the factorised
    (``kind="kronecker"``) path of :func:`~tracinfunc.projected_grads` also reads ``module``
    to reach the inputs and output gradients of its Linear/Conv2d layers. Build it with
    :func:`loss_from_module`.

    Attributes:
        module: The model (eval mode); its own parameters are never used or changed.
        criterion: ``criterion(outputs [1, ...], target [1, ...]) -> scalar``.
        buffers: Non-trainable state by name, read-only.
    """

    module: nn.Module
    criterion: Callable[[Tensor, Tensor], Tensor]
    buffers: Mapping[str, Tensor]
    # Names fixed when the loss is made, checked on every call: functional_call silently
    # takes the module's own weight for a name missing from ``params`` and ignores unknown
    # ones, which would give gradients of the wrong model without an error.
    trainable: frozenset[str] = field(init=False, repr=False)
    known: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        named = dict(self.module.named_parameters())
        trainable = frozenset(name for name, value in named.items() if value.requires_grad)
        object.__setattr__(self, "trainable", trainable)
        object.__setattr__(self, "known", frozenset(named))

    def __call__(self, params: Params, example: Example) -> Tensor:
        """The loss of one ``example = (inputs, target)`` (no batch dimension) at ``params``."""
        self._check_names(params)
        inputs, target = example
        outputs = functional_call(self.module, ({**self.buffers, **params},),
                                  (inputs.unsqueeze(0),))
        return self.criterion(outputs, target.unsqueeze(0))

    def _check_names(self, params: Params) -> None:
        names = params.keys()
        missing, unknown = self.trainable - names, names - self.known
        if missing or unknown:
            raise LossFunctionError(
                f"loss_from_module: the parameters passed do not match the model: missing "
                f"{sorted(missing)[:5]}, unknown {sorted(unknown)[:5]} (expected the "
                f"{len(self.trainable)} trainable parameter names of model.named_parameters()). "
                "Build checkpoints with Checkpoint.from_module/from_state_dict(..., model) "
                "so that they hold exactly those."
            )


def loss_from_module(
    module: nn.Module,
    criterion: Callable[[Tensor, Tensor], Tensor],
    *,
    buffers: Mapping[str, Tensor] | None = None,
) -> ModuleLoss:
    """Turn a module and a criterion into ``loss(params, example)`` for one example.

    The example is ``(inputs, target)`` with no batch dimension; the module is called on
    ``inputs[None]`` with ``torch.func.functional_call`` so the parameters come from ``params``
    (the checkpoint) and the module's own weights are never touched.

    Args:
        module: The model, in eval mode (BatchNorm in train mode would update running
            statistics per example, which vmap cannot do and TracIn does not want).
        criterion: ``criterion(outputs [1, ...], target [1, ...]) -> scalar``, e.g.
            ``torch.nn.functional.cross_entropy``.
        buffers: Non-trainable state by name (BatchNorm statistics). Defaults to a copy of
            the module's buffers taken now; they are passed explicitly, never mutated.

    Returns:
        A :class:`ModuleLoss`: ``loss(params, example) -> scalar tensor``.

    Raises:
        TrainModeError: the module has BatchNorm/InstanceNorm layers in train mode.
    """
    check_eval_mode(module, caller="loss_from_module")
    if buffers is None:
        buffers = {key: value.detach().clone() for key, value in module.named_buffers()}
    return ModuleLoss(module, criterion, MappingProxyType(dict(buffers)))


def check_eval_mode(module: nn.Module, *, caller: str) -> None:
    """Raise :class:`TrainModeError` if a layer of ``module`` keeps state in train mode."""
    offenders = [
        name or type(module).__name__
        for name, layer in module.named_modules()
        if isinstance(layer, _STATEFUL_IN_TRAIN_MODE) and layer.training
        and getattr(layer, "track_running_stats", False)
    ]
    if offenders:
        raise TrainModeError(
            f"{caller}: {offenders} are in train mode, where they update running statistics "
            "from each batch; per-example gradients under vmap need fixed statistics. Call "
            "model.eval() before building the loss."
        )
