"""Recording checkpoints while training: their lr weights and, optionally, optimizer state.

TracIn needs checkpoints ``w_c`` with their learning rates ``lr_c`` (and, for optimizer-aware
TracIn, the optimizer state saved with each). These helpers do that bookkeeping during
training and read it back:

- :class:`CheckpointRecorder` for a plain PyTorch loop (call ``.step()`` after each
  ``optimizer.step()``);
- :func:`trainer_callback` for a HF ``transformers.Trainer`` (``callbacks=[...]``);
- :func:`load_recorded_checkpoints` / :func:`load_recorded_preconditioners` to build
  ``Checkpoint`` and ``Preconditioner`` lists for :func:`~tracinfunc.build_store`.

A directory holds ``checkpoint-<step>.pt`` (the trained parameters and the buffers; the
frozen rest, such as a LoRA model's base, is referenced once by fingerprint in the manifest,
not saved), ``optimizer-<step>.pt`` (``optimizer.state_dict()``) and ``manifest.json``: one
entry per checkpoint with its name, step, lr, files and the optimizer's parameter names in
``param_groups`` order. A checkpoint's lr is the mean of the lrs used by the optimizer steps
it stands for (those since the previous checkpoint). Recordings of format 1 (whole state
dicts, lr read after the step) still load.
"""

from __future__ import annotations

import json
import os
import warnings
from os import PathLike
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tracinfunc._devices import module_device
from tracinfunc._validate import current_caller, entry_point
from tracinfunc.checkpoint import Checkpoint
from tracinfunc.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    MissingDependencyError,
)
from tracinfunc.precondition.optimizer import Preconditioner, optimizer_param_names
from tracinfunc.training.manifest import (
    FrozenReference,
    StepLrs,
    load_checkpoint,
    trained_names,
    trained_state,
)

__all__ = [
    "MANIFEST",
    "CheckpointRecorder",
    "current_lr",
    "load_recorded_checkpoints",
    "load_recorded_preconditioners",
    "record_checkpoint",
    "trainer_callback",
]

MANIFEST = "manifest.json"
FORMAT_VERSION = 2


def current_lr(optimizer: torch.optim.Optimizer, scheduler: Any = None) -> float:
    """The learning rate in force: the scheduler's last lr, else the first param group's.

    With several param groups of different lrs the first group's is recorded (TracIn's
    per-checkpoint weight is one number).
    """
    if scheduler is not None:
        return float(scheduler.get_last_lr()[0])
    return float(optimizer.param_groups[0]["lr"])


def record_checkpoint(directory: str | PathLike, model: nn.Module,
                      optimizer: torch.optim.Optimizer | None, *, step: int, lr: float,
                      save_optimizer_state: bool = True, select: Any = None,
                      _frozen: FrozenReference | None = None) -> dict[str, Any]:
    """Save what ``model`` trains (and ``optimizer``) at ``step``; add it to the manifest.

    Args:
        lr: The checkpoint's TracIn weight: the mean lr of the steps it stands for.
        select: The parameters to save (a name, glob, list, or ``last_layers(n)``); ``None``:
            those ``optimizer`` updates (every trainable one without an optimizer). The rest
            are referenced by fingerprint, not saved; they must not change during training.

    Returns:
        The manifest entry: ``{"name", "step", "lr", "weights", "frozen", "optimizer",
        "optimizer_param_names"}`` (the last two ``None`` without optimizer state).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"checkpoint-{step}"
    names = trained_names(model, optimizer, select)
    fingerprint, frozen = (_frozen or FrozenReference())(model, names)
    torch.save(trained_state(model, names), directory / f"{name}.pt")
    entry = {"name": name, "step": int(step), "lr": float(lr), "weights": f"{name}.pt",
             "frozen": fingerprint, "optimizer": None, "optimizer_param_names": None}
    if save_optimizer_state and optimizer is not None:
        entry["optimizer"] = f"optimizer-{step}.pt"
        entry["optimizer_param_names"] = optimizer_param_names(optimizer, model)
        torch.save(optimizer.state_dict(), directory / entry["optimizer"])
    manifest = _read_full_manifest(directory)
    entries = [e for e in manifest["checkpoints"] if e["name"] != name] + [entry]
    references = {**manifest.get("frozen", {}), **({fingerprint: frozen} if frozen else {})}
    _write_manifest(directory, sorted(entries, key=lambda e: e["step"]), references)
    return entry


class CheckpointRecorder:
    """Saves checkpoints every ``every`` optimizer steps of a plain training loop.

    Each checkpoint is weighted by the mean lr of the optimizer steps since the previous one,
    read from the optimizer's first param group as each ``optimizer.step()`` starts (a step
    pre-hook), so calling ``scheduler.step()`` before or after :meth:`step` gives the same lrs.
    Call :meth:`save` after the loop to keep the final model when the step count is not a
    multiple of ``every``.

    Args:
        directory: Where checkpoints and ``manifest.json`` go (created if missing).
        model: The model being trained.
        optimizer: Its optimizer; only the parameters it updates are saved.
        every: Save after every ``every``-th call to :meth:`step`.
        scheduler: Read (``get_last_lr()[0]``) only when no ``optimizer.step()`` was seen
            since the last checkpoint; the optimizer's own lr is used otherwise.
        save_optimizer_state: Also save ``optimizer.state_dict()`` (for preconditioners).
        select: Save only these parameters (as ``build_store``'s ``select=``); the others
            must stay unchanged during training. ``None``: what the optimizer updates.

    Example:
        >>> recorder = CheckpointRecorder("ckpts", model, opt, every=100)
        >>> for batch in loader:
        ...     loss(model, batch).backward(); opt.step(); opt.zero_grad(); recorder.step()
        >>> checkpoints = load_recorded_checkpoints("ckpts", model)
    """

    def __init__(self, directory: str | PathLike, model: nn.Module,
                 optimizer: torch.optim.Optimizer, *, every: int = 1, scheduler: Any = None,
                 save_optimizer_state: bool = True, select: Any = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise InvalidArgumentError(
                f"CheckpointRecorder: every must be a positive int (optimizer steps between "
                f"checkpoints), got {every!r}; e.g. every=100."
            )
        if not isinstance(model, nn.Module):
            raise InvalidTypeError(
                f"CheckpointRecorder: model must be a torch.nn.Module, got "
                f"{type(model).__name__}."
            )
        self.directory, self.model, self.optimizer = Path(directory), model, optimizer
        self.every, self.scheduler = every, scheduler
        self.save_optimizer_state, self.select = save_optimizer_state, select
        self.steps = 0
        self._lrs, self._frozen = StepLrs(optimizer), FrozenReference()
        self._last: dict[str, Any] | None = None

    def step(self) -> dict[str, Any] | None:
        """Count one optimizer step; save when it is a multiple of ``every``.

        Returns:
            The manifest entry when a checkpoint was saved, else ``None``.
        """
        self.steps += 1
        return self.save() if self.steps % self.every == 0 else None

    def save(self) -> dict[str, Any]:
        """Save a checkpoint now, named by the number of steps counted so far."""
        if self._last is not None and self._last["step"] == self.steps:
            return self._last  # already saved at this step (by step() then save())
        lr, _ = self._lrs.take(current_lr(self.optimizer, self.scheduler))
        self._last = record_checkpoint(
            self.directory, self.model, self.optimizer, step=self.steps, lr=lr,
            save_optimizer_state=self.save_optimizer_state, select=self.select,
            _frozen=self._frozen)
        return self._last


def trainer_callback(directory: str | PathLike, *, every: int | None = None,
                     save_optimizer_state: bool = True, select: Any = None) -> Any:
    """A ``transformers.TrainerCallback`` recording checkpoints like :class:`CheckpointRecorder`.

    Each checkpoint's lr is the mean of the lrs the optimizer steps since the previous
    checkpoint used (read as each step begins, before the scheduler moves on), and the model
    at the end of training is always recorded, so a linear schedule's last checkpoint (the
    model you ship) keeps a positive weight.

    Args:
        directory: Where checkpoints and ``manifest.json`` go.
        every: Save every ``every`` optimizer steps (``on_step_end``); ``None``: whenever
            the Trainer saves its own checkpoints (``on_save``, following ``save_steps``).
        save_optimizer_state: Also save the optimizer state, named in optimizer order.
        select: As for :class:`CheckpointRecorder`: by default only the parameters the
            optimizer updates (a peft model's adapters) are saved.

    Returns:
        A callback for ``Trainer(..., callbacks=[...])``.

    Raises:
        MissingDependencyError: transformers is not installed.
    """
    try:
        from transformers import TrainerCallback
    except ImportError as error:
        raise MissingDependencyError(
            "trainer_callback: needs transformers; install it with "
            "pip install 'tracinfunc[hf]'."
        ) from error
    if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                              or every < 1):
        raise InvalidArgumentError(
            f"trainer_callback: every must be a positive int or None, got {every!r}."
        )

    class TracInCheckpointCallback(TrainerCallback):
        """Records ``checkpoint-<global_step>`` with the mean lr of its steps."""

        def __init__(self) -> None:
            self.lrs, self.frozen, self.last_step = StepLrs(), FrozenReference(), 0

        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            if optimizer is not None:  # the lr this step will use: the scheduler steps after
                self.lrs.add(optimizer)

        def _record(self, state, model, optimizer, lr_scheduler) -> None:
            if state.global_step == self.last_step:
                return
            lr, _ = self.lrs.take(current_lr(optimizer, lr_scheduler))
            record_checkpoint(directory, model, optimizer, step=state.global_step, lr=lr,
                              save_optimizer_state=save_optimizer_state, select=select,
                              _frozen=self.frozen)
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
            self._record(state, model, optimizer, lr_scheduler)  # the model you ship

    return TracInCheckpointCallback()


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
    """
    directory = Path(directory)
    device = module_device(model) if device is None else torch.device(device)
    frozen, checked = _read_full_manifest(directory).get("frozen", {}), set()
    return [load_checkpoint(directory, entry, frozen, model, checked, device=device)
            for entry in _entries(directory)]


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
    entries = _entries(directory)
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
    return [Preconditioner.load(directory / e["optimizer"], e["optimizer_param_names"],
                                kind=kind, eps=eps) for e in entries]


def _entries(directory: Path) -> list[dict[str, Any]]:
    """The manifest's checkpoints that weigh in TracIn: those recorded at lr 0 (the end of a
    linearly decaying schedule) add nothing to any score and are left out, with a warning."""
    entries = _read_manifest(directory)
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


def _read_manifest(directory: Path) -> list[dict[str, Any]]:
    return _read_full_manifest(directory)["checkpoints"]


def _read_full_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.exists():
        return {"checkpoints": []}
    return json.loads(path.read_text())


def _write_manifest(directory: Path, entries: list[dict[str, Any]],
                    frozen: dict[str, list[str]]) -> None:
    # Written aside, then renamed: an interrupted run never leaves a half-written manifest.
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"format_version": FORMAT_VERSION, "frozen": frozen,
                               "checkpoints": entries}, indent=1))
    os.replace(tmp, directory / MANIFEST)
