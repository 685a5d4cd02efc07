"""Inputs of selection normalised at the boundary: task labels, scalars, finite scores.

Labels and numbers arrive as Python lists, NumPy, torch or JAX arrays and their scalars.
Tensors hash by identity (two ``torch.tensor(1)`` are two dict keys) and floats truncate when
cast to rows, so everything is turned into plain Python ``int``/``str``/``float`` here, once,
or refused with what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tracinfunc._validate import current_caller
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["as_python_real", "check_finite", "first_positions", "task_labels"]

_LABELS = "a list, tuple or 1-D array of int or str labels, one per validation row"


_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def _as_numpy(value: Any) -> np.ndarray | None:
    """``value`` as an ndarray when it is an array (NumPy, torch, JAX, ...), else ``None``."""
    if isinstance(value, Tensor):
        value = value.detach().cpu()
        if value.is_floating_point() and value.dtype not in _NUMPY_FLOATS:
            value = value.double()  # bfloat16, float8: no NumPy dtype; exact in float64
        return value.numpy()
    if isinstance(value, np.ndarray | np.generic) or hasattr(value, "__array__"):
        return np.asarray(value)
    return None


def _label(value: Any, row: int) -> int | str:
    """One label as a Python ``int`` or ``str`` (integral floats become ints)."""
    array = _as_numpy(value)
    if array is not None and array.ndim == 0:
        value = array.item()
    if isinstance(value, str):
        return str(value)  # np.str_ too
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    what = (f"{value!r}, a float that is not a whole number" if isinstance(value, float)
            else f"{value!r:.60} ({type(value).__name__})")
    raise InvalidTypeError(
        f"{current_caller()}: tasks must be {_LABELS}; row {row} is {what}. Give each row's "
        "task as an int or a str, e.g. tasks=['qa', 'qa', 'math']."
    )


def task_labels(tasks: Any, n_test: int) -> list[int | str]:
    """``tasks`` as ``n_test`` Python ints or strs, equal for every spelling of the labels.

    Raises:
        InvalidTypeError: not a sequence or 1-D array, or a label that is not an int, a whole
            float or a str (lists, None, bools, 0.5).
        InvalidArgumentError: another number of labels than ``n_test``.
    """
    array = _as_numpy(tasks)
    if array is not None:
        if array.ndim != 1:
            raise InvalidArgumentError(
                f"{current_caller()}: tasks must be {_LABELS}, got a {array.ndim}-D array of "
                f"shape {list(array.shape)}; pass one label per row, e.g. labels.reshape(-1)."
            )
        if array.dtype.kind == "b":
            raise InvalidTypeError(
                f"{current_caller()}: tasks must be {_LABELS}, got booleans; pass the task of "
                "each row as an int or str (e.g. labels.astype(int))."
            )
        tasks = array.tolist()  # NumPy scalars -> Python ints, floats, strs
    elif isinstance(tasks, str | bytes) or not isinstance(tasks, Sequence):
        raise InvalidTypeError(
            f"{current_caller()}: tasks must be {_LABELS}, got {type(tasks).__name__} "
            f"{tasks!r:.60}; e.g. tasks=['qa'] * 5 + ['math'] * 5."
        )
    if len(tasks) != n_test:
        raise InvalidArgumentError(
            f"{current_caller()}: tasks must give one label per validation row ({n_test} rows), "
            f"got {len(tasks)} labels; e.g. tasks=['qa'] * 5 + ['math'] * 5."
        )
    return [_label(task, row) for row, task in enumerate(tasks)]


def as_python_real(value: Any) -> Any:
    """A Python ``float`` for real NumPy/JAX/torch scalars (0-d, not bool); else unchanged."""
    array = _as_numpy(value)
    if array is not None and array.ndim == 0 and array.dtype.kind in "iuf":
        return float(array.item())
    return value


def first_positions(mask: Tensor, count: int = 3) -> str:
    """The first ``count`` positions where ``mask`` holds, e.g. ``"[0, 3], [2, 3]"``."""
    found = torch.nonzero(mask)[:count].tolist()
    return ", ".join(str(place if len(place) > 1 else place[0]) for place in found)


def check_finite(scores: Tensor, where: str) -> None:
    """Refuse NaN and +-inf in ``scores`` (``where`` names the axes, e.g. ``"[test, train]"``).

    NaN has no rank, and +inf and -inf of one training row averaged over a task are NaN,
    which a descending sort puts first; an infinite score is an overflow, not a judgement.
    """
    bad = ~torch.isfinite(scores)
    if bad.any():
        kinds = [name for name, hit in (("NaN", scores.isnan()), ("+inf", scores == math.inf),
                                        ("-inf", scores == -math.inf)) if hit.any()]
        raise InvalidArgumentError(
            f"{current_caller()}: scores must be finite to be ranked, got {int(bad.sum())} "
            f"{'/'.join(kinds)} at {where} {first_positions(bad)}"
            f"{' ...' if int(bad.sum()) > 3 else ''}; check the store and the test gradients "
            "(tif.verify_store) and score again, or drop those rows before selecting."
        )
