"""Adam's second moment in factored (Adafactor) form, so preconditioning stays factorised.

A per-element preconditioner ``g / sqrt(S)`` (``S [r, c]`` positive, a weight's stored layout
with trailing dimensions flattened) does not factorise over a layer's gradient
``G = left.T @ right``. Adafactor's estimate (Shazeer and Stern, 2018; bergson's normaliser)
keeps only the row sums ``r = S 1`` and column sums ``c = 1^T S``::

    S ~ r c^T / sum(r),   1 / sqrt(S) ~ a b^T,   a = sqrt(sum(r)) / sqrt(r),   b = 1 / sqrt(c)

and ``G * (a b^T) = diag(a) G diag(b) = (left diag(a)).T @ (right diag(b))``: the
preconditioned block ``P_r.T (G * a b^T) P_c`` only rescales the rows of the Kronecker side
projections, ``(diag(a) P_r, diag(b) P_c)``, so the factorised path's cost is unchanged.

``S`` is ``v + eps`` for TrackStar. For Adam (LESS) the example's own ``(1 - b2) g**2`` term of
the new second moment is left out (so the update direction is linear in ``g``):
``S = (sqrt(b2 v / (1 - b2**t)) + eps)**2`` and the direction is
``(1 - b1) / (1 - b1**t) * g / sqrt(S) + b1 m / (1 - b1**t) / sqrt(S)``, the second term a
constant that every example shares. Vectors (biases, norms) keep the exact diagonal.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["FactoredTerms", "adafactor_inverse_root", "factored_terms"]

FactoredTerms = tuple[Tensor, Tensor, float, Tensor | None]
"""``(a [r], b [c], g_scale, offset [r, c] or None)``: the preconditioned gradient of
``g [r, c]`` is ``g_scale * a[:, None] * g * b[None, :] + offset``."""


def adafactor_inverse_root(second: Tensor) -> tuple[Tensor, Tensor]:
    """``(a [r], b [c])`` with ``a_i b_j = 1 / sqrt(r_i c_j / sum(r))`` for ``second [r, c]``.

    Args:
        second: A positive second moment ``[r, c]``.
    """
    rows, cols = second.sum(dim=1), second.sum(dim=0)  # [r], [c]
    return torch.rsqrt(rows) * rows.sum().sqrt(), torch.rsqrt(cols)


def factored_terms(kind: str, state, like: Tensor) -> FactoredTerms:
    """The factored preconditioner of one matrix parameter, on ``like``'s device and dtype.

    Args:
        kind: ``"adam"`` or ``"trackstar"``.
        state: Its :class:`~tracinfunc.precondition.optimizer.AdamState`.
        like: A tensor of the wanted device and dtype.
    """
    shape = state.exp_avg_sq.shape
    v = state.exp_avg_sq.to(device=like.device, dtype=like.dtype).reshape(shape[0], -1)
    if kind == "trackstar":
        a, b = adafactor_inverse_root(v + state.eps)
        return a, b, 1.0, None
    t = state.step + 1
    second = (v * (state.beta2 / (1 - state.beta2**t))).sqrt_().add_(state.eps).square_()
    a, b = adafactor_inverse_root(second)
    m = state.exp_avg.to(device=like.device, dtype=like.dtype).reshape(shape[0], -1)
    offset = m * (state.beta1 / (1 - state.beta1**t)) * a[:, None] * b[None, :]
    return a, b, (1 - state.beta1) / (1 - state.beta1**t), offset


def apply_factored(terms: FactoredTerms, g: Tensor) -> Tensor:
    """``g`` (a matrix parameter's shape) preconditioned by ``terms`` (safe inside vmap)."""
    a, b, g_scale, offset = terms
    flat = g.reshape(a.shape[0], -1) * (a[:, None] * b[None, :]) * g_scale
    if offset is not None:
        flat = flat + offset
    return flat.reshape(g.shape)


def is_factored(shape) -> bool:
    """Matrices (two or more dimensions) are factored; vectors keep the exact diagonal."""
    return len(shape) >= 2 and math.prod(shape) > 0


def preconditioned_sides(terms: FactoredTerms, p_rows: Tensor, p_cols: Tensor, scale: float
                         ) -> tuple[Tensor, Tensor, Tensor | None]:
    """Kronecker side projections that precondition as they project.

    Args:
        terms: :func:`factored_terms` of the parameter.
        p_rows, p_cols: Its side projections ``[r, k_r]``, ``[c, k_c]``.
        scale: The projection's overall scale (``1 / sqrt(k)``).

    Returns:
        ``(g_scale diag(a) P_r, diag(b) P_c, offset row [k_r * k_c] or None)``: the projected
        preconditioned gradient of ``G`` is ``(P_r'.T G P_c') * scale + offset row``.
    """
    a, b, g_scale, offset = terms
    row = None if offset is None else (p_rows.T @ offset @ p_cols).reshape(-1) * scale
    return p_rows * (a * g_scale)[:, None], p_cols * b[:, None], row
