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

from collections.abc import Mapping

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


def completion_labels(input_ids: Tensor | Mapping[str, Tensor], prompt_length: int | Tensor,
                      *, attention_mask: Tensor | None = None,
                      pad_token_id: int | None = None) -> Tensor:
    """``input_ids`` with the prompt's tokens and the padding set to :data:`IGNORE_INDEX`.

    Padding is where ``attention_mask`` is 0, else (without a mask) where the token is
    ``pad_token_id``. Give one of them for padded batches: HF's own loss (``labels=``) and a
    ``Trainer`` score every label that is not -100, so unmasked padding would be trained on
    and counted. Prefer the mask when the pad token is also the end-of-text token (GPT-2,
    Llama), since the pad id also masks a real end-of-text token.

    Args:
        input_ids: ``[T]`` or ``[b, T]`` token ids, or a tokenizer's output (a dict or
            ``BatchEncoding`` with ``input_ids`` and, if present, ``attention_mask``).
        prompt_length: Tokens of prompt (an int, or ``[b]`` per row), counted from the
            first position (left padding counts as prompt).
        attention_mask: ``[T]`` or ``[b, T]``, 1 on tokens, 0 on padding.
        pad_token_id: The tokenizer's ``pad_token_id``, used when there is no mask.

    Returns:
        Labels shaped like ``input_ids``: the completion's tokens are scored; the prompt's
        and the padding's are :data:`IGNORE_INDEX`.

    Example:
        >>> batch = tokenizer(texts, padding=True, return_tensors="pt")
        >>> batch["labels"] = completion_labels(batch, prompt_lengths)
    """
    if isinstance(input_ids, Mapping):
        if attention_mask is None:
            attention_mask = input_ids.get("attention_mask")
        input_ids = input_ids["input_ids"]
    lengths = torch.as_tensor(prompt_length, device=input_ids.device)
    if (lengths < 0).any():
        raise InvalidArgumentError(
            f"completion_labels: prompt_length must be >= 0, got {prompt_length!r}."
        )
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    prompt = positions < lengths.unsqueeze(-1) if lengths.dim() else positions < lengths
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise InvalidArgumentError(
                f"completion_labels: attention_mask has shape {tuple(attention_mask.shape)} "
                f"but input_ids has {tuple(input_ids.shape)}; pass the tokenizer's mask for "
                "the same batch."
            )
        prompt = prompt | (attention_mask == 0)
    elif pad_token_id is not None:
        prompt = prompt | (input_ids == pad_token_id)
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
