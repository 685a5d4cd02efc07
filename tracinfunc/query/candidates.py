"""``candidates=``: score each test example against its own rows of the store only.

A candidate set is a ``[n_test, M]`` integer array (torch, NumPy, JAX, or a list of ``n_test``
equal-length 1-D arrays), or the ``(values, indices)`` of an earlier ``top_k`` /
``indexed_top_k`` / :func:`tracinfunc.rerank` (its ``indices`` are the candidates). Rows are
refused, never truncated or deduplicated: floats, booleans, negative or ``>= n_train``
indices, a row naming one training row twice, ``M = 0``, a ragged list. Only the union of
the candidate rows is read, once per checkpoint, in runs (:mod:`tracinfunc.store.gather`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from tracinfunc._validate import current_caller
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError
from tracinfunc.interop import tensor_if_array
from tracinfunc.query.checks import safe_reciprocal
from tracinfunc.query.prepared import PreparedQuery
from tracinfunc.store.gather import norms_at, read_rows_at
from tracinfunc.store.protocols import GradientStore

__all__ = ["candidate_scores", "check_candidate_rows", "check_candidates"]

# Queries are scored in blocks of this many. A block's scores against the union of its
# candidates ([b, u_b], one matrix product) are used when that union holds at most this many
# times M rows: a matrix product ran 60x more multiply-adds per second than gathering each
# query's rows (1 CPU thread, k=650-1024), so it wins unless most of its products are wasted.
_QUERY_BLOCK = 64
_DENSE_UNION_FACTOR = 32
_FIX = ("pass a [n_test, M] integer array of store rows, e.g. the indices of "
        "tif.top_k(cheap_store, cheap_test_grads, M)")


def check_candidates(candidates: object, n_train: int) -> Tensor:
    """``candidates`` as int64 CPU rows ``[n_test, M]``, each in ``[0, n_train)``, distinct
    within a row.

    Raises:
        InvalidTypeError: not an integer array (floats and booleans are refused, never cast),
            or not one of the accepted forms.
        InvalidArgumentError: not 2-D, ``M = 0``, ragged rows, an index out of range, or a
            row naming a training row twice.
    """
    rows = _as_rows(candidates)
    if rows.ndim != 2:
        raise InvalidArgumentError(
            f"{current_caller()}: candidates must be [n_test, M], got shape {list(rows.shape)}; "
            f"{_FIX}.")
    if rows.shape[1] == 0:
        raise InvalidArgumentError(
            f"{current_caller()}: candidates hold no rows (M=0); give every test example at "
            "least one candidate.")
    bad = (rows < 0) | (rows >= n_train)
    if bool(bad.any()):
        i, j = (int(v) for v in torch.nonzero(bad)[0])
        raise InvalidArgumentError(
            f"{current_caller()}: candidates must be rows of the store in [0, n_train={n_train})"
            f", got {int(rows[i, j])} at [{i}, {j}]; were they made for another (larger) "
            "store? Retrieve them from a store with the same training rows.")
    ordered = rows.sort(dim=1).values
    repeats = ordered[:, 1:] == ordered[:, :-1]
    if bool(repeats.any()):
        i, j = (int(v) for v in torch.nonzero(repeats)[0])
        raise InvalidArgumentError(
            f"{current_caller()}: candidates of test example {i} name row {int(ordered[i, j])} "
            "twice; scores are aligned with the candidates, so each row may appear once per "
            "test example (deduplicate them, e.g. with numpy.unique per row).")
    return rows


def check_candidate_rows(candidates: Tensor, n_test: int) -> None:
    """Refuse candidates for another number of test examples."""
    if candidates.shape[0] != n_test:
        raise InvalidArgumentError(
            f"{current_caller()}: candidates have {candidates.shape[0]} rows but there are "
            f"{n_test} test examples; give one row of candidates per test example.")


def _as_rows(candidates: object) -> Tensor:
    """The integer tensor inside any accepted form (unchecked ranges)."""
    array = isinstance(candidates, Tensor) or hasattr(candidates, "__dlpack__")
    if not array and not isinstance(candidates, tuple | list | str) \
            and hasattr(candidates, "indices"):  # a result object (tif.rerank's Reranked)
        return _integer(candidates.indices, "the indices of candidates")
    if isinstance(candidates, tuple | list) and candidates:
        items = [tensor_if_array(item) for item in candidates]
        if len(items) == 2 and all(isinstance(t, Tensor) and t.ndim == 2 for t in items):
            if items[1].is_floating_point() or not items[0].is_floating_point():
                raise InvalidTypeError(
                    f"{current_caller()}: a pair of 2-D arrays is read as (values, indices) "
                    f"of a top-k result, got dtypes ({items[0].dtype}, {items[1].dtype}); "
                    f"pass the indices alone as candidates.")
            return _integer(items[1], "the indices of candidates")
        rows = [_integer(item, f"candidates[{i}]") for i, item in enumerate(items)]
        lengths = {tuple(row.shape) for row in rows}
        if len(lengths) != 1 or len(next(iter(lengths))) != 1:
            raise InvalidArgumentError(
                f"{current_caller()}: a list of candidates must hold 1-D arrays of one length "
                f"M, got shapes {sorted(lengths)}; score queries with different M in separate "
                "calls (or pass a [n_test, M] array).")
        return torch.stack(rows)
    return _integer(candidates, "candidates")


def _integer(value: object, what: str) -> Tensor:
    value = tensor_if_array(value)
    if isinstance(value, list | tuple):
        try:
            value = torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError, RuntimeError) as error:
            raise InvalidTypeError(f"{current_caller()}: {what} must be an integer array; "
                                   f"{error}; {_FIX}.") from None
    if not isinstance(value, Tensor):
        raise InvalidTypeError(
            f"{current_caller()}: {what} must be an integer array (torch, NumPy, JAX) or a "
            f"top-k result (values, indices), got {type(value).__name__}; {_FIX}.")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise InvalidTypeError(
            f"{current_caller()}: {what} must hold integers, got {value.dtype}; indices are "
            f"never cast from {value.dtype} (a float would be truncated); {_FIX}.")
    return value.detach().to("cpu", torch.int64)


def candidate_scores(store: GradientStore, query: PreparedQuery, candidates: Tensor) -> Tensor:
    """TracIn scores ``[n_test, M]`` of each test row against its candidate rows.

    ``scores[i, j]`` is the score of test example ``i`` with store row ``candidates[i, j]``,
    what ``score()[i, candidates[i, j]]`` holds (up to the order of summation). The union of
    the candidates is read once per checkpoint; each block of queries then multiplies the
    rows its candidates name as one matrix product (rows shared by queries are multiplied
    once, at matrix-product speed) unless that union is much larger than ``M``.
    """
    unique, position = torch.unique(candidates, return_inverse=True)  # sorted union
    plans = [_plan(position[lo:lo + _QUERY_BLOCK], candidates.shape[1], query.device)
             for lo in range(0, len(position), _QUERY_BLOCK)]
    total = torch.zeros(candidates.shape, dtype=query.dtype, device=query.device)
    for ckpt in range(store.meta.n_ckpt):
        rows = read_rows_at(store, ckpt, unique).to(query.device, query.dtype)  # [u, k]
        if query.normalize:  # the store's side of the cosine, per row
            norms = norms_at(store, ckpt, unique).to(query.device, query.dtype)
            rows = rows * safe_reciprocal(norms)[:, None]
        for lo, (block, local) in zip(range(0, len(position), _QUERY_BLOCK), plans,
                                      strict=True):
            test = query.rows[ckpt, lo:lo + len(local)]  # [b, k]
            if block is None:  # each query's own rows: [M, k] @ [k] per query
                total[lo:lo + len(local)] += torch.stack(
                    [rows[index] @ row for index, row in zip(local, test, strict=True)])
            else:  # [b, k] @ [k, u_b] -> [b, u_b], then each query's own columns
                total[lo:lo + len(local)] += (test @ rows[block].T).gather(1, local)
    return total


def _plan(position: Tensor, m: int, device: torch.device) -> tuple[Tensor | None, Tensor]:
    """For a block of queries: ``(rows of the union its candidates name, positions in it)``
    when that union is small enough for one product, else ``(None, positions in all rows)``."""
    block, local = torch.unique(position, return_inverse=True)
    if len(block) <= _DENSE_UNION_FACTOR * m:
        return block.to(device), local.to(device)
    return None, position.to(device)
