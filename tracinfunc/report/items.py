"""How the report shows one item: a thumbnail (images), text, or decoded tokens."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from tracinfunc.errors import InvalidArgumentError, InvalidTypeError
from tracinfunc.interop import tensor_if_array
from tracinfunc.report.html import text
from tracinfunc.report.png import png_data_uri

__all__ = ["Shown"]


class Shown:
    """Renders items of one collection (``None``, images ``[n, ...]``, texts, token batches).

    Thumbnails are written once per item into ``styles`` and referenced by class.
    """

    def __init__(self, items: Any, labels: Any, *, what: str, image_shape: tuple | None,
                 decode: Callable[[int], str] | None, styles: dict[str, str]) -> None:
        self.what, self.styles, self.decode = what, styles, decode
        self.items = tensor_if_array(items)
        self.image_shape = image_shape
        self.labels = None if labels is None else list(labels)
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

    def check_length(self, n: int) -> None:
        for name, value in ((self.what, self._length()), (f"{self.what}_labels",
                                                           None if self.labels is None
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
            image = item.reshape(self.image_shape) if self.image_shape else item
            if image.dim() not in (2, 3):
                raise InvalidArgumentError(
                    f"write_report: {self.what} items have shape {tuple(item.shape)}; pass "
                    "image_shape=(H, W) (e.g. (8, 8) for digits) or images [n, H, W].")
            self.styles[key] = png_data_uri(image.to(torch.float64))
        return f'<i class="thumb {key}"></i>'
