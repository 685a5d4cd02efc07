"""Checkpoints: a snapshot of parameters and the learning rate that weights it in TracIn."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from os import PathLike
from types import MappingProxyType

import torch
from torch import Tensor, nn

from tracinfunc._devices import module_device
from tracinfunc._shapes import check_loaded_shapes
from tracinfunc._validate import entry_point
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError, MissingParametersError
from tracinfunc.interop import tensor_if_array
from tracinfunc.loss import refuse_lazy
from tracinfunc.store.meta import check_lr
from tracinfunc.types import LossFn, Params

__all__ = ["Checkpoint", "loss_at", "params_fingerprint"]


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """One model snapshot ``w_c`` and its TracIn weight ``lr_c``.

    TracIn sums ``lr_c * <grad L(test; w_c), grad L(train_i; w_c)>`` over checkpoints, so ``lr``
    is the learning rate in force around the snapshot (or any positive weight you choose).

    Args:
        params: Parameters by name, ``{name: tensor}`` (JAX/NumPy arrays are imported through
            DLPack). They are detached but not copied: build
            checkpoints with :meth:`from_module` (which copies) if you keep training the model.
        lr: The checkpoint's weight in the TracIn sum.
        name: A label stored in gradient-store metadata; ``build_store`` names unnamed
            checkpoints ``"checkpoint-<i>"`` by position.
        buffers: The model's non-trainable state at this snapshot (BatchNorm running
            statistics), ``{name: tensor}``; ``build_store`` differentiates a
            :class:`~tracinfunc.loss.ModuleLoss` with them (:func:`loss_at`). Never differentiated.

    Example:
        >>> ckpt = Checkpoint.from_module(model, lr=0.1, name="epoch-3")
    """

    params: Params
    lr: float = 1.0
    name: str | None = None
    buffers: Mapping[str, Tensor] = field(default_factory=dict)

    @entry_point("Checkpoint")
    def __post_init__(self) -> None:
        if not isinstance(self.params, Mapping) or not self.params:
            raise InvalidTypeError(
                "Checkpoint: params must be a non-empty dict {name: tensor}, got "
                f"{type(self.params).__name__}; use Checkpoint.from_module(model) to build one."
            )
        # JAX/NumPy/CuPy arrays come in through DLPack, shared like tensors (never copied).
        params = {key: tensor_if_array(value)
                  for key, value in self.params.items()}
        object.__setattr__(self, "params", params)
        for key, value in self.params.items():
            if not isinstance(key, str) or not isinstance(value, Tensor):
                raise InvalidTypeError(
                    "Checkpoint: params must map str names to tensors, got "
                    f"{type(key).__name__} -> {type(value).__name__} for {key!r}."
                )
            if not value.is_floating_point():
                raise InvalidTypeError(
                    f"Checkpoint: parameter {key!r} has dtype {value.dtype}; gradients need a "
                    "floating-point dtype. Pass buffers/integer state through the loss instead."
                )
            if value.is_meta:
                raise InvalidArgumentError(
                    f"Checkpoint: parameter {key!r} is on the meta device, which holds shapes "
                    "but no values; load real weights first (e.g. model.to_empty(device='cpu') "
                    "then load_state_dict, or Checkpoint.load)."
                )
        lr = check_lr(self.lr)
        if self.name is not None and not isinstance(self.name, str):
            raise InvalidTypeError(f"Checkpoint: name must be a str or None, got {self.name!r}.")
        # Frozen dataclass: the only way to store a normalised value is object.__setattr__.
        detached = {key: value.detach() for key, value in self.params.items()}
        object.__setattr__(self, "params", MappingProxyType(detached))
        object.__setattr__(self, "lr", lr)
        if not isinstance(self.buffers, Mapping) or not all(
                isinstance(k, str) and isinstance(v, Tensor) for k, v in self.buffers.items()):
            raise InvalidTypeError(
                "Checkpoint: buffers must map str names to tensors, got "
                f"{type(self.buffers).__name__}; Checkpoint.from_module(model) fills them."
            )
        buffers = {key: value.detach() for key, value in self.buffers.items()}
        object.__setattr__(self, "buffers", MappingProxyType(buffers))

    @classmethod
    def from_module(
        cls, module: nn.Module, *, lr: float = 1.0, name: str | None = None
    ) -> Checkpoint:
        """Snapshot (copy) the trainable parameters and the buffers of ``module``.

        Parameters with ``requires_grad=False`` are left out: they are not differentiated, so
        they belong in the loss as constants (e.g. via :func:`tracinfunc.loss_from_module`).
        A peft model thus gives only its trainable adapters. Buffers (BatchNorm running
        statistics) are kept in ``buffers``, so each checkpoint is differentiated with its own.
        """
        refuse_lazy(module, "Checkpoint.from_module")
        params = {
            key: value.detach().clone()
            for key, value in module.named_parameters()
            if value.requires_grad
        }
        buffers = {key: value.detach().clone() for key, value in module.named_buffers()}
        return cls(params=params, lr=lr, name=name, buffers=buffers)

    @classmethod
    @entry_point("Checkpoint.from_state_dict")
    def from_state_dict(
        cls,
        state_dict: Mapping[str, Tensor],
        module: nn.Module,
        *,
        lr: float = 1.0,
        name: str | None = None,
    ) -> Checkpoint:
        """Take the entries of ``state_dict`` that are trainable parameters of ``module``.

        The state dict's entries that are buffers of ``module`` (BatchNorm statistics; not the
        non-persistent ones, which state dicts leave out) become the checkpoint's ``buffers``.
        Raises :class:`MissingParametersError` (a ``KeyError``)
        naming any parameter it lacks, and :class:`InvalidArgumentError` naming a parameter
        whose shape differs from the module's.
        """
        names = [key for key, value in module.named_parameters() if value.requires_grad]
        missing = [key for key in names if key not in state_dict]
        if missing:
            raise MissingParametersError(
                f"Checkpoint.from_state_dict: the state dict lacks parameters {missing} of "
                f"{type(module).__name__}; was it saved from another model?"
            )
        live = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        # in the model's dtypes, as model.load_state_dict copies them (a float64 tensor saved
        # beside float32 ones would otherwise fail later, far from here)
        params = {key: state_dict[key].detach().to(live[key].dtype, copy=True) for key in names}
        buffers = {key: state_dict[key].detach().to(live[key].dtype, copy=True)
                   for key, _ in module.named_buffers() if key in state_dict}
        check_loaded_shapes(((k, live[k], v) for k, v in {**params, **buffers}.items()),
                            hint="was the state dict saved from another model (other sizes)?")
        return cls(params=params, lr=lr, name=name, buffers=buffers)

    @classmethod
    @entry_point("Checkpoint.load")
    def load(
        cls,
        path: str | PathLike,
        module: nn.Module,
        *,
        lr: float = 1.0,
        name: str | None = None,
        device: torch.device | str | None = None,
    ) -> Checkpoint:
        """Load a state dict saved with ``torch.save(model.state_dict(), path)``.

        Tensors land on ``device`` (default: ``module``'s device, so a GPU model gets GPU
        checkpoints, whatever device they were saved from).
        """
        device = module_device(module) if device is None else torch.device(device)
        state_dict = torch.load(path, map_location=device, weights_only=True)
        return cls.from_state_dict(state_dict, module, lr=lr, name=name)

    @cached_property
    def fingerprint(self) -> str:
        """A hex digest of names, shapes, dtypes and values (stable across processes).

        Buffers count when there are any (they change the gradients); without buffers the
        digest is that of the parameters alone, as before buffers were kept.
        """
        # cached_property writes the instance __dict__ directly, which a frozen dataclass allows.
        if not self.buffers:
            return params_fingerprint(self.params)
        return params_fingerprint({**self.params,
                                   **{f"buffer:{k}": v for k, v in self.buffers.items()
                                      if v.is_floating_point()}})


def loss_at(loss: LossFn, checkpoint: Checkpoint) -> LossFn:
    """``loss`` with ``checkpoint``'s buffers, for a loss that takes them.

    A :class:`~tracinfunc.loss.ModuleLoss` (from :func:`~tracinfunc.loss_from_module` or
    :func:`~tracinfunc.loss_from_model`) gets the checkpoint's running statistics in place of
    the ones captured when it was built; other losses are returned unchanged (they own their
    state). Used by :func:`~tracinfunc.build_store` for every checkpoint.

    Example:
        >>> rows = projected_grads(loss_at(loss, ckpt), projection)(ckpt.params, batch)
    """
    with_buffers = getattr(loss, "with_buffers", None)
    if not checkpoint.buffers or with_buffers is None:
        return loss
    return with_buffers(checkpoint.buffers)


def params_fingerprint(params: Params) -> str:
    """Hash parameter names, shapes, dtypes and bytes, in sorted-name order.

    Returns:
        A 32-character hex string; equal parameters give equal strings in any process.
    """
    digest = hashlib.blake2b(digest_size=16)
    for key in sorted(params):
        value = params[key].detach().cpu().contiguous()
        digest.update(f"{key}|{tuple(value.shape)}|{value.dtype}|".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
