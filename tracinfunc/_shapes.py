"""Loaded weights against the live model: the shapes must agree, as ``load_state_dict`` checks.

A state dict of another model (hidden size 64 instead of 8) or a LoRA file of another rank
has every name the model expects, so only the shapes tell it apart; loading it anyway gives
gradients of another model (and, for LoRA, a live ``lora_alpha / r`` scaling that no longer
fits the loaded weights).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from tracinfunc._validate import current_caller
from tracinfunc.errors import InvalidArgumentError

__all__ = ["check_loaded_shapes"]


def check_loaded_shapes(pairs: Iterable[tuple[str, Tensor, Tensor]], *, hint: str) -> None:
    """Raise unless each loaded tensor has its model tensor's shape.

    Args:
        pairs: ``(name, the model's tensor, the loaded tensor)`` for every entry loaded.
        hint: How to fix a mismatch, e.g. "load it into the model it was saved from".

    Raises:
        InvalidArgumentError: a shape differs; names the first parameter, both shapes, and
            how many differ.
    """
    wrong = [(name, list(ours.shape), list(loaded.shape))
             for name, ours, loaded in pairs if ours.shape != loaded.shape]
    if wrong:
        name, expected, got = wrong[0]
        more = f" ({len(wrong)} tensors differ, e.g. {[w[0] for w in wrong[:3]]})" if len(
            wrong) > 1 else ""
        raise InvalidArgumentError(
            f"{current_caller('Checkpoint')}: parameter {name!r} has shape {got} in the loaded "
            f"weights but {expected} in the model{more}; {hint}"
        )
