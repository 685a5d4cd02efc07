"""Automatic ``chunk_size`` from a memory budget in bytes.

With projection fused inside vmap, the memory that grows with the chunk is the full
per-example gradient of every example in the chunk, plus temporaries of the same order
(autograd's per-example products before they are summed into the gradient, the projection's
flattened input). A chunk therefore costs about ``copies * p * itemsize`` bytes per example,
where ``p`` is the number of parameters differentiated at once: all selected parameters on
the plain path, the largest stage's with ``stages=``. The budget covers that variable part;
the model, its activations and the projection blocks are fixed costs outside it.
"""

from __future__ import annotations

import operator

from tracinfunc._validate import check_int, current_caller
from tracinfunc.errors import InvalidArgumentError, MemoryBudgetError

__all__ = ["DEFAULT_COPIES", "check_memory_budget", "chunk_size_for_budget"]

DEFAULT_COPIES = 3
"""Per-example gradient-sized buffers alive at once (gradient, autograd and projection work)."""


def check_memory_budget(memory_budget: object, chunk_size: int | None) -> None:
    """Validate ``memory_budget`` (positive int bytes or None) against ``chunk_size``."""
    if memory_budget is None:
        return
    check_int(memory_budget, "memory_budget", optional=True,
              wanted="a positive number of bytes", fix="e.g. memory_budget=2 * 2**30 for 2 GiB")
    if chunk_size is not None:
        raise InvalidArgumentError(
            f"{current_caller()}: pass chunk_size or memory_budget, not both (got chunk_size="
            f"{chunk_size}, memory_budget={memory_budget}); memory_budget chooses chunk_size."
        )


def chunk_size_for_budget(
    memory_budget: int, n_params: int, *, itemsize: int = 4, copies: int = DEFAULT_COPIES) -> int:
    """The largest chunk whose per-example gradients fit ``memory_budget`` bytes.

    Args:
        memory_budget: Bytes allowed for per-example gradients and their temporaries.
        n_params: ``p``, the number of parameters differentiated at once.
        itemsize: Bytes per gradient entry (4 for float32).
        copies: Gradient-sized buffers per example (see the module docstring).

    Returns:
        ``memory_budget // (copies * p * itemsize)``, at least 1.

    Raises:
        MemoryBudgetError: the budget cannot hold even one example.

    Example:
        >>> chunk_size_for_budget(2**30, 10_000_000)   # 1 GiB, 10M float32 parameters
        8
    """
    n_params, itemsize, copies = (operator.index(v) for v in (n_params, itemsize, copies))
    per_example = max(1, copies * n_params * itemsize)
    chunk = memory_budget // per_example
    if chunk < 1:
        raise MemoryBudgetError(
            f"{current_caller('chunk_size_for_budget')}: memory_budget={memory_budget} bytes "
            "cannot hold one example's gradient "
            f"of p={n_params} parameters (about {per_example} bytes with temporaries); raise "
            "the budget, select fewer parameters (select=), or split the model into stages "
            "(stages=) so only one stage's gradient exists at a time."
        )
    return int(chunk)
