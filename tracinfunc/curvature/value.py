"""The :class:`Curvature` value: one damped curvature estimate per checkpoint, and its inverse.

Made by :func:`~tracinfunc.fit_curvature`, saved and loaded by
:mod:`tracinfunc.curvature.persist`; immutable (inverses are cached, never changed).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from tracinfunc._validate import check_int, current_caller, entry_point
from tracinfunc.curvature import kfac, refine
from tracinfunc.curvature.blocks import Block, block_index
from tracinfunc.curvature.capture import KfacLayer
from tracinfunc.curvature.conditioning import (
    MAX_CONDITION,
    condition,
    minimal_damping,
    rank_mean,
    round_up,
    spectrum,
    systems,
)
from tracinfunc.curvature.damping import Damping, check_damping, resolve
from tracinfunc.curvature.flat import flatten, layer_matrix, split_layer, unflatten
from tracinfunc.curvature.refine import Refinement
from tracinfunc.errors import IllConditionedError, InvalidArgumentError, NonFiniteGradientError
from tracinfunc.projection.spec import Layout, Projection
from tracinfunc.store.meta import CheckpointMeta
from tracinfunc.types import Batch

__all__ = ["CURVATURE_KINDS", "Curvature"]

CURVATURE_KINDS = ("dense", "projected", "kfac", "ekfac")


@dataclass(frozen=True, eq=False)
class Curvature:
    """Damped Gauss-Newton (true Fisher) estimates ``H_c + lambda_c I``, one per checkpoint.

    Curvature-aware TracIn scores ``sum_c lr_c g_test,c^T (H_c + lambda_c I)^-1 g_train,c``:
    only the test side is preconditioned, so one training store serves plain TracIn and this.

    Attributes:
        kind: ``"dense"`` (``[p, p]``), ``"projected"`` (``[k, k]`` in the store's projected
            space), ``"kfac"`` or ``"ekfac"`` (per-layer Kronecker factors).
        checkpoints: Name, lr and parameter fingerprint of each checkpoint fitted.
        layout: The differentiated parameters' names and shapes (sorted by name).
        projection: The store's projection (``"projected"`` only; ``None`` otherwise).
        damping: ``lambda_c`` per checkpoint.
        estimates: Per checkpoint, named float64 tensors (read-only mappings).
        layers: The layers K-FAC covers (``"kfac"``/``"ekfac"``; empty otherwise).
        info: How it was fitted (examples, sampler, damping rule), JSON types.
        blocks: ``"projected"`` with ``block_diagonal=True`` only: the per-layer blocks
            (:mod:`tracinfunc.curvature.blocks`); the estimates are then one
            ``"block:<i>"`` matrix ``[k_l, k_l]`` per block instead of ``"matrix"`` ``[k, k]``.
        refinement: Queries refined by conjugate gradient on the Fisher itself
            (:meth:`with_refinement`, :mod:`tracinfunc.curvature.refine`); ``None``: not.
    """

    kind: str
    checkpoints: tuple[CheckpointMeta, ...]
    layout: Layout
    projection: Projection | None
    damping: tuple[float, ...]
    estimates: tuple[Mapping[str, Tensor], ...]
    layers: tuple[KfacLayer, ...] = ()
    info: Mapping[str, Any] = field(default_factory=dict)
    blocks: tuple[Block, ...] = ()
    refinement: Refinement | None = None

    def __post_init__(self) -> None:
        if self.kind not in CURVATURE_KINDS:
            raise InvalidArgumentError(
                f"Curvature: kind must be one of {list(CURVATURE_KINDS)}, got {self.kind!r}."
            )
        if not len(self.checkpoints) == len(self.damping) == len(self.estimates):
            raise InvalidArgumentError(
                f"Curvature: one damping and one estimate per checkpoint, got "
                f"{len(self.checkpoints)} checkpoints, {len(self.damping)} dampings and "
                f"{len(self.estimates)} estimates."
            )
        if not all(isinstance(d, int | float) and math.isfinite(d) and d >= 0
                   for d in self.damping):
            raise InvalidArgumentError(
                f"Curvature: every damping must be a finite float >= 0, got "
                f"{list(self.damping)}; use curvature.with_damping(Damping()) for the default."
            )
        if self.blocks and self.kind != "projected":
            raise InvalidArgumentError(
                f"Curvature: per-layer blocks belong to kind='projected', got {self.kind!r}."
            )
        blocks = tuple((str(layer), tuple((int(a), int(b)) for a, b in spans))
                       for layer, spans in self.blocks)  # JSON lists -> hashable tuples
        object.__setattr__(self, "blocks", blocks)
        frozen = tuple(MappingProxyType(dict(e)) for e in self.estimates)
        object.__setattr__(self, "estimates", frozen)
        object.__setattr__(self, "info", MappingProxyType(dict(self.info)))
        object.__setattr__(self, "_cache", {})  # inverses, computed once each

    @property
    def n_ckpt(self) -> int:
        return len(self.checkpoints)

    @property
    def dim(self) -> int:
        """Size of the space it acts on: ``k`` (projected) or ``p``."""
        if self.kind == "projected":
            return int(sum(b - a for _, spans in self.blocks for a, b in spans)
                       or self.estimates[0]["matrix"].shape[0])
        return sum(math.prod(shape) for _, shape in self.layout)

    def metadata(self) -> dict[str, Any]:
        """Everything but the tensors, as JSON types (``"blocks"`` only when there are some,
        so a curvature without them has the metadata and digest it had before blocks)."""
        blocks = {"blocks": [[layer, [list(span) for span in spans]]
                             for layer, spans in self.blocks]} if self.blocks else {}
        if self.refinement is not None:  # only then, so digests of the others are unchanged
            blocks["refinement"] = self.refinement.describe()
        return {
            "kind": self.kind,
            "checkpoints": [{"name": c.name, "lr": c.lr, "fingerprint": c.fingerprint}
                            for c in self.checkpoints],
            "layout": [[name, list(shape)] for name, shape in self.layout],
            "projection": None if self.projection is None else self.projection.to_dict(),
            "damping": list(self.damping),
            "layers": [layer.to_list() for layer in self.layers],
            "info": dict(self.info),
            **blocks,
        }

    @property
    def digest(self) -> str:
        """SHA-256 of the metadata and every tensor's bytes: equal digests, equal curvatures."""
        if "digest" not in self._cache:
            h = hashlib.sha256(json.dumps(self.metadata(), sort_keys=True).encode())
            for estimate in self.estimates:
                for name in sorted(estimate):
                    value = estimate[name].detach().cpu().contiguous()
                    h.update(f"{name}|{tuple(value.shape)}|{value.dtype}|".encode())
                    h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
            self._cache["digest"] = h.hexdigest()
        return self._cache["digest"]

    def mean_eigenvalues(self, over: str = "dimension") -> tuple[float, ...]:
        """Per checkpoint, the mean eigenvalue of the undamped estimate: ``tr(H_c) / dim``
        (``over="dimension"``) or ``tr(H_c) / rank(H_c)`` (``"rank"``, from its spectrum):
        what a :class:`~tracinfunc.curvature.Damping` multiplies."""
        if over == "rank":
            return tuple(self._rank_mean(c)[0] for c in range(self.n_ckpt))
        if self.blocks:
            return tuple(sum(float(e[f"block:{i}"].trace()) for i in range(len(self.blocks)))
                         / self.dim for e in self.estimates)
        if self.kind in ("dense", "projected"):
            return tuple(float(e["matrix"].trace()) / e["matrix"].shape[0]
                         for e in self.estimates)
        mean = kfac.kfac_mean_eigenvalue if self.kind == "kfac" else kfac.ekfac_mean_eigenvalue
        return tuple(mean(e, list(self.layers)) for e in self.estimates)

    @entry_point("Curvature.with_damping")
    def with_damping(self, damping: Damping | float) -> Curvature:
        """The same estimates with another damping (a new value; this one is unchanged).

        Args:
            damping: A :class:`~tracinfunc.curvature.Damping` (relative to each checkpoint's
                mean eigenvalue) or a float (one ``lambda`` for every checkpoint).

        Raises:
            InvalidArgumentError: a negative, NaN or infinite damping; a ``Damping`` at a
                checkpoint whose estimate is zero (named: nothing to be relative to).
            IllConditionedError: a checkpoint's damped solve would be meaningless (see
                :meth:`check_conditioned`); the message gives the damping that fixes it.
        """
        damping = check_damping(damping)
        over = damping.over if isinstance(damping, Damping) else "dimension"
        values = tuple(resolve(damping, mean, self.kind, c.name)
                       for mean, c in zip(self.mean_eigenvalues(over), self.checkpoints,
                                          strict=True))
        rule = damping.describe(self.kind) if isinstance(damping, Damping) else "fixed"
        damped = replace(self, damping=values, info={**self.info, "damping": rule})
        damped._cache.update({key: value for key, value in self._cache.items()
                              if key[0].startswith("systems") or key[0] == "largest"})
        damped.check_conditioned()
        if damped.refinement is not None:
            damped.check_refinable()
        return damped

    @entry_point("Curvature.with_refinement")
    def with_refinement(self, data: Batch | Iterable[Batch], *, steps: int = 5,
                        max_examples: int | None = None, sampler: Any = None, seed: int = 0,
                        tolerance: float = 1e-2, solver: str = "cg",
                        fisher: str = "sampled", step_size: float | None = None,
                        batches_per_step: int | None = None) -> Curvature:
        """The same curvature, its queries solved with the sampled Fisher itself.

        Each query ``g`` is solved on ``(H_c + lambda_c I) x = g`` with ``H_c`` the Fisher of
        the training examples in ``data`` (labels drawn by ``sampler``, as in
        :func:`~tracinfunc.fit_curvature`). The per-example gradients ``G [m, p]`` of the
        ``m`` labelled examples are computed once per checkpoint at the first refined query
        and kept on this curvature (and those ``with_damping`` makes from it) while
        ``m x p x 8`` bytes (and one Cholesky factor, ``min(m, p)^2 x 8``) fit
        :data:`tracinfunc.curvature.fisher.GRADIENT_BUDGET` (256 MiB, over all checkpoints);
        ``H = G^T diag(w) G / sum w`` ``[p, p]`` is kept instead when ``p < 2 m``. Then:

        - ``solver="cg"`` (default): conjugate gradient preconditioned by this curvature,
          starting from its answer: each query stops once its relative residual
          ``||g - (H + lambda I) x|| / ||g||`` is at most ``tolerance``, or after ``steps``
          steps. Each step is one Fisher-vector product for a batch of queries: two matrix
          products with ``G`` (or one with ``H``); a Fisher that is not kept is never formed
          and each product is a jvp and a vjp over every example instead.
        - ``solver="direct"``: solved exactly (Cholesky of ``H + lambda I``, or Woodbury
          through an ``[m, m]`` Cholesky when ``G`` is kept; the factor made once per
          checkpoint and damping): the answer conjugate gradient converges to, at about two
          Fisher-vector products per query. Refused at the query when the Fisher is not kept.
          The exact answer of a small sample's Fisher can attribute worse than a few steps
          from this curvature (docs/curvature.md measures both).
        - ``solver="neumann"``: ASTRA-style preconditioned Neumann iterations, ``x <- x +
          step_size M (g - (H_B + lambda I) x)`` from this curvature's answer ``M g``, with
          ``H_B`` the Fisher of ``batches_per_step`` of ``data``'s batches drawn afresh at
          every step (seeded by ``seed`` and the checkpoint: the same draws for every query),
          or of all of them (``None``: deterministic, converging to the solve). A step costs
          one product over its batches, so a small ``batches_per_step`` buys many cheap steps;
          its residuals are measured on the step's batches, sampling noise included.

        Applied by :func:`~tracinfunc.preconditioned_test_grads` (so ``score``, ``top_k``,
        ``indexed_top_k`` and the CLI get it through ``curvature=``); the test gradients'
        metadata holds, per checkpoint, the worst residual after each step (one value for a
        direct solve) and the solver used. ``steps``, ``tolerance`` and ``solver`` are part of
        the digest: queries refined differently are never mixed.

        Args:
            data: Training batches (or a sample of them), copied and kept in memory
                (changing ``data`` in place later changes nothing).
            steps: Conjugate-gradient steps at most, ``>= 1`` (a direct solve takes none).
            max_examples: Keep only the first this many inputs of ``data``.
            sampler: Draws labels (``None``: the loss's default sampler).
            seed: Seeds the label draws (``seed + checkpoint position``).
            tolerance: The stop criterion: a query whose relative residual is at most this
                stops (its answer does not depend on the queries batched with it); one still
                above it after ``steps`` (or after a direct solve, from rounding) is reported
                (a ``RuntimeWarning``).
            solver: ``"cg"``, ``"direct"`` or ``"neumann"`` (above).
            fisher: The matrix ``H_c`` solved. ``"sampled"`` (default): the Fisher of the
                labels ``sampler`` draws (above). ``"expected"``: its expectation over the
                model's labels, computed exactly (no label noise; for a language model its
                rank is not limited by the number of sequences), for losses made by
                :func:`~tracinfunc.loss_from_module` (classifiers) or
                :func:`~tracinfunc.causal_lm_loss`. Never formed or kept: every
                step is a jvp and a vjp of the logits over every example in ``data`` (or
                the step's batches, ``solver="neumann"``), so it costs more per step than a
                kept sampled Fisher; no ``solver="direct"``, no ``sampler``, and ``seed``
                only for the Neumann solver's draws (:mod:`tracinfunc.curvature.expected`).
            step_size: The Neumann solver's ``eta``, ``0 < eta <= 2`` (default ``None``:
                ``1 / lambda_max(M (H + lambda I))``, estimated once per checkpoint and
                damping; ``solver="neumann"`` only). A residual that grows is reported: take a
                smaller one.
            batches_per_step: Batches of ``data`` each Neumann product averages over, drawn
                at every step (default ``None``: all; ``solver="neumann"`` only).

        Raises:
            InvalidArgumentError: ``kind="projected"`` (its space has no Fisher-vector
                product), ``steps < 1``, a bad tolerance, solver or fisher (``"expected"``
                with ``solver="direct"`` or a ``sampler``), ``step_size`` or
                ``batches_per_step`` out of range or given to another solver, or no examples
                in ``data``.
            IllConditionedError: a zero, tiny or huge damping (:func:`refine.check_refinable`).
        """
        steps = check_int(steps, "steps", minimum=1)
        if self.kind == "projected":
            raise InvalidArgumentError(
                f"{current_caller()}: refinement needs Fisher-vector products in parameter "
                "space, but a 'projected' curvature acts on projected rows; fit kind='ekfac' "
                "(or 'kfac', 'dense') and refine that.")
        if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) \
                or not math.isfinite(tolerance) or tolerance <= 0:
            raise InvalidArgumentError(
                f"{current_caller()}: tolerance must be a positive finite float, got "
                f"{tolerance!r}; e.g. tolerance=1e-2.")
        # at most 2**62: seed + checkpoint (the label draws) stays a torch seed
        seed = check_int(seed, "seed", minimum=0, maximum=2**62, fix="e.g. seed=0")
        if not isinstance(solver, str) or solver not in refine.SOLVERS:
            raise InvalidArgumentError(
                f"{current_caller()}: solver must be one of {', '.join(map(repr, refine.SOLVERS))}"
                f", got {solver!r}; e.g. solver='direct' (the exact solve, where the sampled "
                "Fisher is kept).")
        if not isinstance(fisher, str) or fisher not in refine.FISHERS:
            raise InvalidArgumentError(
                f"{current_caller()}: fisher must be one of {', '.join(map(repr, refine.FISHERS))}"
                f", got {fisher!r}; e.g. fisher='expected' (the Fisher's expectation over the "
                "model's labels, computed exactly).")
        if fisher == "expected" and solver == "direct":
            raise InvalidArgumentError(
                f"{current_caller()}: fisher='expected' is never formed (each product is a jvp "
                "and a vjp over the data), so it has no exact solve; use solver='cg' (or "
                "'neumann') with it, or solver='direct' with fisher='sampled' (the Fisher of "
                "drawn labels, kept).")
        if fisher == "expected" and (sampler is not None or (seed != 0 and solver != "neumann")):
            given = f"sampler={sampler!r}" if sampler is not None else f"seed={seed!r}"
            raise InvalidArgumentError(
                f"{current_caller()}: fisher='expected' draws no labels (it takes their "
                f"expectation exactly), so sampler= and seed= have no use; got {given}. Drop "
                "it, or refine with fisher='sampled' and this sampler or seed.")
        if sampler is not None and not callable(sampler):
            raise InvalidArgumentError(
                f"{current_caller()}: sampler must be None (the loss's default) or a sampler "
                f"callable such as tracinfunc.curvature.classification_sampler(), got "
                f"{sampler!r}; e.g. sampler=classification_sampler(exact=True).")
        batches = refine.kept_batches(data, check_int(max_examples, "max_examples",
                                                      optional=True, minimum=1))
        step_size, batches_per_step = refine.check_neumann(solver, step_size, batches_per_step,
                                                           len(batches))
        refined = replace(self, refinement=refine.Refinement(
            steps, batches, sampler, seed, float(tolerance), refine.data_digest(batches),
            solver, fisher, step_size=step_size, batches_per_step=batches_per_step))
        refined._cache.update({key: value for key, value in self._cache.items()
                               if key != "digest"})  # a str key: its own digest
        refined.check_refinable()
        return refined

    def without_refinement(self) -> Curvature:
        """The same curvature with plain (unrefined) queries."""
        return replace(self, refinement=None)

    def check_refinable(self) -> None:
        """Raise unless every checkpoint's damping suits refinement
        (:func:`tracinfunc.curvature.refine.check_refinable`)."""
        for c in range(self.n_ckpt):
            key = ("largest", c)
            if key not in self._cache:
                self._cache[key] = refine.largest_eigenvalue(self.kind, self.estimates[c],
                                                             self.layers)
        every = tuple(self._cache[("largest", c)] for c in range(self.n_ckpt))
        for c in range(self.n_ckpt):
            refine.check_refinable(every[c], self.damping[c], self.checkpoints[c].name,
                                   MAX_CONDITION, every if all(map(math.isfinite, every)) else (),
                                   solved=f"the {self.refinement.fisher} Fisher"
                                   if self.refinement is not None else "the refined Fisher")

    def ranks(self) -> tuple[int, ...]:
        """Per checkpoint, the estimate's numerical rank (eigenvalues above
        ``RANK_TOLERANCE`` times the largest)."""
        return tuple(self._rank_mean(c)[1] for c in range(self.n_ckpt))

    def _rank_mean(self, ckpt: int) -> tuple[float, int]:
        key = ("systems-rank", ckpt)
        if key not in self._cache:
            self._cache[key] = rank_mean(spectrum(self.kind, self.estimates[ckpt], self.layers,
                                                  len(self.blocks)))
        return self._cache[key]

    def condition_numbers(self) -> tuple[float, ...]:
        """Per checkpoint, the largest condition number of the damped systems solved
        (:mod:`tracinfunc.curvature.conditioning`; ``inf`` for a singular one)."""
        return tuple(condition(self._systems(c), self.damping[c], exact=True)
                     for c in range(self.n_ckpt))

    @entry_point("Curvature.check_conditioned")
    def check_conditioned(self, ckpt: int | None = None) -> None:
        """Raise unless every damped solve (of ``ckpt``, or of every checkpoint) has a
        condition number of at most ``MAX_CONDITION`` (``1 / eps(float32)``).

        Raises:
            IllConditionedError: names the checkpoint, its condition number and the smallest
                damping that fixes every checkpoint.
        """
        for c in range(self.n_ckpt) if ckpt is None else (ckpt,):
            if ("conditioned", c) in self._cache:
                continue
            kappa = condition(self._systems(c), self.damping[c])
            if not kappa <= MAX_CONDITION:
                error = IllConditionedError(self._ill_conditioned(c, kappa))
                error.checkpoint = self.checkpoints[c].name  # a damping error, by checkpoint
                raise error
            self._cache[("conditioned", c)] = True

    def _ill_conditioned(self, ckpt: int, kappa: float) -> str:
        needed = [minimal_damping(self._systems(c)) for c in range(self.n_ckpt)]
        if not math.isfinite(needed[ckpt]):
            return (f"{current_caller()}: the curvature's estimate at checkpoint {ckpt} "
                    f"({self.checkpoints[ckpt].name!r}) holds NaN or infinite values (or its "
                    "eigenvalues could not be computed), so no damping makes its solve "
                    "meaningful; fit it again with tif.fit_curvature on finite data.")
        means = self.mean_eigenvalues()
        if means[ckpt] == 0:  # a zero estimate: only a fixed damping means anything there
            fitted = [d for d in self.damping if d > 0]
            example = f"{max(fitted):.2g}" if fitted else "1e-3"
            return (
                f"{current_caller()}: the curvature's estimate at checkpoint {ckpt} "
                f"({self.checkpoints[ckpt].name!r}) is zero (every sampled gradient vanishes: "
                f"the model's predictions are certain there) and its damping is "
                f"{self.damping[ckpt]:.3g}, so its solve is meaningless, and no relative "
                "damping (Damping) exists there. Give every checkpoint one fixed damping: "
                f"curvature.with_damping({example})"
                + (" (the largest of curvature.damping)" if fitted else "")
                + ", or rebuild the store and the fit without that checkpoint.")
        scale = round_up(max(lam / mean if mean > 0 else lam
                             for lam, mean in zip(needed, means, strict=True)))
        return (
            f"{current_caller()}: the damped curvature at checkpoint {ckpt} "
            f"({self.checkpoints[ckpt].name!r}) has condition number {kappa:.3g} with damping "
            f"{self.damping[ckpt]:.3g}, above {MAX_CONDITION:.3g} (1 / float32 epsilon): the "
            f"rounding of a float32 gradient could be as large as the solve's answer, so "
            f"the scores would be meaningless (a rank-deficient estimate with damping near 0 "
            f"is one cause). Raise the damping: at least {needed[ckpt]:.2g} at this checkpoint; "
            f"curvature.with_damping({max(needed):.2g}) or with_damping(Damping(scale="
            f"{scale:.2g})) for every checkpoint, or Damping() for the default."
        )

    def _systems(self, ckpt: int) -> list:
        key = ("systems", ckpt)
        if key not in self._cache:
            self._cache[key] = systems(self.kind, self.estimates[ckpt], self.layers,
                                       len(self.blocks))
        return self._cache[key]

    def precondition(self, ckpt: int, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """``(H_c + lambda_c I)^-1 g`` for per-example gradients ``{name: [b, *shape]}``.

        Computed in float64, returned in the gradients' dtype; for every kind but
        ``"projected"`` (which acts on projected rows: :meth:`precondition_rows`).

        Raises:
            NonFiniteGradientError: finite gradients whose solve overflows the dtype (or
                float64): a damping tiny against them (checkpoint and damping named).
        """
        self.check_conditioned(ckpt)
        dtype = next(iter(grads.values())).dtype
        grads = {name: value.double() for name, value in grads.items()}
        finite = _once(lambda: all(bool(v.isfinite().all()) for v in grads.values()))
        if self.kind == "dense":
            flat = flatten(grads, self.layout) @ self._inverse(ckpt)  # [b, p] @ [p, p]
            return {n: self._cast(v, dtype, ckpt, finite) for n, v in unflatten(
                flat, self.layout).items()}
        out, shapes = {}, dict(self.layout)
        for layer in self.layers:
            matrix = layer_matrix(grads, layer)  # [b, d_out, d_a]
            estimate = self.kron_eigensystem(ckpt, layer) if self.kind == "kfac" \
                else self.estimates[ckpt]
            matrix = kfac.precondition_ekfac(matrix, estimate, layer, self.damping[ckpt])
            out.update(split_layer(matrix, layer, shapes[layer.weight]))
        return {name: self._cast(value, dtype, ckpt, finite) for name, value in out.items()}

    def precondition_rows(self, ckpt: int, rows: Tensor) -> Tensor:
        """``(F_c + lambda_c I)^-1 row`` for projected rows ``[b, k]`` (``"projected"``).

        The inverse is computed in float64 once, and applied in float64 to float64 rows and
        in float32 otherwise (scores accumulate in float32 anyway; half the time of a
        float64 product, which matters when ``k`` approaches ``n_train``), unless its float32
        copy would overflow (then in float64).

        Raises:
            NonFiniteGradientError: finite rows whose solve overflows their dtype (checkpoint
                and damping named).
        """
        self.check_conditioned(ckpt)
        finite = _once(lambda: bool(rows.isfinite().all()))
        if self.blocks:
            return self._precondition_blocks(ckpt, rows, finite)
        # [b, k] @ [k, k]; symmetric, so row @ inv = (inv @ row)^T
        return self._cast(rows.to(self._dtype(ckpt, rows, "matrix"))
                          @ self._inverse_on(ckpt, rows, "matrix"), rows.dtype, ckpt, finite)

    def _dtype(self, ckpt: int, rows: Tensor, name: str) -> torch.dtype:
        """float64 for float64 rows, and where the float32 inverse overflows (a tiny
        damping at a tiny but meaningful scale: entries beyond 3.4e38 whose products are
        not); float32 otherwise."""
        if rows.dtype == torch.float64:
            return torch.float64
        key = ("inverse-float32-finite", ckpt, name)
        if key not in self._cache:
            self._cache[key] = bool(self._inverse(ckpt, name).to(torch.float32).isfinite().all())
        return torch.float32 if self._cache[key] else torch.float64

    def _inverse_on(self, ckpt: int, rows: Tensor, name: str) -> Tensor:
        """The damped inverse ``name`` on the rows' device, in :meth:`_dtype`, cached."""
        dtype = self._dtype(ckpt, rows, name)
        key = ("inverse", ckpt, name, dtype, rows.device)
        if key not in self._cache:
            self._cache[key] = self._inverse(ckpt, name).to(rows.device, dtype)
        return self._cache[key]

    def _precondition_blocks(self, ckpt: int, rows: Tensor,
                             finite: Callable[[], bool]) -> Tensor:
        """Each block's coordinates ``[b, k_l]`` times that block's damped inverse."""
        names = [f"block:{i}" for i in range(len(self.blocks))]
        dtype = max((self._dtype(ckpt, rows, name) for name in names),
                    key=lambda d: d.itemsize)
        out = torch.empty(rows.shape, dtype=dtype, device=rows.device)
        for block, name in zip(self.blocks, names, strict=True):
            key = ("block-index", block, rows.device)
            if key not in self._cache:
                self._cache[key] = block_index(block, rows.device)
            index = self._cache[key]
            inverse = self._inverse_on(ckpt, rows, name).to(dtype)
            out[:, index] = rows[:, index].to(dtype) @ inverse  # [b, k_l] @ [k_l, k_l]
        return self._cast(out, rows.dtype, ckpt, finite)

    def kron_eigensystem(self, ckpt: int, layer: KfacLayer) -> dict[str, Tensor]:
        """``"kfac"``: one layer's ``S (x) A`` in its Kronecker eigenbasis at checkpoint
        ``ckpt`` (:func:`tracinfunc.curvature.kfac.kron_eigensystem`; independent of the
        damping, so kept by :meth:`with_damping`)."""
        key = ("systems-kron", ckpt, layer.weight)
        if key not in self._cache:
            self._cache[key] = kfac.kron_eigensystem(self.estimates[ckpt], layer)
        return self._cache[key]

    def _cast(self, value: Tensor, dtype: torch.dtype, ckpt: int,
              finite_inputs: Callable[[], bool]) -> Tensor:
        return _cast(value, dtype, self.checkpoints[ckpt].name, self.damping[ckpt],
                     finite_inputs)

    def _inverse(self, ckpt: int, name: str = "matrix") -> Tensor:
        key = ("inverse", ckpt, name)
        if key not in self._cache:
            matrix = self.estimates[ckpt][name]
            eye = torch.eye(matrix.shape[0], dtype=matrix.dtype)
            self._cache[key] = torch.linalg.inv(matrix + self.damping[ckpt] * eye)
        return self._cache[key]


def _once(check: Callable[[], bool]) -> Callable[[], bool]:
    """``check``, computed at most once (several outputs share one input)."""
    result: list[bool] = []

    def cached() -> bool:
        if not result:
            result.append(check())
        return result[0]

    return cached


def _cast(value: Tensor, dtype: torch.dtype, checkpoint: str, damping: float,
          finite_inputs: Callable[[], bool]) -> Tensor:
    """``value`` in ``dtype``, refusing a value that overflows (in ``dtype``, or already in
    the float64 solve) where the gradients or rows it came from were finite
    (``finite_inputs()``): a solve divides by eigenvalues + lambda, which can be far below 1
    (float16's 65504; a (nearly) zero estimate with a tiny fixed damping reaches float32's
    3.4e38 and float64's 1.8e308 too)."""
    out = value.to(dtype)
    if bool(out.isfinite().all()) or not finite_inputs():
        return out  # non-finite data: refused where the gradients are checked
    largest = float(value.abs().max())
    reached = f"reach {largest:.3g}" if math.isfinite(largest) else "overflow (inf/NaN)"
    half = dtype in (torch.float16, torch.bfloat16)
    error = NonFiniteGradientError(
        f"{current_caller()}: the preconditioned gradients at checkpoint {checkpoint!r} "
        f"{reached}, beyond {dtype}'s largest value {torch.finfo(dtype).max:.5g}: the damping "
        f"there ({damping:.3g}) is small against the gradients (a (nearly) zero estimate at "
        "that checkpoint is one cause). Raise the damping (curvature.with_damping(...))"
        + ("; or use float32 parameters (or test gradients)." if half else ".")
    )
    error.checkpoint = checkpoint  # a damping error, by checkpoint
    raise error
