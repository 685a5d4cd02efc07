"""Mislabel detection: how many flipped labels an inspector finds, in order of a ranking.

The TracIn paper's experiment: inspect training examples in descending self-influence (or
any other suspicion score) and count the flipped labels found after each one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tracinfunc.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["MislabelCurve", "mislabel_curve"]


@dataclass(frozen=True)
class MislabelCurve:
    """Fraction of flipped labels found against fraction of the training data inspected.

    Attributes:
        inspected: ``[n_train + 1]`` float64, ``0, 1/n, ..., 1``.
        found: ``[n_train + 1]`` float64, fraction of flipped examples among the first
            ``i`` inspected (``found[0] = 0``, ``found[-1] = 1``).
        auc: Area under the curve (trapezoids over ``inspected``): 1 - n_flipped / (2 n)
            for a perfect ranking, about 0.5 for a random one.
    """

    inspected: Tensor
    found: Tensor
    auc: float

    def found_at(self, fraction: float) -> float:
        """Fraction of flips found after inspecting ``fraction`` of the data (rounded down)."""
        n = len(self.inspected) - 1
        return self.found[int(fraction * n)].item()


def mislabel_curve(suspicion: Tensor, flipped: Tensor) -> MislabelCurve:
    """The mislabel-detection curve of a ranking by descending ``suspicion``.

    Args:
        suspicion: ``[n_train]`` real scores, larger inspected first (e.g.
            :func:`tracinfunc.self_influence`). Ties are inspected in index order.
        flipped: The flipped examples: a bool mask ``[n_train]`` or int indices ``[n_flip]``.

    Returns:
        A :class:`MislabelCurve`.

    Raises:
        InvalidTypeError: ``suspicion`` or ``flipped`` is not a 1-D tensor of the right kind.
        InvalidArgumentError: The mask's length differs from ``n_train``, an index is out of
            range, or nothing is flipped.
    """
    mask = _flipped_mask(suspicion, flipped)
    # stable: ties keep index order, so the curve is a function of the arguments only
    order = torch.sort(suspicion.detach().cpu().double(), descending=True, stable=True).indices
    hits = mask[order].double().cumsum(0) / mask.sum()
    n = len(mask)
    found = torch.cat([hits.new_zeros(1), hits])
    inspected = torch.arange(n + 1, dtype=torch.float64) / n
    auc = torch.trapezoid(found, inspected).item()
    return MislabelCurve(inspected=inspected, found=found, auc=auc)


def _flipped_mask(suspicion: object, flipped: object) -> Tensor:
    if not isinstance(suspicion, Tensor) or suspicion.dim() != 1 or suspicion.is_complex():
        got = tuple(suspicion.shape) if isinstance(suspicion, Tensor) else type(suspicion).__name__
        raise InvalidTypeError(
            f"mislabel_curve: suspicion must be a real 1-D tensor [n_train], got {got}; pass "
            "e.g. tracinfunc.self_influence(store)."
        )
    n = len(suspicion)
    if not isinstance(flipped, Tensor) or flipped.dim() != 1 or flipped.is_floating_point():
        got = tuple(flipped.shape) if isinstance(flipped, Tensor) else type(flipped).__name__
        raise InvalidTypeError(
            f"mislabel_curve: flipped must be a bool mask [n_train] or int indices [n_flip], "
            f"got {got}; e.g. torch.tensor([3, 17])."
        )
    if flipped.dtype == torch.bool:
        if len(flipped) != n:
            raise InvalidArgumentError(
                f"mislabel_curve: expected a flipped mask of length n_train={n}, got "
                f"{len(flipped)}; build it over the same training rows as suspicion."
            )
        mask = flipped.cpu()
    else:
        if len(flipped) and (flipped.min() < 0 or flipped.max() >= n):
            raise InvalidArgumentError(
                f"mislabel_curve: expected flipped indices in [0, {n}), got range "
                f"[{flipped.min().item()}, {flipped.max().item()}]; index the training rows."
            )
        mask = torch.zeros(n, dtype=torch.bool)
        mask[flipped.cpu()] = True
    if not mask.any():
        raise InvalidArgumentError(
            "mislabel_curve: expected at least one flipped example, got none; pass the "
            "indices (or mask) of the training examples whose labels were changed."
        )
    return mask
