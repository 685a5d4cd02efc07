"""Experiment specs for the command line: a user function that returns loss, checkpoints, data.

The command line hard-codes no model zoo. ``--spec path/to/file.py:make`` (or
``package.module:make``) names a function returning a :class:`Spec` (or a dict with its
fields); everything model-specific lives there.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from tracinfunc.checkpoint import Checkpoint
from tracinfunc.errors import TracInFuncError
from tracinfunc.grads.stages import Stages
from tracinfunc.types import Batch, LossFn

__all__ = ["Spec", "SpecError", "load_spec"]


class SpecError(TracInFuncError, ValueError):
    """A ``--spec`` reference cannot be loaded or returns the wrong thing."""


@dataclass(frozen=True)
class Spec:
    """What an experiment needs: how to differentiate, where, and on what.

    Attributes:
        loss: ``loss(params, example) -> scalar``.
        checkpoints: The checkpoints to attribute over (may be empty when the command line
            supplies ``--checkpoints`` files, which then need ``model``).
        train: Training data: one batch or an iterable of batches.
        test: Named test sets, ``{"name": batch or batches}``; ``--test NAME`` picks one.
        model: The module, needed to load ``--checkpoints`` state dicts.
        stages: The model as :class:`~tracinfunc.grads.Stages` for ``--checkpointing`` (default:
            derived from an ``nn.Sequential`` model behind :func:`~tracinfunc.loss_from_module`).
    """

    loss: LossFn
    train: Batch | Iterable[Batch]
    checkpoints: Sequence[Checkpoint] = ()
    test: Mapping[str, Batch | Iterable[Batch]] | None = None
    model: nn.Module | None = None
    stages: Stages | None = None


def load_spec(reference: str) -> Spec:
    """Import ``"file.py:function"`` or ``"package.module:function"`` and call the function.

    Raises:
        SpecError: the reference is malformed, the file/module or function is missing, or the
            function returns something that is not a Spec (or a dict of its fields).
    """
    target, _, name = reference.rpartition(":")
    if not target or not name:
        raise SpecError(
            f"--spec: expected 'path/to/file.py:function' or 'module:function', got "
            f"{reference!r}."
        )
    module = _import_target(target)
    factory = getattr(module, name, None)
    if not callable(factory):
        available = sorted(k for k, v in vars(module).items() if callable(v) and k[0] != "_")
        raise SpecError(
            f"--spec: {target} has no function {name!r}; callables defined there: {available}."
        )
    made = factory()
    if isinstance(made, Spec):
        return made
    if isinstance(made, Mapping):
        try:
            return Spec(**made)
        except TypeError as error:
            raise SpecError(
                f"--spec: {reference} returned a dict that does not fit Spec ({error}); use the "
                "keys loss, train, checkpoints, test, model."
            ) from error
    raise SpecError(
        f"--spec: {reference} returned {type(made).__name__}; return tracinfunc.cli.Spec(loss=..., "
        "train=..., checkpoints=..., test={...}) or a dict with those keys."
    )


def _import_target(target: str) -> Any:
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise SpecError(f"--spec: no such file {target!r}.")
        module_name = f"_tracinfunc_spec_{abs(hash(path.resolve()))}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as error:
        raise SpecError(f"--spec: cannot import module {target!r} ({error}).") from error
