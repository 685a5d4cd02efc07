"""K-FAC and EK-FAC: per-layer Kronecker factors of the Fisher and their damped inverses.

For a layer with per-example gradient ``G = delta^T [x, 1]`` ``[d_out, d_a]`` (``d_a = d_in``
plus a bias column), K-FAC approximates the layer's block of the Fisher by ``A (x) S`` with
``A = E[x x^T]`` (mean over tokens) and ``S = E[sum_t delta delta^T]``, so that
``(A (x) S)^-1 vec(G) = vec(S^-1 G A^-1)``. Damping ``lambda`` is split between the factors as
``(A + pi sqrt(lambda) I) (x) (S + sqrt(lambda) / pi I)`` with ``pi^2 = (tr A / d_a) /
(tr S / d_out)`` (Martens & Grosse, 2015), which keeps the Kronecker form: a query is
preconditioned as ``(delta S'^-1)^T (x A'^-1)``, so a Kronecker projection stays factored.

EK-FAC (George et al., 2018) keeps K-FAC's eigenbases ``A = Q_A L_A Q_A^T``,
``S = Q_S L_S Q_S^T`` but refits the eigenvalues, ``E[(Q_S^T G Q_A)^2]`` (a second pass), and
damps them exactly: ``G -> Q_S [(Q_S^T G Q_A) / (L + lambda)] Q_A^T``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tracinfunc.curvature.capture import KfacLayer

__all__ = ["accumulate_eigenvalues", "accumulate_factors", "augmented", "ekfac_mean_eigenvalue",
           "factor_inverses", "kfac_mean_eigenvalue", "precondition_ekfac", "precondition_kfac"]


def augmented(x: Tensor, layer: KfacLayer) -> Tensor:
    """``[..., d_in] -> [..., d_a]``: a column of ones for the bias, float64."""
    x = x.double()
    if layer.bias is None:
        return x
    return torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)


def accumulate_factors(sums: dict[str, Tensor], io: list[tuple[Tensor, Tensor]],
                       layers: list[KfacLayer], weights: Tensor) -> None:
    """Add one labelled batch's weighted ``A`` and ``S`` sums into ``sums`` (float64).

    Args:
        io: Per layer ``(x [b, T, d_in], delta [b, T, d_out])``.
        weights: ``[b]``, each input's weights summing to 1.
    """
    for layer, (x, delta) in zip(layers, io, strict=True):
        xa, d = augmented(x, layer), delta.double()
        w = weights.to(xa.device, torch.float64)[:, None, None]
        a = torch.einsum("bti,btj->ij", xa * (w / xa.shape[1]), xa)  # [d_a, d_a]
        s = torch.einsum("bti,btj->ij", d * w, d)  # [d_out, d_out]
        for key, value in ((f"{layer.weight}:A", a), (f"{layer.weight}:S", s)):
            sums[key] = sums[key] + value.cpu() if key in sums else value.cpu()


def eigenbases(estimate: dict[str, Tensor], layers: list[KfacLayer]) -> dict[str, Tensor]:
    """``{weight:QA, weight:QS}`` eigenvectors of each layer's factors."""
    out = {}
    for layer in layers:
        for side in ("A", "S"):
            _, vectors = torch.linalg.eigh(estimate[f"{layer.weight}:{side}"])
            out[f"{layer.weight}:Q{side}"] = vectors
    return out


def accumulate_eigenvalues(sums: dict[str, Tensor], io: list[tuple[Tensor, Tensor]],
                           layers: list[KfacLayer], weights: Tensor,
                           bases: dict[str, Tensor]) -> None:
    """Add one batch's weighted ``(Q_S^T G Q_A)^2`` ``[d_out, d_a]`` per layer into ``sums``."""
    for layer, (x, delta) in zip(layers, io, strict=True):
        q_a = bases[f"{layer.weight}:QA"].to(x.device)
        q_s = bases[f"{layer.weight}:QS"].to(x.device)
        xq, dq = augmented(x, layer) @ q_a, delta.double() @ q_s  # [b, T, d_a], [b, T, d_out]
        rotated = torch.einsum("bto,bti->boi", dq, xq)  # [b, d_out, d_a]
        w = weights.to(x.device, torch.float64)[:, None, None]
        value = (rotated.square() * w).sum(0).cpu()
        key = f"{layer.weight}:eigen"
        sums[key] = sums[key] + value if key in sums else value


def kfac_mean_eigenvalue(estimate: dict[str, Tensor], layers: list[KfacLayer]) -> float:
    """Mean eigenvalue of the block-diagonal ``A (x) S``: ``sum tr A tr S / sum d_a d_out``."""
    trace = sum(float(estimate[f"{layer.weight}:A"].trace() * estimate[f"{layer.weight}:S"].trace())
                for layer in layers)
    return trace / sum(layer.d_a * layer.d_out for layer in layers)


def ekfac_mean_eigenvalue(estimate: dict[str, Tensor], layers: list[KfacLayer]) -> float:
    return sum(float(estimate[f"{layer.weight}:eigen"].sum()) for layer in layers) / sum(
        layer.d_a * layer.d_out for layer in layers)


def factor_inverses(estimate: dict[str, Tensor], layer: KfacLayer, damping: float
                    ) -> tuple[Tensor, Tensor]:
    """``((S + lambda_S I)^-1 [d_out, d_out], (A + lambda_A I)^-1 [d_a, d_a])``, float64."""
    a, s = estimate[f"{layer.weight}:A"], estimate[f"{layer.weight}:S"]
    mean_a, mean_s = float(a.trace()) / a.shape[0], float(s.trace()) / s.shape[0]
    pi = math.sqrt(mean_a / mean_s) if mean_a > 0 and mean_s > 0 else 1.0
    root = math.sqrt(damping)
    eye_a = torch.eye(a.shape[0], dtype=a.dtype)
    eye_s = torch.eye(s.shape[0], dtype=s.dtype)
    return (torch.linalg.inv(s + (root / pi) * eye_s), torch.linalg.inv(a + (root * pi) * eye_a))


def precondition_kfac(matrix: Tensor, inverses: tuple[Tensor, Tensor]) -> Tensor:
    """``S'^-1 G A'^-1`` for ``G [b, d_out, d_a]``."""
    s_inv, a_inv = (m.to(matrix.device) for m in inverses)
    return s_inv @ matrix @ a_inv


def precondition_ekfac(matrix: Tensor, estimate: dict[str, Tensor], layer: KfacLayer,
                       damping: float) -> Tensor:
    """``Q_S [(Q_S^T G Q_A) / (eigen + lambda)] Q_A^T`` for ``G [b, d_out, d_a]``."""
    q_a = estimate[f"{layer.weight}:QA"].to(matrix.device)
    q_s = estimate[f"{layer.weight}:QS"].to(matrix.device)
    eigen = estimate[f"{layer.weight}:eigen"].to(matrix.device)
    rotated = q_s.T @ matrix @ q_a
    return q_s @ (rotated / (eigen + damping)) @ q_a.T
