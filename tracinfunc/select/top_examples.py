"""Top-k training rows turned back into the training examples, to read, print and save.

``tif.top_k`` gives row numbers; :class:`TopExamples` pairs them with the dataset they index
(a list, a HF ``datasets.Dataset``, or a batch dict of ``[n_train, ...]`` tensors) and shows
text as text (strings, a ``"text"`` field, or token ids decoded with a tokenizer).
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tracinfunc._artifacts import check_writable
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError, OutputPathError

__all__ = ["TopExamples"]

_SHOWN = 200  # characters of an item shown when printing


@dataclass(frozen=True)
class TopExamples:
    """The best training examples for each query, as the dataset's own items.

    Args:
        values: Scores ``[n_test, k]`` (``tif.top_k``'s first output).
        indices: Training rows ``[n_test, k]`` (its second).
        dataset: What the rows index: a sequence of items, or a dict of ``[n_train, ...]``
            tensors/lists (row ``i`` is ``{key: value[i]}``).
        queries: Optional: the ``n_test`` test items, shown as headings.
        tokenizer: Optional: decodes ``input_ids`` of dict items (``tokenizer.decode``).
        text: Optional: ``item -> str``, overriding how items are shown.

    Example:
        >>> values, indices = tif.top_k(store, test_grads, k=5)
        >>> top = tif.TopExamples(values, indices, train_texts, queries=prompts)
        >>> print(top)                        # each query, then its 5 examples with scores
        >>> top.save("top.json")              # records with the text
    """

    values: Tensor
    indices: Tensor
    dataset: Any
    _: KW_ONLY
    queries: Sequence[Any] | None = None
    tokenizer: Any = None
    text: Callable[[Any], str] | None = None

    def __post_init__(self) -> None:
        values, indices = torch.as_tensor(self.values), torch.as_tensor(self.indices)
        if values.dim() == 1:
            values, indices = values[None], indices[None]
        if values.shape != indices.shape or values.dim() != 2:
            raise InvalidArgumentError(
                f"TopExamples: values and indices must both be [n_test, k], got "
                f"{list(values.shape)} and {list(indices.shape)}; pass tif.top_k's outputs."
            )
        n = _length(self.dataset)
        if indices.numel() and not 0 <= int(indices.min()) <= int(indices.max()) < n:
            raise InvalidArgumentError(
                f"TopExamples: indices run to {int(indices.max())} but the dataset has {n} "
                "items; pass the training data the store was built from, in its order."
            )
        if self.queries is not None and len(self.queries) != values.shape[0]:
            raise InvalidArgumentError(
                f"TopExamples: {len(self.queries)} queries for {values.shape[0]} rows of "
                "scores; pass one query per test example."
            )
        object.__setattr__(self, "values", values.detach().cpu())
        object.__setattr__(self, "indices", indices.detach().cpu().to(torch.int64))

    def __len__(self) -> int:
        return self.values.shape[0]

    def __getitem__(self, test_row: int) -> list[tuple[float, int, Any]]:
        """``(score, train_row, item)`` for one test row, best first."""
        return [(float(v), int(i), _item(self.dataset, int(i)))
                for v, i in zip(self.values[test_row], self.indices[test_row], strict=True)]

    def as_text(self, item: Any) -> str:
        """How an item is shown: ``text(item)``, a string, a ``"text"`` field, or decoded ids."""
        if self.text is not None:
            return str(self.text(item))
        return _as_text(item, self.tokenizer)

    def records(self) -> list[dict[str, Any]]:
        """One dict per (test row, rank): ``test_index, query, rank, train_index, score, text``."""
        rows = []
        for test_row in range(len(self)):
            query = None if self.queries is None else self.as_text(self.queries[test_row])
            for rank, (value, index, item) in enumerate(self[test_row]):
                rows.append({"test_index": test_row, "query": query, "rank": rank,
                             "train_index": index, "score": value, "text": self.as_text(item)})
        return rows

    def __str__(self) -> str:
        lines = []
        for test_row in range(len(self)):
            query = ("" if self.queries is None
                     else f": {_short(self.as_text(self.queries[test_row]))}")
            lines.append(f"test {test_row}{query}")
            lines += [f"  {rank + 1:>3}. {value:+.4g}  [{index}] {_short(self.as_text(item))}"
                      for rank, (value, index, item) in enumerate(self[test_row])]
        return "\n".join(lines)

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write :meth:`records` as ``.json`` (a list) or ``.csv``, atomically.

        Raises:
            OutputPathError: ``path`` exists (without ``overwrite``), its directory is missing,
                or the suffix is neither ``.json`` nor ``.csv``.
            ForeignArtifactError: ``path`` is, lies inside, or holds an artefact of another
                kind (a store, index, curvature, recording...; see docs/concepts/stores.md).
        """
        path = Path(path)
        check_writable(path, "selection file", overwrite=overwrite, caller="TopExamples.save")
        if path.suffix not in (".json", ".csv"):
            raise OutputPathError(
                f"TopExamples.save: {str(path)!r} must end in .json or .csv."
            )
        if path.exists() and not overwrite:
            raise OutputPathError(
                f"TopExamples.save: {str(path)!r} exists; choose another path or pass "
                "overwrite=True."
            )
        if not path.resolve().parent.is_dir():
            raise OutputPathError(
                f"TopExamples.save: the directory of {str(path)!r} does not exist; create it."
            )
        records = self.records()
        handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.resolve().parent)
        try:
            with os.fdopen(handle, "w", newline="", encoding="utf-8") as file:
                if path.suffix == ".json":
                    json.dump(records, file, indent=1, ensure_ascii=False)
                else:
                    writer = csv.DictWriter(file, fieldnames=list(records[0]) if records else [])
                    writer.writeheader()
                    writer.writerows(records)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path


def _length(dataset: Any) -> int:
    if isinstance(dataset, Mapping):
        lengths = {len(value) for value in dataset.values()}
        if len(lengths) != 1:
            raise InvalidArgumentError(
                f"TopExamples: a dict dataset needs columns of one length, got {sorted(lengths)}."
            )
        return lengths.pop()
    try:
        return len(dataset)
    except TypeError as error:
        raise InvalidTypeError(
            f"TopExamples: dataset must support len() and [i] (a list, a datasets.Dataset, a "
            f"dict of [n_train, ...] columns), got {type(dataset).__name__}."
        ) from error


def _item(dataset: Any, index: int) -> Any:
    if isinstance(dataset, Mapping):
        return {key: value[index] for key, value in dataset.items()}
    return dataset[index]


def _as_text(item: Any, tokenizer: Any) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, bytes):
        return item.decode("utf-8", errors="replace")
    if isinstance(item, Mapping):
        if isinstance(item.get("text"), str):
            return item["text"]
        if tokenizer is not None and "input_ids" in item:
            ids = torch.as_tensor(item["input_ids"])
            mask = item.get("attention_mask")
            if mask is not None:
                ids = ids[torch.as_tensor(mask) != 0]
            return tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        return "{" + ", ".join(f"{k}: {_as_text(v, None)}" for k, v in item.items()) + "}"
    if isinstance(item, Tensor) and item.numel() > 8:
        return f"tensor{list(item.shape)}"
    return repr(item)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _SHOWN else text[:_SHOWN - 1] + "…"
