"""What a recorded checkpoint holds, how it is written, and how it is read back whole.

Each checkpoint file holds the parameters that training changes (those the optimizer updates,
or ``select=``) and the module's buffers. The parameters training never changes (a LoRA
model's frozen base) are not saved: the manifest references them once by name and
fingerprint, and loading takes them from the model passed in, after checking that their
values are the ones recorded. A 7B model with adapters thus records megabytes per
checkpoint, not its 14 GB base each time.

The learning rate of a checkpoint is the mean of the rates the optimizer steps it stands for
used (the steps since the previous checkpoint), as docs/concepts/checkpoints.md defines it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from tracinfunc._validate import current_caller
from tracinfunc.checkpoint import Checkpoint, params_fingerprint
from tracinfunc.errors import CorruptRecordingError, InvalidArgumentError
from tracinfunc.grads.selection import selected_names
from tracinfunc.precondition.optimizer import optimizer_param_names

if TYPE_CHECKING:
    from tracinfunc.training.manifest import Recording

__all__ = ["FrozenReference", "StepLrs", "check_continues", "current_lr", "load_checkpoint",
           "load_recorded_file",
           "record_checkpoint", "trained_names", "trained_state"]


def current_lr(optimizer: torch.optim.Optimizer, scheduler: Any = None) -> float:
    """The learning rate in force: the scheduler's last lr, else the first param group's.

    With several param groups of different lrs the first group's is recorded (TracIn's
    per-checkpoint weight is one number).
    """
    if scheduler is not None:
        return float(scheduler.get_last_lr()[0])
    return float(optimizer.param_groups[0]["lr"])


class StepLrs:
    """The lr each optimizer step used, collected since the last checkpoint.

    A step pre-hook reads the first param group's lr as ``optimizer.step()`` starts, which is
    the rate that step uses whether the scheduler is stepped before or after the recorder.
    """

    def __init__(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.lrs: list[float] = []
        self.handle = None
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            self.handle = optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer, args, kwargs) -> None:
        self.add(optimizer)

    def add(self, optimizer: Any) -> None:
        """Count one step at the lr ``optimizer`` holds now."""
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))

    def take(self, fallback: float) -> tuple[float, int]:
        """The mean lr of the steps since the last call and their count; ``fallback`` when
        no step was seen (the recorder was stepped without ``optimizer.step()``)."""
        lrs, self.lrs = self.lrs, []
        if not lrs:
            return float(fallback), 0
        return float(sum(lrs) / len(lrs)), len(lrs)


def trained_names(model: nn.Module, optimizer: Any, select: Any) -> list[str]:
    """The parameters a checkpoint saves: ``select``'s, else those ``optimizer`` updates
    (trainable ones), else every trainable parameter."""
    named = dict(model.named_parameters())
    if select is not None:
        return list(selected_names(named, select))
    trainable = [name for name, value in named.items() if value.requires_grad]
    if optimizer is None:
        return trainable
    updated = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [name for name in trainable if id(named[name]) in updated]


def trained_state(model: nn.Module, names: list[str]) -> dict[str, Tensor]:
    """The named parameters and every persistent buffer, detached (as ``state_dict``)."""
    state = model.state_dict()
    every_param = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    kept = set(names) | (set(state) - every_param)
    return {name: value for name, value in state.items() if name in kept}


class FrozenReference:
    """The parameters a recorder does not save, by fingerprint, computed once per name set."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, ...], str] = {}

    def __call__(self, model: nn.Module, saved: list[str]) -> tuple[str | None, list[str]]:
        """``(fingerprint, names)`` of the parameters outside ``saved``; ``(None, [])`` if none."""
        named = dict(model.named_parameters())
        names = tuple(sorted(set(named) - set(saved)))
        if not names:
            return None, []
        if names not in self._cache:
            self._cache[names] = params_fingerprint({n: named[n] for n in names})
        return self._cache[names], list(names)


def record_checkpoint(recording: Recording, model: nn.Module,
                      optimizer: torch.optim.Optimizer | None, *, step: int, lr: float,
                      save_optimizer_state: bool, select: Any,
                      frozen: FrozenReference) -> dict[str, Any]:
    """Save what ``model`` trains (and ``optimizer``'s state) at ``step`` into ``recording``.

    Args:
        lr: The checkpoint's TracIn weight: the mean lr of the steps it stands for.
        select: The parameters to save (a name, glob, list, or ``last_layers(n)``); ``None``:
            those ``optimizer`` updates (every trainable one without an optimizer). The rest
            are referenced by fingerprint, not saved; they must not change during training.

    Returns:
        The manifest entry: ``{"name", "step", "lr", "weights", "frozen", "optimizer",
        "optimizer_param_names", "files"}`` (optimizer fields ``None`` without its state).
    """
    recording.check_step(step)  # before any work: a refused step costs nothing
    name = f"checkpoint-{step}"
    names = trained_names(model, optimizer, select)
    fingerprint, frozen_names = frozen(model, names)
    check_continues(recording, model, names, fingerprint)  # a resumed run: the same model
    entry = {"name": name, "step": int(step), "lr": float(lr), "weights": f"{name}.pt",
             "frozen": fingerprint, "optimizer": None, "optimizer_param_names": None}
    files = {entry["weights"]: lambda path: torch.save(trained_state(model, names), path)}
    if save_optimizer_state and optimizer is not None:
        entry["optimizer"] = f"optimizer-{step}.pt"
        entry["optimizer_param_names"] = optimizer_param_names(optimizer, model)
        files[entry["optimizer"]] = lambda path: torch.save(optimizer.state_dict(), path)
    return recording.add(entry, files, frozen_names)


def check_continues(recording: Recording, model: nn.Module, names: list[str],
                    fingerprint: str | None) -> None:
    """Refuse to continue a recording with another model (once per recorder, before writing).

    The recording's last checkpoint fixes what a resumed run must save: the same parameter
    and buffer names with the same shapes (read from its file's header, memory-mapped: no
    weights are read), and the same frozen base (fingerprint). A run resumed over another
    base or architecture would leave a recording that loads with neither model.

    Raises:
        InvalidArgumentError: the frozen base or a saved tensor's name or shape differs.
        CorruptRecordingError: the last checkpoint's file cannot be read.
    """
    last = recording.last_entry
    if last is None or recording.model_checked:
        return
    where = f"{str(recording.directory)!r} (last checkpoint {last['name']!r})"
    if last.get("frozen") != fingerprint:
        raise InvalidArgumentError(
            f"{current_caller()}: the recording in {where} was made over another frozen base: "
            f"its fingerprint is {last.get('frozen')}, this model's untrained parameters give "
            f"{fingerprint}; resume with the base (and the same trainable parameters, select=) "
            "the recording was made with, or record into another directory."
        )
    shapes = {n: tuple(v.shape) for n, v in trained_state(model, names).items()}
    recorded = _recorded_shapes(recording.directory / last["weights"])
    differ = sorted(n for n in set(shapes) | set(recorded) if shapes.get(n) != recorded.get(n))
    if differ:
        n = differ[0]
        raise InvalidArgumentError(
            f"{current_caller()}: {type(model).__name__} is not the model recorded in {where}: "
            f"{len(differ)} saved tensors differ, e.g. {n!r} has shape "
            f"{list(shapes[n]) if n in shapes else 'none (absent)'} here but "
            f"{list(recorded[n]) if n in recorded else 'none (absent)'} recorded; resume with "
            "the architecture that was trained, or record into another directory."
        )
    recording.model_checked = True


def _recorded_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, ValueError) as error:
        raise CorruptRecordingError(
            f"{current_caller()}: the last recorded checkpoint {str(path)!r} cannot be read "
            f"({error}); restore it, or pass overwrite=True to record anew."
        ) from None
    return {n: tuple(v.shape) for n, v in state.items()}


def load_recorded_file(path: Path, *, device: torch.device | str = "cpu") -> Any:
    """``torch.load`` of a recording's file, tensors only (``weights_only``: a pickle that
    would run code is never executed).

    Raises:
        CorruptRecordingError: the file is not a tensors-only PyTorch file (crafted, or
            damaged although its manifest hash matches: a resealed manifest), naming it.
    """
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except (OSError, MemoryError):  # the file system's own errors stay what they are
        raise
    except Exception as error:  # UnpicklingError (weights_only refused it), EOFError, ...
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        raise CorruptRecordingError(
            f"{current_caller()}: the recorded file {str(path)!r} is not a tensors-only "
            f"PyTorch file ({type(error).__name__}: {first}); it was crafted or damaged and "
            "was not loaded (nothing in it ran). Record the run again or restore the file from "
            "a copy; never load it with weights_only=False."
        ) from None


def load_checkpoint(path: Path, entry: dict[str, Any], frozen: dict[str, list[str]],
                    model: nn.Module, checked: set[str], *, device: torch.device) -> Checkpoint:
    """One manifest entry (its weights at ``path``) as a whole :class:`Checkpoint` of
    ``model``'s trainable parameters, every tensor on ``device``.

    The parameters the recorder referenced but did not save (the frozen base) must hold in
    ``model`` the values they had when recorded (checked once per fingerprint, whether or
    not ``model`` trains them); trainable ones the file lacks are taken from ``model``.
    """
    state = load_recorded_file(path, device=device)
    named = dict(model.named_parameters())
    fingerprint = entry.get("frozen")
    names = frozen.get(fingerprint, []) if fingerprint else []
    missing = [n for n, p in named.items() if p.requires_grad and n not in state]
    unknown = sorted(set(missing) - set(names))
    if unknown:
        raise InvalidArgumentError(
            f"{current_caller()}: {entry['name']!r} lacks parameters {unknown[:5]} that "
            f"{type(model).__name__} trains and that were not recorded as frozen; pass "
            "the model that was trained, with the same parameters trainable."
        )
    if names and fingerprint not in checked:
        _check_frozen(entry["name"], names, fingerprint, model, named)
        checked.add(fingerprint)
    state = {**state, **{n: named[n].detach().to(device) for n in missing}}
    return Checkpoint.from_state_dict(state, model, lr=entry["lr"], name=entry["name"])


def _check_frozen(name: str, names: list[str], fingerprint: str, model: nn.Module,
                  named: dict[str, Tensor]) -> None:
    """Refuse ``model`` unless its parameters ``names`` hash to the recorded ``fingerprint``."""
    absent = sorted(set(names) - set(named))
    if absent:
        raise InvalidArgumentError(
            f"{current_caller()}: {name!r} was recorded with a frozen base that includes "
            f"{absent[:5]}, which {type(model).__name__} lacks; pass a model of the "
            "architecture that was trained, on the same base."
        )
    if params_fingerprint({n: named[n] for n in names}) != fingerprint:
        raise InvalidArgumentError(
            f"{current_caller()}: the parameters {name!r} references but did not save (the "
            f"frozen base, {len(names)} tensors such as {names[:3]}) differ in "
            f"{type(model).__name__} from their values when recorded; load the base model "
            "the recording was made from (or record with select= covering every parameter "
            "that changes)."
        )
