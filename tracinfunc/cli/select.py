"""``tracinfunc select``: the training rows to keep, from saved scores (LESS's last step)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from tracinfunc.cli.results import check_output_path, write_results
from tracinfunc.errors import InvalidArgumentError
from tracinfunc.select.less import select_training_data

__all__ = ["add_select_command"]

_OUTPUTS = (".json", ".npy")


def add_select_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser,
                       positive_int) -> None:
    """Register ``select`` on the command line's subcommands."""
    select = commands.add_parser(
        "select", parents=[common],
        help="choose training rows from scores (LESS aggregation, or a plain top-k)")
    select.add_argument("scores", type=Path,
                        help="scores written by 'tracinfunc score' (.npy or .json): a matrix "
                             "[n_test, n_train] (LESS: use score --normalize) or a vector")
    amount = select.add_mutually_exclusive_group(required=True)
    amount.add_argument("--fraction", type=float, help="keep this fraction (LESS: 0.05)")
    amount.add_argument("--top-k", type=positive_int, help="keep this many rows")
    tasks = select.add_mutually_exclusive_group()
    tasks.add_argument("--tasks", type=Path, metavar="FILE.json",
                       help="a JSON list: the task of each test (validation) row")
    tasks.add_argument("--n-tasks", type=positive_int, metavar="N",
                       help="the test rows are N tasks of equal size, one after another")
    select.add_argument("--output", required=True, type=Path,
                        help=".json (indices and scores) or .npy (indices)")
    select.add_argument("--overwrite", action="store_true", help="replace an existing output")
    select.set_defaults(run=_select)


def _select(args: argparse.Namespace) -> int:
    if args.output.suffix not in _OUTPUTS:
        raise InvalidArgumentError(
            f"select: output {str(args.output)!r} must end in .json (indices and scores) or "
            ".npy (indices)."
        )
    check_output_path(args.output, overwrite=args.overwrite)
    scores = _read_scores(args.scores)
    tasks = _tasks(args, scores)
    chosen = select_training_data(scores, fraction=args.fraction, k=args.top_k, tasks=tasks)
    arrays = {"indices": chosen.indices}
    if args.output.suffix == ".json":
        arrays["scores"] = chosen.scores
    write_results(args.output, arrays, columns="vector")
    print(f"selected {chosen.indices.numel()} of {chosen.n_train} training rows; wrote "
          f"{args.output}")
    return 0


def _read_scores(path: Path) -> torch.Tensor:
    if path.suffix not in (".npy", ".json") or not path.is_file():
        raise InvalidArgumentError(
            f"select: scores {str(path)!r} must be a .npy or .json file written by "
            "'tracinfunc score --output' (or 'self-influence'); score the store first."
        )
    try:
        if path.suffix == ".npy":
            return torch.from_numpy(np.load(path, allow_pickle=False))
        data = json.loads(path.read_text())
        keys = sorted(data) if isinstance(data, dict) else []
        arrays = [data[k] for k in keys if k in ("scores", "self_influence")]
        if len(arrays) == 1:
            return torch.tensor(arrays[0], dtype=torch.float64)
    except (ValueError, TypeError, OSError, RuntimeError) as error:  # ragged, object, not JSON
        raise InvalidArgumentError(
            f"select: scores {str(path)!r} are not a numeric [n_test, n_train] or [n_train] "
            f"array ({error}); pass the file 'tracinfunc score --output' wrote."
        ) from error
    raise InvalidArgumentError(
        f"select: {str(path)!r} holds no 'scores' (keys: {keys[:5]}); write full scores "
        "with 'tracinfunc score' without --top-k, or 'tracinfunc self-influence'."
    )


def _tasks(args: argparse.Namespace, scores: torch.Tensor) -> list | None:
    if args.tasks is None and args.n_tasks is None:
        return None
    if scores.dim() != 2:
        raise InvalidArgumentError(
            "select: --tasks/--n-tasks group the rows of a score matrix [n_test, n_train], "
            f"but {str(args.scores)!r} holds a vector; leave them out."
        )
    if args.tasks is not None:
        try:
            labels = json.loads(args.tasks.read_text())
        except (ValueError, OSError) as error:
            raise InvalidArgumentError(
                f"select: --tasks {str(args.tasks)!r} is not a readable JSON file ({error}); "
                'write the labels as a JSON list, e.g. ["qa", "qa", "math"].'
            ) from error
        if not isinstance(labels, list):
            raise InvalidArgumentError(
                f"select: --tasks {str(args.tasks)!r} must hold a JSON list of task labels, "
                f"one per test row, got {type(labels).__name__}."
            )
        return [json.dumps(label) if isinstance(label, list | dict) else label
                for label in labels]
    n_test = scores.shape[0]
    if n_test % args.n_tasks:
        raise InvalidArgumentError(
            f"select: --n-tasks {args.n_tasks} does not divide the {n_test} test rows into "
            "equal tasks; pass --tasks FILE.json with each row's task instead."
        )
    return [row // (n_test // args.n_tasks) for row in range(n_test)]
