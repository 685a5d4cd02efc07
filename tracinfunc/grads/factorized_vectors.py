"""The non-matrix parameters of the factorised kronecker path, projected by one matmul.

Under ``kind="kronecker"`` a parameter with fewer than two dimensions (a bias, a LayerNorm
weight or bias) has a dense Rademacher block ``[numel, k]`` (its definition in
:mod:`tracinfunc.projection.spec`). The generic projector applies one block per parameter: some
forty ``[b, n] @ [n, k]`` products for a small transformer, each reading its block from memory
for a handful of examples. Here the blocks are generated once, stacked in the layout's order
into one ``[n_vectors, k]`` matrix, and one example's vector gradients, concatenated in the
same order ``[n_vectors]``, are projected by one product (``[b, n_vectors] @ [n_vectors, k]``
under ``vmap``). The sum is the same as the projector's, in another float summation order.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tracinfunc.projection import Projection, canonical_layout, plan_projection
from tracinfunc.projection._kernels import fill_rademacher
from tracinfunc.types import Params

__all__ = ["VectorBlocks", "split_vectors"]

# Stacked blocks larger than this stay with the generic projector (which streams blocks over
# its own cache budget instead of holding them).
_MAX_BYTES = 2**30


def split_vectors(projection: Projection, rest: Params) -> tuple[list[str], list[str]]:
    """``(vectors, others)``: the names of ``rest`` projected here, and the others (matrices,
    empty parameters, or every name when the stack would exceed the byte budget)."""
    vectors = [name for name, value in sorted(rest.items())
               if value.dim() < 2 and value.numel() > 0]
    itemsize = next(iter(rest.values())).element_size() if rest else 4
    rows = sum(rest[name].numel() for name in vectors)
    if not vectors or rows * projection.dim * itemsize > _MAX_BYTES:
        return [], sorted(rest)
    return vectors, [name for name in sorted(rest) if name not in vectors]


class VectorBlocks:
    """The stacked dense blocks ``[n_vectors, k]`` (unscaled) of some non-matrix parameters.

    Args:
        projection: A ``kind="kronecker"`` spec.
        vectors: ``{name: value}`` of parameters with fewer than two dimensions.
        device, dtype: Where and in which dtype the gradients come.
    """

    def __init__(self, projection: Projection, vectors: Params, *, device: torch.device,
                 dtype: torch.dtype) -> None:
        plan = plan_projection(projection, canonical_layout(vectors))
        self.names = [name for name, _ in plan.layout]
        rows = sum(math.prod(shape) for _, shape in plan.layout)
        self.block = torch.empty(rows, plan.k, dtype=dtype, device=device)
        start = 0
        for name, shape in plan.layout:
            stop = start + math.prod(shape)
            fill_rademacher(self.block[start:stop], plan.keys[name], 0)
            start = stop

    def __call__(self, grads: Params, *, scale: float = 1.0) -> Tensor:
        """One example's ``[k]`` (``[b, k]`` under ``vmap``) times ``scale`` (applied to the
        ``[n_vectors]`` gradients, not to the ``[k]`` row)."""
        flat = torch.cat([grads[name].reshape(-1) for name in self.names])
        return (flat.to(self.block.dtype) * scale) @ self.block
