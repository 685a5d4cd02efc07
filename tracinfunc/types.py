"""Type aliases shared across tracinfunc.

The conventions follow ``torch.func`` and JAX: parameters are a flat dict pytree
``{name: tensor}`` (as from ``module.named_parameters()``), a *batch* is any pytree of tensors
whose leaves share a leading batch dimension, and an *example* is one slice of it (no batch
dimension). A loss takes them in JAX argument order: ``loss(params, example) -> scalar``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

from torch import Tensor

Params: TypeAlias = Mapping[str, Tensor]
"""Model parameters by name, e.g. ``{"fc1.weight": [h, d], "fc1.bias": [h]}``."""

Example: TypeAlias = Any
"""One training or test example: a pytree of tensors with no batch dimension."""

Batch: TypeAlias = Any
"""A pytree of tensors whose leaves all have the same leading dimension ``b``."""

LossFn: TypeAlias = Callable[[Params, Example], Tensor]
"""``loss(params, example) -> scalar tensor``: the per-example loss."""

__all__ = ["Batch", "Example", "LossFn", "Params"]
