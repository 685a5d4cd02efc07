"""Condition numbers of a curvature's damped solves, and the damping that keeps them meaningful.

Curvature-aware scores solve ``(H_c + lambda_c I) x = g`` per checkpoint. A solve amplifies the
relative error of its input by up to its condition number ``kappa = (s_max + lambda) /
(s_min + lambda)``, and the gradients it is applied to, like the store's rows and the scores,
are float32: rounded to a relative ``eps32 / 2`` (``eps32 = 2^-23 = 1.19e-7``). Once ``kappa``
reaches ``1 / eps32 = 8.4e6`` that rounding alone can be as large as the answer, so the scores
carry no information (a rank-deficient Fisher with ``lambda = 0`` has ``kappa`` of 1e16 or
infinite, and its scores reach 1e17). Such a solve is refused (:class:`IllConditionedError`)
with the smallest damping that brings ``kappa`` to ``MAX_CONDITION``. No safety factor: the
bound is already a worst case, and the defaults stay far below it (``kappa <= 1 + dim / scale``
for ``"dense"`` and ``"projected"``).

Each system solved on its own has its own ``kappa``: the whole matrix (``"dense"``,
``"projected"``), each per-layer block (block-diagonal ``"projected"``), each layer's
``S (x) A + lambda I`` (``"kfac"``: eigenvalues ``s_i a_j + lambda``) or ``eigen + lambda``
(``"ekfac"``). A cheap bound (the largest eigenvalue is at most the trace) settles the usual
case without an eigendecomposition.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from tracinfunc.curvature.capture import KfacLayer

__all__ = ["MAX_CONDITION", "RANK_TOLERANCE", "System", "condition", "minimal_damping",
           "rank_mean", "round_up", "spectrum", "systems"]

# An eigenvalue counts towards the rank above this fraction of the largest one (float64
# spectra of float32-sized data: what is below is rounding).
RANK_TOLERANCE = 1e-10

MAX_CONDITION = 1 / torch.finfo(torch.float32).eps  # 8.39e6

# One solve: lambda -> its condition number; ``bound`` never under it, ``exact`` the value.
System = tuple[Callable[[float], float], Callable[[], Callable[[float], float]]]


def systems(kind: str, estimate: Mapping[str, Tensor], layers: Sequence[KfacLayer],
            n_blocks: int) -> list[System]:
    """``(bound, exact)`` per system solved at one checkpoint; ``exact()`` decomposes."""
    if kind == "ekfac":
        return [_eigen_system(estimate[f"{layer.weight}:eigen"]) for layer in layers]
    if kind == "kfac":
        return [_kron_system(estimate[f"{layer.weight}:A"], estimate[f"{layer.weight}:S"])
                for layer in layers]
    names = [f"block:{i}" for i in range(n_blocks)] if n_blocks else ["matrix"]
    return [_matrix_system(estimate[name]) for name in names]


def condition(checks: list[System], damping: float, *, exact: bool = False) -> float:
    """The largest condition number of the systems at ``damping`` (``inf`` for a singular or
    non-finite one). Not ``exact``: a system whose cheap bound is within ``MAX_CONDITION``
    reports the bound (enough to accept it) and is never decomposed."""
    worst = 0.0
    for bound, make in checks:
        kappa = math.inf if exact else bound(damping)
        if not kappa <= MAX_CONDITION:
            kappa = make()(damping)
        worst = max(worst, kappa) if not math.isnan(kappa) else math.inf
    return worst


def minimal_damping(checks: list[System]) -> float:
    """The smallest ``lambda`` (2 significant digits, rounded up) whose condition number is at
    most ``MAX_CONDITION``; ``inf`` where none is (a non-finite estimate)."""
    exact = [make() for _, make in checks]

    def ok(damping: float) -> bool:
        return all(fn(damping) <= MAX_CONDITION for fn in exact)

    high = 1e-300
    while not ok(high):
        high *= 10.0
        if high > 1e300:
            return math.inf
    low = high / 10.0
    for _ in range(60):  # bisection on a log scale
        middle = math.sqrt(low * high)
        low, high = (low, middle) if ok(middle) else (middle, high)
    return round_up(high)


def round_up(value: float) -> float:
    """``value`` rounded up to 2 significant digits (a suggestion that still passes)."""
    if not math.isfinite(value) or value <= 0:
        return value
    digits = 10.0 ** (math.floor(math.log10(value)) - 1)
    return float(f"{math.ceil(value / digits * (1 - 1e-12)) * digits:.2g}") or value


def spectrum(kind: str, estimate: Mapping[str, Tensor], layers: Sequence[KfacLayer],
             n_blocks: int) -> Tensor:
    """Every eigenvalue of one checkpoint's undamped estimate, ``[dim]`` float64: the matrix's
    (or each block's), K-FAC's ``s_i a_j`` per layer, or EK-FAC's refitted ones."""
    if kind == "ekfac":
        return torch.cat([estimate[f"{layer.weight}:eigen"].reshape(-1) for layer in layers])
    if kind == "kfac":
        parts = []
        for layer in layers:
            a, s = estimate[f"{layer.weight}:A"], estimate[f"{layer.weight}:S"]
            values_a = a if a.dim() == 1 else _eigenvalues(a)
            parts.append(torch.outer(_eigenvalues(s), values_a).reshape(-1))
        return torch.cat(parts)
    names = [f"block:{i}" for i in range(n_blocks)] if n_blocks else ["matrix"]
    return torch.cat([_eigenvalues(estimate[name]) for name in names])


def rank_mean(values: Tensor) -> tuple[float, int]:
    """``(trace / rank, rank)``: the mean of the eigenvalues above ``RANK_TOLERANCE`` times the
    largest (``(0.0, 0)`` for a zero estimate, ``(nan, 0)`` for a non-finite one)."""
    if not bool(values.isfinite().all()):
        return math.nan, 0
    top = float(values.max()) if values.numel() else 0.0
    if top <= 0:
        return 0.0, 0
    kept = values[values > RANK_TOLERANCE * top]
    return float(kept.sum()) / kept.numel(), int(kept.numel())


def _ratio(low: float, high: float, shift: float) -> float:
    denominator = low + shift
    if math.isnan(low) or math.isnan(high) or math.isinf(high):
        return math.inf
    return math.inf if denominator <= 0 else (high + shift) / denominator


def _matrix_system(matrix: Tensor) -> System:
    trace = float(matrix.trace())

    @functools.cache
    def exact() -> Callable[[float], float]:
        if not bool(torch.isfinite(matrix).all()):
            return lambda damping: math.inf
        values = _eigenvalues(matrix)
        low, high = float(values[0]), float(values[-1])
        return lambda damping: _ratio(low, high, damping)

    return (lambda damping: _ratio(0.0, trace, damping)), exact


def _eigen_system(eigen: Tensor) -> System:
    low, high = float(eigen.min()), float(eigen.max())
    return (lambda damping: _ratio(low, high, damping)), (lambda: lambda d: _ratio(low, high, d))


def _kron_system(a: Tensor, s: Tensor) -> System:
    """K-FAC's ``S (x) A + lambda I``: eigenvalues ``s_i a_j``, so its condition number is
    ``(s_max a_max + lambda) / (s_min a_min + lambda)`` (both factors are PSD)."""
    trace_a = float(a.sum() if a.dim() == 1 else a.trace())
    trace_s = float(s.trace())

    @functools.cache
    def exact() -> Callable[[float], float]:
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(s).all())):
            return lambda damping: math.inf
        values_a = a if a.dim() == 1 else _eigenvalues(a)
        values_s = _eigenvalues(s)
        products = torch.outer(values_s, values_a)
        low, high = float(products.min()), float(products.max())
        return lambda damping: _ratio(low, high, damping)

    return (lambda damping: _ratio(0.0, trace_a * trace_s, damping)), exact


def _eigenvalues(matrix: Tensor) -> Tensor:
    """Ascending eigenvalues of a symmetric matrix; ``[nan]`` (refused as singular) where the
    solver does not converge, rather than its raw error."""
    try:
        return torch.linalg.eigvalsh(matrix)
    except torch.linalg.LinAlgError:
        return torch.tensor([torch.nan], dtype=torch.float64)
