"""How the report shows one item: a thumbnail (images), text, or decoded tokens."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from tracinfunc.errors import InvalidArgumentError, InvalidTypeError
from tracinfunc.interop import tensor_if_array
from tracinfunc.report.html import text
from tracinfunc.report.png import png_data_uri

__all__ = ["Shown", "check_image_shape"]


def check_image_shape(image_shape: Any) -> tuple[int, ...] | None:
    """``image_shape`` as a tuple of 2 or 3 positive ints (``(H, W)`` or ``(H, W, 3)``)."""
    if image_shape is None:
        return None
    try:
        shape = tuple(operator.index(size) for size in image_shape)
    except TypeError:
        shape = ()
    if len(shape) not in (2, 3) or min(shape) < 1 or (len(shape) == 3 and shape[2] != 3):
        raise InvalidArgumentError(
            f"write_report: image_shape must be (H, W) or (H, W, 3) of positive ints, got "
            f"{image_shape!r}; e.g. image_shape=(8, 8) for flat 64-feature digits.")
    return shape


def _scalar(value: Any) -> Any:
    """A label as Python: 0-d tensors and NumPy/JAX scalars become numbers (``0``, not
    ``tensor(0)``); arrays become (nested) lists; anything else is kept."""
    value = tensor_if_array(value)
    return value.tolist() if isinstance(value, Tensor) else value


def _labels(labels: Any, name: str) -> list | dict | None:
    """``labels`` normalised once: ``None``, a list of Python values, or ``{row: value}``."""
    if labels is None:
        return None
    if isinstance(labels, Mapping):
        out = {}
        for key, value in labels.items():
            try:
                out[operator.index(_scalar(key))] = _scalar(value)
            except TypeError:
                raise InvalidTypeError(
                    f"write_report: {name} is a mapping whose key {key!r} is not a row number; "
                    "pass {row: label} with int rows, or a list with one label per row.") from None
        return out
    labels = tensor_if_array(labels)
    if isinstance(labels, Tensor):
        if labels.ndim == 0:
            raise InvalidArgumentError(
                f"write_report: {name} is one number; pass one label per row [n].")
        return labels.tolist()
    if isinstance(labels, str) or not isinstance(labels, Sequence | Iterable):
        raise InvalidTypeError(
            f"write_report: {name} must be a list of labels (one per row), a 1-D array or a "
            f"{{row: label}} mapping, got {type(labels).__name__}.")
    return [_scalar(value) for value in labels]


class Shown:
    """Renders items of one collection (``None``, images ``[n, ...]``, texts, token batches).

    Thumbnails are written once per item into ``styles`` and referenced by class.
    """

    def __init__(self, items: Any, labels: Any, *, what: str, labels_name: str,
                 image_shape: tuple | None, decode: Callable[[int], str] | None,
                 styles: dict[str, str]) -> None:
        self.what, self.labels_name, self.styles, self.decode = what, labels_name, styles, decode
        self.items = tensor_if_array(items)
        self.image_shape = image_shape
        self.labels = _labels(labels, labels_name)
        if isinstance(self.items, Mapping):
            self.items = {key: tensor_if_array(value) for key, value in self.items.items()}
            if "input_ids" not in self.items:
                raise InvalidTypeError(
                    f"write_report: {what} is a dict without 'input_ids'; pass a token batch, "
                    "images [n, ...] or a list of strings.")
        elif (self.items is not None and not isinstance(self.items, Tensor | Sequence)) or (
                isinstance(self.items, str)):
            raise InvalidTypeError(
                f"write_report: {what} must be images [n, ...], a list of strings or a token "
                f"batch, got {type(self.items).__name__}.")
        self._check_images()

    def _check_images(self) -> None:
        """Image items match ``image_shape`` (or are ``[n, H, W]`` / ``[n, H, W, 3]``)."""
        if not isinstance(self.items, Tensor) or not self.items.is_floating_point():
            return
        item = tuple(self.items.shape[1:])
        if self.image_shape is not None:
            if math.prod(item) != math.prod(self.image_shape):
                raise InvalidArgumentError(
                    f"write_report: image_shape={self.image_shape} holds "
                    f"{math.prod(self.image_shape)} values but {self.what} items have shape "
                    f"{item} ({math.prod(item)} values); pass an image_shape whose product is "
                    f"{math.prod(item)}, or leave {self.what} out for row ids only.")
        elif len(item) not in (2, 3) or (len(item) == 3 and item[2] != 3):
            raise InvalidArgumentError(
                f"write_report: {self.what} items have shape {item}; pass image_shape=(H, W) "
                "(e.g. (8, 8) for digits), images [n, H, W] or [n, H, W, 3], or leave "
                f"{self.what} out for row ids only.")

    def check_length(self, n: int) -> None:
        if isinstance(self.labels, dict):
            bad = [row for row in self.labels if not 0 <= row < n]
            if bad:
                raise InvalidArgumentError(
                    f"write_report: {self.labels_name} labels row {bad[0]} but there are {n} "
                    f"rows; use rows in [0, {n}).")
        for name, value in ((self.what, self._length()), (self.labels_name,
                                                           None if self.labels is None
                                                           or isinstance(self.labels, dict)
                                                           else len(self.labels))):
            if value is not None and value != n:
                raise InvalidArgumentError(
                    f"write_report: {name} has {value} items but the gradients have {n} rows; "
                    "pass one per row, in row order.")

    def _length(self) -> int | None:
        if self.items is None:
            return None
        if isinstance(self.items, Mapping):
            return len(self.items["input_ids"])
        return len(self.items)

    def label(self, row: int) -> str:
        if isinstance(self.labels, dict):
            return text(self.labels[row], limit=80) if row in self.labels else ""
        return "" if self.labels is None else text(self.labels[row], limit=80)

    def cell(self, row: int) -> str:
        """The item's HTML: a thumbnail, or (escaped) text."""
        if self.items is None:
            return ""
        if isinstance(self.items, Mapping):
            return f'<div class="doc">{text(self.token_text(row), limit=600)}</div>'
        item = self.items[row]
        if isinstance(item, Tensor) and item.is_floating_point():
            return self._thumbnail(row, item)
        return f'<div class="doc">{text(item, limit=600)}</div>'

    def token_text(self, row: int) -> str:
        ids = self.items["input_ids"][row]
        mask = self.items.get("attention_mask")
        keep = ids if mask is None else ids[mask[row] != 0]
        return "".join(self.token(int(t)) for t in keep)

    def token(self, token_id: int) -> str:
        return self.decode(token_id) if self.decode is not None else f"{token_id} "

    def _thumbnail(self, row: int, item: Tensor) -> str:
        key = f"{self.what[0]}{row}"
        if key not in self.styles:
            image = item.reshape(self.image_shape) if self.image_shape else item  # checked
            self.styles[key] = png_data_uri(image.to(torch.float64))
        return f'<i class="thumb {key}"></i>'
