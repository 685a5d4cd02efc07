"""Ready-made per-example losses for language models (Hugging Face or any module).

Examples are dicts of tensors without a batch dimension, as a tokenizer gives them for one
text: ``{"input_ids": [T], "attention_mask": [T], "labels": [T]}`` (``labels`` optional).
Tokens whose label is ``-100`` (HF's ignore index) and padding (``attention_mask == 0``) do not
count, so :func:`completion_labels` makes the completion-only loss of LESS: the prompt's
tokens are context, and only the completion's tokens are scored.

The losses compute the loss from the logits themselves (the model is never given the
labels), so every model that returns logits works, and factorised projection
(``kind="kronecker"``) covers the embedding, every Linear/Conv1D and a tied output head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tracinfunc.errors import InvalidArgumentError, LossFunctionError
from tracinfunc.loss import ModuleLoss, loss_from_model

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "completion_labels", "sequence_classification_loss"]

IGNORE_INDEX = -100
"""Label of a token that is not scored (as in Hugging Face and ``F.cross_entropy``)."""


def causal_lm_loss(model: nn.Module) -> ModuleLoss:
    """Mean next-token cross-entropy of one sequence, over its scored tokens.

    Token ``t + 1`` is predicted from tokens ``<= t``; a target counts unless its label is
    :data:`IGNORE_INDEX` or its ``attention_mask`` is 0. ``labels`` defaults to ``input_ids``.

    Args:
        model: A causal LM (HF ``*ForCausalLM`` or any module returning logits ``[1, T, V]``
            or an object with ``.logits``), in eval mode.

    Returns:
        A :class:`~tracinfunc.loss.ModuleLoss` over examples
        ``{"input_ids": [T], "attention_mask"?: [T], "labels"?: [T]}``.

    Example:
        >>> loss = causal_lm_loss(gpt2)
        >>> labels = completion_labels(ids, prompt_length=5)      # completion-only (LESS)
        >>> loss(params, {"input_ids": ids, "labels": labels})
    """
    return loss_from_model(model, criterion=_next_token_loss, skip_keys=("labels",))


def sequence_classification_loss(model: nn.Module) -> ModuleLoss:
    """Cross-entropy of one sequence's class (HF ``*ForSequenceClassification``).

    Returns:
        A :class:`~tracinfunc.loss.ModuleLoss` over examples
        ``{"input_ids": [T], "attention_mask"?: [T], "labels": []}``.
    """
    return loss_from_model(model, criterion=_classification_loss, skip_keys=("labels",))


def completion_labels(input_ids: Tensor, prompt_length: int | Tensor) -> Tensor:
    """``input_ids`` with the prompt's tokens set to :data:`IGNORE_INDEX`.

    Args:
        input_ids: ``[T]`` or ``[b, T]`` token ids.
        prompt_length: Tokens of prompt (an int, or ``[b]`` per row).

    Returns:
        Labels shaped like ``input_ids``: the completion's tokens are scored, the prompt's not.
    """
    lengths = torch.as_tensor(prompt_length, device=input_ids.device)
    if (lengths < 0).any():
        raise InvalidArgumentError(
            f"completion_labels: prompt_length must be >= 0, got {prompt_length!r}."
        )
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    prompt = positions < lengths.unsqueeze(-1) if lengths.dim() else positions < lengths
    return input_ids.masked_fill(prompt, IGNORE_INDEX)


def _logits(outputs) -> Tensor:
    logits = outputs if isinstance(outputs, Tensor) else getattr(outputs, "logits", None)
    if not isinstance(logits, Tensor):
        raise LossFunctionError(
            f"causal_lm_loss: the model returned {type(outputs).__name__}, expected logits "
            "[1, T, V] or an output with .logits; wrap the model so it returns them."
        )
    return logits


def _next_token_loss(outputs, example) -> Tensor:
    logits = _logits(outputs)  # [1, T, V]
    labels = example.get("labels", example["input_ids"])
    mask = example.get("attention_mask")
    if mask is not None:
        labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    targets = labels[:, 1:]  # [1, T - 1]
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(),
                                ignore_index=IGNORE_INDEX, reduction="none")
    scored = (targets.flatten() != IGNORE_INDEX).to(per_token.dtype)
    # A mean over a data-dependent count, without .item() (vmap cannot branch on values).
    return per_token.sum() / scored.sum().clamp_min(1)


def _classification_loss(outputs, example) -> Tensor:
    logits = _logits(outputs)  # [1, n_classes]
    return F.cross_entropy(logits, example["labels"].reshape(1))
