"""Per-layer blocks of the projected Fisher: ``kind="projected", block_diagonal=True``.

A block-diagonal approximation keeps each layer's own ``k_l x k_l`` block of the ``k x k``
Fisher and drops the blocks between layers (as K-FAC does before it factors a block), so it
costs ``sum_l k_l^2`` instead of ``k^2`` and inverts each block alone. It needs a projection in
which every layer owns its output coordinates. ``kind="identity"`` does (each parameter keeps
its entries, in sorted-name order): the blocks are then the exact per-layer Gauss-Newton
blocks, for models whose full ``[p, p]`` matrix is too large for ``"dense"`` but whose layers
are not. The random projections (``"rademacher"``, ``"sjlt"``, ``"kronecker"``) add every
layer's block into the same ``k`` outputs, so their Fisher has no per-layer blocks: refused,
with the kinds that fit.

A layer is a parameter's module path (``"encoder.0.weight"`` -> ``"encoder.0"``); its
coordinates are the union of its parameters' ranges (not always contiguous: sorted names may
interleave a submodule's parameters).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tracinfunc._validate import current_caller
from tracinfunc.errors import InvalidArgumentError
from tracinfunc.projection.spec import Layout, Projection

__all__ = ["Block", "block_index", "layer_blocks"]

Block = tuple[str, tuple[tuple[int, int], ...]]
"""``(layer, ((start, stop), ...))``: a layer and the output coordinate ranges it owns."""


def layer_blocks(layout: Layout, projection: Projection) -> tuple[Block, ...]:
    """The per-layer blocks of ``projection``'s output for gradients of ``layout``, in order of
    each layer's first coordinate.

    Raises:
        InvalidArgumentError: the projection mixes layers into shared outputs.
    """
    if projection.kind != "identity":
        raise InvalidArgumentError(
            f"{current_caller()}: block_diagonal=True needs a projection in which each layer "
            f"owns its outputs, but kind={projection.kind!r} adds every layer's block into the "
            "same k outputs, so its k x k Fisher has no per-layer blocks. Use "
            "Projection(kind='identity') (an exact store), kind='kfac'/'ekfac' (per-layer "
            "Kronecker blocks), or block_diagonal=False."
        )
    ranges: dict[str, list[tuple[int, int]]] = {}
    start = 0
    for name, shape in layout:
        size = math.prod(shape)
        layer = name.rpartition(".")[0] or name
        ranges.setdefault(layer, []).append((start, start + size))
        start += size
    return tuple((layer, tuple(_merged(spans))) for layer, spans in ranges.items())


def block_index(block: Block, device: torch.device | None = None) -> Tensor:
    """The output coordinates of ``block``, ``[k_l]`` int64 ascending."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in block[1]])


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent ranges joined: ``[(0, 3), (3, 5)] -> [(0, 5)]``."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
