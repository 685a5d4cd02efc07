"""Key derivation: each parameter's block is a pure function of its hash keys.

Pure Python (hashlib and json), so torch, JAX and NumPy derive the same keys.

Element rule for row ``r`` of a parameter's block (its flattened coordinate), with the keys
``(s0, s1) = block_seed(projection, name, shape)`` and ``mix32`` = lowbias32::

    a = mix32(r ^ s0) ^ s1
    rademacher: P[r, c] = -1 if bit 31 of mix32(a ^ c) else +1; scaled by 1/sqrt(k)
    sjlt, t < nnz: h = mix32(a ^ t); column (h * k) >> 32; sign from bit 31 of mix32(h);
        scaled by 1/sqrt(nnz) (columns of one row may repeat; their entries then add)

Kronecker side factors ``P_out``/``P_in`` follow the Rademacher rule with the keys of
:func:`kronecker_seeds`. Changing anything here changes every saved store
(``tests/projection/test_projection.py`` guards it with a golden hash).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tracinfunc.errors import InvalidProjectionError

__all__ = [
    "MAX_ROWS",
    "block_seed",
    "hash_record",
    "is_matrix",
    "kronecker_seeds",
    "kronecker_split",
    "kronecker_view",
    "param_keys",
    "side_split",
]


class ProjectionFields(Protocol):
    """The fields of a :class:`~tracinfunc.projection.spec.Projection` the keys are made of.

    A structural type, so that this module (which ``spec`` builds on) never imports ``spec``.
    """

    kind: str
    dim: int | None
    seed: int
    nnz: int
    split: str
    vectors: str
    checkpoint: str | None

PERSON = b"tracinfunc.proj1"  # blake2b domain tag: bump it if the element rule ever changes
MAX_ROWS = 2**32  # rows are hashed as uint32 counters


def hash_record(record: Mapping[str, Any]) -> tuple[int, int]:
    """Two uint32 keys: blake2b (8 bytes, personalised) of the record's canonical JSON."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    digest = hashlib.blake2b(text.encode("ascii"), digest_size=8, person=PERSON).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def block_seed(projection: ProjectionFields, name: str, shape: Sequence[int]) -> tuple[int, int]:
    """The two uint32 keys ``(s0, s1)`` of one parameter's block.

    blake2b (8 bytes, personalised) of the canonical JSON of
    ``{dim, kind, name, nnz, seed, shape}`` (plus ``checkpoint`` for a per-checkpoint
    projection); keyed by the name, never by pytree position.
    """
    return hash_record(_key_record(projection, name, shape))


def _key_record(projection: ProjectionFields, name: str, shape: Sequence[int]) -> dict[str, Any]:
    record = {"dim": projection.dim, "kind": projection.kind, "name": name,
              "nnz": projection.nnz, "seed": projection.seed, "shape": [int(s) for s in shape]}
    if projection.checkpoint is not None:  # per-checkpoint projections only
        record["checkpoint"] = projection.checkpoint
    return record


def kronecker_split(dim: int, shape: Sequence[int] | None = None) -> tuple[int, int]:
    """``(k_out, k_in)`` with ``k_out * k_in = dim``, the sizes of a layer's side projections.

    Every layer's block adds into the same ``k`` outputs, so ``k_out * k_in = dim`` always;
    only the factorisation varies.

    Args:
        dim: ``k``.
        shape: The parameter's shape ``[d_out, *in]``. ``None``: the square split, the same
            for every layer (``k_out`` the largest divisor <= sqrt(dim): 512 -> 16 x 32).
            Given: the divisor pair that never exceeds a side's own dimension (``d_out``,
            ``d_in = prod(in)``) and keeps the most of the smaller side's relative size
            (``max min(k_out / d_out, k_in / d_in)``): a ``10 x 64`` weight at ``k=256`` gets
            ``8 x 32``, not ``16 x 16`` (which maps 10 outputs to 16). When no pair fits (a
            layer with fewer than ``k`` entries), the pair that wastes least. An empty
            side (``d_out`` or ``d_in`` 0) takes the square split.
    """
    d_out, d_in = (None, None) if shape is None else (shape[0], math.prod(shape[1:]))
    if shape is None or d_out == 0 or d_in == 0:  # an empty weight adds nothing: any split
        k_out = max(d for d in range(1, math.isqrt(dim) + 1) if dim % d == 0)
        return k_out, dim // k_out
    pairs = [(a, dim // a) for a in range(1, dim + 1) if dim % a == 0]
    fitting = [(a, b) for a, b in pairs if a <= d_out and b <= d_in]
    if fitting:
        return max(fitting, key=lambda ab: (min(ab[0] / d_out, ab[1] / d_in), ab[0]))
    return min(pairs, key=lambda ab: (max(ab[0] / d_out, ab[1] / d_in), -ab[0]))


def side_split(projection: ProjectionFields, shape: Sequence[int]) -> tuple[int, int]:
    """``(k_out, k_in)`` of one matrix parameter under ``projection.split``."""
    if projection.split == "square":
        return kronecker_split(projection.dim)
    return kronecker_split(projection.dim, shape)


def kronecker_seeds(projection: ProjectionFields, name: str, shape: Sequence[int]
                    ) -> tuple[tuple[int, int], tuple[int, int]]:
    """The keys of ``P_out`` and ``P_in`` of parameter ``name``: ``block_seed``'s record plus
    ``"side": "out"`` or ``"in"``."""
    record = _key_record(projection, name, shape)
    return hash_record({**record, "side": "out"}), hash_record({**record, "side": "in"})


def param_keys(projection: ProjectionFields, name: str, shape: tuple[int, ...]) -> tuple:
    """A parameter's keys: ``kronecker_seeds`` where it is projected side by side
    (:func:`kronecker_view`), else ``block_seed``."""
    view = kronecker_view(projection, shape)
    if view is not None:
        if max(view) > MAX_ROWS:
            raise InvalidProjectionError(
                f"make_projector: each side of {name!r} must hold at most 2**32 elements, got "
                f"shape {list(shape)}; reshape the parameter or use kind='sjlt'."
            )
        return kronecker_seeds(projection, name, shape)
    return block_seed(projection, name, shape)


def is_matrix(shape: Sequence[int]) -> bool:
    """Two or more dimensions: projected side by side under ``kind="kronecker"``."""
    return len(shape) >= 2


def kronecker_view(projection: ProjectionFields, shape: Sequence[int]) -> tuple[int, int] | None:
    """``(d_out, d_in)``: the matrix a parameter is projected as under ``kind="kronecker"``,
    by ``P_out [d_out, k_out]`` and ``P_in [d_in, k_in]``; ``None`` where the dense
    Rademacher rule applies (other kinds, and vectors under ``vectors="dense"``).

    A parameter with two or more dimensions is ``[shape[0], prod(shape[1:])]``. Under
    ``vectors="kronecker"`` a non-empty parameter with fewer (``n`` elements: a bias, a norm's
    weight, a scalar) is its flat gradient padded with zeros to ``d_out * d_in`` entries, read
    row by row as ``[d_out, d_in]`` with ``d_in = ceil(sqrt(n))`` and ``d_out = ceil(n /
    d_in)``: the most square shape, so that the Kronecker matrix keeps rank ``n`` while ``n``
    is at most about ``k`` (a ``[1, n]`` view would keep ``min(n, k_in)``). The padding's rows
    of ``P_out (x) P_in`` meet only zeros.
    """
    if projection.kind != "kronecker":
        return None
    if is_matrix(shape):
        return shape[0], math.prod(shape[1:])
    n = math.prod(shape)
    if projection.vectors != "kronecker" or n == 0:
        return None
    d_in = math.isqrt(n - 1) + 1  # ceil(sqrt(n))
    return -(-n // d_in), d_in
