"""Small loader batches merged into larger gradient calls, for in-memory builds of small models.

Every vmapped gradient call has a fixed cost (about 2 ms on a CPU: functorch's wrappers,
one dispatch per operation and per parameter); a model of a few thousand parameters fed a
loader's batches of 100 spends most of its build in it. Per-example rows do not depend on
which examples share a call, so ``build_store`` with ``batch_size=None`` concatenates
consecutive batches into calls of up to :func:`merge_limit` examples where nothing else
depends on the batching: the store is in memory (no resume, no parts), and no memory option
(``chunk_size``, ``memory_budget``, ``stages``) bounds what a call may hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from tracinfunc.batches import batch_size_of, flatten_batch, unflatten_batch
from tracinfunc.grads.chunking import DEFAULT_COPIES
from tracinfunc.grads.options import GradientOptions
from tracinfunc.projection.spec import Layout
from tracinfunc.types import Batch

__all__ = ["MERGE_BYTES", "MERGE_EXAMPLES", "MergedCall", "merge_limit", "merged_calls"]

MergedCall = tuple[Batch, int, tuple[int, ...]]
"""``(batch, first, sizes)``: a call's batch, its first data batch and their sizes."""

MERGE_BYTES = 64 * 2**20
"""Per-example gradient bytes (with their temporaries) one merged call may hold."""

MERGE_EXAMPLES = 4096
"""The most examples one merged call holds, however small the model."""


def merge_limit(layout: Layout, itemsize: int, options: GradientOptions, *,
                in_memory: bool) -> int:
    """Examples per merged call for this layout, or 0 where batches must be kept as given.

    Args:
        layout: The differentiated parameters' names and shapes (``p`` entries in all).
        itemsize: Bytes per gradient entry.
        options: The build's gradient options; any memory option keeps the batches.
        in_memory: Whether the store is in memory (a Zarr store resumes batch by batch).
    """
    if not in_memory or options.chunk_size is not None or options.memory_budget is not None \
            or options.stages is not None:
        return 0
    n_params = sum(math.prod(shape) for _, shape in layout)
    per_example = max(1, DEFAULT_COPIES * n_params * itemsize)
    return min(MERGE_EXAMPLES, MERGE_BYTES // per_example)


def merged_calls(batches: Iterable[Batch], limit: int) -> Iterator[MergedCall]:
    """Consecutive ``batches`` concatenated while the total stays within ``limit`` examples.

    A batch is never split (one larger than ``limit`` goes alone), the order of the examples
    is kept, and only batches of one structure (pytree, leaf dtypes and trailing shapes) are
    merged: a batch that differs goes to its own call, which reports it as before. A batch
    held while the next one is read is copied first (a loader may refill one buffer for
    every batch: a prefetcher, a ``collate_fn`` writing into a preallocated tensor), straight
    into its call's leaves: one copy of the data, not a copy and then a concatenation.

    Yields:
        ``(batch, first, sizes)``: the call's batch, the index of its first batch in
        ``batches`` and the sizes of the batches it holds.
    """
    call: _Call | None = None
    for index, batch in enumerate(batches):
        size, batch_kind = batch_size_of(batch), _kind(batch)
        if call is not None and (call.count + size > limit or batch_kind != call.kind):
            yield call.batch(), call.first, tuple(call.sizes)
            call = None
        if call is None and size >= limit:  # alone in its call: computed before the next read
            yield batch, index, (size,)
            continue
        if call is None:
            call = _Call(batch, index, batch_kind, limit)
        call.add(batch, size)  # held past the next read: a copy
    if call is not None:
        yield call.batch(), call.first, tuple(call.sizes)


class _Call:
    """One merged call's batches, copied as they arrive; ``batch()`` is the call's batch.

    CPU leaves are copied into ``[limit, *trailing]`` tensors (pages past what is written
    are never touched, so cost nothing) and ``batch()`` is a view of the rows filled: one
    copy. Leaves on an accelerator, whose memory is reserved as allocated, are cloned and
    concatenated at the end, as large as the call and no larger."""

    def __init__(self, batch: Batch, first: int, kind: tuple, limit: int) -> None:
        leaves, self.spec = flatten_batch(batch)
        self.in_place = all(leaf.device.type == "cpu" for leaf in leaves)
        self.leaves = ([leaf.new_empty((limit, *leaf.shape[1:])) for leaf in leaves]
                       if self.in_place else [[] for _ in leaves])
        self.first, self.kind = first, kind
        self.sizes: list[int] = []
        self.count = 0

    def add(self, batch: Batch, size: int) -> None:
        with torch.no_grad():
            for target, leaf in zip(self.leaves, flatten_batch(batch)[0], strict=True):
                if self.in_place:
                    target[self.count:self.count + size].copy_(leaf)
                else:
                    target.append(leaf.clone())
        self.sizes.append(size)
        self.count += size

    def batch(self) -> Batch:
        if self.in_place:
            return unflatten_batch([leaf[:self.count] for leaf in self.leaves], self.spec)
        return unflatten_batch([parts[0] if len(parts) == 1 else torch.cat(parts)
                                for parts in self.leaves], self.spec)


def _kind(batch: Batch) -> tuple:
    leaves, spec = flatten_batch(batch)
    return spec, tuple((leaf.dtype, leaf.shape[1:]) for leaf in leaves)
