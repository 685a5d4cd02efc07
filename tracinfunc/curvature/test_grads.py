"""Preconditioned test gradients from a loss: the only side of curvature-aware TracIn that changes.

``sum_c lr_c g_test,c^T (H_c + lambda_c I)^-1 g_train,c`` is plain TracIn between the stored
training rows and preconditioned test rows, so the training store stays as built.

- ``kind="projected"`` acts on projected rows: ``score(store, test_grads, curvature=c)``
  preconditions plain test gradients itself (:mod:`tracinfunc.query.curvature`).
- ``"dense"``, ``"kfac"`` and ``"ekfac"`` act on full gradients, before the projection:
  :func:`preconditioned_test_grads` computes them, marked with the curvature's digest, and
  ``score(..., curvature=c)`` checks the mark.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch
from torch import Tensor
from torch.func import vmap

from tracinfunc._norms import row_norms
from tracinfunc._validate import current_caller, entry_point
from tracinfunc._version import __version__
from tracinfunc.batches import iter_batches
from tracinfunc.build.loop import check_finite, checkpoint_list
from tracinfunc.checkpoint import Checkpoint, loss_at
from tracinfunc.curvature.binding import check_bound, check_curvature
from tracinfunc.curvature.conditioning import MAX_CONDITION
from tracinfunc.curvature.expected import expected_loss, expected_product
from tracinfunc.curvature.fisher import FORWARD_AD_LOCK, checkpoint_product
from tracinfunc.curvature.flat import flat_map, flatten, unflatten
from tracinfunc.curvature.refine import (
    check_refinable,
    direct_solve,
    finite_rows,
    neumann_flat,
    neumann_step,
    pcg_flat,
    sampled_largest,
    warn_unconverged,
)
from tracinfunc.curvature.samplers import CheckedSampler, default_sampler
from tracinfunc.curvature.value import Curvature
from tracinfunc.errors import EmptyDataError, InvalidArgumentError
from tracinfunc.grads import per_sample_grads, projected_grads
from tracinfunc.grads.options import GradientOptions, gradient_options
from tracinfunc.grads.selection import selected_names
from tracinfunc.projection import Projection, canonical_layout, make_projector
from tracinfunc.projection.spec import check_projection
from tracinfunc.store.memory.dense import MemoryStore
from tracinfunc.store.meta import CheckpointMeta, StoreMeta, dtype_name
from tracinfunc.types import Batch, LossFn, Params

__all__ = ["MARK", "GradientPreconditioner", "RefinedSolve", "marked_store",
           "preconditioned_test_grads"]

MARK = "curvature"  # StoreMeta.extra key: {"kind", "digest"} of the curvature applied


@entry_point("preconditioned_test_grads")
def preconditioned_test_grads(
    loss: LossFn,
    checkpoints: Sequence[Checkpoint],
    data: Batch | Iterable[Batch],
    curvature: Curvature,
    *,
    projection: Projection,
    options: GradientOptions | None = None,
) -> MemoryStore:
    """Test gradients preconditioned by ``curvature``, then projected: ``P (H_c + l I)^-1 g``.

    Args:
        loss: The per-example loss (the test examples keep their own labels).
        checkpoints: The checkpoints the curvature and the store were made at.
        data: Test batches.
        curvature: From :func:`~tracinfunc.fit_curvature` at these checkpoints.
        projection: The store's projection (``store.projection``).
        options: How per-example gradients are computed (``chunk_size``, ``select``, ...), as
            for the store. Without ``options.select`` the parameters the curvature was fitted
            over (``curvature.layout``) are differentiated: the store's selection.

    Returns:
        A :class:`~tracinfunc.store.MemoryStore` ``[n_ckpt, n_test, k]`` to pass as ``test_grads``
        (with or without ``curvature=``) to :func:`~tracinfunc.query.score` or ``top_k``.

    Raises:
        IncompatibleGradientsError: the curvature was fitted at other checkpoints, over
            other parameters, or (``"projected"``) in another projected space.
    """
    curvature = check_curvature(curvature)
    check_projection(projection)
    checkpoints = checkpoint_list(checkpoints, Checkpoint, name="tracinfunc.Checkpoint")
    metas = tuple(CheckpointMeta(c.name or f"checkpoint-{i}", c.lr, c.fingerprint)
                  for i, c in enumerate(checkpoints))
    options = gradient_options(options)
    select = options.select if options.select is not None else [n for n, _ in curvature.layout]
    options = replace(options, select=list(selected_names(checkpoints[0].params, select)))
    names = options.select
    layout = canonical_layout({name: checkpoints[0].params[name] for name in names})
    meta = StoreMeta(projection=projection, checkpoints=metas, layout=layout, n_train=0,
                     k=projection.output_dim(layout), library_version=__version__)
    check_bound(curvature, meta)
    if curvature.refinement is not None:
        curvature.check_refinable()
    refined, sampler = curvature.refinement is not None, None
    if refined and curvature.refinement.fisher == "expected":
        expected_loss(loss)  # refused before any work when its expected Fisher is unknown
    elif refined:
        sampler = curvature.refinement.sampler or default_sampler(loss)
    with FORWARD_AD_LOCK if refined else contextlib.nullcontext():
        per_ckpt, residuals, solvers = _per_checkpoint(loss, checkpoints, metas, data,
                                                       curvature, names, projection, options,
                                                       refined, sampler)
    return marked_store(meta, per_ckpt, curvature, residuals=residuals or None,
                        solvers=solvers or None)


def _per_checkpoint(loss, checkpoints, metas, data, curvature, names, projection, options,
                    refined, sampler) -> tuple[list[Tensor], list[list[float]], list[str]]:
    """Per checkpoint, the preconditioned projected test rows ``[n_test, k]`` (and, refined,
    the residuals and the solver used)."""
    per_ckpt, residuals, solvers = [], [], []

    keys = [] if not refined else [
        (c, Checkpoint.fingerprint.func(ckpt), tuple(names), _Same(loss))
        for c, ckpt in enumerate(checkpoints)]  # the parameters' state, hashed once per query

    def refined_solve(c: int, ckpt: Checkpoint) -> RefinedSolve:
        return RefinedSolve(loss_at(loss, ckpt), curvature, c, names, dict(ckpt.params),
                            sampler, key=keys[c])

    if refined:
        # The condition rule on the Fisher solved, not the fitted estimate (checked before: a
        # small sample's largest eigenvalue can be far above the estimate's), at every
        # checkpoint before any solve, so the advised damping passes at each. Its products
        # (kept) are reused below; each largest eigenvalue is kept for later queries, which
        # then build nothing here.
        known = curvature.refinement.largest
        largest = tuple(known[keys[c]] if keys[c] in known else refined_solve(c, ckpt).largest
                        for c, ckpt in enumerate(checkpoints))
        for c, meta in enumerate(metas):
            check_refinable(largest[c], curvature.damping[c], meta.name, MAX_CONDITION,
                            largest if all(map(math.isfinite, largest)) else (), huge=False,
                            what=f"the {curvature.refinement.fisher} Fisher",
                            solved=f"the {curvature.refinement.fisher} Fisher")
    for c, (ckpt, ckpt_meta) in enumerate(zip(checkpoints, metas, strict=True)):
        params = dict(ckpt.params)
        solve = refined_solve(c, ckpt) if refined else None
        rows_fn = _rows_fn(loss_at(loss, ckpt), curvature, c, names,
                           projection.for_checkpoint(ckpt_meta.name), options, solve)
        parts = [rows_fn(params, batch) for batch in iter_batches(data)]
        if not parts:
            raise EmptyDataError(f"{current_caller()}: data holds no test examples.")
        per_ckpt.append(torch.cat(parts))
        if solve is not None:
            residuals.append(solve.finish(ckpt_meta.name))
            solvers.append(solve.solver)
    return per_ckpt, residuals, solvers


def marked_store(meta: StoreMeta, per_ckpt: Sequence[Tensor], curvature: Curvature, *,
                 residuals: list[list[float]] | None = None,
                 solvers: list[str] | None = None) -> MemoryStore:
    """Preconditioned rows (``[n_test, k]`` per checkpoint) as a store marked with the
    curvature's digest, which ``score(..., curvature=)`` checks (torch and JAX frontends).
    A refined curvature's ``residuals`` (per checkpoint, the worst relative residual after
    each conjugate-gradient step; one value for a direct solve) and ``solvers`` (per
    checkpoint, ``"direct"`` or ``"cg"``) are kept in the mark.

    Raises:
        NonFiniteGradientError: a row is NaN/inf (names the checkpoint and test examples).
    """
    rows = torch.stack(list(per_ckpt)).cpu()  # [n_ckpt, n_test, k]
    check_finite(rows, meta, first_row=0)
    mark = {"kind": curvature.kind, "digest": curvature.digest}
    if residuals is not None:
        mark["residuals"] = residuals
        if solvers is not None:
            mark["solvers"] = solvers
        # the unrefined curvature's digest: a saved (hence plain) one is told apart, with advice
        mark["plain"] = curvature.without_refinement().digest
    meta = meta.replace(n_train=rows.shape[1], dtype=dtype_name(rows.dtype),
                        extra={MARK: mark})
    return MemoryStore(meta, rows, row_norms(rows))  # rows of 1e-30 (huge damping): not 0


class GradientPreconditioner:
    """``grads {name: [b, *shape]} -> [b, k]``: ``P (H_c + l I)^-1 g`` at checkpoint ``ckpt``
    for the full-space kinds (``"dense"``, ``"kfac"``, ``"ekfac"``), gradients named and
    shaped as the curvature's layout, from any frontend.

    The projector is made once per dtype and device (its blocks generated once, not per batch).
    """

    def __init__(self, curvature: Curvature, ckpt: int, projection: Projection,
                 chunk_size: int | None = None, solve: RefinedSolve | None = None) -> None:
        if curvature.refinement is not None and solve is None:
            raise InvalidArgumentError(
                f"{current_caller()}: the curvature is refined (with_refinement), which needs "
                "torch Fisher-vector products of the loss; this frontend has none. Pass "
                "curvature.without_refinement(), or make the test gradients with "
                "tif.preconditioned_test_grads and a torch loss.")
        self.curvature, self.ckpt, self.projection = curvature, ckpt, projection
        self.chunk_size = chunk_size
        self.solve = solve
        self._projectors: dict = {}

    def __call__(self, grads: dict[str, Tensor]) -> Tensor:
        grads = (self.curvature.precondition(self.ckpt, grads) if self.solve is None
                 else self.solve(grads))
        first = next(iter(grads.values()))
        key = (first.dtype, first.device)
        if key not in self._projectors:
            self._projectors[key] = make_projector(self.projection, self.curvature.layout,
                                                   device=first.device, dtype=first.dtype)
        return vmap(self._projectors[key], chunk_size=self.chunk_size)(grads)


class RefinedSolve:
    """``grads {name: [b, *shape]} -> (H_c + lambda_c I)^-1 grads`` with the sampled Fisher
    over the refinement's batches labelled once (or its expectation over the labels,
    ``fisher="expected"``), exactly or by preconditioned conjugate
    gradient (the refinement's ``solver``; :mod:`tracinfunc.curvature.refine`); keeps the
    worst relative residual after each step (a direct solve's: one).

    ``key`` names the checkpoint's state, the selection and the loss: the sampled Fisher kept
    on the refinement under it is reused (the parameters' fingerprint is recomputed, so
    parameters changed in place are not served a stale Fisher).

    Raises:
        InvalidArgumentError: ``solver="direct"`` where the Fisher is not kept (over
            ``GRADIENT_BUDGET``) or its sampler's weights are negative.
    """

    def __init__(self, loss: LossFn, curvature: Curvature, ckpt: int, names, params: Params,
                 sampler, *, key) -> None:
        refinement = curvature.refinement
        name = curvature.checkpoints[ckpt].name

        def label() -> list:
            checked = CheckedSampler(sampler, name)
            generator = torch.Generator().manual_seed(refinement.seed + ckpt)
            try:
                return [checked(loss, params, batch, generator) for batch in refinement.batches]
            except RuntimeError as err:  # torch's shape/dtype errors: the refinement data's
                raise InvalidArgumentError(
                    f"{current_caller()}: the loss failed on the refinement data (given to "
                    f"Curvature.with_refinement) at checkpoint {name!r}: {err}. Refine with "
                    "training batches of this model's input shape and dtype.") from err

        if refinement.fisher == "expected":  # never formed: a jvp and a vjp per product
            self.product = expected_product(expected_loss(loss), params, list(names),
                                            refinement.batches)
        else:
            # the Neumann solver's products over some batches need G's rows
            self.product = checkpoint_product(
                refinement.gradients, key, loss, params, list(names), label,
                factor=refinement.solver == "direct",
                rows=refinement.solver == "neumann" and refinement.batches_per_step is not None)
        kept = self.product.kept
        self.direct = refinement.solver == "direct"
        if self.direct and (kept is None or not kept.solvable):
            why = (f"keeping it needs {self.product.needed / 2**20:.3g} MiB (the Fisher and the "
                   "Cholesky factor of the direct solve), over tracinfunc.curvature.fisher."
                   f"GRADIENT_BUDGET ({self.product.budget / 2**20:.3g} MiB)" if kept is None
                   else "the sampler gave negative weights, so sqrt(w) G is not real")
            raise InvalidArgumentError(
                f"{current_caller()}: solver='direct' solves the sampled Fisher exactly, but at "
                f"checkpoint {name!r} {why}; use solver='cg' (on the command line "
                "--refine-solver cg), fewer refinement examples (max_examples=, "
                "--refine-examples M), or raise the budget.")
        if key not in refinement.largest:  # once per checkpoint, for every damping
            # fewer power steps where each product is a forward and backward pass over every
            # refinement example (the functional product): a rougher estimate, a bounded cost
            refinement.largest[key] = sampled_largest(
                self.product.flat, sum(math.prod(params[n].shape) for n in names),
                params[names[0]].device, iterations=16 if kept is not None else 4)
        self.largest = refinement.largest[key]
        self.curvature, self.ckpt, self.key = curvature, ckpt, key
        self.device = params[names[0]].device
        self.draws = refinement.draws(ckpt) if refinement.solver == "neumann" else None
        # flat rows [b, p] in the product's column order (the selection's), converted once
        self.layout = tuple((name, tuple(params[name].shape)) for name in names)
        self.precondition = flat_map(lambda v: curvature.precondition(ckpt, v), self.layout)
        self.history: list[Tensor] = []

    @property
    def solver(self) -> str:
        """The solver used at this checkpoint: ``"direct"``, ``"cg"`` or ``"neumann"``."""
        return self.curvature.refinement.solver

    def step_size(self, damping: float) -> float:
        """The Neumann solver's step: the refinement's, or :func:`neumann_step`'s (once per
        checkpoint and damping, kept on the refinement)."""
        refinement = self.curvature.refinement
        if refinement.step_size is not None:
            return refinement.step_size
        key = ("neumann step", self.key, damping)
        if key not in refinement.largest:
            refinement.largest[key] = neumann_step(
                self.product.flat, self.precondition, damping,
                sum(math.prod(shape) for _, shape in self.layout), self.device)
        return refinement.largest[key]

    def __call__(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        dtype = next(iter(grads.values())).dtype
        # A non-finite test gradient is the test example's fault: solve the finite ones and
        # give NaN rows back, which marked_store names as test examples (as unrefined).
        rows = flatten(grads, self.layout)  # [b, p], the selection's order
        finite = finite_rows(rows)  # [b]
        everyone = bool(finite.all())
        if not everyone:
            rows = torch.where(finite[:, None], rows, 0)
        refinement = self.curvature.refinement
        damping = self.curvature.damping[self.ckpt]
        if self.direct:
            solution, residuals = direct_solve(self.product, damping, rows.double())
        elif self.draws is not None:
            solution, residuals = neumann_flat(
                self.product.flat, self.precondition, damping, rows.double(), refinement.steps,
                refinement.tolerance, step_size=self.step_size(damping), draws=self.draws)
        else:
            solution, residuals = pcg_flat(self.product.flat, self.precondition, damping,
                                           rows.double(), refinement.steps, refinement.tolerance)
        self.history.append(residuals)
        if not everyone:
            solution = torch.where(finite[:, None], solution, torch.nan)
        return {name: value.to(dtype) for name, value in unflatten(solution, self.layout).items()}

    def finish(self, name: str) -> list[float]:
        """Per step taken, the worst residual over every query solved (a batch that stopped
        earlier keeps its last); warns if not converged."""
        taken = max((r.shape[0] for r in self.history), default=1)
        residuals = (torch.cat([torch.cat([r, r[-1:].expand(taken - r.shape[0], -1)])
                                for r in self.history], dim=1)
                     if self.history else torch.zeros(1, 0))
        warn_unconverged(residuals, self.curvature.refinement.tolerance, name, self.direct,
                         neumann=self.draws is not None,
                         drawn=self.draws is not None and any(d is not None for d in self.draws))
        return [float(r.max()) if r.numel() else 0.0 for r in residuals]


class _Same:
    """Hashes and compares by identity, holding its object (so its id is not reused)."""

    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and other.value is self.value


def _rows_fn(loss, curvature: Curvature, ckpt: int, names, projection: Projection,
             options: GradientOptions, solve: RefinedSolve | None = None):
    """``fn(params, batch) -> [b, k]`` preconditioned, projected test rows at checkpoint c."""
    if curvature.kind == "projected":
        fn = projected_grads(loss, projection, options=options)
        return lambda params, batch: curvature.precondition_rows(ckpt, fn(params, batch))
    psg = per_sample_grads(loss, options=options)
    precondition = GradientPreconditioner(curvature, ckpt, projection, options.chunk_size,
                                          solve)
    return lambda params, batch: precondition(psg(params, batch))
