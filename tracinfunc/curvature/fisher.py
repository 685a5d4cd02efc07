"""Fisher-vector products of the sampled Fisher ``H = sum_j w_j g_j g_j^T / sum_j w_j``.

Refinement (:mod:`tracinfunc.curvature.refine`) needs ``H v`` for a batch of queries at every
conjugate-gradient step. Two ways, equal up to rounding:

- :func:`gradient_product`: the per-example gradients ``G [m, p]`` (``g_j`` with the sampler's
  label, float64) computed once, then ``H V = G^T (w * (G V)) / sum w``: two matrix products
  per step (``4 m p`` flops per vector); when ``p < 2 m``, ``H = G^T diag(w) G / sum w``
  ``[p, p]`` itself (``2 p^2`` flops, fewer bytes). :func:`checkpoint_product` keeps either for
  the life of the refined curvature (one per checkpoint), up to :data:`GRADIENT_BUDGET` bytes.
- :func:`fisher_product`: functional, never holding ``G``: a ``torch.func.jvp`` of the
  per-example losses and a ``vjp``, ``vmap``-ed over the queries: a forward and a backward
  pass over every refinement example at every step. Used when ``G`` is over the budget (large
  models), and the reference the matrix product is tested against.

Every product takes ``batches=`` (indices into the refinement's ``n`` batches, ``None``: all):
the unbiased estimate of ``H`` from those batches ``B`` drawn uniformly, ``(n / |B|) sum_{j in
B} w_j g_j g_j^T / sum_j w_j`` (normalised by every batch's weights, so batches of unequal
size or weight keep its expectation ``H``), the minibatch product of the Neumann solver
(:func:`tracinfunc.curvature.refine.neumann_flat`).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.func import grad, jvp, vjp, vmap

from tracinfunc._validate import current_caller
from tracinfunc.curvature.flat import flat_map, flatten, unflatten
from tracinfunc.errors import IllConditionedError, InvalidArgumentError, NonFiniteGradientError
from tracinfunc.types import Batch, LossFn, Params

__all__ = ["FORWARD_AD_LOCK", "GRADIENT_BUDGET", "KeptFisher", "checkpoint_product",
           "fisher_product", "gradient_product", "sampled_gradients"]

Vectors = dict[str, Tensor]  # {name: [t, *shape]}: t vectors in parameter space

# Forward-mode AD levels are process-global in torch: two threads inside torch.func.jvp at once
# corrupt each other's level ("Trying to access a forward AD level with an invalid index") and
# the functorch transforms around them, so every Fisher-vector product and every refined query
# (preconditioned_test_grads) runs under this one (re-entrant) lock; it also guards the
# per-example gradients a refinement keeps.
FORWARD_AD_LOCK = threading.RLock()

# Bytes of float64 per-example gradients (m refinement rows x p selected parameters x 8) one
# refined curvature keeps, over all its checkpoints. A checkpoint whose gradients alone are
# larger uses the functional product; older checkpoints' are dropped to make room.
GRADIENT_BUDGET = 256 * 2**20


@dataclass(eq=False)
class KeptFisher:
    """One checkpoint's sampled Fisher, kept: ``G [m, p]`` with its weights ``[m]``, or
    ``H [p, p]`` itself (``weights is None``); and the Cholesky factor of its damped system at
    the last damping solved (:meth:`solve`), replaced when the damping changes.

    Attributes:
        matrix: ``G [m, p]`` or ``H [p, p]``, float64.
        weights: ``[m]`` float64, or ``None`` (``matrix`` is ``H``).
        starts: ``G``'s first row of each refinement batch and ``m`` after the last
            (``[n_batches + 1]``, for products over some batches); ``()`` with ``H``.
        factor: ``(damping, L, gram)``: ``L L^T = H + damping I`` ``[p, p]`` and ``gram =
            None`` (``H`` kept), or ``L L^T = damping I + B B^T`` ``[m, m]`` and ``gram = B
            B^T`` with ``B = sqrt(w / sum w) G`` (``G`` kept); ``None`` until the first
            direct solve.
    """

    matrix: Tensor
    weights: Tensor | None
    factor: tuple[float, Tensor, Tensor | None] | None = None
    starts: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes held (the matrix, the weights and the factor)."""
        held = [self.matrix, self.weights, *(self.factor[1:] if self.factor else ())]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    @property
    def factor_bytes(self) -> int:
        """Bytes of one factor: ``L [p, p]``, or ``L`` and ``B B^T`` ``[m, m]``, float64."""
        return _factor_bytes(self.matrix.shape[0], gram=self.weights is not None)

    @property
    def solvable(self) -> bool:
        """Whether :meth:`solve` applies: every weight ``>= 0`` (``B = sqrt(w) G`` is real)."""
        return self.weights is None or bool((self.weights >= 0).all())

    def product(self, shapes: dict[str, tuple[int, ...]]) -> Callable[..., Vectors]:
        """:func:`gradient_product` of the kept matrix (its ``kept`` is this)."""
        product = gradient_product(self.matrix, self.weights, shapes, self.starts)
        product.kept = self
        return product

    def solve(self, damping: float, rhs: Tensor) -> tuple[Tensor, Tensor]:
        """``(H + damping I)^-1 rhs`` exactly, ``rhs [t, p]`` float64, with each row's relative
        residual ``||rhs - (H + damping I) x|| / ||rhs||``.

        ``H`` kept: Cholesky of ``H + damping I``; the residual by one product with ``H``.
        ``G`` kept: Woodbury, ``x = (v - B^T y) / damping`` with ``y = K^-1 B v``, ``K =
        damping I + B B^T`` ``[m, m]`` and ``B = sqrt(w / sum w) G`` (``B`` never formed: its
        rows are ``G``'s scaled). Then ``rhs - (H + damping I) x = B^T d`` with ``d = (K y -
        B v) / damping`` (up to the rounding of forming ``x``), so the residual's norm is
        ``sqrt(d^T B B^T d)``, computed in ``[m, m]`` (no third product with ``G``). The factor
        (and ``B B^T``) is made at the first solve at a damping and kept.

        Returns:
            ``(x [t, p] float64, residuals [t] float64)`` (``0`` for a zero row).

        Raises:
            NonFiniteGradientError: the kept matrix holds NaN or infinite values.
            IllConditionedError: ``H + damping I`` is not positive definite (negative sampler
                weights with ``H`` kept; with ``G`` kept they are refused before,
                :attr:`solvable`).
        """
        if self.factor is None or self.factor[0] != damping:
            self.factor = None  # the old one's memory first
            self.factor = (damping, *self._factorise(damping))
        _, factor, gram = self.factor
        rows = rhs.to(self.matrix)
        norm = torch.linalg.vector_norm(rows, dim=1)
        safe = torch.where(norm > 0, norm, torch.ones_like(norm))
        if gram is None:  # (H + l I) x = v, both triangles
            x = torch.cholesky_solve(rows.T, factor).T
            residual = torch.linalg.vector_norm(rows - (x @ self.matrix).add_(x, alpha=damping),
                                                dim=1)
            return x.to(rhs.device), (residual / safe).to(rhs.device)
        root = (self.weights / self.weights.sum()).sqrt()  # [m]
        projected = (rows @ self.matrix.T) * root  # B v: [t, m]
        inner = torch.cholesky_solve(projected.T, factor).T  # y: [t, m]
        x = (rows - (inner * root) @ self.matrix) / damping
        misfit = (inner @ gram).add_(inner, alpha=damping).sub_(projected) / damping  # d
        squared = ((misfit @ gram) * misfit).sum(1).clamp_min(0)  # ||B^T d||^2
        return x.to(rhs.device), (squared.sqrt() / safe).to(rhs.device)

    def _factorise(self, damping: float) -> tuple[Tensor, Tensor | None]:
        """``(L, B B^T or None)``: the Cholesky factor of the damped system."""
        gram = None
        if self.weights is None:
            system = self.matrix + damping * torch.eye(self.matrix.shape[0], dtype=torch.float64,
                                                       device=self.matrix.device)
        else:
            scaled = self.matrix * (self.weights / self.weights.sum()).sqrt()[:, None]
            gram = scaled @ scaled.T
            system = gram + damping * torch.eye(gram.shape[0], dtype=torch.float64,
                                                device=gram.device)
        if not bool(system.isfinite().all()):
            raise NonFiniteGradientError(
                f"{current_caller()}: the sampled Fisher holds NaN or infinite values, so it "
                "cannot be solved (its per-example gradients are not finite); check the "
                "refinement data and the model at this checkpoint, or refine with other data.")
        factor, info = torch.linalg.cholesky_ex(system)
        if int(info) != 0:
            raise IllConditionedError(
                f"{current_caller()}: the damped sampled Fisher (damping {damping:.3g}) is not "
                "positive definite, so it cannot be solved directly: the sampler's weights "
                "make it indefinite (a Fisher's are non-negative); use a sampler with "
                "non-negative weights, or a larger damping.")
        return factor, gram


def _factor_bytes(side: int, *, gram: bool) -> int:
    """Bytes of a direct solve's factor over a kept ``[side, ...]`` matrix: ``L [p, p]``
    (``H`` kept), or ``L`` and ``B B^T`` ``[m, m]`` (``G`` kept, ``gram``), float64."""
    return side * side * 8 * (2 if gram else 1)


def checkpoint_product(cache: MutableMapping[Any, Any], key: Any, loss: LossFn, params: Params,
                       names: list[str], label: Callable[[], list[tuple[Batch, Tensor]]],
                       budget: int | None = None, factor: bool = False,
                       rows: bool = False) -> Callable[..., Vectors]:
    """``v -> H v`` at one checkpoint, by :func:`gradient_product` when ``G`` fits ``budget``.

    Args:
        cache: Where the sampled Fisher is kept (the refinement's), ``{key: KeptFisher}``.
        key: Identifies the checkpoint, loss and selection ``G`` was computed for.
        label: ``() -> [(labelled batch, weights [b])]``, the sampler's draws (run on a miss).
        budget: Bytes kept at most (default :data:`GRADIENT_BUDGET`, read at call time).
        factor: Count one Cholesky factor in the budget too (``[p, p]``, or ``[m, m]`` and
            ``B B^T`` beside it, float64): the direct solve (:meth:`KeptFisher.solve`) keeps
            one.
        rows: Keep ``G`` even where ``H`` is smaller (``p < 2 m``): products over some of
            the batches (``batches=``) need the rows.

    Returns:
        ``fn({name: [t, *shape]}) -> {name: [t, *shape]}`` in float64; its ``method`` is
        ``"gradients"``, ``"matrix"`` (``p < 2 m``) or ``"functional"`` (``G`` over budget);
        its ``flat`` is the same map on flat rows ``[t, p]`` (columns in ``names``' order);
        its ``kept`` the :class:`KeptFisher` (``None`` for ``"functional"``).
    """
    budget = GRADIENT_BUDGET if budget is None else budget
    shapes = {name: tuple(params[name].shape) for name in names}
    with FORWARD_AD_LOCK:
        if key in cache:
            return cache[key].product(shapes)
        labelled = label()
        total = sum(float(weights.double().sum()) for _, weights in labelled)
        if not math.isfinite(total) or total <= 0:
            raise InvalidArgumentError(
                f"{current_caller()}: the sampler's weights sum to {total:g} over the "
                "refinement data; the sampled Fisher is divided by their sum, so it must be "
                "positive and finite (each input's weights sum to 1 for the library's "
                "samplers); fix the sampler's weights.")
        m = sum(int(weights.shape[0]) for _, weights in labelled)
        p = sum(math.prod(shape) for shape in shapes.values())
        # H [p, p] is kept when p < 2m (and no product wants G's rows), else G [m, p]
        side = p if p < 2 * m and not rows else m
        kept_size = side * p * 8 + (_factor_bytes(side, gram=side != p) if factor else 0)
        if m * p * 8 > budget or kept_size > budget:  # G is made before H is
            product = fisher_product(loss, params, names, labelled)
            product.kept, product.needed, product.budget = None, max(m * p * 8,
                                                                     kept_size), budget
            return product
        gradients, weights = sampled_gradients(loss, params, names, labelled)
        starts = tuple(itertools.accumulate((int(w.shape[0]) for _, w in labelled), initial=0))
        if side == p:  # H [p, p] is smaller and cheaper to apply
            gradients, weights = (gradients.T * (weights / weights.sum())) @ gradients, None
            starts = ()
        kept = KeptFisher(gradients, weights, starts=starts)
        size = kept.nbytes + (kept.factor_bytes if factor else 0)
        while cache and size + sum(k.nbytes for k in cache.values()) > budget:
            del cache[next(iter(cache))]  # the oldest checkpoint's
        cache[key] = kept
        return kept.product(shapes)


def sampled_gradients(loss: LossFn, params: Params, names: list[str],
                      labelled: list[tuple[Batch, Tensor]]) -> tuple[Tensor, Tensor]:
    """Per-example gradients of the labelled batches, ``(G [m, p] float64, weights [m])``.

    Columns follow ``names`` (each parameter flattened); computed in the parameters' dtype.
    """
    selected = {name: params[name] for name in names}
    frozen = {name: value for name, value in params.items() if name not in selected}

    def one(chosen: Params, example: Batch) -> Tensor:
        return loss({**frozen, **chosen}, example)

    per_example = vmap(grad(one), in_dims=(None, 0))
    parts, weights = [], []
    for batch, w in labelled:
        grads = per_example(selected, batch)  # {name: [b, *shape]}
        parts.append(torch.cat([grads[name].reshape(w.shape[0], -1).double()
                                for name in names], dim=1))
        weights.append(w.double().to(parts[-1].device))
    return torch.cat(parts), torch.cat(weights)


def gradient_product(gradients: Tensor, weights: Tensor | None,
                     shapes: dict[str, tuple[int, ...]], starts: tuple[int, ...] = ()
                     ) -> Callable[..., Vectors]:
    """``V -> G^T (w * (G V)) / sum w`` for ``G [m, p]`` (columns in ``shapes``' order);
    with ``weights=None``, ``gradients`` is ``H [p, p]`` itself and ``V -> H V``
    (``method``: ``"gradients"``, ``"matrix"``). Its ``flat`` is the same map on flat rows
    ``[t, p]`` float64 (what conjugate gradient runs on: no conversion per step).

    ``batches=`` (``G`` only: ``starts`` gives each batch's rows, :class:`KeptFisher`) takes
    the product over those batches' rows, scaled to the unbiased estimate (module
    docstring)."""
    layout = tuple(shapes.items())
    share = None if weights is None else weights / weights.sum()  # [m], once, not per step

    def flat(rows: Tensor, batches: list[int] | None = None) -> Tensor:  # [t, p] -> [t, p]
        device, rows = rows.device, rows.to(gradients)
        if batches is not None:
            if share is None or not starts:
                raise InvalidArgumentError(
                    f"{current_caller()}: a product over some batches needs the kept "
                    "per-example gradients G, but H [p, p] was kept; keep G "
                    "(checkpoint_product(rows=True)).")
            chosen = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in batches])
            part = gradients[chosen.to(gradients.device)]
            # share's rows times n / |B|: the estimate's expectation over the draws is H
            scale = share[chosen.to(share.device)] * ((len(starts) - 1) / len(batches))
            return (((rows @ part.T) * scale) @ part).to(device)
        if share is None:
            return (rows @ gradients).to(device)  # H is symmetric
        # [t, m]: g_j . v_t, then [t, p]
        return (((rows @ gradients.T) * share) @ gradients).to(device)

    def product(vectors: Vectors, batches: list[int] | None = None) -> Vectors:
        first = next(iter(vectors.values()))
        return unflatten(flat(flatten(vectors, layout).to(first.device, torch.float64),
                              batches), layout)

    product.method = "gradients" if weights is not None else "matrix"
    product.flat = flat
    product.kept = None  # set by KeptFisher.product
    return product


def fisher_product(loss: LossFn, params: Params, names: list[str],
                   labelled: list[tuple[Batch, Tensor]]) -> Callable[..., Vectors]:
    """``v -> H v`` for ``t`` vectors at once, functionally (``H`` and ``G`` never formed).

    Args:
        loss: The per-example loss (one example -> a scalar).
        params: The checkpoint's parameters; ``names`` are differentiated.
        labelled: ``(batch, weights [b])`` pairs from the sampler.

    Returns:
        ``fn({name: [t, *shape]}, batches=None) -> {name: [t, *shape]}`` in float64
        (``batches``: indices into ``labelled``, the unbiased estimate from those, module
        docstring).
    """
    selected = {name: params[name] for name in names}
    frozen = {name: value for name, value in params.items() if name not in selected}
    dtype = next(iter(selected.values())).dtype
    total_weight = float(sum(float(w.sum()) for _, w in labelled))

    def product(vectors: Vectors, batches: list[int] | None = None) -> Vectors:
        with FORWARD_AD_LOCK:  # the jvp and the vjp nested in it: one thread at a time
            if batches is None:
                return unlocked(vectors, labelled, total_weight)
            # every batch's weight times |B| / n: the estimate's expectation is H
            return unlocked(vectors, [labelled[i] for i in batches],
                            total_weight * len(batches) / len(labelled))

    def unlocked(vectors: Vectors, chosen_batches: list[tuple[Batch, Tensor]],
                 total_weight: float) -> Vectors:
        out = {name: torch.zeros_like(value, dtype=torch.float64)
               for name, value in vectors.items()}
        # jvp wants the tangents in the primals' key order, which need not be the vectors'
        # (a selection listed out of module order: GPT-Neo's k, v, q projections)
        tangents = {name: vectors[name].to(dtype) for name in selected}
        for batch, weights in chosen_batches:
            def losses(chosen: Params, batch=batch) -> Tensor:  # [b]
                return vmap(lambda example: loss({**frozen, **chosen}, example))(batch)

            def along(tangent: Params) -> Tensor:  # g_j . v for every j: [b]
                return jvp(losses, (selected,), (tangent,))[1]

            directional = vmap(along)(tangents)  # [t, b]
            _, pullback = vjp(losses, selected)
            cotangents = directional * weights.to(directional)[None, :]
            summed = vmap(pullback)(cotangents)[0]  # {name: [t, *shape]}
            for name in out:
                out[name] += summed[name].double()
        return {name: value / total_weight for name, value in out.items()}

    product.method = "functional"
    product.flat = flat_map(product, tuple(
        (name, tuple(value.shape)) for name, value in selected.items()))
    return product
