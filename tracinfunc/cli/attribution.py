"""``tracinfunc tokens`` (per-token scores of the top candidates) and ``tracinfunc report``."""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tracinfunc.build.torch import build_store
from tracinfunc.cli.results import check_output_path
from tracinfunc.cli.spec import Spec, SpecError, load_spec
from tracinfunc.errors import InvalidArgumentError
from tracinfunc.grads.options import GradientOptions
from tracinfunc.lm.spans import top_spans
from tracinfunc.lm.tokens import token_scores
from tracinfunc.query import top_k
from tracinfunc.report.write import check_report_path, write_report
from tracinfunc.store.protocols import GradientStore
from tracinfunc.store.zarr.paths import open_store
from tracinfunc.store.zarr.urls import location

__all__ = ["add_attribution_commands"]


def add_attribution_commands(commands: argparse._SubParsersAction,
                             common: argparse.ArgumentParser, positive_int) -> None:
    """Register ``tokens`` and ``report`` on the command line's subcommands."""
    tokens = commands.add_parser(
        "tokens", parents=[common],
        help="per-token scores of each test row's top training documents (causal LMs)")
    _query_arguments(tokens)
    tokens.add_argument("--top-k", type=positive_int, default=10,
                        help="candidate documents per test row (default 10)")
    tokens.add_argument("--span", type=positive_int, default=8, metavar="WIDTH",
                        help="tokens per reported span (default 8)")
    tokens.add_argument("--output", required=True, type=Path, help=".json")
    tokens.add_argument("--overwrite", action="store_true", help="replace an existing output")
    tokens.set_defaults(run=_tokens)

    report = commands.add_parser(
        "report", parents=[common],
        help="one self-contained HTML page: queries, proponents, opponents, outliers")
    _query_arguments(report)
    report.add_argument("--top-k", type=positive_int, default=None,
                        help="proponents and opponents per test row, at most the store's "
                             "rows (default 10, or all rows if fewer)")
    report.add_argument("--outliers", type=int, default=None,
                        help="rows of highest self-influence listed, at most the store's "
                             "rows (default 20, or all rows if fewer; 0: none)")
    report.add_argument("--image-shape", type=_shape, metavar="HxW",
                        help="show training inputs as images of this shape, e.g. 8x8")
    report.add_argument("--output", required=True, type=Path, help=".html")
    report.add_argument("--overwrite", action="store_true", help="replace an existing output")
    report.set_defaults(run=_report)


def _query_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", type=location)
    parser.add_argument("--spec", required=True, help="file.py:function or module:function")
    parser.add_argument("--test", default="test", help="name of the spec's test set")


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) not in (2, 3) or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected HxW (e.g. 8x8), got {text!r}")
    return shape


def _setup(args: argparse.Namespace) -> tuple[GradientStore, Spec, Any, GradientStore]:
    store = open_store(str(args.store))
    spec = load_spec(args.spec)
    if not spec.test or args.test not in spec.test:
        raise SpecError(f"the spec has no test set {args.test!r}; it has "
                        f"{sorted(spec.test or {})}.")
    if not spec.checkpoints:
        raise SpecError("the spec has no checkpoints; return the store's checkpoints in "
                        "Spec.checkpoints.")
    select = GradientOptions(select=[name for name, _ in store.meta.layout])
    test = build_store(spec.loss, spec.checkpoints, spec.test[args.test],
                       projection=store.projection, options=select,
                       progress=False if args.quiet else None)
    return store, spec, spec.test[args.test], test


def _tokens(args: argparse.Namespace) -> int:
    if args.output.suffix != ".json":
        raise InvalidArgumentError(f"output {str(args.output)!r} must end in .json.")
    check_output_path(args.output, overwrite=args.overwrite)
    store, spec, _, test = _setup(args)
    if not isinstance(spec.train, Mapping) or "input_ids" not in spec.train:
        raise SpecError("tokens needs Spec.train as one token batch {'input_ids': [n, T], "
                        "...} (the rows of the store, in order).")
    _, rows = top_k(store, test, k=min(args.top_k, store.meta.n_train),
                    progress=False if args.quiet else None)
    records = []
    for query in range(rows.shape[0]):
        rows_q = rows[query]
        docs = {key: value[rows_q] for key, value in spec.train.items()}
        one = [test.read_rows(c, query, query + 1) for c in range(store.meta.n_ckpt)]
        scores = token_scores(store, torch.stack(one), spec.loss, spec.checkpoints, docs,
                              rows=rows_q)
        records.append(_record(query, scores, args.span))
    _write_json(args.output, records)
    print(f"wrote {args.output}")
    return 0


def _record(query: int, scores, width: int) -> dict:
    values = scores.values[0]
    documents = [{"row": int(row), "score": _finite(float(values[i].sum())),
                  "tokens": scores.input_ids[i].tolist(),
                  "token_scores": [_finite(v) for v in values[i].tolist()]}
                 for i, row in enumerate(scores.rows.tolist())]
    spans = [{"row": int(scores.rows[span.document]), "start": span.start, "stop": span.stop,
              "score": _finite(span.score)} for span in top_spans(scores, width=width, k=10)]
    return {"query": query, "documents": documents, "top_spans": spans}


def _finite(value: float) -> float | None:
    """JSON has no NaN or infinity: a non-finite score is written as null."""
    return value if math.isfinite(value) else None


def _write_json(path: Path, records: list) -> None:
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.resolve().parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump(records, file, allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _report(args: argparse.Namespace) -> int:
    check_report_path(args.output, overwrite=args.overwrite)
    store, spec, queries, test = _setup(args)
    train_items, train_labels = _shown(spec.train, args.image_shape)
    query_items, query_labels = _shown(queries, args.image_shape)
    write_report(args.output, store, test, k=args.top_k, train=train_items,
                 train_labels=train_labels, queries=query_items, query_labels=query_labels,
                 image_shape=args.image_shape, outliers=args.outliers,
                 overwrite=args.overwrite)
    print(f"wrote {args.output}")
    return 0


def _shown(data: Any, image_shape: tuple[int, ...] | None) -> tuple[Any, Any]:
    """Items and labels of a spec's batch: ``(x, y)`` pairs, token batches, else nothing.

    Float inputs are shown as images with ``--image-shape`` or when they are images
    ``[n, H, W]`` / ``[n, H, W, 3]``; other (tabular) rows are shown by row id and label.
    """
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], Tensor):
        inputs, labels = data
        images = image_shape is not None or inputs.dim() == 3 or (
            inputs.dim() == 4 and inputs.shape[-1] == 3)
        items = inputs if inputs.is_floating_point() and images else None
        return items, [str(v) for v in labels.tolist()] if labels.dim() == 1 else None
    if isinstance(data, Mapping) and "input_ids" in data:
        return dict(data), None
    return None, None
