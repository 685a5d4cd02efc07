"""Spans of training tokens: per-token scores summed over windows or given ranges."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from tracinfunc._validate import entry_point
from tracinfunc.errors import InvalidArgumentError
from tracinfunc.lm.tokens import TokenScores

__all__ = ["Span", "span_scores", "top_spans"]


class Span(NamedTuple):
    """Tokens ``[start, stop)`` of document ``document`` and their summed score."""

    document: int
    start: int
    stop: int
    score: float


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"top_spans: {name} must be a positive int, got {value!r}.")
    return value


@entry_point("top_spans")
def top_spans(scores: TokenScores, *, width: int = 8, k: int = 5, query: int = 0,
              largest: bool = True) -> list[Span]:
    """The ``k`` highest-scoring windows of ``width`` tokens, never overlapping in a document.

    Args:
        scores: From :func:`~tracinfunc.token_scores`.
        width: Tokens per window (cut to the documents' length).
        k: Spans returned (fewer when the documents hold fewer disjoint windows).
        query: Which test row's scores (``0 <= query < n_test``).
        largest: ``False``: the most negative windows (opponent spans).

    Returns:
        Up to ``k`` :class:`Span`, best first (greedy: the best window, then the best one
        not overlapping a chosen window of the same document, ...).
    """
    width, k = _positive("width", width), _positive("k", k)
    n_test = scores.values.shape[0]
    if isinstance(query, bool) or not isinstance(query, int) or not 0 <= query < n_test:
        raise InvalidArgumentError(
            f"top_spans: query must be an int in [0, {n_test}), got {query!r}.")
    values = scores.values[query].double()  # [n_docs, T]
    width = min(width, values.shape[1])
    sums = values.unfold(1, width, 1).sum(-1)  # [n_docs, T - width + 1]
    order = torch.argsort(sums.flatten(), descending=largest, stable=True).tolist()
    taken: dict[int, list[int]] = {}
    chosen: list[Span] = []
    for flat in order:
        doc, start = divmod(flat, sums.shape[1])
        if any(abs(start - other) < width for other in taken.get(doc, [])):
            continue
        taken.setdefault(doc, []).append(start)
        chosen.append(Span(doc, start, start + width, float(sums[doc, start])))
        if len(chosen) == k:
            break
    return chosen


@entry_point("span_scores")
def span_scores(scores: TokenScores, spans: Sequence[tuple[int, int]]) -> Tensor:
    """Summed scores of given token ranges ``[(start, stop), ...]`` in every document.

    Returns:
        ``[n_test, n_docs, n_spans]``, the sums of ``values[..., start:stop]``.

    Raises:
        InvalidArgumentError: a range is empty, reversed or beyond the documents' ``T``.
    """
    length = scores.values.shape[-1]
    checked = []
    for span in spans:
        start, stop = (int(x) for x in span)
        if not 0 <= start < stop <= length:
            raise InvalidArgumentError(
                f"span_scores: span {tuple(span)} must satisfy 0 <= start < stop <= {length} "
                "(the documents' length).")
        checked.append((start, stop))
    if not checked:
        raise InvalidArgumentError("span_scores: spans is empty; pass [(start, stop), ...].")
    return torch.stack([scores.values[..., a:b].sum(-1) for a, b in checked], dim=-1)
