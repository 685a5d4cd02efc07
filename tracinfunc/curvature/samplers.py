"""Labels drawn from the model's own predictive distribution: the true Fisher, not the empirical.

The Gauss-Newton matrix of a cross-entropy loss equals the Fisher ``E_x E_{y ~ p(y|x; w)}
[g(x, y) g(x, y)^T]``: gradients taken at labels the model itself would predict. The empirical
Fisher, built from the dataset's labels, is a different matrix (and measured worse here, see
``docs/curvature.md``). A sampler turns a batch into such a labelled batch:

    sampler(loss, params, batch, generator) -> (labelled batch [b'], weights [b'])

where every input's weights sum to 1, so ``sum_j w_j g_j g_j^T`` over the labelled batch is
``b`` times the batch's Fisher. ``loss`` is the per-example loss with the checkpoint's buffers
(:func:`~tracinfunc.checkpoint.loss_at`), ``params`` the checkpoint's parameters, ``generator`` the
only source of randomness (results are a function of the arguments).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from tracinfunc._validate import current_caller
from tracinfunc.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    LossFunctionError,
    NonFiniteGradientError,
)
from tracinfunc.lm.losses import IGNORE_INDEX, causal_lm_loss
from tracinfunc.loss import ModuleLoss, swapped_call
from tracinfunc.types import Batch, LossFn, Params

__all__ = ["CheckedSampler", "Sampler", "causal_lm_sampler", "class_label_shape",
           "classification_sampler", "default_sampler"]


class Sampler(Protocol):
    """``(loss, params, batch, generator) -> (labelled batch [b'], weights [b'])``."""

    def __call__(self, loss: LossFn, params: Params, batch: Batch,
                 generator: torch.Generator) -> tuple[Batch, Tensor]: ...


@dataclass(frozen=True)
class ClassificationSampler:
    """Class labels for ``(inputs, target)`` batches of a :func:`~tracinfunc.loss_from_module`
    loss whose module returns logits ``[b, n_classes]``.

    Attributes:
        samples: Labels drawn per input (weights ``1 / samples`` each).
        exact: Every class once, weighted by its probability: the exact Fisher (``n_classes``
            gradients per input instead of ``samples``).
    """

    samples: int = 1
    exact: bool = False

    def __call__(self, loss: LossFn, params: Params, batch: Batch,
                 generator: torch.Generator) -> tuple[Batch, Tensor]:
        module_loss = _module_loss(loss, pair=True)
        inputs = batch[0]
        with torch.no_grad():
            logits = swapped_call(module_loss.module, {**module_loss.buffers, **params},
                                  (inputs,))
        if not isinstance(logits, Tensor) or logits.dim() != 2:
            raise LossFunctionError(
                f"classification_sampler: the model must return logits [b, n_classes], got "
                f"{_describe(logits)}; pass sampler= your own (see tracinfunc.curvature."
                "samplers) for other outputs."
            )
        _check_logits(logits)
        probs = logits.double().softmax(-1)  # [b, C]
        b, n_classes = probs.shape
        if self.exact:
            labels = torch.arange(n_classes, device=inputs.device).repeat(b)  # [b * C]
            owner = torch.arange(b, device=inputs.device).repeat_interleave(n_classes)
            weights = probs.reshape(-1)
        else:
            draws = _draw_labels(probs.cpu(), self.samples, generator).to(inputs.device)
            labels = draws.reshape(-1)
            owner = torch.arange(b, device=inputs.device).repeat_interleave(self.samples)
            weights = torch.full((b * self.samples,), 1 / self.samples, dtype=torch.float64)
        target = batch[1]
        shape = class_label_shape(target, "classification_sampler",
                                  "pass sampler= your own that draws labels in your form")
        return (inputs[owner], labels.to(target.dtype).reshape(-1, *shape)), weights.cpu()


def class_label_shape(target: Tensor, who: str, fix: str) -> tuple[int, ...]:
    """One example's target shape (``()`` or ``(1,)``) when the targets ``[b, ...]`` are
    integer class indices, the label form a class drawn or enumerated from the logits takes;
    else a refusal (one-hot or soft float targets would be given a class index, which a
    soft-label criterion broadcasts into a wrong Fisher silently) ending with ``fix``."""
    shape = tuple(target.shape[1:])
    if target.is_floating_point() or target.is_complex() or math.prod(shape) != 1:
        raise InvalidArgumentError(
            f"{who}: labels are class indices shaped like one example's target, but the "
            f"targets are {target.dtype} of shape {list(shape)} per example (one-hot or soft "
            "labels?), so the criterion would be given another label form and the Fisher "
            f"would be wrong. Use integer class targets, or {fix}.")
    return shape


@dataclass(frozen=True)
class CausalLMSampler:
    """Next tokens for ``{"input_ids": [b, T], ...}`` batches of a
    :func:`~tracinfunc.causal_lm_loss`: every scored position gets a token drawn from the
    model's next-token distribution (the inputs stay as given, teacher forcing).

    Attributes:
        samples: Label sequences drawn per input (weights ``1 / samples`` each).
    """

    samples: int = 1

    def __call__(self, loss: LossFn, params: Params, batch: Batch,
                 generator: torch.Generator) -> tuple[Batch, Tensor]:
        module_loss = _module_loss(loss, pair=False)
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise InvalidArgumentError(
                "causal_lm_sampler: batches must be dicts with 'input_ids' [b, T], got "
                f"{_describe(batch)}; this sampler is for tracinfunc.causal_lm_loss."
            )
        kwargs = {k: v for k, v in batch.items() if k not in module_loss.skip_keys}
        with torch.no_grad():
            outputs = swapped_call(module_loss.module, {**module_loss.buffers, **params},
                                   (), kwargs)
        logits = outputs if isinstance(outputs, Tensor) else getattr(outputs, "logits", None)
        if not isinstance(logits, Tensor) or logits.dim() != 3:
            raise LossFunctionError(
                f"causal_lm_sampler: the model must return logits [b, T, V], got "
                f"{_describe(outputs)}."
            )
        ids = batch["input_ids"]
        b, length, vocab = logits.shape
        scored = batch.get("labels", ids).clone()
        if "attention_mask" in batch:
            scored = scored.masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        _check_logits(logits[:, :-1])
        probs = logits[:, :-1].double().softmax(-1).reshape(-1, vocab).cpu()
        draws = _draw_labels(probs, self.samples, generator)  # [b * (T - 1), samples]
        draws = draws.reshape(b, length - 1, self.samples).permute(0, 2, 1).to(ids.device)
        owner = torch.arange(b, device=ids.device).repeat_interleave(self.samples)
        labels = torch.full((b * self.samples, length), IGNORE_INDEX, dtype=ids.dtype,
                            device=ids.device)
        labels[:, 1:] = draws.reshape(-1, length - 1).to(ids.dtype)
        labels = labels.masked_fill(scored[owner] == IGNORE_INDEX, IGNORE_INDEX)
        labelled = {key: value[owner] for key, value in batch.items() if key != "labels"}
        labelled["labels"] = labels
        weights = torch.full((b * self.samples,), 1 / self.samples, dtype=torch.float64)
        return labelled, weights


@dataclass
class CheckedSampler:
    """A sampler that knows where it is in the data (the offset of each batch), so a NaN or
    infinite example is refused by its index in the data and the checkpoint, as
    ``build_store`` names one, instead of a raw error from the draw.

    Attributes:
        sampler: The sampler wrapped.
        checkpoint: The checkpoint's name, for messages.
        start: Index in the data of the last batch's first example.
        size: Examples in the last batch.
    """

    sampler: Sampler
    checkpoint: str
    start: int = 0
    size: int = 0

    def __call__(self, loss: LossFn, params: Params, batch: Batch,
                 generator: torch.Generator) -> tuple[Batch, Tensor]:
        self.start += self.size
        leaves = [leaf for leaf in tree_leaves(batch) if isinstance(leaf, Tensor)]
        self.size = leaves[0].shape[0]
        finite = torch.ones(self.size, dtype=torch.bool, device=leaves[0].device)
        for leaf in leaves:
            if leaf.is_floating_point() and leaf.dim() and leaf.shape[0] == self.size:
                finite &= leaf.reshape(self.size, -1).isfinite().all(1).to(finite.device)
        if not bool(finite.all()):
            self.refuse("the input", (torch.nonzero(~finite).reshape(-1) + self.start).tolist())
        try:
            labelled, weights = self.sampler(loss, params, batch, generator)
        except NonFiniteGradientError as error:
            rows = getattr(error, "rows", None)
            if rows is None:
                raise
            self.refuse("the model's output", [self.start + r for r in rows])
        _check_weights(weights, labelled, self.checkpoint)
        if not bool(torch.isfinite(weights).all()):
            self.refuse("the sampler's weights")
        return labelled, weights

    def refuse(self, what: str, rows: list[int] | None = None) -> None:
        """Raise naming ``rows`` (indices in the data), or the last batch's range."""
        shown = (", ".join(map(str, rows[:10])) + (", ..." if len(rows) > 10 else "")
                 if rows else f"{self.start} to {self.start + self.size - 1} (one of them)")
        raise NonFiniteGradientError(
            f"{current_caller()}: {what} for data example(s) {shown} is NaN or infinite at "
            f"checkpoint {self.checkpoint!r}, so the curvature cannot be estimated from it. "
            "Remove or fix those examples (check their inputs for NaN/inf), or fit on data "
            "without them."
        )


def _draw_labels(probs: Tensor, samples: int, generator: torch.Generator) -> Tensor:
    """``samples`` labels per row of ``probs`` ``[rows, C]`` (float64, on the CPU; finite,
    non-negative, as a softmax of checked logits gives them), drawn with replacement from each
    row's distribution: ``[rows, samples]`` int64.

    Inverse transform sampling, vectorised: one uniform per draw from ``generator``, scaled by
    the row's total (a sum of rounded probabilities), then the first class whose cumulative
    probability exceeds it (a class of probability 0 is never drawn). torch.multinomial draws
    from the same distribution but loops over the rows (~2 us a row: 0.14 s of a 3 s EK-FAC
    fit of the 2-layer Llama of ``benchmarks/curvature_fit.py``)."""
    cdf = probs.cumsum(-1)  # [rows, C]
    uniform = torch.rand(probs.shape[0], samples, dtype=probs.dtype, generator=generator)
    draws = torch.searchsorted(cdf, uniform.mul_(cdf[:, -1:]), right=True)
    return draws.clamp_(max=probs.shape[1] - 1)


def _check_weights(weights: Any, labelled: Batch, checkpoint: str) -> None:
    """Refuse weights that are not a floating ``[b']`` tensor, one per labelled example."""
    leaves = [leaf for leaf in tree_leaves(labelled) if isinstance(leaf, Tensor) and leaf.dim()]
    rows = leaves[0].shape[0] if leaves else None
    if isinstance(weights, Tensor) and weights.is_floating_point() and weights.dim() == 1 \
            and (rows is None or weights.shape[0] == rows):
        return
    got = (f"a {weights.dtype} tensor of shape {list(weights.shape)}"
           if isinstance(weights, Tensor) else type(weights).__name__)
    raise InvalidArgumentError(
        f"{current_caller()}: the sampler must return (labelled batch, weights) with weights "
        f"a floating tensor [b'] (one per labelled example: {rows}), got {got} at checkpoint "
        f"{checkpoint!r}; return e.g. torch.full((b',), 1.0 / samples, dtype=torch.float64).")


def _check_logits(logits: Tensor) -> None:
    """Raise (with ``.rows``, indices in the batch) if any example's logits are NaN/inf:
    labels cannot be drawn from them."""
    finite = logits.reshape(logits.shape[0], -1).isfinite().all(1)  # [b]
    if not bool(finite.all()):
        rows = torch.nonzero(~finite).reshape(-1).tolist()
        error = NonFiniteGradientError(
            f"{current_caller()}: the model's logits for example(s) {rows} of the batch are "
            "NaN or infinite; labels cannot be drawn from them. Fix those examples' inputs."
        )
        error.rows = rows
        raise error


def classification_sampler(*, samples: int = 1, exact: bool = False) -> ClassificationSampler:
    """Labels for a classifier: ``samples`` draws per input, or every class (``exact``).

    Args:
        samples: Draws per input, a positive int.
        exact: Use every class weighted by its probability (the exact Fisher, as ``dense``'s
            reference); costs ``n_classes`` gradients per input.
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise InvalidArgumentError(
            f"classification_sampler: samples must be a positive int, got {samples!r}; e.g. 1."
        )
    if not isinstance(exact, bool):
        raise InvalidTypeError(
            f"classification_sampler: exact must be True or False, got {exact!r}."
        )
    return ClassificationSampler(samples, exact)


def causal_lm_sampler(*, samples: int = 1) -> CausalLMSampler:
    """Next-token labels for a :func:`~tracinfunc.causal_lm_loss`, ``samples`` per sequence."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise InvalidArgumentError(
            f"causal_lm_sampler: samples must be a positive int, got {samples!r}; e.g. 1."
        )
    return CausalLMSampler(samples)


_CAUSAL_CRITERION = causal_lm_loss.__module__  # lm's criteria live in tracinfunc.lm.losses


def default_sampler(loss: LossFn) -> Sampler:
    """The sampler for losses the library made: classification for
    :func:`~tracinfunc.loss_from_module`, next tokens for :func:`~tracinfunc.causal_lm_loss`.

    Raises:
        InvalidArgumentError: any other loss (pass ``sampler=`` yourself).
    """
    if isinstance(loss, ModuleLoss) and loss.pair:
        return classification_sampler()
    criterion = getattr(loss, "criterion", None)
    if isinstance(loss, ModuleLoss) and getattr(criterion, "__name__", "") == "_next_token_loss" \
            and getattr(criterion, "__module__", "") == _CAUSAL_CRITERION:
        return causal_lm_sampler()
    raise InvalidArgumentError(
        f"fit_curvature: cannot tell how to sample labels for this loss "
        f"({type(loss).__name__}); the true Fisher needs labels drawn from the model. Pass "
        "sampler=classification_sampler() for a loss_from_module classifier, "
        "sampler=causal_lm_sampler() for causal_lm_loss, or your own "
        "sampler(loss, params, batch, generator) -> (labelled batch, weights)."
    )


def _module_loss(loss: LossFn, *, pair: bool) -> ModuleLoss:
    if not isinstance(loss, ModuleLoss) or loss.pair != pair:
        made_by = "loss_from_module" if pair else "causal_lm_loss"
        raise InvalidTypeError(
            f"{current_caller()}: needs a loss made by tracinfunc.{made_by} (it runs the model to "
            f"draw labels), got {type(loss).__name__}; pass sampler= your own for other losses."
        )
    return loss


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return type(value).__name__
