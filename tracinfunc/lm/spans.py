"""Spans of training tokens: per-token scores summed over windows or given ranges."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tracinfunc._validate import as_int, check_int, entry_point
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError
from tracinfunc.lm.tokens import TokenScores

__all__ = ["Span", "span_scores", "top_spans"]


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, stop)`` of document ``document`` and their summed score, for test
    row ``test`` (the row of ``TokenScores.values`` the score belongs to).

    A frozen value, not a tuple: a list of spans is never mistaken for nested lists.
    """

    document: int
    start: int
    stop: int
    score: float
    test: int = 0


@entry_point("top_spans")
def top_spans(scores: TokenScores, *, width: int = 8, k: int = 5, query: int | None = None,
              largest: bool = True) -> list[Span]:
    """The ``k`` highest-scoring windows of ``width`` tokens of each test row, never
    overlapping in a document.

    Args:
        scores: From :func:`~tracinfunc.token_scores`, ``values`` ``[n_test, n_docs, T]``.
        width: Tokens per window, ``1 <= width <= T`` (the documents' length).
        k: Spans per test row (fewer when the documents hold fewer disjoint windows).
        query: One test row (``0 <= query < n_test``); ``None``: every test row.
        largest: ``False``: the most negative windows (opponent spans).

    Returns:
        One flat list: up to ``k`` :class:`Span` per test row, test row by test row
        (``Span.test`` says which), each row's best first (greedy: the best window, then the
        best one not overlapping a chosen window of the same document, ...). Scores of one
        test row give just its spans; no test row is left out.

    Raises:
        InvalidArgumentError: ``width`` outside ``[1, T]``, ``k`` not a positive int or
            ``query`` outside ``[0, n_test)``.
    """
    n_test, _, length = scores.values.shape
    width = check_int(width, "width", maximum=length, maximum_label="T",
                      fix="a window is at most the documents' length")
    k = check_int(k, "k", fix="pass how many spans to keep per test row")
    query = check_int(query, "query", minimum=0, maximum=n_test - 1, maximum_label="n_test - 1",
                      optional=True, fix="None gives every test row")
    tests = range(n_test) if query is None else [query]
    return [span for test in tests for span in _row_spans(scores, test, width, k, largest)]


def _row_spans(scores: TokenScores, test: int, width: int, k: int, largest: bool) -> list[Span]:
    """Test row ``test``'s best ``k`` disjoint windows (greedy, best first)."""
    sums = scores.values[test].double().unfold(1, width, 1).sum(-1)  # [n_docs, T - width + 1]
    order = torch.argsort(sums.flatten(), descending=largest, stable=True).tolist()
    taken: dict[int, list[int]] = {}
    chosen: list[Span] = []
    for flat in order:
        doc, start = divmod(flat, sums.shape[1])
        if any(abs(start - other) < width for other in taken.get(doc, [])):
            continue
        taken.setdefault(doc, []).append(start)
        chosen.append(Span(doc, start, start + width, float(sums[doc, start]), test))
        if len(chosen) == k:
            break
    return chosen


@entry_point("span_scores")
def span_scores(scores: TokenScores, spans: Sequence[tuple[int, int]]) -> Tensor:
    """Summed scores of given token ranges ``[(start, stop), ...]`` in every document.

    Returns:
        ``[n_test, n_docs, n_spans]``, the sums of ``values[..., start:stop]``.

    Raises:
        InvalidTypeError: a range is not two integers (floats and bools are refused, never
            truncated).
        InvalidArgumentError: a range is empty, reversed or beyond the documents' ``T``.
    """
    length = scores.values.shape[-1]
    checked = [_checked_span(span, length) for span in spans]
    if not checked:
        raise InvalidArgumentError("span_scores: spans is empty; pass [(start, stop), ...].")
    return torch.stack([scores.values[..., a:b].sum(-1) for a, b in checked], dim=-1)


def _checked_span(span: object, length: int) -> tuple[int, int]:
    try:
        bounds = () if isinstance(span, str) else tuple(span)  # a pair, array row or tensor row
    except TypeError:
        bounds = ()
    ints = tuple(as_int(x) for x in bounds)
    if len(ints) != 2 or None in ints:
        raise InvalidTypeError(
            f"span_scores: each span must be two ints (start, stop), got {span!r}; "
            "floats and bools are not token positions (use int(...) on whole numbers).")
    start, stop = ints
    if not 0 <= start < stop <= length:
        raise InvalidArgumentError(
            f"span_scores: span {bounds} must satisfy 0 <= start < stop <= {length} "
            "(the documents' length).")
    return start, stop
