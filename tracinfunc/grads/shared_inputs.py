"""A call's raw inputs projected once for all of its checkpoints.

A layer that reads the batch itself (a first ``nn.Linear``) sees the same input at every
checkpoint, so the input side of its kronecker projection, ``x @ P_c``
(``[b, in] @ [in, k_c]``), is the same product at each of them: in the dattri setting
(logistic regression, 2 checkpoints, k=512) ~7 ms of a ~100 ms build. ``build_store``
computes each call's checkpoints in turn inside :func:`sharing_inputs`, and the batched
path takes its input products from :func:`input_product`, which reuses a product only for
the *same memory*: ``x`` spans exactly a batch leaf's elements (same address, dtype, device,
element count, both contiguous), the leaf's version counter has not moved since (no in-place
write through torch), and ``P_c`` is the same tensor, unchanged. The same operands at the
same addresses make the same bits, so rows are identical to computing each product again.
Anything else (an input the loss derived from the batch, a cast, another projection, outside
:func:`sharing_inputs`) is computed as before.

Not seen: a write into a batch leaf that bypasses torch's version counter (through a NumPy
view of it, from inside the loss, between two checkpoints of one call).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tracinfunc.batches import batch_leaves
from tracinfunc.types import Batch

__all__ = ["input_product", "sharing_inputs"]


@dataclass
class _Scope:
    leaves: list[Tensor]  # the call's batch leaves: held, so no other tensor gets their memory
    # (leaf index, id(p), x's shape) -> (p, leaf version, p version, x @ p)
    products: dict[tuple, tuple[Tensor, int, int, Tensor]] = field(default_factory=dict)


_SCOPE: ContextVar[_Scope | None] = ContextVar("tracinfunc_shared_inputs", default=None)


@contextmanager
def sharing_inputs(batch: Batch) -> Iterator[None]:
    """Within: :func:`input_product` computes a product of one of ``batch``'s leaves once.

    Wrap the computation of every checkpoint of one call, and nothing longer: the products
    are held until the block ends."""
    # (an inference-mode tensor has no version counter: not shared)
    leaves = [leaf for leaf in batch_leaves(batch)
              if isinstance(leaf, Tensor) and leaf.layout == torch.strided
              and not leaf.is_inference() and leaf.is_contiguous()]
    token = _SCOPE.set(_Scope(leaves) if leaves else None)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def input_product(x: Tensor, p: Tensor) -> Tensor:
    """``x @ p``: ``[b, n] @ [n, k] -> [b, k]``, computed once per checkpoint-sharing block
    where ``x`` is one of the call's batch leaves (module docstring). Do not write into the
    result: it may be another checkpoint's too."""
    scope = _SCOPE.get()
    index = None if scope is None or p.is_inference() else _leaf_of(scope.leaves, x)
    if index is None:  # (an inference-mode factor has no version counter to watch)
        return x @ p
    leaf = scope.leaves[index]
    key = (index, id(p), tuple(x.shape))
    kept = scope.products.get(key)
    if kept is not None:
        kept_p, leaf_version, p_version, product = kept
        if kept_p is p and leaf_version == leaf._version and p_version == p._version:
            return product
    product = x @ p
    scope.products[key] = (p, leaf._version, p._version, product)
    return product


def _leaf_of(leaves: list[Tensor], x: Tensor) -> int | None:
    """The index of the leaf whose elements ``x`` is, in their order; else ``None``."""
    if x.layout != torch.strided or x.is_inference() or not x.is_contiguous():
        return None
    address = x.data_ptr()
    for index, leaf in enumerate(leaves):
        if leaf.data_ptr() == address and leaf.dtype == x.dtype and \
                leaf.device == x.device and leaf.numel() == x.numel():
            return index
    return None
