"""The gradient calls of a torch build, each knowing which of the data's batches it holds.

A call is one of the data's batches, several of them merged (:mod:`tracinfunc.build.merge`)
or ``batch_size`` examples re-batched from them. When the loss fails on a call, the error
names the batch and the data rows it holds, so the user finds the bad batch without
bisecting: a merged call that fails is run again batch by batch to find the failing one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map

from tracinfunc._validate import current_caller
from tracinfunc.batches import batch_size_of
from tracinfunc.build.merge import MergedCall
from tracinfunc.errors import LossFunctionError, TracInFuncError
from tracinfunc.grads.transforms import explain_loss_error
from tracinfunc.types import Batch

__all__ = ["Call", "CallSite", "numbered"]


@dataclass(frozen=True)
class Call:
    """Where a call's examples come from.

    Attributes:
        first_row: The data row (store row) of its first example.
        first: The index of its first batch in the data, or ``None`` where ``batch_size``
            re-batched the data.
        sizes: The sizes of the data's batches it holds (one entry when re-batched).
        batch_size: The build's ``batch_size`` (``None``: the data's batches).
    """

    first_row: int
    first: int | None
    sizes: tuple[int, ...]
    batch_size: int | None

    def part(self, i: int) -> Call:
        """The call of its ``i``-th batch alone."""
        return Call(self.first_row + sum(self.sizes[:i]), self.first + i, (self.sizes[i],),
                    self.batch_size)

    def where(self) -> str:
        """``"batch 6 of data (rows 30-34)"`` and the like."""
        rows = f"rows {self.first_row}-{self.first_row + sum(self.sizes) - 1}"
        if self.first is None:
            return f"the call of {rows} (batch_size={self.batch_size})"
        if len(self.sizes) == 1:
            return f"batch {self.first} of data ({rows})"
        return (f"batches {self.first}-{self.first + len(self.sizes) - 1} of data merged into "
                f"one call ({rows})")


def numbered(calls: Iterable[MergedCall] | Iterable[Batch], *, merged: bool,
             batch_size: int | None) -> Iterator[tuple[Batch, Call]]:
    """Each call's batch with its :class:`Call` (``calls`` from ``merged_calls`` where
    ``merged``, else batches: the data's, or re-batched to ``batch_size``)."""
    row = 0
    for index, item in enumerate(calls):
        batch, first, sizes = item if merged else (item, index, (batch_size_of(item),))
        yield batch, Call(row, None if batch_size is not None else first, sizes, batch_size)
        row += sum(sizes)


class CallSite:
    """Runs ``rows_of`` on the current call, turning a failure into a library error that
    names the call (``current`` is set as each call is handed to the build loop)."""

    def __init__(self, rows_of: Callable[[Batch], Tensor]) -> None:
        self.rows_of = rows_of
        self.current: Call | None = None

    def follow(self, calls: Iterable[tuple[Batch, Call]]) -> Iterator[tuple[int, Batch]]:
        """``(examples, batch)`` of each of ``calls`` (:func:`numbered`'s), the call made
        :attr:`current` as it is handed on (the build loop's ``batches``)."""
        for batch, call in calls:
            self.current = call
            yield sum(call.sizes), batch

    def __call__(self, batch: Batch) -> Tensor:
        try:
            return self.rows_of(batch)
        except (torch.OutOfMemoryError, MemoryError):
            raise  # not the loss's fault: memory options are the fix, as the error says
        except Exception as error:
            call = self.current
            if call is None:
                raise
            cause, batch, call = self._failing_part(error, batch, call)
            raise _located(cause, batch, call) from cause

    def _failing_part(self, error: Exception, batch: Batch, call: Call
                      ) -> tuple[Exception, Batch, Call]:
        """The first batch of a merged call that fails alone (else the whole call)."""
        if call.first is None or len(call.sizes) == 1:
            return error, batch, call
        start = 0
        for i, size in enumerate(call.sizes):
            part = tree_map(lambda leaf, a=start, b=start + size: leaf[a:b], batch)
            start += size
            try:
                self.rows_of(part)
            except Exception as part_error:
                return part_error, part, call.part(i)
        return error, batch, call


def _located(error: Exception, batch: Batch, call: Call) -> Exception:
    """``error`` as a tracinfunc error that names the call and what its batch holds (torch,
    JAX or NumPy arrays)."""
    where = call.where()
    if isinstance(error, TracInFuncError):
        return type(error)(f"{error} (failed on {where})")
    clearer = explain_loss_error(error)
    if clearer is not None:
        return type(clearer)(f"{clearer} (failed on {where})")
    held = [f"{str(leaf.dtype).removeprefix('torch.')} {list(leaf.shape)}"
            for leaf in tree_leaves(batch) if hasattr(leaf, "shape") and hasattr(leaf, "dtype")]
    return LossFunctionError(
        f"{current_caller('build_store')}: loss(params, example) failed on {where} with "
        f"{type(error).__name__}: "
        f"{error}. The call's batch holds tensors {held}; check that every batch has the "
        "structure, dtypes and shapes the loss expects (cast it, e.g. x.float(), or drop it)."
    )
