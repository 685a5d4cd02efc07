"""Merging partial top-k results (chunks of one scan, row ranges of workers) exactly."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tracinfunc._validate import check_int, entry_point
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError
from tracinfunc.interop import Array, as_tensor, framework_of, to_framework

__all__ = ["merge_sorted", "merge_top_k"]


@entry_point("merge_top_k")
def merge_top_k(parts: Sequence[tuple[Array, Array]], k: int, *, largest: bool = True
                ) -> tuple[Array, Array]:
    """Merge partial ``top_k`` results into the top-k of their union.

    Args:
        parts: ``(values, indices)`` pairs, each ``[n_test, k_i]``, indices being rows of the
            whole store (as ``top_k(..., rows=...)`` returns them): torch, NumPy, JAX or CuPy
            arrays (``top_k(..., output=...)``). Every part must come from the same test
            examples, and no row may appear in two parts (workers scan disjoint row ranges).
        k: Results kept per test example, ``>= 1``.
        largest: As in ``top_k``.

    Returns:
        ``(values, indices)`` ``[n_test, min(k, sum k_i)]`` sorted best first; equal values
        are ordered by row index, so the merge equals one scan of the whole store. In the
        framework of the first part's values.

    Raises:
        InvalidArgumentError: no parts, parts of other test sets (``n_test`` differs), values
            and indices of different shapes, or a row in more than one part (a part gathered
            twice, overlapping row ranges).
        InvalidTypeError: a part is not a ``(values, indices)`` pair of arrays, indices are
            not integers or values not floating point (the pair swapped).
    """
    if not parts:
        raise InvalidArgumentError("merge_top_k: parts is empty; pass at least one "
                                   "(values, indices) pair from top_k.")
    k = check_int(k, "k", fix="pass how many results to keep per test example")
    framework = _framework(parts[0])
    pairs = [_checked_pair(part, i) for i, part in enumerate(parts)]
    n_test = {v.shape[0] for v, _ in pairs}
    if len(n_test) > 1:
        raise InvalidArgumentError(
            f"merge_top_k: the parts hold results for different numbers of test examples "
            f"({[v.shape[0] for v, _ in pairs]}); merge only parts of one query (the same "
            "test gradients, each worker scanning its rows=)."
        )
    device = pairs[0][0].device
    values, indices = merge_sorted([(v.to(device), i.to(device)) for v, i in pairs], k,
                                   largest=largest, check_disjoint=True)
    return to_framework(values, framework), to_framework(indices, framework)


def merge_sorted(parts: Sequence[tuple[Tensor, Tensor]], k: int, *, largest: bool,
                 check_disjoint: bool = False) -> tuple[Tensor, Tensor]:
    """The merge itself on checked torch pairs (``top_k``'s running merge calls it per chunk).

    Two stable sorts: by row, then by value; equal values keep the row order.
    """
    values = torch.cat([v for v, _ in parts], dim=1)  # [n_test, sum k_i]
    indices = torch.cat([i.to(torch.long) for _, i in parts], dim=1)
    by_row = indices.argsort(dim=1, stable=True)
    values, indices = values.gather(1, by_row), indices.gather(1, by_row)
    if check_disjoint and indices.shape[1] > 1:
        same = indices[:, 1:] == indices[:, :-1]
        if bool(same.any()):
            test, col = (int(x) for x in same.nonzero()[0])
            raise InvalidArgumentError(
                f"merge_top_k: row {int(indices[test, col])} appears in more than one part "
                f"(test example {test}); each part must scan its own rows (a part passed twice, "
                "or overlapping rows= ranges: use tif.distributed.rank_rows)."
            )
    by_value = values.argsort(dim=1, descending=largest, stable=True)[:, :k]
    return values.gather(1, by_value), indices.gather(1, by_value)


def _framework(part: object) -> str:
    try:
        return framework_of(part[0])  # type: ignore[index]
    except (InvalidTypeError, TypeError, IndexError, KeyError):
        return "torch"  # _checked_pair names what is wrong


def _checked_pair(part: object, i: int) -> tuple[Tensor, Tensor]:
    if not isinstance(part, tuple | list) or len(part) != 2:
        raise InvalidTypeError(
            f"merge_top_k: part {i} must be a (values, indices) pair as top_k returns it, got "
            f"{type(part).__name__}."
        )
    try:
        values, indices = as_tensor(part[0]), as_tensor(part[1])
    except InvalidTypeError as e:
        raise InvalidTypeError(f"merge_top_k: part {i}: {e}") from None
    if not values.is_floating_point() or indices.is_floating_point() or indices.is_complex() \
            or indices.dtype == torch.bool:
        raise InvalidTypeError(
            f"merge_top_k: part {i} must be (values, indices) with floating-point values and "
            f"integer indices, got ({values.dtype}, {indices.dtype}); pass the pair in the "
            "order top_k returns it: (values, indices)."
        )
    if values.ndim != 2 or values.shape != indices.shape:
        raise InvalidArgumentError(
            f"merge_top_k: part {i}: values {list(values.shape)} and indices "
            f"{list(indices.shape)} must both be [n_test, k_i]; pass the (values, indices) "
            "pairs top_k returned."
        )
    return values, indices
