"""Recording checkpoints from a HF ``transformers.Trainer``: a callback (``callbacks=[...]``)."""

from __future__ import annotations

from os import PathLike
from pathlib import Path
from typing import Any

from tracinfunc._validate import calling, current_caller, entry_point
from tracinfunc.errors import MissingDependencyError, RecordingExistsError
from tracinfunc.training.contents import FrozenReference, StepLrs, current_lr, record_checkpoint
from tracinfunc.training.manifest import Recording, check_options

__all__ = ["trainer_callback"]


@entry_point("trainer_callback")
def trainer_callback(directory: str | PathLike, *, every: int | None = None,
                     save_optimizer_state: bool = True, select: Any = None,
                     resume: bool = False, overwrite: bool = False) -> Any:
    """A ``transformers.TrainerCallback`` recording checkpoints like :class:`CheckpointRecorder`.

    Each checkpoint's lr is the mean of the lrs the optimizer steps since the previous
    checkpoint used (read as each step begins, before the scheduler moves on), and the model
    at the end of training is always recorded, so a linear schedule's last checkpoint (the
    model you ship) keeps a positive weight. Checkpoints are named by the Trainer's
    ``global_step``.

    The directory is taken when the callback is made (one run at a time, as for
    :class:`CheckpointRecorder`) and freed when training ends.

    Args:
        directory: Where checkpoints and ``manifest.json`` go.
        every: Save every ``every`` optimizer steps (``on_step_end``); ``None``: whenever
            the Trainer saves its own checkpoints (``on_save``, following ``save_steps``).
        save_optimizer_state: Also save the optimizer state, named in optimizer order.
        select: As for :class:`CheckpointRecorder`: by default only the parameters the
            optimizer updates (a peft model's adapters) are saved.
        resume: Continue the recording in ``directory``: for ``Trainer.train(
            resume_from_checkpoint=...)`` from a step at or after its last recorded one.
        overwrite: Replace the recording in ``directory`` (its listed files are removed).

    Returns:
        A callback for ``Trainer(..., callbacks=[...])``.

    Raises:
        MissingDependencyError: transformers is not installed.
        RecordingExistsError: ``directory`` holds a recording and neither ``resume`` nor
            ``overwrite`` was given; or (when training begins) the Trainer starts before the
            last recorded step.
        StoreLockedError: another process is recording into ``directory``.
    """
    try:
        from transformers import TrainerCallback
    except ImportError as error:
        raise MissingDependencyError(
            "trainer_callback: needs transformers; install it with "
            "pip install 'tracinfunc[hf]'."
        ) from error
    with calling("trainer_callback"):
        check_options(every=every, resume=resume, overwrite=overwrite)
    recording = Recording(Path(directory), resume=resume, overwrite=overwrite)

    class TracInCheckpointCallback(TrainerCallback):
        """Records ``checkpoint-<global_step>`` with the mean lr of its steps."""

        def __init__(self) -> None:
            self.lrs, self.frozen = StepLrs(), FrozenReference()
            last = recording.last_entry
            self.last_step = 0 if last is None else last["step"]

        @entry_point("trainer_callback")
        def on_train_begin(self, args, state, control, **kwargs):
            if state.global_step < self.last_step:  # refused now, not at the first save
                recording.close()
                raise RecordingExistsError(
                    f"{current_caller()}: {str(directory)!r} holds "
                    f"checkpoints up to step {self.last_step} (checkpoint-{self.last_step}.pt) "
                    f"but the Trainer starts at step {state.global_step}; a recorded "
                    "checkpoint is never overwritten: resume the Trainer from step "
                    f"{self.last_step} or later (resume_from_checkpoint=), pass "
                    "overwrite=True to replace the recording, or record into another directory."
                )

        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            if optimizer is not None:  # the lr this step will use: the scheduler steps after
                self.lrs.add(optimizer)

        @entry_point("trainer_callback")
        def _record(self, state, model, optimizer, lr_scheduler) -> None:
            if state.global_step == self.last_step:
                return
            lr, _ = self.lrs.take(current_lr(optimizer, lr_scheduler))
            record_checkpoint(recording, model, optimizer, step=state.global_step, lr=lr,
                              save_optimizer_state=save_optimizer_state, select=select,
                              frozen=self.frozen)
            self.last_step = state.global_step

        def on_step_end(self, args, state, control, model=None, optimizer=None,
                        lr_scheduler=None, **kwargs):
            if every is not None and state.global_step % every == 0:
                self._record(state, model, optimizer, lr_scheduler)

        def on_save(self, args, state, control, model=None, optimizer=None,
                    lr_scheduler=None, **kwargs):
            if every is None:
                self._record(state, model, optimizer, lr_scheduler)

        def on_train_end(self, args, state, control, model=None, optimizer=None,
                         lr_scheduler=None, **kwargs):
            try:
                self._record(state, model, optimizer, lr_scheduler)  # the model you ship
            finally:
                recording.close()

    return TracInCheckpointCallback()
