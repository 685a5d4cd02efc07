"""Training data as batches: what ``build_store`` iterates, checks and re-batches.

One batch is a tensor, a tuple or a dict of tensors with a leading batch dimension; data is one
batch or an iterable of them (a list, a DataLoader, a generator).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from tracinfunc._validate import check_int, current_caller
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError
from tracinfunc.types import Batch

__all__ = [
    "batch_leaves",
    "batch_size_of",
    "check_ordered",
    "expected_rows",
    "flatten_batch",
    "iter_batches",
    "known_size",
    "rebatch",
    "sized",
    "tuple_note",
    "tuple_of_batches",
    "unflatten_batch",
]

# A batch's structure where it is a tensor or a plain tuple or list of tensors (nearly every
# loader's): ``(type, length)``, else torch's TreeSpec. torch's pytree costs ~50 us a call
# (a namedtuple check per node), and a build looks at each loader batch's leaves 4-5 times:
# ~15 ms of the dattri setting's ~120 ms build (120 loader batches).
FlatSpec = tuple[type, int] | TreeSpec


def flatten_batch(batch: Batch) -> tuple[list, FlatSpec]:
    """``(leaves, spec)`` as ``tree_flatten``, fast for a tensor or a plain tuple or list of
    tensors (the same leaves; a spec :func:`unflatten_batch` reads)."""
    if isinstance(batch, Tensor):
        return [batch], (Tensor, 1)
    if (type(batch) is tuple or type(batch) is list) and batch and \
            all(isinstance(leaf, Tensor) for leaf in batch):
        return list(batch), (type(batch), len(batch))
    return tree_flatten(batch)


def unflatten_batch(leaves: list, spec: FlatSpec) -> Batch:
    """The batch of ``leaves`` in the structure ``spec`` (:func:`flatten_batch`)."""
    if isinstance(spec, tuple):
        return leaves[0] if spec[0] is Tensor else spec[0](leaves)
    return tree_unflatten(leaves, spec)


def batch_leaves(batch: Batch) -> list:
    """``tree_leaves(batch)``, fast for the usual batches (:func:`flatten_batch`)."""
    return flatten_batch(batch)[0]


def sized(data: Batch | Iterable[Batch]) -> int:
    """Examples in ``data``, which a sharded build must know before it starts."""
    size = known_size(data)
    dataset = getattr(data, "dataset", None)
    if size is None and isinstance(data, torch.utils.data.DataLoader) and hasattr(
            dataset, "__len__"):
        size = len(dataset)
    if size is None or size == 0:
        raise InvalidArgumentError(
            f"build_store: a sharded build needs data of known, non-zero size (a batch, a "
            f"list of batches or a DataLoader over a sized dataset), got "
            f"{type(data).__name__} of size {size}; every part sizes the store up front."
        )
    return size


def check_ordered(data: object) -> None:
    """Refuse a DataLoader whose sampler draws at random (``shuffle=True``,
    ``RandomSampler``, ``SubsetRandomSampler``, ``WeightedRandomSampler``, a shuffling
    ``DistributedSampler``) or splits the data between processes (``DistributedSampler``
    over several replicas): row i of a store must be example i of the dataset. A sampler of
    the caller's own (or an index list) that yields a permutation is not detected: row i is
    then the i-th example the loader yields."""
    if not isinstance(data, DataLoader):
        return
    for sampler in (data.sampler, getattr(data.batch_sampler, "sampler", None)):
        if isinstance(sampler, _RANDOM_SAMPLERS):
            name = type(sampler).__name__
            made_by = " (shuffle=True makes one)" if isinstance(sampler, RandomSampler) else ""
            raise InvalidArgumentError(
                f"{current_caller('build_store')}: data is a DataLoader whose sampler is a "
                f"{name}{made_by}, so row "
                "i of the store would not be example i of the dataset (and a resumed build "
                "would store duplicates and miss examples); pass DataLoader(dataset, "
                "batch_size=..., shuffle=False), over torch.utils.data.Subset(dataset, "
                "indices) for a subset (row i is then example indices[i])."
            )
        if isinstance(sampler, DistributedSampler) and sampler.shuffle:
            raise InvalidArgumentError(
                f"{current_caller('build_store')}: data is a DataLoader whose sampler is a "
                "DistributedSampler with shuffle=True, so row i of the store would not be "
                "example i of the dataset; pass DataLoader(dataset, batch_size=..., "
                "shuffle=False)."
            )
        if isinstance(sampler, DistributedSampler) and sampler.num_replicas > 1:
            raise InvalidArgumentError(
                f"{current_caller('build_store')}: data is a DataLoader whose sampler is a "
                "DistributedSampler, so each process would see only its share of the "
                "examples, in its own order; pass every process DataLoader(dataset, "
                "batch_size=..., shuffle=False): a build to a Zarr store under torchrun "
                "splits the rows between processes itself."
            )


_RANDOM_SAMPLERS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def known_size(data: Batch | Iterable[Batch]) -> int | None:
    """Examples in ``data`` when that is cheap to know (one batch or a list of them)."""
    if isinstance(data, Tensor | tuple | Mapping):
        leaves = batch_leaves(data)
        first = leaves[0] if leaves else None
        # A 0-d leaf has no batch dimension: left for iter_batches to report.
        return first.shape[0] if isinstance(first, Tensor) and first.ndim else None
    if isinstance(data, list):
        sizes = [known_size(batch) for batch in data]
        return None if None in sizes else sum(sizes)
    return None  # a DataLoader or generator: the bar counts without a total


def expected_rows(data: Batch | Iterable[Batch]) -> int | None:
    """Examples ``data`` should yield, as a hint (an in-memory build allocates its rows once):
    :func:`known_size`, or a batching DataLoader's sampler length (a ``drop_last`` loader's
    full batches). May be wrong (a dataset whose ``__len__`` is not what it yields): callers
    must cope with more or fewer rows."""
    size = known_size(data)
    if size is not None or not isinstance(data, DataLoader) or data.batch_size is None:
        return size
    try:
        return len(data) * data.batch_size if data.drop_last else len(data.sampler)
    except TypeError:  # an IterableDataset without __len__
        return None


def iter_batches(data: Batch | Iterable[Batch]) -> Iterator[Batch]:
    """Yield batches from ``data``: one batch, or an iterable of batches.

    One batch is a tensor, a tuple or a dict whose leaves are tensors. Anything else that is
    iterable (a list, a DataLoader, a generator) is taken as a sequence of batches.
    """
    if isinstance(data, Tensor | tuple | Mapping):
        yield _check_batch(data, where="data")
        return
    if not isinstance(data, Iterable):
        raise InvalidTypeError(
            f"{current_caller('build_store')}: data must be a batch (tensor, tuple or dict of "
            "tensors) or an "
            f"iterable of batches, got {type(data).__name__}."
        )
    unbatched = isinstance(data, DataLoader) and data.batch_size is None \
        and data.batch_sampler is None
    for index, batch in enumerate(data):
        yield _check_batch(batch, where=f"batch {index} of data", unbatched=unbatched)


def rebatch(data: Batch | Iterable[Batch], batch_size: int) -> Iterator[Batch]:
    """Yield the examples of ``data`` in batches of exactly ``batch_size`` (the last: fewer).

    Batches are split and merged (concatenated along the batch dimension) as needed; the
    order of examples is kept. Examples held while the next batch is read are copied first:
    a loader may refill one buffer for every batch.
    """
    batch_size = check_int(batch_size, "batch_size", optional=True)
    pending: list[Batch] = []  # copies (or slices of copies): never the loader's tensors
    count = 0
    for batch in iter_batches(data):
        pending.append(batch)
        count += batch_size_of(batch)
        split, fresh = False, len(pending) > 1  # a concatenation makes new tensors
        while count >= batch_size:
            merged = _concat(pending)
            yield tree_map(lambda leaf: leaf[:batch_size], merged)
            count -= batch_size
            pending = [tree_map(lambda leaf: leaf[batch_size:], merged)] if count else []
            split = True
        if pending and not (split and fresh):  # the loader's batch (or a view of it) is held
            pending[-1] = tree_map(torch.clone, pending[-1])
    if count:
        yield _concat(pending)


def _concat(batches: list[Batch]) -> Batch:
    if len(batches) == 1:
        return batches[0]
    return tree_map(lambda *leaves: torch.cat(leaves), *batches)


def _check_batch(batch: Batch, *, where: str = "data", unbatched: bool = False) -> Batch:
    """``batch`` if it is a pytree of tensors sharing a leading batch dimension. ``where``
    names it in errors (``"batch 3 of data"``); ``unbatched``: it comes from a
    ``DataLoader(batch_size=None)`` (the error says so)."""
    leaves = batch_leaves(batch)
    if not leaves or not all(isinstance(leaf, Tensor) for leaf in leaves):
        kinds = sorted({type(leaf).__name__ for leaf in leaves})
        raise InvalidTypeError(
            f"{current_caller('build_store')}: a batch must be a pytree of tensors with a "
            f"leading batch dimension, got leaves of types {kinds or ['<none>']} in {where}; "
            "convert arrays with torch.as_tensor."
        )
    sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        raise InvalidArgumentError(
            f"{current_caller('build_store')}: all tensors of a batch need the same leading "
            f"(batch) dimension, got shapes {[list(leaf.shape) for leaf in leaves]} in "
            f"{where}."
            + (" data is a DataLoader with batch_size=None, which yields single examples "
               "without a batch dimension: pass DataLoader(dataset, batch_size=...)."
               if unbatched else "")
        )
    return batch


def batch_size_of(batch: Batch) -> int:
    return batch_leaves(batch)[0].shape[0]


def has_no_examples(batch: Batch) -> bool:
    """Whether ``batch``'s first tensor leaf has a leading dimension of 0 (a batch of no
    examples; one without tensors, or a 0-dim leaf, is left to the caller's own checks)."""
    leaf = next((leaf for leaf in batch_leaves(batch) if isinstance(leaf, Tensor)), None)
    return leaf is not None and leaf.ndim > 0 and leaf.shape[0] == 0


def tuple_of_batches(data: object) -> bool:
    """Whether ``data`` is a tuple of tuples, lists or dicts: one nested batch, or (more
    often, when the loss fails on it) batches meant as a list (``((x, y),)`` too). Functions
    that read a tuple as ONE batch add this to the failure's message."""
    return type(data) is tuple and len(data) >= 1 and \
        all(isinstance(element, tuple | list | Mapping) for element in data)


def tuple_note(error: Exception, function: str, data: tuple) -> str:
    """``error``'s message with the note that ``function`` read the tuple ``data`` as ONE
    batch (for data :func:`tuple_of_batches` says may be batches meant as a list)."""
    return (f"{error} Note: data is a tuple, which {function} reads as ONE batch (a pytree of "
            f"tensors); if its {len(data)} elements are batches, pass them as a list: "
            "[(x1, y1), (x2, y2)].")
