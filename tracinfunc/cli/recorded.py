"""``--recorded DIR`` and ``--preconditioner KIND``: checkpoints and optimizer state recorded
while training (``tif.training.CheckpointRecorder``, ``tif.trainer_callback``) on the command
line, for LESS (``adam``) and TrackStar (``trackstar``) stores."""

from __future__ import annotations

import argparse
from pathlib import Path

from tracinfunc.checkpoint import Checkpoint
from tracinfunc.cli.spec import Spec, SpecError
from tracinfunc.precondition.optimizer import PRECONDITIONER_KINDS, Preconditioner
from tracinfunc.training.recorder import load_recorded_checkpoints, load_recorded_preconditioners

__all__ = ["add_recorded_arguments", "recorded_checkpoints", "recorded_preconditioners"]


def add_recorded_arguments(parser: argparse.ArgumentParser, *, preconditioner: bool) -> None:
    """``--recorded`` (and, for ``build``, ``--preconditioner``) on ``parser``."""
    parser.add_argument("--recorded", type=Path, metavar="DIR",
                        help="checkpoints and their lrs recorded while training "
                             "(tif.training.CheckpointRecorder or tif.trainer_callback); needs "
                             "Spec.model")
    if preconditioner:
        parser.add_argument("--preconditioner", choices=PRECONDITIONER_KINDS,
                            help="optimizer-aware TracIn from the optimizer state in --recorded: "
                                 "adam (LESS's Adam update) or trackstar (g / sqrt(v + eps))")


def recorded_checkpoints(args: argparse.Namespace, spec: Spec) -> list[Checkpoint] | None:
    """The checkpoints of ``--recorded``, or ``None`` without it."""
    if getattr(args, "recorded", None) is None:
        return None
    if args.checkpoints:
        raise SpecError("pass --recorded DIR or --checkpoints FILE..., not both.")
    return load_recorded_checkpoints(args.recorded, _model(spec, "--recorded"))


def recorded_preconditioners(args: argparse.Namespace,
                             spec: Spec) -> list[Preconditioner] | None:
    """One preconditioner per ``--recorded`` checkpoint for ``--preconditioner``, else ``None``."""
    kind = getattr(args, "preconditioner", None)
    if kind is None:
        return None
    if args.recorded is None:
        raise SpecError(
            f"--preconditioner {kind} needs the optimizer state saved with each checkpoint: "
            "pass --recorded DIR, a directory written by tif.training.CheckpointRecorder or "
            "tif.trainer_callback with save_optimizer_state=True."
        )
    return load_recorded_preconditioners(args.recorded, _model(spec, "--preconditioner"),
                                             kind=kind)


def _model(spec: Spec, flag: str):
    if spec.model is None:
        raise SpecError(f"{flag} needs the spec to return its model (Spec.model), whose "
                        "parameter names the recording uses.")
    return spec.model
