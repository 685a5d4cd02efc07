"""``write_report``: one self-contained HTML page of queries, their proponents and opponents."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from tracinfunc._artifacts import check_writable
from tracinfunc._validate import calling, entry_point
from tracinfunc.errors import InvalidArgumentError, OutputPathError
from tracinfunc.lm.tokens import TokenScores
from tracinfunc.query import score, self_influence, top_k
from tracinfunc.query.contrast import Contrast
from tracinfunc.report.html import PAGE, number, text, token_span
from tracinfunc.report.items import Shown, check_image_shape
from tracinfunc.store.protocols import GradientStore

__all__ = ["check_report_path", "write_report"]


@entry_point("write_report")
def write_report(path: str | os.PathLike, store: GradientStore, test_grads: Any, *,
                 k: int | None = None, train: Any = None, queries: Any = None,
                 train_labels: Any = None, query_labels: Any = None,
                 image_shape: tuple[int, ...] | None = None,
                 tokens: Mapping[int, TokenScores] | None = None,
                 decode: Callable[[int], str] | None = None, outliers: int | None = None,
                 overwrite: bool = False) -> Path:
    """Write one self-contained HTML file (no external URL, no script) a person can read.

    For each test row: the query, its ``k`` top proponents and opponents (``tif.top_k``'s
    rows and scores) with their labels and thumbnails or text, and, for queries in
    ``tokens``, the candidate documents with each token coloured by its score (green
    positive, red negative). Then the ``outliers`` rows of highest self-influence. Every
    user-provided string is HTML-escaped and bidi controls are shown, not obeyed.

    Args:
        path: A new ``.html`` file (outside any store or index).
        store: The training store.
        test_grads: As for ``tif.top_k``: ``[n_ckpt, n_test, k]`` or a GradientStore.
        k: Proponents and opponents per query, in ``[1, n_train]``; default
            ``min(10, n_train)``.
        train: How rows are shown: images ``[n_train, ...]`` (float), a list of strings, or
            a token batch ``{"input_ids": [n_train, T], ...}``; ``None``: row ids only.
        queries: The same for the ``n_test`` queries.
        train_labels, query_labels: Optional captions: one per row (a list, or a 1-D
            torch/NumPy/JAX array whose values are shown as numbers), or a mapping
            ``{row: label}`` (rows left out have no caption).
        image_shape: Reshape image items to this, ``(H, W)`` or ``(H, W, 3)`` holding as
            many values as one item (e.g. ``(8, 8)`` for flat 64-feature digits).
        tokens: ``{query: TokenScores}`` from ``tif.token_scores`` (one test row each).
            With ``rows`` each document's summed token scores must equal the query's score
            of that row (tokens made for another query are refused).
        decode: ``token id -> str`` for token batches (e.g. ``lambda t:
            tokenizer.decode([t])``); default: the ids.
        outliers: Rows of highest self-influence listed, in ``[0, n_train]`` (0: none);
            default ``min(20, n_train)``.
        overwrite: Replace an existing file at ``path``.

    Returns:
        The path written (atomically: a reader never sees half a page).

    Raises:
        OutputPathError: ``path`` exists, is inside a store/index, or its directory is
            missing.
        InvalidArgumentError: ``k`` or ``outliers`` out of range, ``image_shape`` that does
            not match the image items, labels or items that do not match the rows, or
            ``tokens`` whose document sums are not their query's scores of those rows.
        InvalidTypeError: labels that are not a list, a 1-D array or ``{row: label}``.
    """
    path = check_report_path(path, overwrite=overwrite)
    n_train = store.meta.n_train
    k = min(10, n_train) if k is None else k
    outliers = min(20, n_train) if outliers is None else outliers
    for name, value, low in (("k", k, 1), ("outliers", outliers, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= n_train:
            raise InvalidArgumentError(
                f"write_report: {name} must be an int in [{low}, {n_train}] (the store has "
                f"{n_train} rows), got {value!r}.")
    image_shape = check_image_shape(image_shape)
    styles: dict[str, str] = {}
    shown_train = Shown(train, train_labels, what="train", labels_name="train_labels",
                        image_shape=image_shape, decode=decode, styles=styles)
    shown_queries = Shown(queries, query_labels, what="queries", labels_name="query_labels",
                          image_shape=image_shape, decode=decode, styles=styles)
    shown_train.check_length(n_train)
    pro_values, pro_rows = top_k(store, test_grads, k=k, progress=False)
    opp_values, opp_rows = top_k(store, test_grads, k=k, largest=False, progress=False)
    shown_queries.check_length(pro_rows.shape[0])
    tokens = _check_tokens(tokens, pro_rows.shape[0], n_train)
    _check_token_sums(store, test_grads, tokens)
    contrast = test_grads.describe() if isinstance(test_grads, Contrast) else None
    sections = [_query_section(q, shown_queries, shown_train, (pro_values[q], pro_rows[q]),
                               (opp_values[q], opp_rows[q]), tokens.get(q), contrast)
                for q in range(pro_rows.shape[0])]
    if outliers:
        sections.append(_outlier_section(self_influence(store), outliers,
                                         shown_train))
    css = "".join(f".{key}{{background:url({uri}) 0 0/100% 100%}}\n"
                  for key, uri in styles.items())
    summary = (f"{pro_rows.shape[0]} queries against {n_train} training rows; top {k} "
               "proponents and opponents by TracIn score (tif.top_k)")
    if contrast is not None:
        summary += f" of a contrast: each query's score {contrast} (tif.Contrast)"
    body = f"<style>{css}</style>\n" + "\n".join(sections)
    page = PAGE.format(title="tracinfunc report", summary=text(summary), body=body)
    return _write_atomic(path, page)


def check_report_path(path: Any, *, overwrite: bool) -> Path:
    """``path`` as a Path if a report may be written there (before any work)."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise OutputPathError(f"write_report: {str(path)!r} must end in .html.")
    # The one writer guard: never inside or over a store, an index, a recording, ...
    with calling("write_report"):
        check_writable(path, "report file", overwrite=overwrite)
    if path.is_dir() or (path.exists() and not overwrite):
        raise OutputPathError(
            f"write_report: {str(path)!r} exists; choose another path or pass overwrite=True "
            "(a directory is never replaced).")
    if not path.resolve().parent.is_dir():
        raise OutputPathError(
            f"write_report: the directory of {str(path)!r} does not exist; create it.")
    return path


def _check_tokens(tokens: Any, n_test: int, n_train: int) -> dict[int, TokenScores]:
    if tokens is None:
        return {}
    if not isinstance(tokens, Mapping):
        raise InvalidArgumentError("write_report: tokens must be {query: TokenScores}.")
    for query, scores in tokens.items():
        if not isinstance(query, int) or not 0 <= query < n_test or not isinstance(
                scores, TokenScores) or scores.values.shape[0] != 1:
            raise InvalidArgumentError(
                f"write_report: tokens must map a query in [0, {n_test}) to the TokenScores "
                f"of that one query's test row, got {query!r}: {type(scores).__name__}.")
        if scores.rows is not None and len(scores.rows) and int(scores.rows.max()) >= n_train:
            raise InvalidArgumentError(
                f"write_report: tokens[{query}] explains row {int(scores.rows.max())} but the "
                f"store has {n_train} rows; pass token scores computed against this store.")
    return dict(tokens)


def _check_token_sums(store: GradientStore, test_grads: Any,
                      tokens: dict[int, TokenScores]) -> None:
    """Each document's summed token scores against the score of its query and row: token
    scores made for another query (or store) are refused, not written under this one."""
    checked = {q: s for q, s in tokens.items() if s.rows is not None and len(s.rows)}
    if not checked:
        return
    plain = test_grads.test if isinstance(test_grads, Contrast) else test_grads
    rows = sorted({int(r) for s in checked.values() for r in s.rows.tolist()})
    position = {row: i for i, row in enumerate(rows)}
    candidates = torch.tensor(rows).expand(_n_test(plain), len(rows))
    expected_all = torch.as_tensor(score(store, plain, candidates=candidates,
                                         progress=False)).double().cpu()  # [n_test, n_rows]
    for query, scores in checked.items():
        got = scores.document_scores()[0].double().cpu()  # [n_docs]
        expected = expected_all[query, [position[int(r)] for r in scores.rows.tolist()]]
        loose = store.meta.quantization is not None or store.meta.dtype in ("float16", "bfloat16")
        scale = float(expected.abs().max()) if expected.numel() else 0.0
        bad = ((got - expected).abs() > (1e-1 if loose else 1e-2) * scale + 1e-12).nonzero()
        if len(bad):
            doc = int(bad[0])
            raise InvalidArgumentError(
                f"write_report: tokens[{query}] document {doc} sums to {float(got[doc]):.6g} but "
                f"query {query} scores row {int(scores.rows[doc])} {float(expected[doc]):.6g}: "
                f"the token scores were made for another query or store; pass "
                f"tif.token_scores(store, <query {query}'s test row>, ...) as tokens[{query}].")


def _n_test(test_grads: Any) -> int:
    if hasattr(test_grads, "meta"):  # a GradientStore of test rows
        return test_grads.meta.n_train
    return int(test_grads.shape[1])


def _rows_table(kind: str, values: torch.Tensor, rows: torch.Tensor, shown: Shown) -> str:
    lines = [f'<table class="{kind}"><tr><th>#</th><th>row</th><th>score</th><th>label</th>'
             "<th>item</th></tr>"]
    for rank, (value, row) in enumerate(zip(values.tolist(), rows.tolist(), strict=True)):
        lines.append(f'<tr class="{kind}" data-row="{int(row)}"><td>{rank + 1}</td>'
                     f'<td>{int(row)}</td><td class="score">{number(value)}</td>'
                     f"<td>{shown.label(row)}</td><td>{shown.cell(row)}</td></tr>")
    lines.append("</table>")
    return "\n".join(lines)


def _query_section(q: int, queries: Shown, train: Shown, pro, opp,
                   tokens: TokenScores | None, contrast: str | None) -> str:
    note = "" if contrast is None else f'<p class="note">Contrast: {text(contrast)}</p>'
    head = (f'<section class="query" data-query="{q}"><h2>Query {q} {queries.label(q)}</h2>'
            f"{note}{queries.cell(q)}")
    tables = (f'<div class="cols"><div><h3>Proponents</h3>{_rows_table("pro", *pro, train)}'
              f'</div><div><h3>Opponents</h3>{_rows_table("opp", *opp, train)}</div></div>')
    return head + tables + (_token_block(tokens, train) if tokens is not None else "") + \
        "</section>"


def _token_block(scores: TokenScores, train: Shown) -> str:
    values = scores.values[0].double().cpu()  # [n_docs, T]
    lines = ["<h3>Training tokens, coloured by their share of the score</h3>"]
    for doc in range(values.shape[0]):
        finite = values[doc][torch.isfinite(values[doc])]
        scale = float(finite.abs().max()) if finite.numel() else 0.0
        row = "" if scores.rows is None else f"row {int(scores.rows[doc])}, "
        ids, mask = scores.input_ids[doc].tolist(), scores.scored[doc].tolist()
        tokens = "".join(token_span(train.token(t), v, scale) if m else text(train.token(t))
                         for t, v, m in zip(ids, values[doc].tolist(), mask, strict=True))
        lines.append(f'<p class="tokdoc" data-doc="{doc}">{row}score '
                     f"{number(float(values[doc].sum()))}</p><div class=\"doc\">{tokens}</div>")
    return "\n".join(lines)


def _outlier_section(influence: torch.Tensor, n: int, train: Shown) -> str:
    order = torch.argsort(torch.nan_to_num(influence.double(), nan=float("inf")),
                          descending=True)[:n]
    table = _rows_table("outlier", influence[order], order, train)
    return (f'<section class="outliers"><h2>Self-influence outliers (top {n})</h2>'
            f'<p class="note">Rows whose gradients are largest: often mislabelled or unusual '
            f"(NaN first).</p>{table}</section>")


def _write_atomic(path: Path, page: str) -> Path:
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.resolve().parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(page)
        umask = os.umask(0o022)  # mkstemp makes 0600; a page is for reading, as open() makes
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
