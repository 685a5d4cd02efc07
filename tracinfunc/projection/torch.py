"""The torch projection kernels: a :class:`Projector` built from a checked ProjectionPlan.

The spec, keys and element rule live in :mod:`tracinfunc.projection.spec` (no torch); this
module only turns them into tensors, with one small block strategy per kind.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from tracinfunc._validate import check_bool, entry_point
from tracinfunc.errors import InvalidProjectionError
from tracinfunc.projection import _kernels
from tracinfunc.projection.spec import (
    Layout,
    Projection,
    ProjectionPlan,
    check_block_args,
    check_cache_bytes,
    check_kronecker_args,
    kronecker_seeds,
    kronecker_view,
    plan_projection,
    side_split,
)

__all__ = ["Projector", "as_kronecker_matrix", "kronecker_factors", "make_projector",
           "rademacher_block", "sjlt_block"]


@entry_point("kronecker_factors")
def kronecker_factors(
    projection: Projection, name: str, shape: Sequence[int], *,
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """The side projections of a parameter projected side by side, unscaled: one with two or
    more dimensions, or under ``vectors="kronecker"`` any non-empty one.

    Returns:
        ``(P_out [d_out, k_out], P_in [d_in, k_in])`` of exact +-1 in ``dtype`` on ``device``,
        ``(d_out, d_in) = kronecker_view(projection, shape)`` (``shape[0]`` and
        ``prod(shape[1:])`` for a matrix), ``(k_out, k_in) = side_split(projection, (d_out,
        d_in))``; the block is ``(P_out.T @ G @ P_in) / sqrt(k)``, ``G`` the gradient read as
        ``[d_out, d_in]`` (a vector's zero-padded).
    """
    shape, view = check_kronecker_args(projection, name, shape)
    keys_out, keys_in = kronecker_seeds(projection, name, shape)
    device = torch.empty(0, device=device).device
    return _kronecker_sides(keys_out, keys_in, view, *side_split(projection, view), device,
                            dtype)


def _kronecker_sides(keys_out, keys_in, view, k_out, k_in, device, dtype) -> tuple:
    d_out, d_in = view
    p_out = torch.empty(d_out, k_out, dtype=dtype, device=device)
    p_in = torch.empty(d_in, k_in, dtype=dtype, device=device)
    return (_kernels.fill_rademacher(p_out, keys_out, 0),
            _kernels.fill_rademacher(p_in, keys_in, 0))


def as_kronecker_matrix(flat: Tensor, view: tuple[int, int]) -> Tensor:
    """``[..., n] -> [..., d_out, d_in]``: a gradient read as the matrix it is projected as,
    zero-padded where ``d_out * d_in > n`` (a vector under ``vectors="kronecker"``)."""
    size = view[0] * view[1]
    if flat.shape[-1] != size:
        flat = torch.nn.functional.pad(flat, (0, size - flat.shape[-1]))
    return flat.reshape(*flat.shape[:-1], *view)


@entry_point("rademacher_block")
def rademacher_block(
    projection: Projection, name: str, shape: Sequence[int], row_start: int, row_stop: int,
    *, device: torch.device | str | None = None,
) -> Tensor:
    """Rows ``[row_start, row_stop)`` of parameter ``name``'s Rademacher block, unscaled.

    Returns:
        ``[rows, k]`` float32 of exact +-1 on ``device`` (the scale 1/sqrt(k) is separate).
    """
    _, keys = check_block_args(projection, "rademacher", name, shape, row_start, row_stop)
    out = torch.empty(row_stop - row_start, projection.dim, dtype=torch.float32, device=device)
    return _kernels.fill_rademacher(out, keys, row_start)


@entry_point("sjlt_block")
def sjlt_block(
    projection: Projection, name: str, shape: Sequence[int], row_start: int, row_stop: int,
    *, device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Rows ``[row_start, row_stop)`` of parameter ``name``'s SJLT block, unscaled.

    Returns:
        ``(cols, signs)``: ``[rows, nnz]`` int64 columns in ``[0, k)`` and ``[rows, nnz]``
        float32 +-1 (the scale 1/sqrt(nnz) is separate), on ``device``.
    """
    _, keys = check_block_args(projection, "sjlt", name, shape, row_start, row_stop)
    device = torch.empty(0, device=device).device
    return _kernels.sjlt_rows(keys, projection.dim, projection.nnz, row_start, row_stop, device,
                      torch.float32)


_STREAM = "stream"  # cache marker: over budget, generated row-block by row-block on each call


class _Block(abc.ABC):
    """How one parameter's block is generated, budgeted and applied: one strategy per kind.

    Strategies hold no per-projector state (the cache lives on the Projector), so one
    instance serves every parameter of its kind.
    """

    always_cached = False  # True: generated even over the cache budget (small blocks)

    @abc.abstractmethod
    def cache_bytes(self, shape: tuple[int, ...], plan: ProjectionPlan, itemsize: int) -> int:
        """Bytes the cached block takes."""

    @abc.abstractmethod
    def generate(self, keys: tuple, shape: tuple[int, ...], plan: ProjectionPlan,
                 dtype: torch.dtype, device: torch.device, rows_fn: Any) -> Any:
        """The whole block, unscaled, in ``dtype`` on ``device``."""

    @abc.abstractmethod
    def project(self, flat: Tensor, entry: Any, keys: tuple, plan: ProjectionPlan,
                rows_fn: Any) -> Tensor:
        """``[numel] -> [k]``, unscaled; ``entry`` is the cached block or ``_STREAM``."""


class _DenseBlock(_Block):
    """Rademacher ``[numel, k]`` of +-1: one matmul, or row-blocks when over budget."""

    def cache_bytes(self, shape, plan, itemsize):
        return math.prod(shape) * plan.k * itemsize

    def generate(self, keys, shape, plan, dtype, device, rows_fn):
        out = torch.empty(math.prod(shape), plan.k, dtype=dtype, device=device)
        return _kernels.fill_rademacher(out, keys, 0, rows_fn=rows_fn)

    def project(self, flat, entry, keys, plan, rows_fn):
        if entry is not _STREAM:
            return flat @ entry  # [numel] @ [numel, k]; one [b, numel] matmul under vmap
        k = plan.k
        # rows.T @ slice, not slice @ rows: under vmap a sliced example vector times an
        # unbatched block lowers to a bmm that reads the block once per example (a batched
        # gemv: 70% of a GPU build's time, 2026-11-26); this order is one [k, rows] @ [rows, b].
        return sum(rows_fn(keys, k, a, b, flat.device, flat.dtype).T @ flat[a:b]
                   for a, b in _kernels.row_ranges(flat.shape[0], k, flat.device))


class _SparseBlock(_Block):
    """SJLT ``(cols, signs)`` ``[numel, nnz]``: a scatter-add costing ``p * nnz``."""

    def cache_bytes(self, shape, plan, itemsize):
        return math.prod(shape) * plan.projection.nnz * (8 + itemsize)  # int64 cols + signs

    def generate(self, keys, shape, plan, dtype, device, rows_fn):
        return _kernels.sjlt_rows(keys, plan.k, plan.projection.nnz, 0, math.prod(shape),
                                  device, dtype)

    def project(self, flat, entry, keys, plan, rows_fn):
        k, nnz, device = plan.k, plan.projection.nnz, flat.device
        blocks = [(0, flat.shape[0], entry)] if entry is not _STREAM else (
            (a, b, _kernels.sjlt_rows(keys, k, nnz, a, b, device, flat.dtype))
            for a, b in _kernels.row_ranges(flat.shape[0], nnz, device))
        out = torch.zeros(k, dtype=flat.dtype, device=device)
        for a, b, (cols, signs) in blocks:
            values = flat[a:b, None] * signs  # [rows, nnz]: cost p * nnz, never p * k
            # Out of place: index_add has a vmap batching rule, so the zeros stay unbatched.
            size = (b - a) * nnz  # explicit: -1 is ambiguous under vmap over 0 examples
            out = out.index_add(0, cols.reshape(size), values.reshape(size))
        return out


class _KroneckerSides(_Block):
    """``P_out.T @ G @ P_in`` for a parameter read as a matrix ``G [d_out, d_in]``
    (:func:`~tracinfunc.projection.keys.kronecker_view`); the sides are small, always cached."""

    always_cached = True

    def cache_bytes(self, shape, plan, itemsize):
        view = kronecker_view(plan.projection, shape)
        k_out, k_in = side_split(plan.projection, view)
        return (view[0] * k_out + view[1] * k_in) * itemsize

    def generate(self, keys, shape, plan, dtype, device, rows_fn):
        view = kronecker_view(plan.projection, shape)
        return _kronecker_sides(*keys, view, *side_split(plan.projection, view), device, dtype)

    def project(self, flat, entry, keys, plan, rows_fn):
        p_out, p_in = entry
        matrix = as_kronecker_matrix(flat, (p_out.shape[0], p_in.shape[0]))  # [d_out, d_in]
        k = p_out.shape[1] * p_in.shape[1]  # explicit sizes: -1 fails under vmap over 0 examples
        if p_out.shape[1] <= p_in.shape[1]:  # contract the larger side with the smaller k first
            return ((p_out.T @ matrix) @ p_in).reshape(k)  # [k_out, k_in] -> [k]
        return (p_out.T @ (matrix @ p_in)).reshape(k)


_DENSE, _SPARSE, _SIDES = _DenseBlock(), _SparseBlock(), _KroneckerSides()


def _strategy(plan: ProjectionPlan, name: str) -> _Block:
    if plan.projection.kind == "sjlt":
        return _SPARSE
    return _SIDES if plan.kronecker_view(name) is not None else _DENSE


class Projector:
    """Projects one example's gradients ``{name: [*shape]}`` to ``[k]``; see make_projector.

    Generated blocks are cached per ``(name, dtype, device)`` of the gradients, cast once to
    the gradients' dtype, so the batches and vmap chunks that follow reuse them. A parameter
    whose block no longer fits ``cache_bytes`` is generated a row-block at a time on every call
    (Kronecker side factors are small and always cached).

    Attributes:
        plan: The checked spec, layout and keys.
        projection: The spec.
        layout: Parameter names and shapes, sorted by name.
        k: Output dimension.
    """

    def __init__(self, plan: ProjectionPlan, *, cache_bytes: int, compile: bool = False
                 ) -> None:
        self.plan = plan
        self.projection, self.layout, self.k = plan.projection, plan.layout, plan.k
        # A plain function, not a bound method: nothing here may refer back to self.
        self._rows_fn = (_kernels.compiled_rademacher_rows() if compile
                         else _kernels.rademacher_rows)
        self._shapes = dict(plan.layout)
        self._blocks = ({} if plan.projection.kind == "identity" else
                        {name: _strategy(plan, name) for name, _ in plan.layout})
        self._cache: dict[tuple, Any] = {}
        self._cache_left = cache_bytes

    def __repr__(self) -> str:
        return (f"Projector(projection={self.projection}, k={self.k}, "
                f"n_params={len(self.layout)}, cached_entries={len(self._cache)})")

    def __call__(self, grads: Mapping[str, Tensor]) -> Tensor:
        """Project ONE example's gradients; use ``torch.func.vmap`` for a batch.

        Args:
            grads: ``{name: [*shape]}`` for exactly the layout's parameters, floating point.

        Returns:
            ``[k]`` (``[b, k]`` under vmap) in the gradients' (promoted) dtype and device.

        Raises:
            InvalidProjectionError: names or shapes differ from the layout.
        """
        self._check(grads)
        if not self._blocks:  # identity: every entry, in sorted-name order
            # Explicit sizes, never -1: under vmap over 0 examples -1 is ambiguous.
            return torch.cat([grads[name].reshape(math.prod(shape))
                              for name, shape in self.layout])
        dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads.values()))
        device = grads[self.layout[0][0]].device
        total = None
        for name, shape in self.layout:  # canonical order fixes the float summation order
            if math.prod(shape) > 0:
                flat = grads[name].reshape(math.prod(shape)).to(dtype)
                part = self._blocks[name].project(flat, self._entry(name, dtype, device),
                                                  self.plan.keys[name], self.plan,
                                                  self._rows_fn)
                total = part if total is None else total + part
        return total * self.plan.scale

    def kronecker_factors(self, name: str, dtype: torch.dtype, device: torch.device
                          ) -> tuple[Tensor, Tensor]:
        """Cached ``(P_out [d_out, k_out], P_in [d_in, k_in])`` of a matrix parameter, unscaled
        (the projector's overall scale ``1/sqrt(k)`` applies), for ``grads.factorized``."""
        if name not in self._shapes or self.plan.kronecker_view(name) is None:
            raise InvalidProjectionError(
                f"Projector.kronecker_factors: {name!r} is not projected side by side by this "
                f"projector (kind={self.projection.kind!r}, vectors="
                f"{self.projection.vectors!r}); ask for a parameter with two or more "
                "dimensions (or any, under kind='kronecker', vectors='kronecker')."
            )
        return self._entry(name, dtype, device)

    @property
    def scale(self) -> float:
        """The factor applied to the summed unscaled blocks: ``1/sqrt(k)`` (``1/sqrt(nnz)``)."""
        return self.plan.scale

    def _entry(self, name: str, dtype: torch.dtype, device: torch.device) -> Any:
        key = (name, dtype, device)
        if key not in self._cache:
            self._cache[key] = self._generate(name, dtype, device)
        return self._cache[key]

    def _generate(self, name: str, dtype: torch.dtype, device: torch.device) -> Any:
        """``name``'s block cast once to ``dtype``, or _STREAM when it exceeds the budget."""
        block, shape = self._blocks[name], self._shapes[name]
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = block.cache_bytes(shape, self.plan, itemsize)
        if nbytes > self._cache_left and not block.always_cached:
            return _STREAM
        self._cache_left -= nbytes
        return block.generate(self.plan.keys[name], shape, self.plan, dtype, device,
                              self._rows_fn)

    def _check(self, grads: Mapping[str, Tensor]) -> None:
        if not isinstance(grads, Mapping):
            raise InvalidProjectionError(
                f"Projector: expected one example's gradients {{name: tensor}}, got "
                f"{type(grads).__name__}; pass e.g. torch.func.grad(loss)(params, example)."
            )
        problems = [f"missing {name!r}" for name in sorted(set(self._shapes) - set(grads))]
        problems += [f"extra {name!r}" for name in sorted(set(grads) - set(self._shapes))]
        for name, shape in self.layout:
            g = grads.get(name)
            if g is None:
                continue
            if not isinstance(g, Tensor) or not g.is_floating_point():
                got = g.dtype if isinstance(g, Tensor) else type(g).__name__
                problems.append(f"{name!r} must be a floating-point tensor, got {got}")
            elif tuple(g.shape) != shape:
                problems.append(f"{name!r} has shape {list(g.shape)}, expected {list(shape)}")
        if problems:
            raise InvalidProjectionError(
                f"Projector: gradients do not match the projector's layout: "
                f"{'; '.join(problems)}. Pass one example's gradients for exactly the "
                "parameters of make_projector(projection, canonical_layout(params)); for a "
                "batch, call the projector inside torch.func.vmap."
            )


@entry_point("make_projector")
def make_projector(
    projection: Projection, layout: Layout | Mapping[str, Any], *,
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
    cache_bytes: int = 2**30, compile: bool = False,
) -> Projector:
    """A function ``{name: [*shape]} -> [k]`` projecting one example's gradients.

    Blocks for gradients in ``dtype`` on ``device`` are generated now (up to ``cache_bytes``),
    so calls do no generation; other dtypes or devices work too, generated at first use.

    Args:
        projection: The spec.
        layout: ``canonical_layout(params)`` (a mapping is canonicalised here).
        device: Where gradients will live (default: torch's default device).
        dtype: Their floating dtype; the projection runs in the gradients' dtype.
        cache_bytes: Budget for cached blocks over all entries; parameters beyond it are
            generated a row-block at a time on each call (same result up to float rounding).
        compile: Generate dense (``"rademacher"``, and ``"kronecker"``'s non-matrix) blocks
            with ``torch.compile``: bit-identical, ~9x faster on a CPU, after a one-off
            compile of seconds per process. Pays for millions of dense rows (large models,
            or blocks over ``cache_bytes`` regenerated every call); off by default.

    Returns:
        A :class:`Projector`; ``torch.func.vmap(projector, chunk_size=...)`` maps
        ``{name: [b, *shape]}`` to ``[b, k]``.

    Raises:
        InvalidProjectionError: empty or malformed layout, identity ``dim`` other than ``p``,
            or two parameters whose block seeds collide.

    Example:
        >>> project = make_projector(Projection(dim=512), canonical_layout(params))
        >>> torch.func.vmap(project)(per_sample_grads(loss)(params, batch)).shape
        torch.Size([b, 512])
    """
    plan = plan_projection(projection, layout)
    check_cache_bytes(cache_bytes)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidProjectionError(
            f"make_projector: dtype must be a floating torch.dtype, got {dtype!r}; use e.g. "
            "dtype=torch.float32."
        )
    check_bool(compile, "compile", error=InvalidProjectionError)
    projector = Projector(plan, cache_bytes=cache_bytes, compile=compile)
    device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as gradients report
    for name, shape in plan.layout:
        if plan.keys and math.prod(shape) > 0:
            projector._entry(name, dtype, device)
    return projector
