"""A contrastive query: test gradients minus a weighted control set's, as one query value.

``tif.Contrast(test_grads, control, weight=1.0)`` is passed where test gradients go
(``score``, ``top_k``, ``score_chunks``, ``indexed_top_k``, ``rerank``), so every query
function takes it without a new keyword, and :func:`~tracinfunc.query.prepared.prepare_query`
applies it once. Scores are linear in the query, so

* shared controls (``paired=False``, default): ``score(Contrast(test, control, weight=w))
  = score(test) - w * mean_j score(control_j)``, one control set ``[n_ckpt, n_ctrl, k]``
  averaged for every test example;
* paired controls (``paired=True``): ``... = score(test) - w * score(control)`` row for row,
  controls ``[n_ckpt, n_test, k]``, control ``i`` for test example ``i``.

With ``normalize=True`` each test and control row is unit-normalised before they are
combined (so the identities above hold for cosine scores too), and with ``curvature=`` both
are preconditioned by it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tracinfunc._validate import current_caller
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError
from tracinfunc.interop import tensor_if_array
from tracinfunc.store.protocols import GradientStore

__all__ = ["Contrast"]


@dataclass(frozen=True, repr=False)
class Contrast:
    """Test gradients contrasted with control gradients: ``test - weight * control``.

    Attributes:
        test: The test gradients, as ``score`` takes them: a GradientStore or an array
            ``[n_ckpt, n_test, k]`` made with ``projection=store.projection``.
        control: Control gradients made the same way: ``[n_ckpt, n_ctrl, k]`` averaged over
            ``n_ctrl`` (shared), or ``[n_ckpt, n_test, k]`` with ``paired=True``.
        weight: How much of the control to subtract, a finite real number (``0``: none).
        paired: Control row ``i`` belongs to test example ``i`` (no averaging).
        name: The control set's name, recorded in results (e.g. the CLI's ``--contrast``).

    Example:
        >>> query = tif.Contrast(test_grads, generic_grads, weight=1.0, name="generic")
        >>> values, indices = tif.top_k(store, query, 10)
    """

    test: object
    control: object
    weight: float = 1.0
    paired: bool = False
    name: str | None = field(default=None)

    def __post_init__(self) -> None:
        for label in ("test", "control"):
            value = tensor_if_array(getattr(self, label))
            if isinstance(value, Contrast) or not isinstance(value, Tensor | GradientStore):
                raise InvalidTypeError(
                    f"{current_caller('Contrast')}: {label} must be a GradientStore or an array "
                    f"[n_ckpt, n, k], got {type(value).__name__}.")
            object.__setattr__(self, label, value)
        weight = tensor_if_array(self.weight)
        if isinstance(weight, Tensor) and weight.ndim == 0 and weight.dtype != torch.bool:
            weight = weight.item()  # a 0-d torch, NumPy or JAX number
        if (isinstance(weight, bool) or not isinstance(weight, numbers.Real)
                or not math.isfinite(float(weight))):
            raise InvalidArgumentError(
                f"{current_caller('Contrast')}: weight must be a finite real number, got "
                f"{weight!r}; e.g. weight=1.0 subtracts the whole control.")
        object.__setattr__(self, "weight", float(weight))
        if not isinstance(self.paired, bool):
            raise InvalidTypeError(f"{current_caller('Contrast')}: paired must be True or "
                                   f"False, got {self.paired!r}.")
        if self.name is not None and not isinstance(self.name, str):
            raise InvalidTypeError(f"{current_caller('Contrast')}: name must be a str or None, "
                                   f"got {type(self.name).__name__}.")

    def describe(self) -> str:
        """One line for results: ``"minus 1 x mean of control 'generic' (8 rows)"``."""
        n = _rows(self.control)
        how = "paired control" if self.paired else "mean of control"
        label = f" {self.name!r}" if self.name else ""
        return f"minus {self.weight:g} x {how}{label} ({n} rows)"

    def __repr__(self) -> str:
        return (f"Contrast(test={_shape(self.test)}, control={_shape(self.control)}, "
                f"weight={self.weight:g}, paired={self.paired}, name={self.name!r})")


def _rows(value: object) -> int:
    return value.meta.n_train if isinstance(value, GradientStore) else int(value.shape[1]) \
        if value.ndim > 1 else 0


def _shape(value: object) -> str:
    if isinstance(value, GradientStore):
        meta = value.meta
        return f"store[{meta.n_ckpt}, {meta.n_train}, {meta.k}]"
    return f"array{list(value.shape)}"
