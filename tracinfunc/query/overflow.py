"""Scores that overflow their dtype: finite rows whose products do not fit it.

A store accepts any row whose norm fits float32, so two rows of norm 1e20 (an exploding
loss, or a model scaled by 1e20) have a dot product of 1e40 that float32 cannot hold:
``score`` and ``self_influence`` would return ``inf`` for it without a word. By
Cauchy-Schwarz no score exceeds ``sum_c |lr_c test_c| |train_c|``, so a query whose bound
fits (every ordinary one) pays nothing; one whose bound does not is checked block by block
and warns once, when the query is done, naming every row and the way out.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from tracinfunc._norms import row_norms
from tracinfunc._validate import current_caller, user_stacklevel
from tracinfunc.errors import NonFiniteGradientError
from tracinfunc.query.prepared import PreparedQuery
from tracinfunc.query.rows import RowRange
from tracinfunc.store.gather import norms_at
from tracinfunc.store.protocols import GradientStore

__all__ = ["OverflowWatch", "largest_norm", "nan_scores_error", "overflow_advice",
           "warn_candidate_overflow", "warn_self_influence_overflow"]

_NAMED = 5  # rows named in a warning
_BROKEN = ("those rows hold NaN or inf values in the store (their norms are not finite). The "
           "other values are right; rebuild those rows, or leave them out with rows=.")


def largest_norm(rows: Tensor) -> float:
    """The largest row norm of ``rows`` ``[..., k]``, in float64 and without overflowing it
    (:func:`~tracinfunc._norms.row_norms`: a float64 row of 1e200 has norm 1e200, not the
    inf of its squares)."""
    return float(row_norms(rows.double()).max()) if rows.numel() else 0.0


def nan_scores_error() -> NonFiniteGradientError:
    """The error of a ranking over NaN scores (NaN sorts first: it would be "the best")."""
    return NonFiniteGradientError(
        f"{current_caller()}: some scores are NaN: the store holds inf or NaN rows (e.g. "
        "gradients beyond float16's range, 65504, stored as float16), or rows so large "
        "that their scores overflowed (a RuntimeWarning then names them). Rebuild it with "
        "dtype=torch.float32 (or bfloat16; float64 for the overflow), or scale the loss down.")


def overflow_advice(dtype: torch.dtype) -> str:
    """How to keep such scores finite, for scores computed in ``dtype``."""
    if dtype == torch.float64:
        return ("float64 cannot hold them either: the gradients are exploding; check the loss, "
                "or scale it down")
    return ("build the store and the test gradients with dtype='float64' to keep them finite, "
            "and check the loss for exploding gradients")


def _named(rows: list[int], total: int) -> str:
    return f"{rows[:_NAMED]}{' and more' if total > _NAMED else ''}"


class OverflowWatch:
    """Records score blocks that are not finite when the rows' norms say they may be (an
    overflow, or a row holding NaN or inf); :meth:`warn` reports them all, once (``score``,
    ``top_k``, ``score_chunks``).

    Args:
        store: The training store (its norms are read once, ``[n_ckpt, n_train]``).
        query: The prepared query (:class:`~tracinfunc.query.prepared.PreparedQuery`).
    """

    def __init__(self, store: GradientStore, query: PreparedQuery) -> None:
        meta, dtype = store.meta, query.dtype
        self.active = False
        self._caller = current_caller()  # a generator closed later runs outside the call
        self._rows: list[int] = []  # store rows with a score that is not finite (first few)
        self._n_rows = self._n_scores = 0
        self._broken_seen: list[int] = []  # of those, rows whose stored norm is NaN or inf
        if query.rows.is_meta:  # shapes without values (the tests' stand-in device)
            return
        norms = [store.read_norms(c, 0, meta.n_train).double() for c in range(meta.n_ckpt)]
        # [n_train]: rows holding NaN or inf (their norms say so); named as such, not as
        # overflows, and for cosine queries too
        self._broken = (torch.stack([~torch.isfinite(n) for n in norms]).any(dim=0)
                        if meta.n_train else torch.zeros(0, dtype=torch.bool))
        train = torch.tensor([float(n[torch.isfinite(n)].amax()) if bool(torch.isfinite(n).any())
                              else 0.0 for n in norms], dtype=torch.float64)
        self._dtype, self._store, self._query = dtype, store, query
        self._largest = float(train.max()) if len(train) else 0.0
        self._offset = store.start if isinstance(store, RowRange) else 0  # rows=: the store's
        if query.normalize:  # cosines are bounded by sum_c |lr_c| (1e39 overflows float32)
            bound = sum(abs(lr) for lr in query.lrs)  # unit rows: lr folded in or not
            self.active = bool(self._broken.any()) or not bound < torch.finfo(dtype).max / 2
            return
        # One pass in the rows' dtype (an overflowed norm is inf: checked, conservatively);
        # the exact largest norms are measured only for a warning.
        test = torch.tensor([float(torch.linalg.vector_norm(query.rows[c], dim=-1).amax())
                             * abs(query.scale(c)) if query.n_test else 0.0
                             for c in range(meta.n_ckpt)], dtype=torch.float64)
        bound = float((test * train).sum())
        # Half the largest value: accumulation rounding, and the block holding the bound.
        self.active = bool(self._broken.any()) or not bound < torch.finfo(dtype).max / 2

    def check(self, start: int, block: Tensor) -> None:
        """Record the scores of ``block`` ``[n_test, rows]`` (training rows from ``start``)
        that are not finite."""
        if not self.active or bool(torch.isfinite(block).all()):
            return
        bad = ~torch.isfinite(block)
        columns = bad.any(dim=0).nonzero().flatten() + start  # rows of the store (or range)
        self._n_scores += int(bad.sum())
        self._n_rows += len(columns)
        broken = columns[self._broken[columns]]
        if len(self._broken_seen) < _NAMED:
            self._broken_seen += (broken[:_NAMED] + self._offset).tolist()
        if len(self._rows) < _NAMED:
            self._rows += (columns[:_NAMED] + self._offset).tolist()

    def warn(self) -> None:
        """Warn once for everything recorded (nothing when nothing was)."""
        if not self._n_scores:
            return
        name = str(self._dtype).removeprefix("torch.")
        n_scores, self._n_scores = self._n_scores, 0  # warned once, however often called
        rows = _named(sorted(self._rows), self._n_rows)
        if self._broken_seen and set(self._rows) <= set(self._broken_seen):
            message = f"{n_scores} score(s) are NaN or inf (training rows {rows}): {_BROKEN}"
        else:
            broken = (f" Training rows {sorted(self._broken_seen)} hold NaN or inf values in "
                      f"the store." if self._broken_seen else "")
            lrs = max(abs(lr) for lr in self._query.lrs)
            sizes = (f"the learning rates (up to {lrs:.3g}) times cosines" if
                     self._query.normalize else
                     f"the largest learning-rate-weighted test row norm (learning rates up to "
                     f"{lrs:.3g}) and training row norm are {_test_norm(self._query):.3g} and "
                     f"{self._largest:.3g}, whose products")
            message = (f"{n_scores} score(s) overflowed {name} and are inf or NaN (training "
                       f"rows {rows}): {sizes} {name} cannot hold.{broken} The "
                       f"other scores are right; these cannot be summed or correlated; "
                       f"{overflow_advice(self._dtype)}.")
        warnings.warn(f"{self._caller}: {message}", RuntimeWarning,
                      stacklevel=user_stacklevel())

    def warn_search(self) -> bool:
        """Warn, before a FAISS search, that rows whose scores may overflow float32 may be
        missing from its candidates (it leaves out inf and NaN products), naming them; whether
        it warned."""
        if not self.active:
            return False
        meta, query = self._store.meta, self._query
        test = [largest_norm(query.rows[c]) * abs(query.scale(c)) for c in range(meta.n_ckpt)]
        reach = sum(self._store.read_norms(c, 0, meta.n_train).double() * test[c]
                    for c in range(meta.n_ckpt))  # [n_train]: each row's score bound
        if bool((reach < torch.finfo(torch.float32).max / 2).all()):
            return False  # the float32 norms alone had overflowed: nothing is at risk
        risky = (~(reach < torch.finfo(torch.float32).max / 2) & ~self._broken)
        risky = risky.nonzero().flatten()
        if not len(risky):
            return False
        rows = (risky[:_NAMED] + self._offset).tolist()
        warnings.warn(
            f"{self._caller}: training rows {_named(rows, len(risky))} have norms (up to "
            f"{self._largest:.3g}) whose scores with these test rows (norms up to "
            f"{_test_norm(self._query):.3g}) can overflow float32; the index searches in "
            f"float32 and leaves such rows out of its candidates, so they may be missing from "
            f"the result. tif.top_k is exact and names overflowed scores; "
            f"{overflow_advice(torch.float32)}.",
            RuntimeWarning, stacklevel=user_stacklevel())
        return True


def warn_self_influence_overflow(total: Tensor, store: GradientStore, first_row: int = 0, *,
                                 curvature: bool = False) -> None:
    """Warn when self-influences ``[n]`` of ``store``'s rows (from ``first_row`` of the store
    it is a range of) are not finite: rows holding NaN or inf, or values that overflowed
    their dtype (``curvature``: they were preconditioned)."""
    bad = ~torch.isfinite(total)
    if not bool(bad.any()):
        return
    positions = bad.nonzero().flatten().cpu()
    broken = torch.zeros(len(positions), dtype=torch.bool)
    for c in range(store.meta.n_ckpt):  # the bad rows' stored norms: NaN or inf rows?
        broken |= ~torch.isfinite(norms_at(store, c, positions))
    name = str(total.dtype).removeprefix("torch.")
    if bool(broken.all()):
        rows = (positions[:_NAMED] + first_row).tolist()
        message = (f"the self-influence of {len(positions)} training row(s) (rows "
                   f"{_named(rows, len(positions))}) is NaN or inf: {_BROKEN}")
    else:
        over = positions[~broken]
        rows = (over[:_NAMED] + first_row).tolist()
        lrs = max(abs(info.lr) for info in store.meta.checkpoints)
        cause = (f"those rows preconditioned by the curvature (a small damping divides by it) "
                 f"give values {name} cannot hold" if curvature else
                 f"the learning rates (up to {lrs:.3g}) times those rows' squared norms (up to "
                 f"{_largest_square(store, over):.3g}) do not fit {name}")
        advice = overflow_advice(total.dtype).replace(" and the test gradients", "")
        if curvature and total.dtype != torch.float64:
            advice = f"raise the damping, or {advice}"
        message = (f"the self-influence of {len(over)} training row(s) (rows "
                   f"{_named(rows, len(over))}) overflowed {name} and is inf or NaN: {cause}. "
                   f"The other rows' values are right; these cannot be summed or correlated; "
                   f"{advice}.")
    warnings.warn(f"{current_caller()}: {message}", RuntimeWarning,
                  stacklevel=user_stacklevel())


def warn_candidate_overflow(scores: Tensor, candidates: Tensor, query: PreparedQuery,
                            store: GradientStore) -> None:
    """Warn when scores ``[n_test, M]`` of the rows ``candidates`` ``[n_test, M]`` of
    ``store`` (``-1``: no candidate, ignored) are not finite: finite rows whose products
    overflowed; ``query`` holds their test rows."""
    bad = ~torch.isfinite(scores) & (candidates >= 0)
    if not bool(bad.any()):
        return
    named = torch.unique(candidates[bad]).cpu()
    store_norm = max(float(norms_at(store, c, named).double().amax())
                     for c in range(store.meta.n_ckpt))
    rows = named.tolist()
    name = str(scores.dtype).removeprefix("torch.")
    warnings.warn(
        f"{current_caller()}: {int(bad.sum())} score(s) overflowed {name} and are inf or NaN "
        f"(training rows {_named(rows, len(rows))}): the largest learning-rate-weighted test "
        f"row norm and candidate row norm are {_test_norm(query):.3g} and "
        f"{store_norm:.3g}, whose products {name} cannot hold. The other scores are right; "
        f"these cannot be summed or correlated; {overflow_advice(scores.dtype)}.",
        RuntimeWarning, stacklevel=user_stacklevel())


def _test_norm(query: PreparedQuery) -> float:
    """The largest learning-rate-weighted test row norm of ``query``."""
    return max(largest_norm(query.rows[c]) * abs(query.scale(c))
               for c in range(query.rows.shape[0]))


def _largest_square(store: GradientStore, rows: Tensor) -> float:
    """The largest squared norm of store ``rows`` (sorted int64) over the checkpoints."""
    return max(float(norms_at(store, c, rows).double().square().amax())
               for c in range(store.meta.n_ckpt))
