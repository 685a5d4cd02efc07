"""Checkpoints: a snapshot of parameters and the learning rate that weights it in TracIn."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from os import PathLike
from types import MappingProxyType

import torch
from torch import Tensor, nn

from tracinfunc.errors import InvalidTypeError, MissingParametersError
from tracinfunc.interop import tensor_if_array
from tracinfunc.store.meta import check_lr
from tracinfunc.types import Params

__all__ = ["Checkpoint", "params_fingerprint"]


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

    Example:
        >>> ckpt = Checkpoint.from_module(model, lr=0.1, name="epoch-3")
    """

    params: Params
    lr: float = 1.0
    name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.params, Mapping) or not self.params:
            raise InvalidTypeError(
                "Checkpoint: params must be a non-empty dict {name: tensor}, got "
                f"{type(self.params).__name__}; use Checkpoint.from_module(model) to build one."
            )
        # JAX/NumPy/CuPy arrays come in through DLPack, shared like tensors (never copied).
        params = {key: tensor_if_array(value, caller="Checkpoint")
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
        lr = check_lr(self.lr, caller="Checkpoint")
        if self.name is not None and not isinstance(self.name, str):
            raise InvalidTypeError(f"Checkpoint: name must be a str or None, got {self.name!r}.")
        # Frozen dataclass: the only way to store a normalised value is object.__setattr__.
        detached = {key: value.detach() for key, value in self.params.items()}
        object.__setattr__(self, "params", MappingProxyType(detached))
        object.__setattr__(self, "lr", lr)

    @classmethod
    def from_module(
        cls, module: nn.Module, *, lr: float = 1.0, name: str | None = None
    ) -> Checkpoint:
        """Snapshot (copy) the trainable parameters of ``module``.

        Parameters with ``requires_grad=False`` are left out: they are not differentiated, so
        they belong in the loss as constants (e.g. via :func:`tracinfunc.loss_from_module`).
        """
        params = {
            key: value.detach().clone()
            for key, value in module.named_parameters()
            if value.requires_grad
        }
        return cls(params=params, lr=lr, name=name)

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, Tensor],
        module: nn.Module,
        *,
        lr: float = 1.0,
        name: str | None = None,
    ) -> Checkpoint:
        """Take the entries of ``state_dict`` that are trainable parameters of ``module``.

        Buffers (BatchNorm statistics and the like) in the state dict are ignored here: pass
        them to the loss explicitly. Raises :class:`MissingParametersError` (a ``KeyError``)
        naming any parameter it lacks.
        """
        names = [key for key, value in module.named_parameters() if value.requires_grad]
        missing = [key for key in names if key not in state_dict]
        if missing:
            raise MissingParametersError(
                f"Checkpoint.from_state_dict: the state dict lacks parameters {missing} of "
                f"{type(module).__name__}; was it saved from another model?"
            )
        params = {key: state_dict[key].detach().clone() for key in names}
        return cls(params=params, lr=lr, name=name)

    @classmethod
    def load(
        cls,
        path: str | PathLike,
        module: nn.Module,
        *,
        lr: float = 1.0,
        name: str | None = None,
    ) -> Checkpoint:
        """Load a state dict saved with ``torch.save(model.state_dict(), path)``."""
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
        return cls.from_state_dict(state_dict, module, lr=lr, name=name)

    @cached_property
    def fingerprint(self) -> str:
        """A hex digest of names, shapes, dtypes and values (stable across processes)."""
        # cached_property writes the instance __dict__ directly, which a frozen dataclass allows.
        return params_fingerprint(self.params)


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
