"""Seeded random projections of per-example gradients, reproducible bit for bit.

A projection maps one example's gradients ``{name: [*shape]}`` (``p`` numbers in all) to
``[k]``. The ``[p, k]`` matrix is never stored whole: each parameter's block is a pure function
of ``(seed, kind, dim, nnz, name, shape)``, computed by a counter-based integer hash
(``tracinfunc._hashing``), so one spec gives the same matrix on any device, in any process and
in NumPy (``tests/numpy_projection.py``), whatever the insertion order of the parameter dict.

Element rule for row ``r`` of a parameter's block (its flattened coordinate), with the keys
``(s0, s1) = block_seed(projection, name, shape)`` and ``mix32`` = lowbias32::

    a = mix32(r ^ s0) ^ s1
    rademacher: P[r, c] = -1 if bit 31 of mix32(a ^ c) else +1; scaled by 1/sqrt(k)
    sjlt, t < nnz: h = mix32(a ^ t); column (h * k) >> 32; sign from bit 31 of mix32(h);
        scaled by 1/sqrt(nnz) (columns of one row may repeat; their entries then add)

Both scalings make ``E[<P g, P g'>] = <g, g'>``. ``identity`` concatenates the flattened
gradients in sorted-name order, unscaled.

``kronecker`` (LoGra-style, for Linear/Conv weights) splits ``k = k_out * k_in``
(:func:`kronecker_split`). A parameter with two or more dimensions is read as a matrix
``G [d_out, d_in]`` (``d_in`` = product of the other dimensions, the layout of
``weight.reshape(d_out, -1)`` and of ``F.unfold``) and projected to
``(P_out.T @ G @ P_in).reshape(k) / sqrt(k)``, i.e. by the Kronecker matrix ``P_out (x) P_in``,
where ``P_out [d_out, k_out]`` and ``P_in [d_in, k_in]`` follow the Rademacher rule with the
keys of :func:`kronecker_seeds` (``side`` ``"out"``/``"in"``). Parameters with fewer than two
dimensions (biases) use the Rademacher rule with ``block_seed``. All blocks add into the same
``k`` outputs, like ``rademacher``; independent zero-mean signs keep the inner products
unbiased. Because ``G = delta.T @ x`` for a Linear layer, ``tracinfunc.factorized`` computes the
same numbers from layer inputs and output gradients without materialising ``G``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import Tensor

from tracinfunc import _hashing
from tracinfunc._hashing import MAX_ROWS, hash_record
from tracinfunc.errors import InvalidProjectionError, InvalidTypeError

__all__ = [
    "Layout",
    "Projection",
    "Projector",
    "block_seed",
    "canonical_layout",
    "kronecker_factors",
    "kronecker_seeds",
    "kronecker_split",
    "make_projector",
    "rademacher_block",
    "sjlt_block",
]

Layout: TypeAlias = tuple[tuple[str, tuple[int, ...]], ...]
"""Parameter names and shapes sorted by name: ``(("fc.bias", (3,)), ("fc.weight", (3, 8)))``."""

_KINDS = ("identity", "rademacher", "sjlt", "kronecker")
_MAX_DIM = 2**31 - 1  # keeps Lemire's (h * k) below 2**63 in int64


@dataclass(frozen=True)
class Projection:
    """How per-example gradients are projected to ``k`` numbers.

    Attributes:
        dim: ``k``. ``None`` for ``kind="identity"`` (or ``p``, checked against the layout);
            a positive int otherwise.
        seed: Non-negative int below ``2**63``.
        kind: ``"identity"``, ``"rademacher"`` (dense +-1/sqrt(k)), ``"sjlt"`` (sparse,
            ``nnz`` entries +-1/sqrt(nnz) per input coordinate; cost ``p * nnz``) or
            ``"kronecker"`` (weights projected side by side as ``P_out.T @ G @ P_in`` with
            ``k = k_out * k_in``; cheapest with :func:`~tracinfunc.loss_from_module`, whose
            Linear/Conv2d layers are then never materialised per example).
        nnz: Nonzeros per input coordinate, ``1 <= nnz <= dim``; must be 1 unless ``"sjlt"``.

    Example:
        >>> Projection(dim=512, seed=0)                  # dense Rademacher
        >>> Projection(dim=4096, kind="sjlt", nnz=4)      # sparse, for large models
        >>> Projection(dim=1024, kind="kronecker")       # factorised: 32 x 32 per layer
    """

    dim: int | None = None
    seed: int = 0
    kind: str = "rademacher"
    nnz: int = 1

    def __post_init__(self) -> None:
        kind = self.kind
        if kind not in _KINDS:
            raise InvalidProjectionError(
                f"Projection: kind must be one of {', '.join(map(repr, _KINDS))}, got "
                f"{kind!r}; e.g. Projection(dim=512, kind='rademacher')."
            )
        seed, nnz = _as_int(self.seed, "seed", "e.g. seed=0"), _as_int(self.nnz, "nnz", "nnz=1")
        identity_any_dim = kind == "identity" and self.dim is None
        dim = None if identity_any_dim else _as_int(self.dim, "dim", "e.g. dim=512")
        if dim is not None and not 1 <= dim <= _MAX_DIM:
            raise InvalidProjectionError(
                f"Projection: dim must be a positive int at most {_MAX_DIM}, got {dim}; use "
                "e.g. dim=512" + (" (or dim=None)." if kind == "identity" else ".")
            )
        if not 0 <= seed < 2**63:
            raise InvalidProjectionError(
                f"Projection: seed must be in [0, 2**63), got {seed}; use e.g. seed=0."
            )
        if kind != "sjlt" and nnz != 1:
            raise InvalidProjectionError(
                f"Projection: nnz is for kind='sjlt' only, got nnz={nnz} with kind={kind!r}; "
                "leave nnz=1 or use kind='sjlt'."
            )
        if kind == "sjlt" and not 1 <= nnz <= dim:
            raise InvalidProjectionError(
                f"Projection: nnz must be in [1, dim={dim}], got {nnz}; use e.g. nnz=1 (or a "
                "larger dim)."
            )
        for field, value in (("dim", dim), ("seed", seed), ("nnz", nnz)):
            object.__setattr__(self, field, value)  # numpy ints -> int, for JSON and hashing

    def output_dim(self, layout: Layout | Mapping[str, Any]) -> int:
        """``k`` for gradients with this layout: ``dim``, or ``p`` for ``"identity"``.

        Raises:
            InvalidProjectionError: ``kind="identity"`` with a ``dim`` other than ``p``.
        """
        if self.kind != "identity":
            return self.dim
        p = sum(math.prod(shape) for _, shape in _as_layout(layout, "Projection.output_dim"))
        if self.dim is not None and self.dim != p:
            raise InvalidProjectionError(
                f"Projection.output_dim: kind='identity' keeps all p={p} gradient entries but "
                f"dim={self.dim}; use Projection(kind='identity') (dim=None)."
            )
        return p

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types; :meth:`from_dict` inverts it."""
        return {"kind": self.kind, "dim": self.dim, "seed": self.seed, "nnz": self.nnz}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Projection:
        """The projection saved by :meth:`to_dict` (missing keys take their defaults)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, Mapping) or set(data) - fields:
            got = sorted(set(data) - fields) if isinstance(data, Mapping) else type(data).__name__
            raise InvalidProjectionError(
                f"Projection.from_dict: expected a mapping with keys among {sorted(fields)}, "
                f"got {got!r}; pass the dict made by Projection.to_dict()."
            )
        return cls(**data)


def _as_int(value: Any, field: str, fix: str) -> int:
    if isinstance(value, bool):
        value = None  # True is an int to Python, never a meaningful size or seed
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidProjectionError(
            f"Projection: {field} must be an int, got {value!r}; {fix}."
        ) from None


def canonical_layout(shapes: Mapping[str, Sequence[int]] | Mapping[str, Tensor]) -> Layout:
    """Names and shapes sorted by name, the order every projection uses (never dict order).

    Args:
        shapes: ``{name: shape}`` or ``{name: tensor}`` (e.g. the params).

    Returns:
        ``((name, shape), ...)`` sorted by name, shapes as tuples of ints.
    """
    if not isinstance(shapes, Mapping):
        raise InvalidProjectionError(
            f"canonical_layout: expected a mapping {{name: shape or tensor}}, got "
            f"{type(shapes).__name__}; pass e.g. dict(model.named_parameters())."
        )
    return tuple(sorted(
        (_check_name(name, "canonical_layout"), _check_shape(value, name, "canonical_layout"))
        for name, value in shapes.items()
    ))


def _check_name(name: Any, caller: str) -> str:
    if not isinstance(name, str):
        raise InvalidProjectionError(
            f"{caller}: parameter names must be str, got {name!r}; key params by name."
        )
    return name


def _check_shape(value: Any, name: str, caller: str) -> tuple[int, ...]:
    try:
        raw = tuple(value.shape if isinstance(value, Tensor) else value)
        shape = tuple(operator.index(s) for s in raw)
        bad = any(isinstance(s, bool) for s in raw) or any(s < 0 for s in shape)
    except TypeError:
        bad = True
    if bad:
        raise InvalidProjectionError(
            f"{caller}: the shape of {name!r} must be a tensor or a sequence of non-negative "
            f"ints, got {value!r}; pass {{name: tensor}} or {{name: tuple(tensor.shape)}}."
        )
    return shape


def _as_layout(layout: Layout | Mapping[str, Any], caller: str) -> Layout:
    if isinstance(layout, Mapping):
        return canonical_layout(layout)
    pairs = [(_check_name(n, caller), _check_shape(s, n, caller)) for n, s in layout]
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        dups = sorted({n for n in names if names.count(n) > 1})
        raise InvalidProjectionError(
            f"{caller}: layout names must be unique, got duplicates {dups}; build the layout "
            "with canonical_layout(params)."
        )
    return tuple(sorted(pairs))


def block_seed(projection: Projection, name: str, shape: Sequence[int]) -> tuple[int, int]:
    """The two uint32 keys ``(s0, s1)`` of one parameter's block.

    blake2b (8 bytes, personalised) of the canonical JSON of
    ``{dim, kind, name, nnz, seed, shape}``; keyed by the name, never by pytree position.
    """
    record = {"dim": projection.dim, "kind": projection.kind, "name": name,
              "nnz": projection.nnz, "seed": projection.seed, "shape": [int(s) for s in shape]}
    return hash_record(record)


def kronecker_split(dim: int) -> tuple[int, int]:
    """``(k_out, k_in)`` with ``k_out * k_in = dim``: ``k_out`` the largest divisor <= sqrt(dim).

    Every layer gets the same split, so its block adds into the same ``k`` outputs as the
    others. Powers of two and squares split evenly (512 -> 16 x 32, 1024 -> 32 x 32); a prime
    ``dim`` gives ``1 x dim``, which is still unbiased but noisier.
    """
    k_out = max(d for d in range(1, math.isqrt(dim) + 1) if dim % d == 0)
    return k_out, dim // k_out


def kronecker_seeds(projection: Projection, name: str, shape: Sequence[int]
                    ) -> tuple[tuple[int, int], tuple[int, int]]:
    """The keys of ``P_out`` and ``P_in`` of parameter ``name``: ``block_seed``'s record plus
    ``"side": "out"`` or ``"in"``."""
    record = {"dim": projection.dim, "kind": projection.kind, "name": name,
              "nnz": projection.nnz, "seed": projection.seed, "shape": [int(s) for s in shape]}
    return hash_record({**record, "side": "out"}), hash_record({**record, "side": "in"})


def kronecker_factors(
    projection: Projection, name: str, shape: Sequence[int], *,
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """The side projections of a parameter with two or more dimensions, unscaled.

    Returns:
        ``(P_out [d_out, k_out], P_in [d_in, k_in])`` of exact +-1 in ``dtype`` on ``device``,
        ``d_out = shape[0]``, ``d_in = prod(shape[1:])``, ``(k_out, k_in) =
        kronecker_split(dim)``; the block is ``(P_out.T @ G @ P_in) / sqrt(k_out * k_in)``.
    """
    shape = check_kronecker_args(projection, name, shape, caller="kronecker_factors")
    keys_out, keys_in = kronecker_seeds(projection, name, shape)
    device = torch.empty(0, device=device).device
    return _kronecker_sides(keys_out, keys_in, shape, *kronecker_split(projection.dim), device,
                            dtype)


def check_kronecker_args(projection: Projection, name: str, shape: Sequence[int], *,
                         caller: str) -> tuple[int, ...]:
    """``shape`` as a tuple if ``projection`` is kronecker and ``name`` a matrix, else raise.

    Shared by the torch and JAX ``kronecker_factors``, so both refuse the same input alike.
    """
    if not isinstance(projection, Projection) or projection.kind != "kronecker":
        got = projection.kind if isinstance(projection, Projection) else type(projection).__name__
        raise InvalidProjectionError(
            f"{caller}: expected a Projection with kind='kronecker', got {got!r}; use "
            "Projection(dim=..., kind='kronecker')."
        )
    shape = _check_shape(shape, _check_name(name, caller), caller)
    if len(shape) < 2 or max(shape[0], math.prod(shape[1:])) > MAX_ROWS:
        raise InvalidProjectionError(
            f"{caller}: {name!r} needs at least two dimensions, each side at most 2**32 "
            f"elements, got shape {list(shape)}; vectors use the Rademacher block (block_seed)."
        )
    return shape


def _kronecker_sides(keys_out, keys_in, shape, k_out, k_in, device, dtype) -> tuple:
    d_out, d_in = shape[0], math.prod(shape[1:])
    p_out = torch.empty(d_out, k_out, dtype=dtype, device=device)
    p_in = torch.empty(d_in, k_in, dtype=dtype, device=device)
    return (_hashing.fill_rademacher(p_out, keys_out, 0),
            _hashing.fill_rademacher(p_in, keys_in, 0))


def _check_block_args(projection, kind, name, shape, row_start, row_stop, caller) -> tuple:
    if not isinstance(projection, Projection) or projection.kind != kind:
        got = projection.kind if isinstance(projection, Projection) else type(projection).__name__
        raise InvalidProjectionError(
            f"{caller}: expected a Projection with kind={kind!r}, got {got!r}; call the "
            "block function of the projection's kind."
        )
    shape = _check_shape(shape, _check_name(name, caller), caller)
    numel = math.prod(shape)
    ints = all(isinstance(r, int) and not isinstance(r, bool) for r in (row_start, row_stop))
    if numel > MAX_ROWS or not ints or not 0 <= row_start <= row_stop <= numel:
        raise InvalidProjectionError(
            f"{caller}: rows must satisfy 0 <= row_start <= row_stop <= numel={numel} "
            f"(ints; numel at most 2**32), got [{row_start!r}, {row_stop!r}); pick rows inside "
            f"{name!r}."
        )
    return shape, block_seed(projection, name, shape)


def rademacher_block(
    projection: Projection, name: str, shape: Sequence[int], row_start: int, row_stop: int,
    *, device: torch.device | str | None = None,
) -> Tensor:
    """Rows ``[row_start, row_stop)`` of parameter ``name``'s Rademacher block, unscaled.

    Returns:
        ``[rows, k]`` float32 of exact +-1 on ``device`` (the scale 1/sqrt(k) is separate).
    """
    _, keys = _check_block_args(projection, "rademacher", name, shape, row_start, row_stop,
                                "rademacher_block")
    out = torch.empty(row_stop - row_start, projection.dim, dtype=torch.float32, device=device)
    return _hashing.fill_rademacher(out, keys, row_start)


def sjlt_block(
    projection: Projection, name: str, shape: Sequence[int], row_start: int, row_stop: int,
    *, device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Rows ``[row_start, row_stop)`` of parameter ``name``'s SJLT block, unscaled.

    Returns:
        ``(cols, signs)``: ``[rows, nnz]`` int64 columns in ``[0, k)`` and ``[rows, nnz]``
        float32 +-1 (the scale 1/sqrt(nnz) is separate), on ``device``.
    """
    _, keys = _check_block_args(projection, "sjlt", name, shape, row_start, row_stop,
                                "sjlt_block")
    device = torch.empty(0, device=device).device
    return _hashing.sjlt_rows(keys, projection.dim, projection.nnz, row_start, row_stop, device,
                      torch.float32)


_STREAM = "stream"  # cache marker: over budget, generated row-block by row-block on each call


class Projector:
    """Projects one example's gradients ``{name: [*shape]}`` to ``[k]``; see make_projector.

    Generated blocks are cached per ``(name, dtype, device)`` of the gradients, cast once to
    the gradients' dtype, so the batches and vmap chunks that follow reuse them. A parameter
    whose block no longer fits ``cache_bytes`` is generated a row-block at a time on every call
    (Kronecker side factors are small and always cached).

    Attributes:
        projection: The spec.
        layout: Parameter names and shapes, sorted by name.
        k: Output dimension.
    """

    def __init__(self, projection: Projection, layout: Layout, k: int,
                 keys: dict[str, tuple], cache_bytes: int, *, compile: bool = False) -> None:
        self.projection, self.layout, self.k = projection, layout, k
        # A plain function, not a bound method: nothing here may refer back to self.
        self._rows_fn = (_hashing.compiled_rademacher_rows() if compile
                         else _hashing.rademacher_rows)
        self._shapes = dict(layout)
        self._keys = keys
        self._cache: dict[tuple, Any] = {}
        self._cache_left = cache_bytes
        sparse = projection.kind == "sjlt"
        self._scale = 1 / math.sqrt(projection.nnz if sparse else k)

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
        if self.projection.kind == "identity":
            return torch.cat([grads[name].reshape(-1) for name, _ in self.layout])
        dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads.values()))
        device = grads[self.layout[0][0]].device
        # Chosen per call, not stored: a bound method kept on self is a reference cycle,
        # and the cached blocks would then wait for the cyclic garbage collector.
        kind = self.projection.kind
        project_one = (self._project_sjlt if kind == "sjlt" else
                       self._project_kronecker if kind == "kronecker" else
                       self._project_rademacher)
        total = None
        for name, shape in self.layout:  # canonical order fixes the float summation order
            if math.prod(shape) > 0:
                part = project_one(name, grads[name].reshape(-1).to(dtype), device)
                total = part if total is None else total + part
        return total * self._scale

    def _project_rademacher(self, name: str, flat: Tensor, device: torch.device) -> Tensor:
        block = self._entry(name, flat.dtype, device)
        if block is not _STREAM:
            return flat @ block  # [numel] @ [numel, k]; one [b, numel] matmul under vmap
        keys, k = self._keys[name], self.k
        return sum(flat[a:b] @ self._rows_fn(keys, k, a, b, device, flat.dtype)
                   for a, b in _hashing.row_ranges(flat.shape[0], k, device))

    def _project_sjlt(self, name: str, flat: Tensor, device: torch.device) -> Tensor:
        entry = self._entry(name, flat.dtype, device)
        keys, k, nnz = self._keys[name], self.k, self.projection.nnz
        blocks = [(0, flat.shape[0], entry)] if entry is not _STREAM else (
            (a, b, _hashing.sjlt_rows(keys, k, nnz, a, b, device, flat.dtype))
            for a, b in _hashing.row_ranges(flat.shape[0], nnz, device))
        out = torch.zeros(k, dtype=flat.dtype, device=device)
        for a, b, (cols, signs) in blocks:
            values = flat[a:b, None] * signs  # [rows, nnz]: cost p * nnz, never p * k
            # Out of place: index_add has a vmap batching rule, so the zeros stay unbatched.
            out = out.index_add(0, cols.reshape(-1), values.reshape(-1))
        return out

    def _project_kronecker(self, name: str, flat: Tensor, device: torch.device) -> Tensor:
        shape = self._shapes[name]
        if len(shape) < 2:
            return self._project_rademacher(name, flat, device)
        p_out, p_in = self._entry(name, flat.dtype, device)
        matrix = flat.reshape(shape[0], -1)  # [d_out, d_in]
        if p_out.shape[1] <= p_in.shape[1]:  # contract the larger side with the smaller k first
            return ((p_out.T @ matrix) @ p_in).reshape(-1)  # [k_out, k_in] -> [k]
        return (p_out.T @ (matrix @ p_in)).reshape(-1)

    def kronecker_factors(self, name: str, dtype: torch.dtype, device: torch.device
                          ) -> tuple[Tensor, Tensor]:
        """Cached ``(P_out [d_out, k_out], P_in [d_in, k_in])`` of a matrix parameter, unscaled
        (the projector's overall scale ``1/sqrt(k)`` applies), for ``tracinfunc.factorized``."""
        if self.projection.kind != "kronecker" or len(self._shapes.get(name, ())) < 2:
            raise InvalidProjectionError(
                f"Projector.kronecker_factors: {name!r} is not a matrix parameter of a "
                f"kind='kronecker' projector (kind={self.projection.kind!r}); ask for a "
                "parameter with two or more dimensions."
            )
        return self._entry(name, dtype, device)

    @property
    def scale(self) -> float:
        """The factor applied to the summed unscaled blocks: ``1/sqrt(k)`` (``1/sqrt(nnz)``)."""
        return self._scale

    def _entry(self, name: str, dtype: torch.dtype, device: torch.device) -> Any:
        key = (name, dtype, device)
        if key not in self._cache:
            self._cache[key] = self._generate(name, dtype, device)
        return self._cache[key]

    def _generate(self, name: str, dtype: torch.dtype, device: torch.device) -> Any:
        """``name``'s block cast once to ``dtype``, or _STREAM when it exceeds the budget."""
        numel, keys, k, nnz = (math.prod(self._shapes[name]), self._keys[name], self.k,
                               self.projection.nnz)
        itemsize = torch.empty((), dtype=dtype).element_size()
        shape = self._shapes[name]
        if self.projection.kind == "kronecker" and len(shape) >= 2:
            (k_out, k_in), (keys_out, keys_in) = kronecker_split(k), keys
            self._cache_left -= (shape[0] * k_out + numel // shape[0] * k_in) * itemsize
            return _kronecker_sides(keys_out, keys_in, shape, k_out, k_in, device, dtype)
        if self.projection.kind in ("rademacher", "kronecker"):
            if not self._reserve(numel * k * itemsize):
                return _STREAM
            return _hashing.fill_rademacher(torch.empty(numel, k, dtype=dtype, device=device),
                                            keys, 0, rows_fn=self._rows_fn)
        if not self._reserve(numel * nnz * (8 + itemsize)):  # int64 cols + signs
            return _STREAM
        return _hashing.sjlt_rows(keys, k, nnz, 0, numel, device, dtype)

    def _reserve(self, nbytes: int) -> bool:
        fits = nbytes <= self._cache_left
        if fits:
            self._cache_left -= nbytes
        return fits

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


def _param_keys(projection: Projection, name: str, shape: tuple[int, ...]) -> tuple:
    if projection.kind == "kronecker" and len(shape) >= 2:
        if max(shape[0], math.prod(shape[1:])) > MAX_ROWS:
            raise InvalidProjectionError(
                f"make_projector: each side of {name!r} must hold at most 2**32 elements, got "
                f"shape {list(shape)}; reshape the parameter or use kind='sjlt'."
            )
        return kronecker_seeds(projection, name, shape)
    return block_seed(projection, name, shape)


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
    if not isinstance(projection, Projection):
        raise InvalidTypeError(
            "make_projector: projection must be a tracinfunc.Projection, got "
            f"{type(projection).__name__}; e.g. Projection(dim=512, seed=0)."
        )
    layout = _as_layout(layout, "make_projector")
    sizes = [math.prod(shape) for _, shape in layout]
    if sum(sizes) == 0 or max(sizes) > MAX_ROWS:
        raise InvalidProjectionError(
            f"make_projector: the layout must hold at least one element and no parameter over "
            f"2**32 elements, got {len(layout)} parameters with sizes {sizes}; build it with "
            "canonical_layout(params)."
        )
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
        raise InvalidProjectionError(
            f"make_projector: cache_bytes must be a non-negative int, got {cache_bytes!r}; "
            "use e.g. cache_bytes=2**30 (0 generates every block on every call)."
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidProjectionError(
            f"make_projector: dtype must be a floating torch.dtype, got {dtype!r}; use e.g. "
            "dtype=torch.float32."
        )
    k = projection.output_dim(layout)
    keys = {} if projection.kind == "identity" else {
        name: _param_keys(projection, name, shape) for name, shape in layout}
    names_by_key: dict[tuple[int, int], list[str]] = {}
    for name, key in keys.items():
        names_by_key.setdefault(key, []).append(name)
    clashes = "; ".join(", ".join(map(repr, names)) for names in names_by_key.values()
                        if len(names) > 1)
    if clashes:
        raise InvalidProjectionError(
            f"make_projector: parameters {clashes} got the same block seed, so their blocks "
            "would be identical; rename one of them or use another seed."
        )
    if not isinstance(compile, bool):
        raise InvalidProjectionError(
            f"make_projector: compile must be True or False, got {compile!r}."
        )
    projector = Projector(projection, layout, k, keys, cache_bytes, compile=compile)
    device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as gradients report
    for (name, _), size in zip(layout, sizes, strict=True):
        if keys and size > 0:
            projector._entry(name, dtype, device)
    return projector
