"""Merging partial top-k results (chunks of one scan, row ranges of workers) exactly."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tracinfunc.errors import InvalidArgumentError

__all__ = ["merge_top_k"]


def merge_top_k(parts: Sequence[tuple[Tensor, Tensor]], k: int, *, largest: bool = True
                ) -> tuple[Tensor, Tensor]:
    """Merge partial ``top_k`` results into the top-k of their union.

    Args:
        parts: ``(values, indices)`` pairs, each ``[n_test, k_i]``, indices being rows of the
            whole store (as ``top_k(..., rows=...)`` returns them).
        k: Results kept per test example.
        largest: As in ``top_k``.

    Returns:
        ``(values, indices)`` ``[n_test, min(k, sum k_i)]`` sorted best first; equal values
        are ordered by row index, so the merge equals one scan of the whole store.
    """
    if not parts:
        raise InvalidArgumentError("merge_top_k: parts is empty; pass at least one "
                                   "(values, indices) pair from top_k.")
    values = torch.cat([v for v, _ in parts], dim=1)  # [n_test, sum k_i]
    indices = torch.cat([i.to(torch.long) for _, i in parts], dim=1)
    if values.shape != indices.shape:
        raise InvalidArgumentError(
            f"merge_top_k: values {list(values.shape)} and indices {list(indices.shape)} "
            "differ in shape; pass the (values, indices) pairs top_k returned."
        )
    # Two stable sorts: by row, then by value; equal values keep the row order.
    by_row = indices.argsort(dim=1, stable=True)
    values, indices = values.gather(1, by_row), indices.gather(1, by_row)
    by_value = values.argsort(dim=1, descending=largest, stable=True)[:, :k]
    return values.gather(1, by_value), indices.gather(1, by_value)
