"""What a part of a sharded build records so that commit can compare the parts with each other.

Each part computes only its own rows, so nothing in its rows says whether the other parts
were built from the same data or with the same options. Each part therefore records, in its
marker (``parts/<i>/zarr.json``):

- ``build``: the options that change its rows but are not in the store's metadata
  (``mixed_precision``), and a digest of the metadata it was built under;
- ``inputs``: fingerprints of the examples it iterated: of rows ``[0, start)`` (``before``;
  a part iterates them, without computing, to reach its own rows) and of rows ``[0, stop)``
  (``through``). A fingerprint is a BLAKE2b per leaf of the batch (tensors and arrays, row by
  row, so it does not depend on how the examples are batched) over the bytes of the rows.

Commit (:func:`~tracinfunc.store.zarr.parts.commit_store`) requires equal ``build`` records
and that each part's ``before`` equals the ``through`` of the part before it, which chains
every part to the same data. Not covered: the rows of the last part are iterated by no
other part (a last part whose own examples alone differ is not caught), leaves that are
not arrays (strings, Python objects) are not fingerprinted, and parts written without this
frontend (the JAX frontend, ``PartWriter.append`` by hand) record nothing to compare.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

__all__ = ["InputFingerprint", "build_record", "fingerprinted", "first_batch_recorded",
           "precision_name"]


class InputFingerprint:
    """A running fingerprint of examples: one BLAKE2b per batch leaf over its rows' bytes."""

    def __init__(self) -> None:
        self._leaves: list[tuple[str, Any]] = []

    def update(self, batch: Any, lo: int, hi: int) -> None:
        """Add examples ``[lo, hi)`` of ``batch`` (a pytree of ``[b, ...]`` arrays)."""
        if hi <= lo:
            return
        arrays = [_as_numpy(leaf) for leaf in tree_leaves(batch)]
        arrays = [a for a in arrays if a is not None and a.ndim >= 1]
        if not self._leaves:
            self._leaves = [(f"{a.dtype.str}{list(a.shape[1:])}", hashlib.blake2b(digest_size=16))
                            for a in arrays]
        for (_, hasher), array in zip(self._leaves, arrays, strict=False):
            hasher.update(np.ascontiguousarray(array[lo:hi]).view(np.uint8).data)

    def digest(self) -> str:
        """The fingerprint so far (updates may go on)."""
        parts = [(kind, hasher.copy().hexdigest()) for kind, hasher in self._leaves]
        return hashlib.blake2b(json.dumps(parts).encode(), digest_size=16).hexdigest()


def _as_numpy(leaf: Any) -> np.ndarray | None:
    if isinstance(leaf, torch.Tensor):
        leaf = leaf.detach().cpu()
        if leaf.dtype == torch.bfloat16:
            leaf = leaf.view(torch.int16)
        return leaf.contiguous().numpy()
    if isinstance(leaf, np.ndarray) or hasattr(leaf, "__array__"):
        return np.asarray(leaf)
    return None


def fingerprinted(batches: Iterable[tuple[int, Any]], writer: Any) -> Iterator[tuple[int, Any]]:
    """``batches`` (``(b, batch)`` pairs) passed on unchanged, while the examples before the
    part's rows and through them are fingerprinted and given to ``writer.record_inputs``
    (a :class:`~tracinfunc.store.zarr.parts.PartWriter`) as soon as they are known."""
    start, stop = writer.start, writer.stop
    running, before, seen, done = InputFingerprint(), None, 0, False
    for size, batch in batches:
        first, seen = seen, seen + size  # this batch holds rows [first, seen)
        if not done:
            if before is None:
                running.update(batch, 0, min(size, start - first))
                if seen >= start:
                    before = running.digest()
            if before is not None:
                running.update(batch, max(0, start - first), min(size, stop - first))
                if seen >= stop:
                    writer.record_inputs(before=before, through=running.digest())
                    done = True
        yield size, batch


def build_record(meta: Any, *, mixed_precision: torch.dtype | None) -> dict[str, Any]:
    """What a part records of how it was built: the options not in the store's metadata
    and a digest of the metadata (projection, layout, dtype, checkpoints, preconditioner)."""
    body = {key: value for key, value in meta.to_dict().items()
            if key not in ("n_train", "complete", "library_version", "integrity")}
    text = json.dumps(body, sort_keys=True, allow_nan=True)
    return {"mixed_precision": precision_name(mixed_precision),
            "metadata": hashlib.sha256(text.encode()).hexdigest()[:32]}


def precision_name(mixed_precision: torch.dtype | None) -> str | None:
    """How a build record holds ``mixed_precision``: ``"float16"``, ``"bfloat16"``, ``None``."""
    return None if mixed_precision is None else str(mixed_precision).removeprefix("torch.")


def first_batch_recorded(pairs: Iterable[tuple[int, Any]], writer: Any, *,
                         record: dict[str, Any]) -> Iterator[tuple[int, Any]]:
    """``pairs`` (``(b, batch)``), recording ``{"batch_size": None, "first_batch": b,
    **record}`` with ``writer.record_build`` before the first is handed on (before any row
    is written).

    With ``batch_size=None`` the data's batches are the gradient calls: a resume re-reads the
    data from its start, so a loader with another batch size is refused at its first batch.
    Only the first batch's size is recorded, not every one.
    """
    first = True
    for size, batch in pairs:
        if first:
            writer.record_build({"batch_size": None, "first_batch": int(size), **record})
            first = False
        yield size, batch
