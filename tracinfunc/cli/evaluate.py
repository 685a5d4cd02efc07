"""``tracinfunc evaluate``: the LDS of saved scores against a saved retraining run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tracinfunc.cli.results import check_output_path
from tracinfunc.evaluate import evaluate_lds_from_files

__all__ = ["add_evaluate_command"]


def add_evaluate_command(commands: argparse._SubParsersAction, common: argparse.ArgumentParser,
                         positive_int) -> None:
    """Register ``evaluate`` on the command line's subcommands."""
    evaluate = commands.add_parser(
        "evaluate", parents=[common],
        help="LDS of saved scores against retrained models (tracinfunc.evaluate)")
    evaluate.add_argument("scores", type=Path,
                          help="scores [n_test, n_train]: .npy (tracinfunc score --output) or .pt")
    evaluate.add_argument("retrain", type=Path,
                          help="Zarr group of a finished tracinfunc.evaluate.retrain_subsets run")
    evaluate.add_argument("--bootstrap", type=positive_int, default=1000,
                          help="bootstrap resamples of the subsets (default 1000)")
    evaluate.add_argument("--confidence", type=float, default=0.95,
                          help="level of the interval (default 0.95)")
    evaluate.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    evaluate.add_argument("--output", type=Path, default=None,
                          help="also write the result as JSON here")
    evaluate.add_argument("--overwrite", action="store_true", help="replace --output")
    evaluate.set_defaults(run=_evaluate)


def _evaluate(args: argparse.Namespace) -> int:
    if args.output is not None:
        check_output_path(args.output, overwrite=args.overwrite)
    result = evaluate_lds_from_files(args.scores, args.retrain, n_bootstrap=args.bootstrap,
                                     confidence=args.confidence, seed=args.seed)
    level = f"{100 * result.confidence:g}%"
    print(f"LDS {result.mean:.4f}  ({level} interval {result.low:.4f} .. {result.high:.4f}, "
          f"{result.n_subsets} subsets, {result.per_test.numel()} test examples)")
    if args.output is not None:
        args.output.write_text(json.dumps({
            "lds": result.mean, "low": result.low, "high": result.high,
            "confidence": result.confidence, "n_subsets": result.n_subsets,
            "per_test": [None if v != v else float(v) for v in result.per_test.tolist()],
        }, indent=1))
        print(f"wrote {args.output}")
    return 0
