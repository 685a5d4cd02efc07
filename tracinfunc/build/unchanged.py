"""A loss must not write into its batch: every checkpoint's rows are of the same examples.

``build_store`` calls the loss on one batch once per checkpoint (and once on its first
example, as a check). A loss that writes into its input in place (``x.mul_(2)``) changes
what the next checkpoint sees, so each checkpoint's rows would be of other inputs, silently.
The vmapped kronecker path refuses such a loss already (torch.func forbids mutating a
captured tensor); the others ran it. The batch's tensors' version counters (which every
in-place write through torch bumps) are read before a call and compared after each
checkpoint. A write that bypasses torch (through a NumPy view of the batch) is not seen.
"""

from __future__ import annotations

from torch import Tensor

from tracinfunc._validate import current_caller
from tracinfunc.batches import batch_leaves
from tracinfunc.errors import LossFunctionError
from tracinfunc.types import Batch

__all__ = ["batch_versions", "check_batch_unchanged"]


def batch_versions(batch: Batch) -> list[int | None]:
    """The version counter of each of the batch's leaves (``None``: not a tensor, or an
    inference-mode tensor, which has none)."""
    return [_version(leaf) for leaf in batch_leaves(batch)]


def check_batch_unchanged(batch: Batch, versions: list[int | None], *,
                          where: str = "") -> None:
    """Raise :class:`LossFunctionError` where a leaf of ``batch`` was written in place since
    :func:`batch_versions` read ``versions`` (``where``: words naming the data, e.g. " on
    the data's first example"; a call's error gets its batch and rows from the build loop)."""
    leaves = batch_leaves(batch)
    for index, (leaf, before) in enumerate(zip(leaves, versions, strict=True)):
        if before is not None and _version(leaf) != before:
            each = list(leaf.shape[1:])
            raise LossFunctionError(
                f"{current_caller('build_store')}: the loss wrote into its batch in place"
                f"{where} (tensor {index} of the batch, "
                f"{str(leaf.dtype).removeprefix('torch.')}, each example's of shape {each}): "
                "every checkpoint must see the same examples, so the rows of the checkpoints "
                "after the first would be of changed inputs. The tensors you passed as data "
                "may have been changed by it (a batch the build did not copy is yours): check "
                "them. Compute on a copy (x = x.clone()) or out of place (x = x * 2, not "
                "x.mul_(2)).")


def _version(leaf: object) -> int | None:
    if not isinstance(leaf, Tensor) or leaf.is_inference():
        return None
    return leaf._version
