"""What a recorded checkpoint holds, and how it is read back whole.

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
from typing import Any

import torch
from torch import Tensor, nn

from tracinfunc._validate import current_caller
from tracinfunc.checkpoint import Checkpoint, params_fingerprint
from tracinfunc.errors import InvalidArgumentError
from tracinfunc.grads.selection import selected_names

__all__ = ["FrozenReference", "StepLrs", "load_checkpoint", "trained_state"]


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


def load_checkpoint(directory: Path, entry: dict[str, Any], frozen: dict[str, list[str]],
                    model: nn.Module, checked: set[str], *, device: torch.device) -> Checkpoint:
    """One manifest entry as a whole :class:`Checkpoint` of ``model``'s trainable parameters,
    every tensor on ``device``.

    Parameters the file lacks come from ``model`` when the manifest references them as
    frozen and ``model`` holds the recorded values (checked once per fingerprint).
    """
    state = torch.load(directory / entry["weights"], map_location=device, weights_only=True)
    named = dict(model.named_parameters())
    missing = [n for n, p in named.items() if p.requires_grad and n not in state]
    if missing:
        fingerprint = entry.get("frozen")
        names = frozen.get(fingerprint, []) if fingerprint else []
        unknown = sorted(set(missing) - set(names))
        if unknown:
            raise InvalidArgumentError(
                f"{current_caller()}: {entry['name']!r} lacks parameters {unknown[:5]} that "
                f"{type(model).__name__} trains and that were not recorded as frozen; pass "
                "the model that was trained, with the same parameters trainable."
            )
        if fingerprint not in checked:
            if params_fingerprint({n: named[n] for n in names}) != fingerprint:
                raise InvalidArgumentError(
                    f"{current_caller()}: the parameters {entry['name']!r} references but did not "
                    f"save (the frozen base, {len(names)} tensors such as {names[:3]}) differ in "
                    f"{type(model).__name__} from their values when recorded; load the base "
                    "model the recording was made from (or record with select= covering "
                    "every parameter that changes)."
                )
            checked.add(fingerprint)
        state = {**state, **{n: named[n].detach().to(device) for n in missing}}
    return Checkpoint.from_state_dict(state, model, lr=entry["lr"], name=entry["name"])
