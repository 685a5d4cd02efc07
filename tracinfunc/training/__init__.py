"""Recording checkpoints during training (lr weights, optimizer state) and loading them back."""

from tracinfunc.training.recorder import (
    CheckpointRecorder,
    load_recorded_checkpoints,
    load_recorded_preconditioners,
    trainer_callback,
)

__all__ = [
    "CheckpointRecorder",
    "load_recorded_checkpoints",
    "load_recorded_preconditioners",
    "trainer_callback",
]
