"""Recording checkpoints while training: their lr weights and, optionally, optimizer state.

TracIn needs checkpoints ``w_c`` with their learning rates ``lr_c`` (and, for optimizer-aware
TracIn, the optimizer state saved with each). These helpers do that bookkeeping during
training and read it back:

- :class:`CheckpointRecorder` for a plain PyTorch loop (call ``.step()`` after each
  ``optimizer.step()``); :func:`~tracinfunc.training.trainer_callback` for a HF ``Trainer``;
- :func:`load_recorded_checkpoints` / :func:`load_recorded_preconditioners` to build
  ``Checkpoint`` and ``Preconditioner`` lists for :func:`~tracinfunc.build_store`.

A directory holds ``checkpoint-<step>.pt`` (the trained parameters and the buffers; the
frozen rest, such as a LoRA model's base, is referenced once by fingerprint in the manifest,
not saved), ``optimizer-<step>.pt`` (``optimizer.state_dict()``) and ``manifest.json``: the
run's id and one entry per checkpoint, in step order, with its name, step, lr, files (with
their sizes and hashes) and the optimizer's parameter names in ``param_groups`` order
(``training/manifest.py``). A checkpoint's lr is the mean of the lrs used by the optimizer
steps it stands for (those since the previous checkpoint). Recordings of formats 1 and 2
(without hashes) still load, with a warning.
"""

from __future__ import annotations

import warnings
from os import PathLike
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tracinfunc._devices import module_device
from tracinfunc._validate import calling, current_caller, entry_point
from tracinfunc.checkpoint import Checkpoint
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError, RecordingExistsError
from tracinfunc.precondition.optimizer import Preconditioner
from tracinfunc.training.contents import (
    FrozenReference,
    StepLrs,
    check_continues,
    current_lr,
    load_checkpoint,
    load_recorded_file,
    record_checkpoint,
    trained_names,
)
from tracinfunc.training.manifest import (
    MANIFEST,
    Recording,
    check_options,
    read_manifest,
    recorded_entries,
    verified_file,
)

__all__ = ["CheckpointRecorder", "load_recorded_checkpoints", "load_recorded_preconditioners"]


class CheckpointRecorder:
    """Saves checkpoints every ``every`` optimizer steps of a plain training loop.

    Each checkpoint is weighted by the mean lr of the optimizer steps since the previous one,
    read from the optimizer's first param group as each ``optimizer.step()`` starts (a step
    pre-hook), so calling ``scheduler.step()`` before or after :meth:`step` gives the same lrs.
    Call :meth:`save` after the loop to keep the final model when the step count is not a
    multiple of ``every``, and :meth:`close` (or use ``with``) to free the directory.

    A recording belongs to one run: a directory that already holds one is refused unless
    ``resume=True`` (continue it: count from its last recorded step, or from ``start_step``)
    or ``overwrite=True`` (remove its files, those its manifest lists, and start anew). A
    recorded checkpoint is never written over, and one recorder at a time writes to a
    directory (a later one in the same process takes over; one in another process is refused).

    Args:
        directory: Where checkpoints and ``manifest.json`` go (created if missing).
        model: The model being trained.
        optimizer: Its optimizer; only the parameters it updates are saved.
        every: Save after every ``every``-th optimizer step (counted from step 0 of training).
        scheduler: Read (``get_last_lr()[0]``) only when no ``optimizer.step()`` was seen
            since the last checkpoint; the optimizer's own lr is used otherwise.
        save_optimizer_state: Also save ``optimizer.state_dict()`` (for preconditioners).
        select: Save only these parameters (as ``build_store``'s ``select=``); the others
            must stay unchanged during training. ``None``: what the optimizer updates.
        resume: Continue the recording in ``directory`` (a fresh one if there is none).
        overwrite: Replace the recording in ``directory``.
        start_step: The optimizer steps done before this recorder's first :meth:`step` (a
            run resumed from a saved training state); default: the last recorded step with
            ``resume=True``, else 0. It may not precede the last recorded step.

    Raises:
        RecordingExistsError: ``directory`` holds a recording and neither ``resume`` nor
            ``overwrite`` was given, or ``start_step`` precedes its last recorded step.
        StoreLockedError: another process is recording into ``directory``.

    Example:
        >>> with CheckpointRecorder("ckpts", model, opt, every=100) as recorder:
        ...     for batch in loader:
        ...         loss(model, batch).backward(); opt.step(); opt.zero_grad(); recorder.step()
        >>> checkpoints = load_recorded_checkpoints("ckpts", model)
    """

    @entry_point("CheckpointRecorder")
    def __init__(self, directory: str | PathLike, model: nn.Module,
                 optimizer: torch.optim.Optimizer, *, every: int = 1, scheduler: Any = None,
                 save_optimizer_state: bool = True, select: Any = None, resume: bool = False,
                 overwrite: bool = False, start_step: int | None = None) -> None:
        with calling("CheckpointRecorder"):
            check_options(every=every, resume=resume, overwrite=overwrite,
                           start_step=start_step)
        if not isinstance(model, nn.Module):
            raise InvalidTypeError(
                f"CheckpointRecorder: model must be a torch.nn.Module, got "
                f"{type(model).__name__}."
            )
        self.directory, self.model, self.optimizer = Path(directory), model, optimizer
        self.every, self.scheduler = every, scheduler
        self.save_optimizer_state, self.select = save_optimizer_state, select
        self._recording = Recording(self.directory, resume=resume, overwrite=overwrite)
        last = self._recording.last_entry
        try:
            self.steps = _start_step(self.directory, last, start_step)
        except RecordingExistsError:
            self._recording.close()
            raise
        self._lrs, self._frozen = StepLrs(optimizer), FrozenReference()
        if last is not None:  # resumed: refuse another model now, not at the first save
            try:
                names = trained_names(model, optimizer, select)
                check_continues(self._recording, model, names, self._frozen(model, names)[0])
            except BaseException:
                self._recording.close()
                raise
        # At the last recorded step, save() has nothing new to record.
        self._last = last if last is not None and last["step"] == self.steps else None

    @entry_point("CheckpointRecorder.step")
    def step(self) -> dict[str, Any] | None:
        """Count one optimizer step; save when it is a multiple of ``every``.

        Returns:
            The manifest entry when a checkpoint was saved, else ``None``.
        """
        self.steps += 1
        return self.save() if self.steps % self.every == 0 else None

    @entry_point("CheckpointRecorder.save")
    def save(self) -> dict[str, Any]:
        """Save a checkpoint now, named by the number of steps counted so far."""
        if self._last is not None and self._last["step"] == self.steps:
            return self._last  # already saved at this step (by step() then save())
        lr, _ = self._lrs.take(current_lr(self.optimizer, self.scheduler))
        self._last = record_checkpoint(
            self._recording, self.model, self.optimizer, step=self.steps, lr=lr,
            save_optimizer_state=self.save_optimizer_state, select=self.select,
            frozen=self._frozen)
        return self._last

    def close(self) -> None:
        """Free the directory for another recorder (idempotent); a recorder that is
        garbage-collected or whose process ends frees it too."""
        self._recording.close()

    def __enter__(self) -> CheckpointRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _start_step(directory: Path, last: dict[str, Any] | None, start_step: int | None) -> int:
    if start_step is None:
        return 0 if last is None else int(last["step"])
    if last is not None and start_step < last["step"]:
        raise RecordingExistsError(
            f"{current_caller()}: {str(directory)!r} already holds "
            f"checkpoints up to step {last['step']} ({last['weights']}), so counting from "
            f"start_step={start_step} would write over or before them; a recorded checkpoint is "
            f"never overwritten: resume training from step {last['step']} or later, pass "
            "overwrite=True to replace the recording, or record into another directory."
        )
    return start_step


@entry_point("load_recorded_checkpoints")
def load_recorded_checkpoints(directory: str | PathLike, model: nn.Module, *,
                              device: torch.device | str | None = None) -> list[Checkpoint]:
    """The recorded checkpoints, by step, each weighted by the lr recorded with it.

    Args:
        directory: A directory written by :class:`CheckpointRecorder` or
            :func:`trainer_callback`.
        model: The trained model, or one of the same architecture holding the same frozen
            parameters (a peft model on the same base): parameters that were not saved
            come from it, after checking they equal the recorded ones.
        device: Where every tensor of the checkpoints goes (default: ``model``'s device, so
            a GPU model gets GPU checkpoints, whatever device they were recorded from).

    Returns:
        ``n_ckpt`` :class:`~tracinfunc.Checkpoint` s named ``checkpoint-<step>``.

    Raises:
        CorruptRecordingError: a checkpoint file differs from the size or hash recorded for
            it (swapped, truncated, replaced), is missing, or the manifest is out of step order.
        InvalidArgumentError: ``model``'s frozen parameters (those the recording referenced
            but did not save, such as a LoRA base) differ from the recorded ones.
    """
    directory = Path(directory)
    device = module_device(model) if device is None else torch.device(device)
    manifest = read_manifest(directory)
    frozen, checked = manifest.get("frozen", {}), set()
    return [load_checkpoint(verified_file(directory, entry, entry["weights"]), entry, frozen,
                            model, checked, device=device)
            for entry in _entries(directory, manifest)]


@entry_point("load_recorded_preconditioners")
def load_recorded_preconditioners(directory: str | PathLike, model: nn.Module, *,
                                  kind: str = "adam", eps: float | None = None
                                  ) -> list[Preconditioner]:
    """One :class:`~tracinfunc.Preconditioner` per recorded checkpoint, in the same order.

    Args:
        directory: As for :func:`load_recorded_checkpoints`; recorded with optimizer state.
        model: A model of the same architecture; the optimizer's parameter names recorded
            in the manifest must be its parameters.
        kind: As for :meth:`Preconditioner.from_state_dict`.
        eps: As for :meth:`Preconditioner.from_state_dict`.
    """
    directory = Path(directory)
    entries = _entries(directory, read_manifest(directory))
    missing = [e["name"] for e in entries if e["optimizer"] is None]
    if missing:
        raise InvalidArgumentError(
            f"load_recorded_preconditioners: checkpoints {missing} in {str(directory)!r} were "
            "saved without optimizer state; record them with save_optimizer_state=True."
        )
    known = {name for name, _ in model.named_parameters()}
    for entry in entries:
        unknown = sorted(set(entry["optimizer_param_names"]) - known)
        if unknown:
            raise InvalidArgumentError(
                f"load_recorded_preconditioners: {entry['name']!r} has optimizer state for "
                f"{unknown[:5]}, which {type(model).__name__} lacks; pass the model that was "
                "trained."
            )
    return [Preconditioner.from_state_dict(
        load_recorded_file(verified_file(directory, e, e["optimizer"])),
        e["optimizer_param_names"], kind=kind, eps=eps) for e in entries]


def _entries(directory: Path, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's checkpoints (checked in step order) that weigh in TracIn: those recorded
    at lr 0 (the end of a linearly decaying schedule) add nothing to any score and are left
    out, with a warning."""
    entries = recorded_entries(directory, manifest)
    if not entries:
        raise InvalidArgumentError(
            f"{current_caller()}: no {MANIFEST} with checkpoints in {str(directory)!r}; record "
            "them with CheckpointRecorder or trainer_callback first."
        )
    idle = [entry["name"] for entry in entries if entry["lr"] == 0]
    if idle:
        warnings.warn(f"{current_caller()}: {idle} were recorded at lr 0 and add nothing to TracIn "
                      "scores; they are left out.", RuntimeWarning, stacklevel=3)
    kept = [entry for entry in entries if entry["lr"] != 0]
    if not kept:
        raise InvalidArgumentError(
            f"{current_caller()}: every checkpoint in {str(directory)!r} was recorded at lr 0, so "
            "TracIn weighs none of them; record checkpoints while the learning rate is positive."
        )
    return kept
