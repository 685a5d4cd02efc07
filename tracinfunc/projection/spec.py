"""The projection spec, framework-neutral: what a projection is, never how it is computed.

Pure Python (no torch, no JAX), so the torch kernels (:mod:`tracinfunc.projection.torch`), the
JAX frontend (:mod:`tracinfunc.jax.projection`) and the store metadata share one definition.

A projection maps one example's gradients ``{name: [*shape]}`` (``p`` numbers in all) to
``[k]``. The ``[p, k]`` matrix is never stored whole: each parameter's block is a pure function
of ``(seed, kind, dim, nnz, name, shape)``, computed by a counter-based integer hash, so one
spec gives the same matrix on any device, in any process and in NumPy
(``tests/numpy_projection.py``), whatever the insertion order of the parameter dict.

Each parameter's block follows the element rule of :mod:`tracinfunc.projection.keys`, keyed by
``block_seed(projection, name, shape)`` (rademacher: dense +-1 scaled by 1/sqrt(k); sjlt:
``nnz`` signed entries per row scaled by 1/sqrt(nnz)).
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
unbiased. Because ``G = delta.T @ x`` for a Linear layer, ``tracinfunc.grads.factorized``
computes the same numbers from layer inputs and output gradients without materialising ``G``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from tracinfunc._validate import check_int, current_caller, entry_point
from tracinfunc.errors import InvalidProjectionError, InvalidTypeError
from tracinfunc.projection.keys import (
    MAX_ROWS,
    block_seed,
    hash_record,
    is_matrix,
    kronecker_seeds,
    kronecker_split,
    kronecker_view,
    param_keys,
    side_split,
)

__all__ = [
    "KINDS",
    "MAX_PROJECTED_DIM",
    "MAX_ROWS",
    "Layout",
    "Projection",
    "ProjectionPlan",
    "as_layout",
    "block_seed",
    "canonical_layout",
    "check_block_args",
    "check_cache_bytes",
    "check_kronecker_args",
    "check_projection",
    "hash_record",
    "is_matrix",
    "kronecker_seeds",
    "kronecker_split",
    "kronecker_view",
    "param_keys",
    "plan_projection",
    "side_split",
]


Layout: TypeAlias = tuple[tuple[str, tuple[int, ...]], ...]
"""Parameter names and shapes sorted by name: ``(("fc.bias", (3,)), ("fc.weight", (3, 8)))``."""

KINDS = ("identity", "rademacher", "sjlt", "kronecker")
VECTORS = ("dense", "kronecker")
SPLITS = ("square", "shape")
# Largest k a projector builds: one example's row is 4 * k bytes and a dense block row 8 * k
# while hashed; past this a typo (dim=2**31-1) ran until the process was OOM-killed.
MAX_PROJECTED_DIM = 2**24
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
        split: How ``"kronecker"`` factors ``k = k_out * k_in`` per weight: ``"square"``
            (default: the same near-square split for every weight) or ``"shape"`` (from each
            weight's shape, never more than a side's own dimension; see
            :func:`~tracinfunc.projection.keys.kronecker_split`). Measured on digits
            (``benchmarks/quality.py``), ``"shape"`` lowered LDS (0.646 -> 0.609 at k=256,
            0.618 -> 0.565 at k=1024): the estimator's variance falls with both ``k_out``
            and ``k_in``, so a balanced split wins even when it exceeds a side. Must stay
            ``"square"`` for other kinds.
        per_checkpoint: Draw an independent projection for every checkpoint (the
            checkpoint's name joins the hash keys), so projection errors average out across
            checkpoints instead of adding up (measured on digits at k=256: score error vs
            exact 0.24 -> 0.10 for rademacher). Test gradients must then come from
            checkpoints of the same names.
            ``build_store`` applies it; a projector needs :meth:`for_checkpoint`.
        checkpoint: Set by :meth:`for_checkpoint` only: the checkpoint a per-checkpoint
            projection is drawn for.
        vectors: How ``"kronecker"`` projects parameters with fewer than two dimensions
            (biases, LayerNorm weights and biases): ``"dense"`` (default: a dense Rademacher
            block ``[n, k]`` each, the rule of ``"rademacher"``) or ``"kronecker"`` (each
            gradient, zero-padded, read as a near-square ``[d_out, d_in]`` matrix and
            projected side by side like a weight; see
            :func:`~tracinfunc.projection.keys.kronecker_view`). A dense block is read whole
            for every call whatever the batch, which made collecting all of a small
            transformer's parameters 1.4x the training step; ``"kronecker"`` costs a few
            small products instead (docs/language-models.md has the measurement and the
            agreement). Must stay ``"dense"`` for other kinds. A store records it, so stores
            and queries of the two forms never mix.

    Example:
        >>> Projection(dim=512, seed=0)                  # dense Rademacher
        >>> Projection(dim=4096, kind="sjlt", nnz=4)      # sparse, for large models
        >>> Projection(dim=1024, kind="kronecker")       # factorised, split per weight
        >>> Projection(dim=4096, kind="kronecker", vectors="kronecker")  # biases too
    """

    dim: int | None = None
    seed: int = 0
    kind: str = "rademacher"
    nnz: int = 1
    split: str = "square"
    per_checkpoint: bool = False
    checkpoint: str | None = None
    vectors: str = "dense"

    def __post_init__(self) -> None:
        kind = self.kind
        if kind not in KINDS:
            raise InvalidProjectionError(
                f"Projection: kind must be one of {', '.join(map(repr, KINDS))}, got "
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
        if self.split not in SPLITS or (kind != "kronecker" and self.split != "square"):
            raise InvalidProjectionError(
                f"Projection: split must be one of {', '.join(map(repr, SPLITS))} for "
                f"kind='kronecker' (and 'square' for other kinds), got {self.split!r} with "
                f"kind={kind!r}; leave the default split='square'."
            )
        if self.vectors not in VECTORS or (kind != "kronecker" and self.vectors != "dense"):
            raise InvalidProjectionError(
                f"Projection: vectors must be one of {', '.join(map(repr, VECTORS))} for "
                f"kind='kronecker' (and 'dense' for other kinds), got {self.vectors!r} with "
                f"kind={kind!r}; use Projection(dim=..., kind='kronecker', vectors='kronecker') "
                "or leave the default vectors='dense'."
            )
        if not isinstance(self.per_checkpoint, bool) or (
                self.checkpoint is not None
                and (not self.per_checkpoint or not isinstance(self.checkpoint, str))):
            raise InvalidProjectionError(
                f"Projection: per_checkpoint must be True or False and checkpoint a name set "
                f"only by for_checkpoint, got per_checkpoint={self.per_checkpoint!r}, "
                f"checkpoint={self.checkpoint!r}; use Projection(..., per_checkpoint=True)"
                ".for_checkpoint('epoch-1')."
            )
        for field, value in (("dim", dim), ("seed", seed), ("nnz", nnz), ("kind", str(kind)),
                             ("split", str(self.split)), ("vectors", str(self.vectors))):
            # numpy ints -> int and numpy strings -> str, for JSON, hashing and the repr
            object.__setattr__(self, field, value)

    @entry_point("Projection.output_dim")
    def output_dim(self, layout: Layout | Mapping[str, Any]) -> int:
        """``k`` for gradients with this layout: ``dim``, or ``p`` for ``"identity"``.

        Raises:
            InvalidProjectionError: ``kind="identity"`` with a ``dim`` other than ``p``.
        """
        if self.kind != "identity":
            return self.dim
        p = sum(math.prod(shape) for _, shape in as_layout(layout))
        if self.dim is not None and self.dim != p:
            raise InvalidProjectionError(
                f"Projection.output_dim: kind='identity' keeps all p={p} gradient entries but "
                f"dim={self.dim}; use Projection(kind='identity') (dim=None)."
            )
        return p

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types; :meth:`from_dict` inverts it."""
        data = {"kind": self.kind, "dim": self.dim, "seed": self.seed, "nnz": self.nnz}
        if self.split != "square":  # absent otherwise: metadata as before splits existed
            data["split"] = self.split
        if self.vectors != "dense":  # absent otherwise: metadata as before the option
            data["vectors"] = self.vectors
        if self.per_checkpoint:  # absent otherwise: metadata of shared projections unchanged
            data["per_checkpoint"] = True
        if self.checkpoint is not None:
            data["checkpoint"] = self.checkpoint
        return data

    def for_checkpoint(self, name: str) -> Projection:
        """The projection of checkpoint ``name``: itself unless ``per_checkpoint``."""
        if not self.per_checkpoint:
            return self
        return dataclasses.replace(self, checkpoint=name)

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


@entry_point("canonical_layout")
def canonical_layout(shapes: Mapping[str, Sequence[int]] | Mapping[str, Any]) -> Layout:
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
        (check_name(name), check_shape(value, name))
        for name, value in shapes.items()
    ))


def check_name(name: Any) -> str:
    if not isinstance(name, str):
        raise InvalidProjectionError(
            f"{current_caller()}: parameter names must be str, got {name!r}; key params by name."
        )
    return name


def check_shape(value: Any, name: str) -> tuple[int, ...]:
    try:
        # Any array (torch, JAX, NumPy) has .shape; a plain sequence is the shape itself.
        raw = tuple(getattr(value, "shape", value))
        shape = tuple(operator.index(s) for s in raw)
        bad = any(isinstance(s, bool) for s in raw) or any(s < 0 for s in shape)
    except TypeError:
        bad = True
    if bad:
        raise InvalidProjectionError(
            f"{current_caller()}: the shape of {name!r} must be a tensor or a sequence of "
            "non-negative "
            f"ints, got {value!r}; pass {{name: tensor}} or {{name: tuple(tensor.shape)}}."
        )
    return shape


def as_layout(layout: Layout | Mapping[str, Any]) -> Layout:
    if isinstance(layout, Mapping):
        return canonical_layout(layout)
    pairs = [(check_name(n), check_shape(s, n)) for n, s in layout]
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        dups = sorted({n for n in names if names.count(n) > 1})
        raise InvalidProjectionError(
            f"{current_caller()}: layout names must be unique, got duplicates {dups}; build the "
            "layout with canonical_layout(params)."
        )
    return tuple(sorted(pairs))


def check_kronecker_args(
    projection: Projection, name: str, shape: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, int]]:
    """``(shape, (d_out, d_in))`` if ``projection`` is kronecker and projects ``name`` side
    by side (:func:`~tracinfunc.projection.keys.kronecker_view`), else raise.

    Shared by the torch and JAX ``kronecker_factors``, so both refuse the same input alike.
    """
    if not isinstance(projection, Projection) or projection.kind != "kronecker":
        got = projection.kind if isinstance(projection, Projection) else type(projection).__name__
        raise InvalidProjectionError(
            f"{current_caller()}: expected a Projection with kind='kronecker', got {got!r}; use "
            "Projection(dim=..., kind='kronecker')."
        )
    shape = check_shape(shape, check_name(name))
    view = kronecker_view(projection, shape)
    if view is None or max(view) > MAX_ROWS:
        vectors = ("vectors use the Rademacher block (block_seed) unless "
                   "Projection(..., vectors='kronecker')" if projection.vectors == "dense"
                   else "an empty vector has no block")
        raise InvalidProjectionError(
            f"{current_caller()}: {name!r} needs at least two dimensions, each side at most 2**32 "
            f"elements, got shape {list(shape)}; {vectors}."
        )
    return shape, view


def check_block_args(projection: Projection, kind: str, name: str, shape: Sequence[int],
                     row_start: int, row_stop: int) -> tuple[tuple[int, ...], tuple[int, int]]:
    """``(shape, block keys)`` if rows ``[row_start, row_stop)`` of ``name``'s ``kind`` block
    exist, else raise. Shared by the torch and JAX block functions."""
    if not isinstance(projection, Projection) or projection.kind != kind:
        got = projection.kind if isinstance(projection, Projection) else type(projection).__name__
        raise InvalidProjectionError(
            f"{current_caller()}: expected a Projection with kind={kind!r}, got {got!r}; call the "
            "block function of the projection's kind."
        )
    shape = check_shape(shape, check_name(name))
    numel = math.prod(shape)
    ints = all(isinstance(r, int) and not isinstance(r, bool) for r in (row_start, row_stop))
    if numel > MAX_ROWS or not ints or not 0 <= row_start <= row_stop <= numel:
        raise InvalidProjectionError(
            f"{current_caller()}: rows must satisfy 0 <= row_start <= row_stop <= numel={numel} "
            f"(ints; numel at most 2**32), got [{row_start!r}, {row_stop!r}); pick rows inside "
            f"{name!r}."
        )
    return shape, block_seed(projection, name, shape)



def check_projection(projection: Any) -> Projection:
    """``projection`` if it is a :class:`Projection`, else :class:`InvalidTypeError`."""
    if not isinstance(projection, Projection):
        raise InvalidTypeError(
            f"{current_caller()}: projection must be a tracinfunc.Projection, got "
            f"{type(projection).__name__}; e.g. projection=Projection(dim=512, seed=0)."
        )
    return projection


def check_cache_bytes(cache_bytes: Any) -> int:
    """The projector cache budget: a non-negative int (torch and JAX projectors)."""
    return check_int(cache_bytes, "cache_bytes", minimum=0,
                     error=InvalidProjectionError,
                     fix="use e.g. cache_bytes=2**30 (0 generates every block on every call)")


@dataclass(frozen=True)
class ProjectionPlan:
    """A projection checked against one parameter layout: everything but the numbers.

    What every frontend (torch, JAX) needs to generate the same blocks: the output size and
    each parameter's hash keys. Made by :func:`plan_projection`.

    Attributes:
        projection: The spec.
        layout: Parameter names and shapes, sorted by name.
        k: Output dimension.
        keys: ``{name: keys}``: ``(s0, s1)`` (``block_seed``) or, for kronecker matrices,
            ``((s0, s1) of P_out, (s0, s1) of P_in)``; empty for ``"identity"``.
    """

    projection: Projection
    layout: Layout
    k: int
    keys: Mapping[str, tuple]

    @property
    def scale(self) -> float:
        """The factor on the summed unscaled blocks: ``1/sqrt(nnz)`` (sjlt), else ``1/sqrt(k)``."""
        sparse = self.projection.kind == "sjlt"
        return 1 / math.sqrt(self.projection.nnz if sparse else self.k)

    def kronecker_view(self, name: str) -> tuple[int, int] | None:
        """``(d_out, d_in)`` where ``name`` is projected side by side (``P_out.T @ G @ P_in``),
        else ``None`` (:func:`~tracinfunc.projection.keys.kronecker_view`)."""
        return kronecker_view(self.projection, dict(self.layout)[name])


def plan_projection(projection: Projection, layout: Layout | Mapping[str, Any]) -> ProjectionPlan:
    """Check ``projection`` against ``layout`` and derive every parameter's keys.

    Raises:
        InvalidTypeError: ``projection`` is not a :class:`Projection`.
        InvalidProjectionError: empty or malformed layout, a parameter over ``2**32``
            elements, identity ``dim`` other than ``p``, or two parameters whose block seeds
            collide.
    """
    check_projection(projection)
    if projection.per_checkpoint and projection.checkpoint is None:
        raise InvalidProjectionError(
            f"{current_caller('make_projector')}: a per_checkpoint projection is drawn per "
            "checkpoint; pass "
            "projection.for_checkpoint(name) for the checkpoint whose gradients these are "
            "(build_store does this for you)."
        )
    layout = as_layout(layout)
    sizes = [math.prod(shape) for _, shape in layout]
    # Dense blocks index their rows below 2**32; a parameter projected side by side has only
    # its sides' limits, which param_keys checks.
    rows = [size for (_, shape), size in zip(layout, sizes, strict=True)
            if kronecker_view(projection, shape) is None]
    if sum(sizes) == 0 or max(rows, default=0) > MAX_ROWS:
        raise InvalidProjectionError(
            f"{current_caller('make_projector')}: the layout must hold at least one element and "
            "no parameter over "
            f"2**32 elements, got {len(layout)} parameters with sizes {sizes}; build it with "
            "canonical_layout(params)."
        )
    k = projection.output_dim(layout)
    if projection.kind != "identity" and k > MAX_PROJECTED_DIM:
        raise InvalidProjectionError(
            f"{current_caller('make_projector')}: dim={k} would give every example a [{k}] row "
            f"({4 * k / 2**30:.1f} GiB in float32) and dense blocks rows of {8 * k / 2**30:.1f} "
            f"GiB while they are generated; projectors take dim up to {MAX_PROJECTED_DIM}. "
            "Use a smaller dim (TracIn needs thousands, e.g. 4096), or kind='identity' for "
            "every entry."
        )
    keys = {} if projection.kind == "identity" else {
        name: param_keys(projection, name, shape) for name, shape in layout}
    names_by_key: dict[tuple, list[str]] = {}
    for name, key in keys.items():
        names_by_key.setdefault(key, []).append(name)
    clashes = "; ".join(", ".join(map(repr, names)) for names in names_by_key.values()
                        if len(names) > 1)
    if clashes:
        raise InvalidProjectionError(
            f"{current_caller('make_projector')}: parameters {clashes} got the same block seed, "
            "so their blocks would be identical; rename one of them or use another seed."
        )
    return ProjectionPlan(projection, layout, k, keys)
