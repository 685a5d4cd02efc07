"""The expected Fisher: the sampled Fisher's expectation over the model's labels, exactly.

Refinement's sampled Fisher (:mod:`tracinfunc.curvature.fisher`) draws labels from the model:
``H = (1 / m) sum_j sum_s w_js g_j(y_s) g_j(y_s)^T`` over ``m`` inputs. Its expectation over
the draws is, with ``J_j`` the Jacobian of input ``j``'s logits in the parameters and
``d_j(y)`` the criterion's gradient in those logits at label ``y``,

    F = (1 / m) sum_j J_j^T M_j J_j,    M_j = E_{y ~ p(. | x_j)} [d_j(y) d_j(y)^T].

``M_j`` is small (output space) and known in closed form for the losses the library makes:

- :func:`~tracinfunc.causal_lm_loss` (the mean of next-token cross-entropy over the ``n_j``
  scored positions; each position's label drawn independently, the inputs teacher-forced):
  ``d_j(y) = (1 / n_j) sum_t (p_t - e_{y_t})``, and the cross terms between positions vanish
  because ``E[p_t - e_{y_t}] = 0``, so ``M_j`` is block diagonal with blocks
  ``(diag p_t - p_t p_t^T) / n_j^2`` at the scored positions;
- a :func:`~tracinfunc.loss_from_module` classifier (labels drawn from ``softmax(logits)``):
  ``M_j = D_j^T diag(p_j) D_j`` with ``D_j [C, C]`` the criterion's gradients at every class
  (for cross-entropy ``diag p - p p^T``): the Fisher ``classification_sampler(exact=True)``
  enumerates.

``F V`` for ``t`` vectors at once is a ``jvp`` of the logits (``J V``), ``M`` applied in output
space, and a ``vjp`` (``J^T``), ``vmap``-ed over the vectors: a forward and a backward pass over
every refinement example per product, with no label noise and a rank not limited by ``m``
(one drawn label sequence per input gives a sampled Fisher of rank at most ``m``; for a
language model ``F`` has up to ``m x T x (V - 1)``). Nothing is formed or kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.func import grad, jvp, vjp, vmap
from torch.utils._pytree import tree_leaves

from tracinfunc._validate import current_caller
from tracinfunc.curvature.fisher import FORWARD_AD_LOCK
from tracinfunc.curvature.flat import flat_map
from tracinfunc.curvature.samplers import class_label_shape
from tracinfunc.errors import InvalidArgumentError, LossFunctionError, NonFiniteGradientError
from tracinfunc.lm.losses import IGNORE_INDEX, causal_lm_loss
from tracinfunc.loss import ModuleLoss, check_eval_mode, class_targets
from tracinfunc.types import Batch, Params

__all__ = ["CHUNK_BYTES", "expected_loss", "expected_product"]

Vectors = dict[str, Tensor]  # {name: [t, *shape]}: t vectors in parameter space

# Bytes of output-space work (J v, M J v in float64) per chunk of query vectors: the product
# runs the queries through the jvp in chunks of at most this (at least one vector).
CHUNK_BYTES = 256 * 2**20

# causal_lm_loss's criterion, recognised by its name and module (as default_sampler does)
_CAUSAL = ("_next_token_loss", causal_lm_loss.__module__)


def expected_loss(loss: Any) -> ModuleLoss:
    """``loss`` itself when its expected Fisher is known (a ``loss_from_module`` classifier or
    a ``causal_lm_loss``); else a clear refusal naming the ways out."""
    if isinstance(loss, ModuleLoss) and loss.criterion is not None:
        criterion = loss.criterion
        if loss.pair or (getattr(criterion, "__name__", ""),
                         getattr(criterion, "__module__", "")) == _CAUSAL:
            return loss
    raise InvalidArgumentError(
        f"{current_caller()}: fisher='expected' computes the Fisher's expectation over the "
        "model's labels in closed form, which is known for losses made by "
        "tracinfunc.loss_from_module (a classifier returning logits [b, n_classes]) or "
        f"tracinfunc.causal_lm_loss; got {type(loss).__name__}"
        + ("" if not isinstance(loss, ModuleLoss) else " with another criterion")
        + ". Refine with fisher='sampled' (labels drawn by a sampler: pass sampler= your own "
        "for this loss; on the command line --refine-fisher sampled).")


def expected_product(loss: ModuleLoss, params: Params, names: list[str],
                     batches: tuple[Batch, ...]) -> Callable[..., Vectors]:
    """``v -> F v`` for ``t`` vectors at once (module docstring), functionally.

    Args:
        loss: A loss :func:`expected_loss` accepts, with the checkpoint's buffers.
        params: The checkpoint's parameters; ``names`` are differentiated.
        batches: The refinement's training batches.

    Returns:
        ``fn({name: [t, *shape]}, batches=None) -> {name: [t, *shape]}`` in float64 (``batches``:
        indices into ``batches``, the unbiased estimate of ``F`` from those, ``(n / |B|) sum
        over their inputs / m``), with ``method`` = ``"expected"``, ``kept = None`` and
        ``flat`` (the same map on flat rows ``[t, p]``).

    Raises:
        NonFiniteGradientError: an example's input, logits or Jacobian-vector products are
            NaN or infinite (named by its index in the refinement data).
        TrainModeError: the model is in train mode (dropout, BatchNorm).
        InvalidArgumentError: a classifier whose targets are not integer class indices
            (``[b]`` or ``[b, 1]``), or whose outputs are not logits ``[b, n_classes]``.
    """
    check_eval_mode(loss.module)  # vmap would refuse dropout with a bare error
    selected = {name: params[name] for name in names}
    frozen = {name: value for name, value in params.items() if name not in selected}
    dtype = next(iter(selected.values())).dtype
    output_fisher = _classifier_fisher(loss) if loss.pair else _causal_fisher
    _check_finite(loss, params, batches)
    starts = [0]  # each batch's first example's index in the refinement data, and m
    for batch in batches:
        starts.append(starts[-1] + _rows(batch))
    batches_of = batches  # the products' own name: their argument is ``batches=``

    def logits_of(chosen: Params, example: Batch) -> Tensor:  # [1, ...] for one example
        return _logits(loss.outputs({**frozen, **chosen}, example)[0])

    def product(vectors: Vectors, batches: list[int] | None = None) -> Vectors:
        with FORWARD_AD_LOCK:  # the jvp and the vjp nested in it: one thread at a time
            if batches is None:
                return unlocked(vectors, range(len(batches_of)), starts[-1])
            # every input counted, times |B| / n: the estimate's expectation is F
            return unlocked(vectors, batches, starts[-1] * len(batches) / len(batches_of))

    def unlocked(vectors: Vectors, indices: Iterable[int], inputs: float) -> Vectors:
        out = {name: torch.zeros_like(value, dtype=torch.float64)
               for name, value in vectors.items()}
        # jvp wants the tangents in the primals' key order (see fisher.fisher_product)
        tangents = {name: vectors[name].to(dtype) for name in selected}
        count = next(iter(tangents.values())).shape[0]
        for index in indices:
            batch, start = batches_of[index], starts[index]

            def logits(chosen: Params, batch=batch) -> Tensor:  # [b, 1, ...]
                return vmap(lambda example: logits_of(chosen, example))(batch)

            def along(tangent: Params) -> Tensor:  # J v for every example: [b, 1, ...]
                return jvp(logits, (selected,), (tangent,))[1]

            primal, pullback = vjp(logits, selected)
            # the vectors in chunks: J v and M J v are [chunk, b, 1, ...] (a language model's
            # logits times the queries would not fit), a few float64 copies per vector
            step = max(1, CHUNK_BYTES // (primal.numel() * 32))
            for first in range(0, count, step):
                part = {name: value[first:first + step] for name, value in tangents.items()}
                directions = vmap(along)(part)  # [chunk, b, 1, ...]
                _check_directions(directions, start)
                cotangents = output_fisher(primal.detach(), directions, batch)
                summed = vmap(pullback)(cotangents.to(primal.dtype))[0]  # {name: [chunk, ...]}
                for name in out:
                    out[name][first:first + step] += summed[name].double()
        return {name: value / inputs for name, value in out.items()}

    product.method = "expected"
    product.kept = None
    product.flat = flat_map(product, tuple(
        (name, tuple(value.shape)) for name, value in selected.items()))
    return product


def _causal_fisher(logits: Tensor, directions: Tensor, batch: Batch) -> Tensor:
    """``M u`` per example: ``(diag p_t - p_t p_t^T) u_t / n^2`` at the scored positions.

    ``logits`` ``[b, 1, T, V]``, ``directions`` ``[t, b, 1, T, V]``; float64 out, zero at
    the last position (no next token) and at unscored ones (as the loss masks them)."""
    labels = batch.get("labels", batch["input_ids"])  # [b, T]
    if "attention_mask" in batch:
        labels = labels.masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
    scored = (labels[:, 1:] != IGNORE_INDEX).double()  # [b, T - 1]
    scale = scored / scored.sum(1, keepdim=True).clamp_min(1) ** 2  # 1 / n^2 where scored
    probs = logits[:, 0, :-1].double().softmax(-1)  # [b, T - 1, V]
    u = directions[:, :, 0, :-1].double()  # [t, b, T - 1, V]
    mu = probs * u - probs * (probs * u).sum(-1, keepdim=True)
    out = torch.zeros_like(directions, dtype=torch.float64)
    out[:, :, 0, :-1] = mu * scale[None, :, :, None].to(mu.device)
    return out


def _classifier_fisher(loss: ModuleLoss) -> Callable[[Tensor, Tensor, Batch], Tensor]:
    """``M u = D^T (p * (D u))`` per example, ``D [C, C]`` the criterion's gradients in the
    logits at every class (the labels ``classification_sampler`` draws)."""

    def apply(logits: Tensor, directions: Tensor, batch: Batch) -> Tensor:
        if logits.dim() != 3:  # [b, 1, C]
            raise InvalidArgumentError(
                f"{current_caller()}: fisher='expected' needs a classifier returning logits "
                f"[b, n_classes], got outputs of shape {[1, *logits.shape[2:]]} per example; "
                "refine with fisher='sampled' and your own sampler= for other outputs.")
        target = class_targets(loss.criterion, batch[1])  # uint8 class indices as int64
        # every class is given to the criterion as a label of the targets' own form
        shape = class_label_shape(target, f"{current_caller()}: fisher='expected'",
                                  "fisher='sampled' with a sampler= that draws your label form")
        n_classes = logits.shape[-1]
        classes = torch.arange(n_classes, device=logits.device).to(target.dtype)

        def at_class(row: Tensor, label: Tensor) -> Tensor:  # d(y): [C]
            return grad(lambda z: loss.criterion(z[None], label.expand(shape)[None]))(row)

        def per_example(row: Tensor) -> Tensor:  # D [C (label), C (logit)]
            # the row batched with the labels (an expanded view, no copy): criteria with
            # in-place steps (label smoothing) refuse an unbatched row beside batched labels
            return vmap(at_class)(row.expand(n_classes, n_classes), classes)

        # D [b, C, C] float64 in chunks of examples of at most ~64 MiB (many classes)
        chunk = max(1, 2**23 // n_classes**2)
        rows = logits[:, 0]
        gradients = torch.cat([vmap(per_example)(rows[i:i + chunk]).double()
                               for i in range(0, rows.shape[0], chunk)])
        probs = rows.double().softmax(-1)  # [b, C]
        u = directions[:, :, 0].double()  # [t, b, C]
        du = torch.einsum("byc,tbc->tby", gradients, u) * probs[None]  # p * (D u)
        return torch.einsum("byc,tby->tbc", gradients, du)[:, :, None]  # [t, b, 1, C]

    return apply


def _check_finite(loss: ModuleLoss, params: Params, batches: tuple[Batch, ...]) -> None:
    """Refuse NaN or infinite inputs or logits by their index in the refinement data."""
    start = 0
    with torch.no_grad():
        for batch in batches:
            size = _rows(batch)
            finite = torch.ones(size, dtype=torch.bool)
            for leaf in tree_leaves(batch):
                if isinstance(leaf, Tensor) and leaf.is_floating_point() and leaf.dim() \
                        and leaf.shape[0] == size:
                    finite &= leaf.reshape(size, -1).isfinite().all(1).cpu()
            if not bool(finite.all()):
                _refuse((torch.nonzero(~finite).reshape(-1) + start).tolist(),
                        "hold NaN or infinite inputs")
            logits = vmap(lambda example: _logits(loss.outputs(params, example)[0]))(batch)
            finite = logits.reshape(size, -1).isfinite().all(1)
            if not bool(finite.all()):
                _refuse((torch.nonzero(~finite).reshape(-1) + start).tolist(),
                        "give NaN or infinite logits")
            start += size


def _check_directions(directions: Tensor, start: int) -> None:
    """Refuse examples whose ``J v`` overflowed (finite but huge inputs), by data index."""
    finite = directions.transpose(0, 1).reshape(directions.shape[1], -1).isfinite().all(1)
    if not bool(finite.all()):
        _refuse((torch.nonzero(~finite).reshape(-1) + start).tolist(),
                "give NaN or infinite Jacobian-vector products (values so large that they "
                "overflow)")


def _refuse(rows: list[int], what: str) -> None:
    shown = ", ".join(map(str, rows[:10])) + (", ..." if len(rows) > 10 else "")
    raise NonFiniteGradientError(
        f"{current_caller()}: refinement example(s) {shown} {what}, so the expected Fisher "
        "cannot be computed from them. Remove or fix those examples (check their inputs for "
        "NaN/inf or huge values).")


def _logits(outputs: Any) -> Tensor:
    logits = outputs if isinstance(outputs, Tensor) else getattr(outputs, "logits", None)
    if not isinstance(logits, Tensor):
        raise LossFunctionError(
            f"{current_caller()}: fisher='expected' needs the model's logits, but it returned "
            f"{type(outputs).__name__} (no .logits); wrap the model so it returns them, or "
            "refine with fisher='sampled'.")
    return logits


def _rows(batch: Batch) -> int:
    return next(leaf for leaf in tree_leaves(batch) if isinstance(leaf, Tensor)).shape[0]
