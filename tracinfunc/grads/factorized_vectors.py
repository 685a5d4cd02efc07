"""The non-matrix parameters of the factorised kronecker path: one packed block, or side
factors under ``vectors="kronecker"``.

Under ``Projection(kind="kronecker", vectors="kronecker")`` each parameter with fewer than two
dimensions is projected side by side through its zero-padded near-square view
(:class:`KroneckerVectors`, :func:`~tracinfunc.projection.keys.kronecker_view`). By default
(``vectors="dense"``) such a parameter (a bias, a LayerNorm weight or bias) has a dense
Rademacher block ``[numel, k]`` (its definition in :mod:`tracinfunc.projection.spec`). The
generic projector applies one block per parameter: some forty ``[b, n] @ [n, k]`` products for
a small transformer, each reading its block from memory for a handful of examples, and blocks
over its cache budget are regenerated on every call (GPT-2 small: 121k vector rows, 2 GB in
float32). Here the blocks are generated once, stacked in the layout's order into one
``[n_vectors, k]`` block kept as bits (``k / 8`` bytes a row, 32x less than float32), and one
example's vector gradients, concatenated in the same order ``[n_vectors]``, are multiplied with
it a row slice at a time, each slice unpacked to exact +-1 in the gradients' dtype by a
256-entry table while it is in cache (``[b, rows] @ [rows, k]`` under ``vmap``). Reading a bit
instead of a float also makes the memory-bound product faster than from the float32 block. The
sum is the projector's, in another float summation order.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from tracinfunc.projection import Projection, canonical_layout, plan_projection
from tracinfunc.projection._kernels import rademacher_bits, row_ranges
from tracinfunc.projection.torch import kronecker_factors
from tracinfunc.types import Params

__all__ = ["KroneckerVectors", "VectorBlocks", "split_vectors", "vector_blocks"]

# Packed stacks larger than this stay with the generic projector (which streams blocks over
# its own cache budget instead of holding them): 2 million rows at k=4096.
_MAX_BYTES = 2**30


def split_vectors(projection: Projection, rest: Params) -> tuple[list[str], list[str]]:
    """``(vectors, others)``: the names of ``rest`` projected here, and the others (matrices,
    empty parameters, or every name when the packed stack would exceed the byte budget)."""
    vectors = [name for name, value in sorted(rest.items())
               if value.dim() < 2 and value.numel() > 0]
    rows = sum(rest[name].numel() for name in vectors)
    if not vectors or (projection.vectors == "dense"
                       and rows * _packed_width(projection.dim) > _MAX_BYTES):
        return [], sorted(rest)
    return vectors, [name for name in sorted(rest) if name not in vectors]


def vector_blocks(projection: Projection, vectors: Params, *, device: torch.device,
                  dtype: torch.dtype) -> VectorBlocks | KroneckerVectors:
    """The block of ``vectors`` (from :func:`split_vectors`) under ``projection.vectors``."""
    kind = KroneckerVectors if projection.vectors == "kronecker" else VectorBlocks
    return kind(projection, vectors, device=device, dtype=dtype)


def _packed_width(k: int) -> int:
    return -(-k // 8)  # bytes a row: columns 8i..8i+7 in byte i, bit j for column 8i+j


class _VectorPart:
    """What both vector projections share: the parameters' names in layout order, ``k``, and
    the per-example and batched entry points; ``_product`` takes each parameter's flat
    gradient ``[..., n]`` in that order and returns ``[..., k]``, unscaled."""

    def __init__(self, projection: Projection, vectors: Params):
        self.plan = plan_projection(projection, canonical_layout(vectors))
        self.names = [name for name, _ in self.plan.layout]
        self.k = self.plan.k

    def __call__(self, grads: Params) -> Tensor:
        """One example's ``[k]`` (``[b, k]`` under ``vmap``), unscaled."""
        return self._product([grads[name].reshape(-1) for name in self.names])

    def batched(self, grads: Params) -> Tensor:
        """``{name: [b, *shape]} -> [b, k]``, unscaled, outside ``vmap`` (under ``vmap`` a
        dense block's slice products cost about twice as much on a CPU)."""
        b = grads[self.names[0]].shape[0]  # reshape, not flatten(1): a 0-d parameter is [b]
        return self._product([grads[name].reshape(b, -1) for name in self.names])

    def _product(self, parts: list[Tensor]) -> Tensor:
        raise NotImplementedError


class VectorBlocks(_VectorPart):
    """The stacked dense blocks ``[n_vectors, k]`` (unscaled) of some non-matrix parameters,
    held as bits ``[n_vectors, ceil(k / 8)]`` uint8 (a set bit is ``-1``).

    Args:
        projection: A ``kind="kronecker"`` spec.
        vectors: ``{name: value}`` of parameters with fewer than two dimensions.
        device, dtype: Where and in which dtype the gradients come.
    """

    def __init__(self, projection: Projection, vectors: Params, *, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__(projection, vectors)
        plan = self.plan
        rows = sum(math.prod(shape) for _, shape in plan.layout)
        self.bits = torch.empty(rows, _packed_width(plan.k), dtype=torch.uint8, device=device)
        start = 0
        for name, shape in plan.layout:
            stop = start + math.prod(shape)
            _fill_bits(self.bits[start:stop], plan.keys[name], plan.k)
            start = stop
        codes = torch.arange(256, device=device)[:, None]
        set_bits = (codes >> torch.arange(8, device=device)) & 1  # [256, 8]
        self.table = (1 - 2 * set_bits).to(dtype)  # byte -> its 8 columns' signs

    def _product(self, parts: list[Tensor]) -> Tensor:
        """``[..., n_vectors] -> [..., k]`` (the parts concatenated), a row slice of the block
        at a time."""
        flat = torch.cat(parts, -1).to(self.table.dtype)
        total = None
        for start, stop in row_ranges(self.bits.shape[0], self.k, self.bits.device):
            signs = F.embedding(self.bits[start:stop].long(), self.table)  # [rows, k/8, 8]
            part = flat[..., start:stop] @ signs.reshape(stop - start, -1)[:, :self.k]
            total = part if total is None else total.add_(part)  # the first part is new
        return total


class KroneckerVectors(_VectorPart):
    """Parameters with fewer than two dimensions under ``vectors="kronecker"``: each gradient
    read as its zero-padded ``[d_out, d_in]`` view and projected side by side,
    ``P_out.T @ G @ P_in`` (:func:`~tracinfunc.projection.keys.kronecker_view`); unscaled.

    A few small products instead of a dense ``[n, k]`` block read whole on every call.
    Parameters whose views and factors have the same shapes (a transformer's LayerNorm
    weights and biases, its attention biases, ...) are projected together: their padded
    views gathered into one ``[V, d_out, d_in]`` stack by one index, then two batched
    products and a sum over ``V``. A per-parameter loop cost about a dozen operations per
    parameter (GPT-2 small: ~100 vectors, ~1,200 kernel launches a call on a GPU); this costs
    about five per distinct shape. Same interface as :class:`VectorBlocks`.

    Args:
        projection: A ``kind="kronecker"``, ``vectors="kronecker"`` spec.
        vectors: ``{name: value}`` of non-empty parameters with fewer than two dimensions.
        device, dtype: Where and in which dtype the gradients come.
    """

    def __init__(self, projection: Projection, vectors: Params, *, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__(projection, vectors)
        factors = [kronecker_factors(projection, name, shape, device=device, dtype=dtype)
                   for name, shape in self.plan.layout]  # [(P_out [d_out, k_out], P_in)]
        sizes = [math.prod(shape) for _, shape in self.plan.layout]
        starts = [0, *itertools.accumulate(sizes)][:-1]
        zero = sum(sizes)  # the index of the zero appended to the concatenated gradients
        # Each gradient's view (kronecker_view, as as_kronecker_matrix reads it): its n
        # entries row by row, then zeros up to d_out * d_in, gathered by one index.
        by_shape: dict[tuple, list[int]] = {}
        for i, (p_out, p_in) in enumerate(factors):
            by_shape.setdefault((*p_out.shape, *p_in.shape), []).append(i)
        self.dtype = dtype
        self.groups = []  # (index [V * d_out * d_in], P_out.T [V, k_out, d_out], P_in, view)
        for (d_out, _, d_in, _), members in by_shape.items():
            index = torch.full((len(members), d_out * d_in), zero, dtype=torch.long)
            for row, i in enumerate(members):
                index[row, :sizes[i]] = torch.arange(starts[i], starts[i] + sizes[i])
            self.groups.append((index.reshape(-1).to(device),
                                torch.stack([factors[i][0].T for i in members]),
                                torch.stack([factors[i][1] for i in members]),
                                (len(members), d_out, d_in)))

    def _product(self, parts: list[Tensor]) -> Tensor:
        """``[..., n]`` per parameter -> ``[..., k]``: per shape group, the stacked views
        ``[..., V, d_out, d_in]`` through ``P_out.T @ G @ P_in``, summed over the group."""
        flat = torch.cat([p if p.dtype == self.dtype else p.to(self.dtype) for p in parts], -1)
        flat = F.pad(flat, (0, 1))  # [..., n + 1]: the last entry the padding's zero
        total = None
        for index, p_out_t, p_in, view in self.groups:
            stack = flat.index_select(-1, index).unflatten(-1, view)  # [..., V, d_out, d_in]
            part = (p_out_t @ stack @ p_in).sum(-3).flatten(-2)  # [..., k]
            total = part if total is None else total.add_(part)  # the first part is new
        return total


def _fill_bits(out: Tensor, keys: tuple[int, int], k: int) -> None:
    """Rows ``[0, len(out))`` of one parameter's block, packed into ``out`` ``[rows, k/8]``."""
    width = out.shape[1]
    weights = 2 ** torch.arange(8, device=out.device)
    for start, stop in row_ranges(out.shape[0], k, out.device):
        bits = F.pad(rademacher_bits(keys, k, start, stop, out.device), (0, 8 * width - k))
        out[start:stop] = (bits.reshape(stop - start, width, 8) * weights).sum(-1)
