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

from tracinfunc._norms import directions
from tracinfunc._validate import current_caller
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError
from tracinfunc.interop import tensor_if_array
from tracinfunc.query.overflow import warn_candidate_overflow
from tracinfunc.query.prepared import PreparedQuery
from tracinfunc.store.gather import norms_at, read_rows_at
from tracinfunc.store.protocols import GradientStore, SupportsRowViews

__all__ = ["candidate_scores", "check_candidate_rows", "check_candidates"]

# Queries are scored in blocks of this many, each block by the cheapest of three products.
_QUERY_BLOCK = 64
# A copied (gathered) row element costs about as much as this many multiply-adds of a matrix
# product: measured 0.4-1 G elements/s copied against 50-60 G multiply-adds/s (1 CPU thread,
# k=650-1024), so a product over rows already in place beats copying most of them.
_COPY_COST = 100
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
        rows = [_integer(item, f"candidates[{i}]", at=(i,)) for i, item in enumerate(items)]
        lengths = {tuple(row.shape) for row in rows}
        if len(lengths) != 1 or len(next(iter(lengths))) != 1:
            raise InvalidArgumentError(
                f"{current_caller()}: a list of candidates must hold 1-D arrays of one length "
                f"M, got shapes {sorted(lengths)}; score queries with different M in separate "
                "calls (or pass a [n_test, M] array).")
        return torch.stack(rows)
    return _integer(candidates, "candidates")


def _integer(value: object, what: str, at: tuple[int, ...] = ()) -> Tensor:
    """``value`` as an integer tensor; ``at``: its position inside ``candidates``."""
    if isinstance(value, np.ndarray) and value.dtype.kind == "u" and value.size \
            and int(value.max()) > torch.iinfo(torch.int64).max:
        huge = value > torch.iinfo(torch.int64).max  # would wrap to a negative int64
        where = at + tuple(int(i) for i in np.unravel_index(int(np.argmax(huge)), value.shape))
        raise InvalidArgumentError(
            f"{current_caller()}: {what} hold {int(value[where[len(at):]])}, beyond any store "
            f"row, at {list(where)}; {_FIX}.")
    if isinstance(value, list | tuple) and not value:
        raise InvalidArgumentError(f"{current_caller()}: {what} are empty; give one row of "
                                   f"candidates per test example; {_FIX}.")
    try:
        value = tensor_if_array(value)
    except (TypeError, RuntimeError, BufferError) as error:  # object arrays, odd dtypes
        raise InvalidTypeError(f"{current_caller()}: {what} must be an integer array; "
                               f"{error}; {_FIX}.") from None
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
    the candidates is read once per checkpoint (an in-memory store's rows are used in place
    when the union is most of the store); each block of queries is then scored by the
    cheapest of three products (:func:`_plan`).
    """
    n_train, m = store.meta.n_train, candidates.shape[1]
    unique, position = torch.unique(candidates, return_inverse=True)  # sorted union
    if isinstance(store, SupportsRowViews) and 2 * len(unique) >= n_train:
        unique, position = None, candidates  # no copy of most of the store
    u = n_train if unique is None else len(unique)
    plans = [_plan(position[lo:lo + _QUERY_BLOCK], m, u, query.device)
             for lo in range(0, len(position), _QUERY_BLOCK)]
    total = torch.zeros(candidates.shape, dtype=query.dtype, device=query.device)
    for ckpt in range(store.meta.n_ckpt):
        rows = (store.view_rows(ckpt, 0, n_train) if unique is None
                else read_rows_at(store, ckpt, unique)).to(query.device, query.dtype)  # [u, k]
        if query.normalize:  # the store's side of the cosine, per row
            norms = (store.read_norms(ckpt, 0, n_train) if unique is None
                     else norms_at(store, ckpt, unique)).to(query.device, query.dtype)
            rows = directions(rows, norms)  # tiny rows from their own entries
        for lo, plan in zip(range(0, len(position), _QUERY_BLOCK), plans, strict=True):
            hi = lo + len(plan[2])
            part = _block_scores(rows, query.rows[ckpt, lo:hi], *plan)
            total[lo:hi] += query.scaled(ckpt, part)
    if not query.normalize:  # cosines are bounded
        warn_candidate_overflow(total, candidates, query, store)
    return total


def _plan(position: Tensor, m: int, u: int, device: torch.device, how: str | None = None
          ) -> tuple[str, Tensor | None, Tensor]:
    """How a block of ``b`` queries is scored, by the cheapest estimate in multiply-adds
    (a copied row element costs ``_COPY_COST``): ``"all"`` rows read (``b * u``, nothing
    copied), ``"union"`` of the block's own candidates (``b * u_b``, ``u_b`` rows copied),
    or ``"each"`` query's own rows (``b * M`` rows copied). Returns ``(how, rows of the
    block's union or None, positions)``."""
    b = len(position)
    block, local = torch.unique(position, return_inverse=True)
    costs = {"all": b * u, "union": (b + _COPY_COST) * len(block), "each": _COPY_COST * b * m}
    how = how or min(costs, key=costs.get)  # (tests choose ``how``)
    if how == "union":
        return how, block.to(device), local.to(device)
    return how, None, position.to(device)


def _block_scores(rows: Tensor, test: Tensor, how: str, block: Tensor | None,
                  position: Tensor) -> Tensor:
    """``[b, M]`` scores of a block of queries ``test`` ``[b, k]`` (see :func:`_plan`)."""
    if how == "each":  # [M, k] @ [k] per query
        return torch.stack([rows[index] @ row for index, row in zip(position, test,
                                                                      strict=True)])
    if how == "union":
        rows = rows[block]
    return (test @ rows.T).gather(1, position)  # [b, k] @ [k, u] -> [b, u] -> [b, M]
