"""Recording checkpoints during training (lr weights, optimizer state) and loading them back."""

from tracinfunc.training.hf import trainer_callback
from tracinfunc.training.recorder import (
    CheckpointRecorder,
    load_recorded_checkpoints,
    load_recorded_preconditioners,
)

__all__ = [
    "CheckpointRecorder",
    "load_recorded_checkpoints",
    "load_recorded_preconditioners",
    "trainer_callback",
]
