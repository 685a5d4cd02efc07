"""Scores that overflow their dtype: finite rows whose products do not fit it.

A store accepts any row whose norm fits float32, so two rows of norm 1e20 (an exploding
loss, or a model scaled by 1e20) have a dot product of 1e40 that float32 cannot hold:
``score`` and ``self_influence`` would return ``inf`` for it without a word. By
Cauchy-Schwarz no score exceeds ``sum_c |lr_c test_c| |train_c|``, so a query whose bound
fits (every ordinary one) pays nothing; one whose bound does not is checked block by block
and warns once, naming the rows and the way out (a float64 store).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from tracinfunc._validate import current_caller, user_stacklevel
from tracinfunc.query.rows import RowRange
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import GradientStore

__all__ = ["OverflowWatch", "warn_candidate_overflow", "warn_self_influence_overflow"]

_FIX = ("build the store and the test gradients with dtype='float64' to keep them finite, and "
        "check the loss for exploding gradients")


class OverflowWatch:
    """Checks score blocks for overflow when the rows' norms say one is possible.

    Args:
        store: The training store (its norms are read once, ``[n_ckpt, n_train]``).
        rows: The prepared test rows ``[n_ckpt, n_test, k]`` (``lr_c`` folded in).
        dtype: The dtype scores are accumulated in.
    """

    def __init__(self, store: GradientStore, rows: Tensor, dtype: torch.dtype) -> None:
        meta: StoreMeta = store.meta
        test = torch.linalg.vector_norm(rows.double(), dim=-1).amax(dim=-1)  # [n_ckpt]
        train = torch.stack([store.read_norms(c, 0, meta.n_train).double().amax()
                             for c in range(meta.n_ckpt)]).to(test.device)
        bound = float((test * train).sum())
        # A NaN bound (a crafted store's NaN norm) is checked too. Half the largest value:
        # accumulation rounding, and the block holding exactly the bound.
        self.active = not bound < torch.finfo(dtype).max / 2
        self._dtype, self._warned = dtype, False
        self._largest = (float(test.max()), float(train.max()))
        self._offset = store.start if isinstance(store, RowRange) else 0  # rows=: the store's

    def check(self, start: int, block: Tensor) -> None:
        """Warn (once) when ``block`` ``[n_test, rows]``, training rows from ``start``, holds
        a score that is not finite."""
        if not self.active or self._warned or bool(torch.isfinite(block).all()):
            return
        self._warned = True
        bad = ~torch.isfinite(block)
        columns = (bad.any(dim=0).nonzero().flatten()[:5] + start + self._offset).tolist()
        name = str(self._dtype).removeprefix("torch.")
        warnings.warn(
            f"{current_caller()}: {int(bad.sum())} score(s) overflowed {name} and are inf or "
            f"NaN (training rows {columns}{' and more' if bad.any(dim=0).sum() > 5 else ''}): "
            f"the largest learning-rate-weighted test row norm and training row norm are "
            f"{self._largest[0]:.3g} and {self._largest[1]:.3g}, whose products {name} cannot "
            f"hold. The other scores are right; these cannot be summed or correlated; {_FIX}.",
            RuntimeWarning, stacklevel=user_stacklevel())


def warn_self_influence_overflow(total: Tensor, first_row: int = 0) -> None:
    """Warn when self-influences ``[n]`` (rows from ``first_row``) overflowed their dtype."""
    bad = ~torch.isfinite(total)
    if not bool(bad.any()):
        return
    rows = (bad.nonzero().flatten()[:5] + first_row).tolist()
    name = str(total.dtype).removeprefix("torch.")
    warnings.warn(
        f"{current_caller()}: the self-influence of {int(bad.sum())} training row(s) (rows "
        f"{rows}{' and more' if int(bad.sum()) > len(rows) else ''}) overflowed {name} and is "
        f"inf or NaN: those rows' norms are too large for their squares to fit {name}. The "
        f"other rows' values are right; these cannot be summed or correlated; build the store with "
        f"dtype='float64' to keep them finite, and check the loss for exploding gradients.",
        RuntimeWarning, stacklevel=user_stacklevel())


def warn_candidate_overflow(scores: Tensor, candidates: Tensor) -> None:
    """Warn when scores ``[n_test, M]`` of the store rows ``candidates`` ``[n_test, M]``
    (``-1``: no candidate, ignored) are not finite: finite rows whose products overflowed."""
    bad = ~torch.isfinite(scores) & (candidates >= 0)
    if not bool(bad.any()):
        return
    rows = torch.unique(candidates[bad]).tolist()
    name = str(scores.dtype).removeprefix("torch.")
    warnings.warn(
        f"{current_caller()}: {int(bad.sum())} score(s) overflowed {name} and are inf or NaN "
        f"(training rows {rows[:5]}{' and more' if len(rows) > 5 else ''}): those rows' and "
        f"the test rows' norms are too large for their products to fit {name}. The other "
        f"scores are right; these cannot be summed or correlated; {_FIX}.",
        RuntimeWarning, stacklevel=user_stacklevel())
