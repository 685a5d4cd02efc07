"""Refinement: solving ``(H_c + lambda_c I) x = g`` with the sampled Fisher itself.

A fitted curvature (K-FAC, EK-FAC, dense) is an approximation of the Gauss-Newton (true
Fisher) matrix ``H_c``; its damped inverse is cheap and close. Refinement solves the damped
system of the Fisher itself, over a fixed sample of training batches with labels drawn once
by the same sampler :func:`~tracinfunc.fit_curvature` uses. Three solvers (``solver=``):

- ``"cg"`` (the default): a few steps of conjugate gradient preconditioned by the fitted
  inverse (starting from its answer), each query until its relative residual is at most the
  tolerance (at most ``steps`` steps).
- ``"direct"``: exactly, where the sampled Fisher is kept in memory (``G [m, p]`` or
  ``H [p, p]``): a Cholesky factor per checkpoint and damping, made once and kept
  (:class:`~tracinfunc.curvature.fisher.KeptFisher`); a query costs about two Fisher-vector
  products. The exact answer of a small sample's Fisher can attribute worse than a few steps
  from the fitted curvature (measured: ``docs/curvature.md``), so it is asked for, not chosen.
- ``"neumann"``: ASTRA-style preconditioned Neumann (Richardson) iterations (Wang et al.,
  2025), ``x <- x + eta M (g - (H_B + lambda I) x)`` from ``x_0 = M g``, where ``H_B`` is the
  Fisher of a few of the refinement's batches drawn afresh at every step
  (``batches_per_step``; all of them: deterministic). Unlike conjugate gradient it stays
  stable when each step sees a different sample, so each step can cost a fraction of a full
  product; :func:`neumann_flat`.

Fisher-vector
products ``H v = (1 / sum w) sum_j w_j g_j (g_j . v)`` never form ``H``: two matrix products
with the per-example gradients ``G``, computed once per checkpoint and kept while they fit
:data:`~tracinfunc.curvature.fisher.GRADIENT_BUDGET`, else functionally (a jvp and a vjp of the
per-example losses per step); :mod:`tracinfunc.curvature.fisher`. One product serves a whole
batch of queries. With ``fisher="expected"`` the matrix is the sampled Fisher's expectation
over the labels instead, each product a jvp and a vjp of the logits
(:mod:`tracinfunc.curvature.expected`; no direct solve).

Made by :meth:`Curvature.with_refinement`; applied by :func:`preconditioned_test_grads` (hence
``score``, ``top_k``, ``indexed_top_k`` and the CLI, through the marked test gradients).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map

from tracinfunc._validate import check_int, current_caller
from tracinfunc.batches import iter_batches
from tracinfunc.curvature.fisher import FORWARD_AD_LOCK, fisher_product
from tracinfunc.curvature.flat import flat_map, flatten, unflatten
from tracinfunc.errors import (
    EmptyDataError,
    IllConditionedError,
    InvalidArgumentError,
    NonFiniteGradientError,
)
from tracinfunc.types import Batch

__all__ = ["FISHERS", "FORWARD_AD_LOCK", "SOLVERS", "Refinement", "check_neumann",
           "check_refinable", "data_digest", "direct_solve", "finite_rows", "fisher_product",
           "kept_batches", "largest_eigenvalue", "neumann_flat", "neumann_step", "pcg",
           "pcg_flat", "sampled_largest", "warn_unconverged"]

Vectors = dict[str, Tensor]  # {name: [t, *shape]}: t vectors in parameter space


@dataclass(frozen=True, eq=False)
class Refinement:
    """How queries are refined (held by a :class:`~tracinfunc.Curvature`).

    Attributes:
        steps: Conjugate-gradient steps per query at most (``>= 1``; unused by a direct solve).
        batches: The training batches the Fisher-vector products average over (a list).
        sampler: Draws their labels (``None``: the loss's default sampler).
        seed: Seeds the label draws (``seed + checkpoint position``).
        tolerance: A query stops once its relative residual ``||g - (H + l I) x|| / ||g||``
            is at most this; one still above it after ``steps`` is reported (a
            ``RuntimeWarning``) as not converged.
        digest: SHA-256 of the batches' tensors (part of the curvature's digest).
        solver: ``"cg"``, ``"direct"`` or ``"neumann"`` (:data:`SOLVERS`).
        fisher: ``"sampled"`` (labels drawn by ``sampler``) or ``"expected"`` (its
            expectation over the labels, exactly: :mod:`tracinfunc.curvature.expected`)
            (:data:`FISHERS`).
        gradients: Per checkpoint, the sampled Fisher the products and direct solves use
            (:class:`~tracinfunc.curvature.fisher.KeptFisher`; filled by the first refined
            query, shared by every curvature made from this one by ``with_damping``; not part
            of the digest).
        largest: Per checkpoint (the same keys), the sampled Fisher's largest eigenvalue
            (:func:`sampled_largest`), for the condition rule at every damping.
        step_size: The Neumann solver's ``eta`` (``None``: :func:`neumann_step` at the query,
            per checkpoint and damping; ``solver="neumann"`` only).
        batches_per_step: The Neumann solver's batches per product, drawn at every step
            (``None``: all of them).
    """

    steps: int
    batches: tuple[Batch, ...]
    sampler: Any = None
    seed: int = 0
    tolerance: float = 1e-2
    digest: str = field(default="")
    solver: str = "cg"
    fisher: str = "sampled"
    gradients: dict = field(default_factory=dict, repr=False, compare=False)
    largest: dict = field(default_factory=dict, repr=False, compare=False)
    step_size: float | None = None
    batches_per_step: int | None = None

    def describe(self) -> dict[str, Any]:
        """JSON types for the curvature's metadata (no tensors)."""
        described = {"steps": self.steps, "n_batches": len(self.batches), "seed": self.seed,
                     "tolerance": self.tolerance, "data": self.digest, "solver": self.solver,
                     "fisher": self.fisher,
                     "sampler": None if self.sampler is None else repr(self.sampler)}
        if self.solver == "neumann":  # only here: other solvers' digests stay as they were
            described.update(step_size=self.step_size, batches_per_step=self.batches_per_step)
        return described

    def draws(self, ckpt: int) -> list[list[int] | None]:
        """The Neumann solver's batches for each product at checkpoint position ``ckpt``: the
        first (the start's residual) and one per step, ``steps + 1`` lists of sorted batch
        indices (``None``: all). Drawn from ``seed`` and ``ckpt`` alone, so a query's answer
        does not depend on the queries solved with it."""
        n = len(self.batches)
        if self.batches_per_step is None or self.batches_per_step >= n:
            return [None] * (self.steps + 1)
        # its own stream (the label draws use seed + ckpt): the salt keeps the two apart
        generator = torch.Generator().manual_seed(
            (_DRAW_SALT + self.seed * 1_000_003 + ckpt) % 2**63)  # within torch's seeds
        return [sorted(torch.randperm(n, generator=generator)[:self.batches_per_step].tolist())
                for _ in range(self.steps + 1)]


SOLVERS = ("cg", "direct", "neumann")  # Refinement.solver: see the module's docstring
_DRAW_SALT = 0x5EED_0A57  # Refinement.draws' generator: apart from the label draws' seeds
FISHERS = ("sampled", "expected")  # Refinement.fisher: the matrix solved


def check_neumann(solver: str, step_size: Any, batches_per_step: Any, n_batches: int
                  ) -> tuple[float | None, int | None]:
    """The Neumann solver's ``(step_size, batches_per_step)`` checked (``None``: chosen at the
    query by :func:`neumann_step`, and every batch); ``(None, None)`` for the other solvers,
    which refuse either being given."""
    if solver != "neumann":
        given = [f"{name}={value!r}" for name, value in (("step_size", step_size),
                 ("batches_per_step", batches_per_step)) if value is not None]
        if given:
            raise InvalidArgumentError(
                f"{current_caller()}: {' and '.join(given)} "
                f"{'belongs' if len(given) == 1 else 'belong'} to solver='neumann' (the "
                f"Neumann iterations' step and sample), but solver={solver!r}; pass "
                "solver='neumann' with them, or drop them.")
        return None, None
    if step_size is not None and (
            isinstance(step_size, bool) or not isinstance(step_size, int | float)
            or not math.isfinite(step_size) or not 0 < step_size <= 2):
        raise InvalidArgumentError(
            f"{current_caller()}: step_size must be None (chosen from the preconditioned "
            "Fisher's largest eigenvalue) or a float in (0, 2] (the Neumann iterations diverge "
            f"beyond 2 even with an exact preconditioner), got {step_size!r}; e.g. "
            "step_size=0.5.")
    if batches_per_step is not None:
        batches_per_step = check_int(batches_per_step, "batches_per_step", minimum=1,
                                     fix="e.g. batches_per_step=4, or None for all batches")
        if batches_per_step > n_batches:
            raise InvalidArgumentError(
                f"{current_caller()}: batches_per_step={batches_per_step} is more than the "
                f"{n_batches} batch(es) of the refinement data; pass at most {n_batches}, or "
                "None for every batch at every step (smaller batches in data give smaller "
                "steps).")
    return (None if step_size is None else float(step_size)), batches_per_step


def kept_batches(data: Batch | Iterable[Batch], max_examples: int | None
                 ) -> tuple[Batch, ...]:
    """Copies of the batches of ``data`` (cut after ``max_examples`` inputs); refuses none."""
    kept, left = [], max_examples
    for batch in iter_batches(data):
        size = next(leaf for leaf in tree_leaves(batch) if isinstance(leaf, Tensor)).shape[0]
        if size == 0:  # a zero-row batch holds no examples: skipped, so all-empty is refused
            continue
        if left is not None:
            if left <= 0:
                break
            if size > left:
                batch = tree_map(lambda x, n=left: x[:n] if isinstance(x, Tensor) else x, batch)
            left -= min(size, left)
        # a copy: the refinement reads these at its first query (and again at every query when
        # its gradients are not kept), so data changed in place, or a loader that refills one
        # buffer, must not reach it
        kept.append(tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, batch))
    if not kept:
        raise EmptyDataError(f"{current_caller()}: data holds no training examples to refine "
                             "with; pass training batches (or a sample of them).")
    return tuple(kept)


def data_digest(batches: Iterable[Batch]) -> str:
    """SHA-256 over every tensor leaf's shape, dtype and bytes (other leaves by ``repr``)."""
    h = hashlib.sha256()
    for batch in batches:
        for leaf in tree_leaves(batch):
            if isinstance(leaf, Tensor):
                value = leaf.detach().cpu().contiguous()
                h.update(f"{tuple(value.shape)}|{value.dtype}|".encode())
                h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(leaf).encode())
    return h.hexdigest()


def pcg(product: Callable[[Vectors], Vectors], precondition: Callable[[Vectors], Vectors],
        damping: float, rhs: Vectors, steps: int, tolerance: float = 0.0
        ) -> tuple[Vectors, Tensor]:
    """:func:`pcg_flat` on named vectors ``{name: [t, *shape]}`` (flattened once, in and out).

    Returns:
        ``(x {name: [t, *shape]} float64, residuals [taken + 1, t])``.
    """
    layout = tuple((name, tuple(value.shape[1:])) for name, value in rhs.items())
    x, residuals = pcg_flat(flat_map(product, layout), flat_map(precondition, layout),
                            damping, flatten(rhs, layout).double(), steps, tolerance)
    return unflatten(x, layout), residuals


def pcg_flat(product: Callable[[Tensor], Tensor], precondition: Callable[[Tensor], Tensor],
             damping: float, rhs: Tensor, steps: int, tolerance: float = 0.0
             ) -> tuple[Tensor, Tensor]:
    """Preconditioned conjugate gradient on ``(H + damping I) x = rhs``, ``t`` systems at once.

    Every vector is a row of one float64 tensor ``[t, p]`` (no per-parameter loop per step).
    Starts from ``x_0 = M rhs`` (``M``: the fitted damped inverse), so zero steps return the
    fitted curvature's answer. A system stops (its ``x`` kept) once its relative residual is
    at most ``tolerance``; all stop after ``steps`` steps or once every one has. A system's
    answer does not depend on the others solved with it.

    Args:
        product: ``[t, p] -> H [t, p]`` (``t`` may be any subset's size).
        precondition: ``[t, p] -> M [t, p]``.
        rhs: ``[t, p]``.

    Returns:
        ``(x [t, p] float64, residuals [taken + 1, t])``: the relative residual
        ``||rhs - (H + l I) x_i|| / ||rhs||`` after each step taken (``0`` for a zero ``rhs``).

    Raises:
        NonFiniteGradientError: a product or the solution is NaN or infinite.
    """
    rhs = rhs.double()
    norm = _norm(rhs)
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))

    def apply(x: Tensor, active: Tensor) -> Tensor:  # (H + damping I) x, a new tensor
        if bool(active.all()):
            return _owned(product(x), x).add_(x, alpha=damping)
        rows = active.nonzero().reshape(-1)  # only the systems still running
        part = x[rows]
        return torch.zeros_like(x).index_copy_(0, rows, _owned(product(part), part).add_(
            part, alpha=damping))

    # x, the residual and the direction are this loop's own tensors, updated in place (the
    # same arithmetic as out of place, without a new [t, p] tensor per operation)
    x = _owned(precondition(rhs), rhs)
    residual = rhs - apply(x, torch.ones_like(norm, dtype=torch.bool))
    history = [_norm(residual) / safe]
    active = history[-1] > tolerance  # NaN: stopped here, refused below
    direction: Tensor | None = None
    rz = torch.zeros_like(norm)
    for _ in range(steps):
        if not bool(active.any()):
            break
        # M r only for a step that follows (none after the last one)
        z = _owned(precondition(residual), residual)
        rz_next = _dot(residual, z)
        if direction is None:
            direction = z
        else:
            beta = torch.where(rz > 0, rz_next / torch.where(rz > 0, rz, 1.0), 0.0)
            direction = z.addcmul_(beta[:, None], direction)
        rz = rz_next
        applied = apply(direction, active)
        curvature = _dot(direction, applied)
        moving = active & (curvature > 0)
        alpha = torch.where(moving, rz / torch.where(moving, curvature, 1.0), 0.0)[:, None]
        x.addcmul_(alpha, direction)
        residual.addcmul_(alpha, applied, value=-1.0)
        history.append(_norm(residual) / safe)
        active = active & (history[-1] > tolerance)
    residuals = torch.stack(history)
    _check_solution(x, residuals, "a Fisher-vector product over the refinement data")
    return x, residuals


def neumann_flat(product: Callable[..., Tensor], precondition: Callable[[Tensor], Tensor],
                 damping: float, rhs: Tensor, steps: int, tolerance: float = 0.0, *,
                 step_size: float = 1.0, draws: list[list[int] | None] | None = None
                 ) -> tuple[Tensor, Tensor]:
    """Preconditioned Neumann (Richardson) iterations on ``(H + damping I) x = rhs``, ``t``
    systems at once, ASTRA-style: ``x_{s+1} = x_s + step_size M r_s`` with ``r_s = rhs -
    (H_s + damping I) x_s``, from ``x_0 = M rhs``.

    ``H_s`` is the Fisher of the batches ``draws[s]`` (``product(x, batches=draws[s])``; ``None``
    or no ``draws``: all of them, and the iteration is deterministic). With the same batches
    every step it converges to the solve when ``step_size`` is below ``2 / lambda_max(M (H +
    damping I))``; with batches drawn afresh it is a stochastic approximation of it, whose
    expectation is the full product's (the Neumann series' terms are linear in ``H_s``). A
    system stops once its residual (measured on the step's batches) is at most ``tolerance``.

    Args:
        product: ``([t, p], batches=) -> H [t, p]`` (``t`` may be any subset's size).
        precondition: ``[t, p] -> M [t, p]``.
        rhs: ``[t, p]``.
        draws: ``steps + 1`` batch choices (:meth:`Refinement.draws`): the start's residual's
            and each step's.

    Returns:
        ``(x [t, p] float64, residuals [taken + 1, t])``: the relative residual ``||rhs - (H_s
        + l I) x_s|| / ||rhs||`` at the start and after each step taken (``0`` for a zero
        ``rhs``), each measured with that step's batches.

    Raises:
        NonFiniteGradientError: a product or the solution is NaN or infinite (a step size
            that diverges ends here or in a residual that grows, reported as not converged).
    """
    draws = draws if draws is not None else [None] * (steps + 1)
    rhs = rhs.double()
    norm = _norm(rhs)
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))

    def residual_of(x: Tensor, rows: Tensor, batches: list[int] | None) -> Tensor:
        part = x[rows]  # only the systems still running
        return rhs[rows] - _owned(product(part, batches=batches), part).add_(part,
                                                                             alpha=damping)

    everyone = torch.arange(rhs.shape[0], device=rhs.device)
    x = _owned(precondition(rhs), rhs)
    residual = residual_of(x, everyone, draws[0])
    history = [_norm(residual) / safe]
    active = history[-1] > tolerance  # NaN: stopped here, refused below
    for step in range(1, steps + 1):
        if not bool(active.any()):
            break
        rows = active.nonzero().reshape(-1)
        x.index_add_(0, rows, _owned(precondition(residual[rows]), residual),
                     alpha=step_size)
        residual[rows] = residual_of(x, rows, draws[step])
        history.append(_norm(residual) / safe)
        active = active & (history[-1] > tolerance)
    residuals = torch.stack(history)
    _check_solution(x, residuals, "a Fisher-vector product over the refinement data")
    return x, residuals


def direct_solve(product: Callable[[Tensor], Tensor], damping: float, rhs: Tensor
                 ) -> tuple[Tensor, Tensor]:
    """``(H + damping I)^-1 rhs`` exactly by the kept Fisher of ``product`` (its ``kept``,
    :meth:`~tracinfunc.curvature.fisher.KeptFisher.solve`), ``t`` systems at once.

    Args:
        product: A kept product (:func:`~tracinfunc.curvature.fisher.checkpoint_product`).
        rhs: ``[t, p]``.

    Returns:
        ``(x [t, p] float64, residuals [1, t])``: the relative residual
        ``||rhs - (H + l I) x|| / ||rhs||`` (rounding only, unless the system is
        ill-conditioned; ``0`` for a zero ``rhs``).

    Raises:
        NonFiniteGradientError: the factor or the solution is NaN or infinite.
    """
    x, residuals = product.kept.solve(damping, rhs.double())
    residuals = residuals[None]
    _check_solution(x, residuals, "the sampled Fisher over the refinement data")
    return x, residuals


def _check_solution(x: Tensor, residuals: Tensor, source: str) -> None:
    """Refuse a solve whose answer ``x [t, p]`` or residuals are NaN or infinite, naming
    ``source`` (what was not finite) in the message."""
    if not (bool(residuals.isfinite().all()) and bool(finite_rows(x).all())):
        raise NonFiniteGradientError(
            f"{current_caller()}: the refined solve produced NaN or infinite values ({source} "
            "is not finite); check that data and the model at this checkpoint, or refine with "
            "other data.")


def warn_unconverged(residuals: Tensor, tolerance: float, checkpoint: str,
                     direct: bool = False, neumann: bool = False, drawn: bool = False) -> None:
    """A ``RuntimeWarning`` naming the worst final residual when it is above ``tolerance``
    (``direct``: of the direct solve, where only rounding leaves one; ``neumann``: of the
    Neumann solver, whose residual grows when its step size is too large; ``drawn``: its
    residuals are measured on each step's drawn batches, so they carry sampling noise and
    only a tenfold growth is called divergence)."""
    worst = float(residuals[-1].max()) if residuals.numel() else 0.0
    first = float(residuals[0].max()) if residuals.numel() else 0.0
    if worst > tolerance and neumann and worst > (10 * first if drawn else first):
        warnings.warn(
            f"{current_caller()}: the Neumann refinement at checkpoint {checkpoint!r} diverged: "
            f"its relative residual grew from {first:.3g} to {worst:.3g} in "
            f"{residuals.shape[0] - 1} steps; a smaller step_size (with_refinement("
            "step_size=...), on the command line --refine-step-size) or solver='cg' "
            "converges.", RuntimeWarning, stacklevel=3)
    elif worst > tolerance and direct:
        warnings.warn(
            f"{current_caller()}: the direct solve at checkpoint {checkpoint!r} left a relative "
            f"residual of {worst:.3g}, above the tolerance {tolerance:g}: the damped system is "
            "too ill-conditioned for float64 rounding at this damping; a larger damping "
            "(with_damping) solves it.", RuntimeWarning, stacklevel=3)
    elif worst > tolerance:
        noise = (" (measured on each step's drawn batches: it includes their sampling noise)"
                 if drawn else "")
        warnings.warn(
            f"{current_caller()}: refinement at checkpoint {checkpoint!r} stopped at a relative "
            f"residual of {worst:.3g} after {residuals.shape[0] - 1} steps (first "
            f"{first:.3g}){noise}, above the tolerance {tolerance:g}; more steps "
            "(with_refinement(steps=...), on the command line --refine-steps N) or a larger "
            "damping converge further.",
            RuntimeWarning, stacklevel=3)


def largest_eigenvalue(kind: str, estimate: Mapping[str, Tensor], layers) -> float:
    """The largest eigenvalue of a fitted estimate (``nan`` if it is not finite)."""
    if kind == "dense":
        return float(torch.linalg.eigvalsh(estimate["matrix"])[-1])
    if kind == "ekfac":
        return max(float(estimate[f"{layer.weight}:eigen"].max()) for layer in layers)
    top = []
    for layer in layers:
        a, s = estimate[f"{layer.weight}:A"], estimate[f"{layer.weight}:S"]
        top_a = float(a.max()) if a.dim() == 1 else float(torch.linalg.eigvalsh(a)[-1])
        top.append(top_a * float(torch.linalg.eigvalsh(s)[-1]))
    return max(top)


def check_refinable(largest: float, damping: float, checkpoint: str,
                    max_condition: float, every: tuple[float, ...] = (), *,
                    huge: bool = True, what: str = "the curvature",
                    solved: str = "the sampled Fisher") -> None:
    """Refuse a damping the refined system cannot use.

    The sampled Fisher is rank-deficient (a finite sample; a softmax's shift direction), so
    its damped system's condition number is ``(s_max + lambda) / lambda``: above
    ``max_condition`` (``lambda`` zero or tiny) the conjugate-gradient answer is rounding;
    with ``lambda * eps32 > s_max`` (huge) the curvature is below float32 rounding of
    ``lambda I`` and refinement changes nothing (checked only with ``huge``). ``every``:
    each checkpoint's largest eigenvalue, so the advised ``with_damping(X)`` (one lambda for
    all) passes at each. ``what`` names the matrix ``largest`` belongs to, in messages;
    ``solved`` the matrix the query solves with (which it checks again when ``what`` is not
    that matrix).
    """
    eps = torch.finfo(torch.float32).eps
    if not math.isfinite(largest):
        raise IllConditionedError(
            f"{current_caller()}: {what} at checkpoint {checkpoint!r} holds NaN or infinite "
            "values, so refining with it is meaningless; fit it again on finite data.")
    if damping <= 0 or (largest + damping) / damping > max_condition:
        need = _round_2g(max((largest, *every)) / (max_condition - 1) * (1 + 1e-6), up=True)
        raise IllConditionedError(
            f"{current_caller()}: refinement solves (H + lambda I) x = g with a Fisher H "
            f"that can be rank-deficient, so lambda must be positive: at checkpoint "
            f"{checkpoint!r} lambda = {damping:.3g} gives a condition number of "
            f"{(largest + damping) / damping if damping > 0 else math.inf:.3g} (largest "
            f"eigenvalue of {what} {largest:.3g}), above {max_condition:.3g}; use "
            f"with_damping({need!r}) or more, or Damping() for the default."
            + ("" if what == solved else f" (A query checks {solved}'s own largest "
               "eigenvalue too, which can be larger, and then advises again, for every "
               "checkpoint at once.)"))
    if huge and largest <= 0:  # a zero Fisher (e.g. one class): nothing to refine
        raise IllConditionedError(
            f"{current_caller()}: {what} at checkpoint {checkpoint!r} is zero (largest "
            f"eigenvalue {largest:.3g}), so every refined answer would be g / lambda: "
            "refinement would change nothing. Score without refinement, or check the model "
            "(an output with a single class has no curvature).")
    if huge and damping * eps > largest:
        positive = [value for value in (largest, *every) if value > 0]
        raise IllConditionedError(
            f"{current_caller()}: at checkpoint {checkpoint!r} lambda = {damping:.3g} is so "
            f"large that the curvature (largest eigenvalue {largest:.3g}) is below the float32 "
            f"rounding of lambda I: refinement would change nothing. Lower the damping (at "
            f"most {_round_2g(min(positive) / eps * (1 - 1e-6), up=False)!r}), or "
            "score without refinement.")


def sampled_largest(product: Callable[[Tensor], Tensor], p: int, device: Any = None,
                    iterations: int = 16) -> float:
    """The sampled Fisher's largest eigenvalue, by power iteration on its product (``[1, p]
    -> [1, p]``; a Rayleigh quotient, from below: within a few percent for the fast-decaying
    spectra of Fishers, and the condition rule's threshold is orders of magnitude away).
    ``nan`` if a product is not finite; ``0`` for a zero Fisher."""
    generator = torch.Generator().manual_seed(0)
    vector = torch.randn(1, p, dtype=torch.float64, generator=generator).to(device)
    vector /= vector.norm()
    value = 0.0
    for _ in range(iterations):
        image = product(vector)
        value = float((vector * image).sum())
        size = float(image.norm())
        if not math.isfinite(size) or not math.isfinite(value):
            return math.nan
        if size == 0:
            return 0.0
        vector = image / size
    return value


def neumann_step(product: Callable[..., Tensor], precondition: Callable[[Tensor], Tensor],
                 damping: float, p: int, device: Any = None, iterations: int = 16) -> float:
    """The Neumann solver's default step size, ``1 / lambda_max(M (H + damping I))``.

    ``lambda_max`` by power iteration (the full product): ``M (H + l I)`` is similar to the
    symmetric ``M^1/2 (H + l I) M^1/2``, so its eigenvalues are real and positive, and the
    estimate (from below) converges to the largest. With ``eta = 1 / lambda_max`` every error
    component shrinks by ``1 - eta lambda`` in ``[0, 1)``; the iterations converge while the
    estimate is above half the true value. A preconditioner that underestimates the curvature
    in some direction (``lambda_max > 2``: the fixed step ``1`` diverges) gets a smaller step.
    """
    generator = torch.Generator().manual_seed(0)
    vector = torch.randn(1, p, dtype=torch.float64, generator=generator).to(device)
    vector /= vector.norm()
    size = 1.0
    for _ in range(iterations):
        image = precondition(_owned(product(vector), vector).add_(vector, alpha=damping))
        size = float(image.norm())
        if not math.isfinite(size) or size == 0:
            raise NonFiniteGradientError(
                f"{current_caller()}: the Neumann step size could not be chosen: the "
                f"preconditioned Fisher-vector product is {'zero' if size == 0 else 'not finite'}"
                "; check the refinement data and the model at this checkpoint, or pass "
                "step_size= yourself.")
        vector = image / size
    return 1.0 / size


def _round_2g(value: float, *, up: bool) -> float:
    """``value`` to two significant digits, rounded up or down (so advice built on it passes)."""
    step = 10.0 ** (math.floor(math.log10(value)) - 1)
    digits = (math.ceil if up else math.floor)(value / step)
    return float(f"{digits}e{math.floor(math.log10(step))}")


def finite_rows(rows: Tensor) -> Tensor:
    """Per row of ``[b, n]``, whether every value is finite, ``[b]`` bool: the row's max and
    min (NaN propagates through both), two passes without the temporaries ``isfinite`` makes
    (``[64, 23552]``: 1.3 ms against 15 ms on this machine)."""
    if rows.shape[1] == 0:
        return torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    if rows.shape[0] == 0:
        return torch.ones(0, dtype=torch.bool, device=rows.device)
    return rows.amax(1).isfinite() & rows.amin(1).isfinite()


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Per row ``<a_t, b_t>``, ``[t]``."""
    return (a * b).sum(1)


def _norm(a: Tensor) -> Tensor:
    """Per row ``||a_t||``, ``[t]`` (one pass, no temporary)."""
    return torch.linalg.vector_norm(a, dim=1)


def _owned(value: Tensor, given: Tensor) -> Tensor:
    """``value``, or a copy of it where it shares memory with ``given`` (a product or
    preconditioner may hand back its argument), so updating it in place changes nothing else."""
    if value.untyped_storage().data_ptr() == given.untyped_storage().data_ptr():
        return value.clone()
    return value
