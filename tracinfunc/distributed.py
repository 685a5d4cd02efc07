"""torch.distributed glue (torchrun) and the exact merge of partial top-k results.

Under ``torchrun``, ``build_store`` takes its shard from the rank and world size and rank 0
commits the store after a barrier; ``top_k(..., rows=...)`` results of workers that each
scanned part of a store merge with :func:`merge_top_k` into exactly the single-process
result (ties broken by the lower row index, as one scan breaks them), and
:func:`gather_top_k` does the gathering and merging on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from tracinfunc.query.merge import merge_top_k
from tracinfunc.store.protocols import GradientStore
from tracinfunc.store.zarr.parts import commit_store
from tracinfunc.store.zarr.paths import open_store

# torch.func's first vmap imports torch._dynamo, and importing it while a process group
# exists keeps references to that group: destroy_process_group then leaves the C++ gloo group
# and its threads alive into interpreter shutdown, where a gloo thread releasing a finished
# collective's tensors needs the GIL of a finalizing interpreter and the process aborts
# ("terminate called without an active exception", a flaky torchrun teardown). Imported here,
# with tracinfunc, it is loaded before any group a script or the CLI creates afterwards: in a
# process started for torch.distributed (torchrun, or the env:// rendezvous variables set),
# only, since it costs every other process ~70 MiB of RSS (sympy, the compiler's tables).
DISTRIBUTED_ENV = ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")
if any(name in os.environ for name in DISTRIBUTED_ENV):
    import torch._dynamo  # its side effect above, before any group

T = TypeVar("T")

__all__ = ["commit_after_barrier", "gather_top_k", "init_from_environment", "is_distributed",
           "merge_top_k", "rank_rows", "rank_shard", "rank_zero_first"]


def is_distributed() -> bool:
    """True inside an initialised ``torch.distributed`` process group of more than one rank."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


def init_from_environment() -> bool:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1), if not joined yet.

    gloo on CPUs, nccl when CUDA is available. Returns whether a group of more than one
    rank is initialised.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(backend)
    return is_distributed()


def rank_shard() -> tuple[int, int]:
    """``(rank, world_size)`` of this process."""
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def rank_zero_first(make: Callable[[], T]) -> T:
    """``make()`` on rank 0, then (after a barrier) on the other ranks: rank 0 creates the
    store's layout before anyone opens it."""
    if torch.distributed.get_rank() == 0:
        made = make()
    torch.distributed.barrier()
    if torch.distributed.get_rank() != 0:
        made = make()
    return made


def rank_rows(n_train: int, shard: tuple[int, int] | None = None) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``n_train`` that part ``shard`` (default: this rank) scans."""
    index, count = shard if shard is not None else rank_shard()
    return index * n_train // count, (index + 1) * n_train // count


def commit_after_barrier(path: str | os.PathLike[str]) -> GradientStore:
    """Wait for every rank's part, commit the store on rank 0, and open it on every rank."""
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        commit_store(path)
    torch.distributed.barrier()  # nobody opens the store before rank 0 sealed it
    return open_store(path)


def gather_top_k(values: Tensor, indices: Tensor, k: int, *, largest: bool = True
                 ) -> tuple[Tensor, Tensor]:
    """All-gather every rank's partial top-k and merge them; every rank gets the result."""
    if not is_distributed():
        return merge_top_k([(values, indices)], k, largest=largest)
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (values.cpu(), indices.cpu()))
    merged = merge_top_k(gathered, k, largest=largest)
    return merged[0].to(values.device), merged[1].to(indices.device)
