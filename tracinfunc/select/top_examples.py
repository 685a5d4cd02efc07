"""Top-k training rows turned back into the training examples, to read, print and save.

``tif.top_k`` gives row numbers; :class:`TopExamples` pairs them with the dataset they index
(a list, a HF ``datasets.Dataset``, or a batch dict of ``[n_train, ...]`` tensors) and shows
text as text (strings, a ``"text"`` field, or token ids decoded with a tokenizer).
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tracinfunc._artifacts import check_writable
from tracinfunc._validate import calling
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError, OutputPathError
from tracinfunc.select._inputs import first_positions

__all__ = ["TopExamples", "dataset_length"]

_SHOWN = 200  # characters of an item shown when printing


@dataclass(frozen=True)
class TopExamples:
    """The best training examples for each query, as the dataset's own items.

    Args:
        values: Scores ``[n_test, k]`` (``tif.top_k``'s first output): real, no NaN
            (refused: it has no rank); +-inf are shown as they are.
        indices: Training rows ``[n_test, k]`` (its second): a tensor, NumPy/JAX array or
            nested list of integers (float or bool rows are refused, never truncated), each
            in ``[0, len(dataset))`` and none twice within a test row. A 1-D pair is one
            test row.
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

    Raises:
        InvalidTypeError: indices not integers, values not real, an unsized dataset.
        InvalidArgumentError: shapes differ or are not ``[n_test, k]``, a row negative or
            beyond the dataset, a row repeated within a test row, NaN values, or another
            number of queries than test rows.
    """

    values: Tensor
    indices: Tensor
    dataset: Any
    _: KW_ONLY
    queries: Sequence[Any] | None = None
    tokenizer: Any = None
    text: Callable[[Any], str] | None = None

    def __post_init__(self) -> None:
        values, indices = _values(self.values), _indices(self.indices)
        if values.dim() == 1 and indices.dim() == 1:
            values, indices = values[None], indices[None]
        if values.shape != indices.shape or values.dim() != 2:
            raise InvalidArgumentError(
                f"TopExamples: values and indices must both be [n_test, k], got "
                f"{list(values.shape)} and {list(indices.shape)}; pass tif.top_k's outputs."
            )
        _check_rows(indices, dataset_length(self.dataset))
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

        JSON has no infinity: a +-inf score is written as ``null`` there (its rank keeps its
        place in the order); CSV writes ``inf``/``-inf``.

        Raises:
            OutputPathError: ``path`` exists (without ``overwrite``), its directory is missing,
                or the suffix is neither ``.json`` nor ``.csv``.
            ForeignArtifactError: ``path`` is, lies inside, or holds an artefact of another
                kind (a store, index, curvature, recording...; see docs/concepts/stores.md).
        """
        path = Path(path)
        with calling("TopExamples.save"):
            check_writable(path, "selection file", overwrite=overwrite)
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
                    json.dump(_json_safe(records), file, indent=1, ensure_ascii=False,
                              allow_nan=False)
                else:
                    writer = csv.DictWriter(file, fieldnames=list(records[0]) if records else [])
                    writer.writeheader()
                    writer.writerows(records)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path


def _json_safe(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records with a +-inf score written as ``null``: JSON (RFC 8259) has no infinity, and
    strict parsers refuse Python's ``Infinity``. The rank keeps its place in the order."""
    return [{**r, "score": r["score"] if math.isfinite(r["score"]) else None} for r in records]


def _as_tensor(value: Any, name: str) -> Tensor:
    try:
        return value if isinstance(value, Tensor) else torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError, RuntimeError) as error:
        raise InvalidTypeError(
            f"TopExamples: {name} must be a tensor, array or nested list [n_test, k], got "
            f"{type(value).__name__} ({error}); pass tif.top_k's outputs."
        ) from error


def _values(values: Any) -> Tensor:
    """Scores as a real tensor without NaN (+-inf are shown as they are)."""
    values = _as_tensor(values, "values")
    if values.dtype == torch.bool or values.is_complex():
        raise InvalidTypeError(
            f"TopExamples: values must be real scores, got {values.dtype}; pass tif.top_k's "
            "first output."
        )
    if values.is_floating_point() and (nan := values.isnan()).any():
        raise InvalidArgumentError(
            f"TopExamples: values hold NaN at [test row, rank] {first_positions(nan)}, which "
            "has no rank; check the store and the test gradients (tif.verify_store)."
        )
    return values


def _indices(indices: Any) -> Tensor:
    """Training rows as an integer tensor: floats would be truncated to other rows."""
    if _holds_bool(indices):  # [[True, 2]] would become the int array [[1, 2]]
        raise InvalidTypeError(
            "TopExamples: indices must be integer training rows, got a list holding a bool "
            "(True/False would be read as rows 1/0); pass the rows as ints, e.g. tif.top_k's "
            "second output."
        )
    indices = _as_tensor(indices, "indices")
    if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
        raise InvalidTypeError(
            f"TopExamples: indices must be integer training rows (int64 like tif.top_k's "
            f"second output), got {indices.dtype}; floats would be truncated to other rows. "
            "Pass the indices as integers (e.g. indices.long() after checking they are whole)."
        )
    return indices


def _holds_bool(value: Any) -> bool:
    """Whether a (nested) list or tuple holds a Python or NumPy bool (checked iteratively)."""
    stack = [value] if isinstance(value, list | tuple) else []
    while stack:
        item = stack.pop()
        if isinstance(item, bool | np.bool_):
            return True
        if isinstance(item, list | tuple):
            stack.extend(item)
    return False


def _check_rows(indices: Tensor, n: int) -> None:
    """Rows in ``[0, n)``, none twice for one test row (a ranking never repeats a row)."""
    if indices.numel() == 0:
        return
    for bad, what in ((indices < 0, "negative rows"),
                      (indices >= n, f"rows beyond the dataset's {n} items")):
        if bad.any():
            raise InvalidArgumentError(
                f"TopExamples: indices must be rows in [0, {n}), got {what} at [test "
                f"row, rank] {first_positions(bad)} (e.g. {int(indices[bad][0])}); pass the "
                "training data the store was built from, in its order, and tif.top_k's rows."
            )
    ordered = indices.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
    if repeated.any():
        row = int(torch.nonzero(repeated)[0])
        raise InvalidArgumentError(
            f"TopExamples: indices must not repeat a training row within a test row, but "
            f"test row {row} holds {indices[row].tolist()!r:.80}; a ranking names each row once "
            "(were two top_k outputs concatenated?)."
        )


def dataset_length(dataset: Any) -> int:
    """Items in ``dataset``: ``len``, or the common length of a dict's columns."""
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
