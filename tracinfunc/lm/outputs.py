"""Output-token attribution: one test row per generated token."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from tracinfunc._validate import entry_point
from tracinfunc.build.torch import build_store
from tracinfunc.checkpoint import Checkpoint
from tracinfunc.errors import EmptyDataError, InvalidArgumentError, InvalidTypeError
from tracinfunc.grads import GradientOptions
from tracinfunc.lm.losses import IGNORE_INDEX
from tracinfunc.projection import Projection
from tracinfunc.store.protocols import GradientStore
from tracinfunc.types import LossFn

__all__ = ["OutputTokens", "output_token_grads"]


class OutputTokens(NamedTuple):
    """Test rows of a sequence's scored tokens: row ``j`` is the gradient of token
    ``positions[j]``'s loss (predicting it from the tokens before it)."""

    grads: GradientStore
    positions: Tensor


@entry_point("output_token_grads")
def output_token_grads(loss: LossFn, checkpoints: Sequence[Checkpoint],
                       sequence: Mapping[str, Tensor], *, projection: Projection,
                       options: GradientOptions | None = None) -> OutputTokens:
    """One test row per scored token of ``sequence`` (e.g. each generated token).

    Row ``j`` is the projected gradient of the loss of token ``positions[j]`` alone (a copy of
    ``sequence`` whose labels keep only that target), so ``tif.top_k(store, grads)`` answers
    "which training documents made the model say token j", and
    :func:`~tracinfunc.token_scores` which of their tokens did.

    Args:
        loss: ``tif.causal_lm_loss(model)``, as for the store.
        checkpoints: The store's checkpoints.
        sequence: ``{"input_ids": [T], "attention_mask"?: [T], "labels"?: [T]}`` (or
            ``[1, T]``); scored targets are the positions ``t >= 1`` whose label is not
            ``IGNORE_INDEX`` and whose mask is 1 (``generation_batch`` scores the
            continuation only).
        projection: ``store.projection``.
        options: As for ``build_store`` (the store's ``select``).

    Returns:
        :class:`OutputTokens`: ``grads`` an in-memory store ``[n_ckpt, n_out, k]`` and
        ``positions [n_out]``, increasing.

    Raises:
        EmptyDataError: the sequence scores no token.
    """
    if not isinstance(sequence, Mapping) or "input_ids" not in sequence:
        raise InvalidTypeError(
            "output_token_grads: sequence must be {'input_ids': [T], ...}, got "
            f"{type(sequence).__name__}.")
    example = {key: torch.as_tensor(value) for key, value in sequence.items()}
    if example["input_ids"].dim() == 2 and example["input_ids"].shape[0] == 1:
        example = {key: value[0] for key, value in example.items()}
    ids = example["input_ids"]
    if ids.dim() != 1 or any(value.shape != ids.shape for value in example.values()):
        raise InvalidArgumentError(
            "output_token_grads: every key of sequence must be [T] (one sequence), got "
            f"{ {key: tuple(value.shape) for key, value in example.items()} }.")
    labels = example.get("labels", ids)
    scored = labels != IGNORE_INDEX
    if "attention_mask" in example:
        scored &= example["attention_mask"] != 0
    scored[:1] = False
    positions = scored.nonzero().flatten()
    if len(positions) == 0:
        raise EmptyDataError(
            "output_token_grads: the sequence scores no token (all labels IGNORE_INDEX, "
            "masked, or one token); give labels to the tokens to explain.")
    only = torch.full((len(positions), len(ids)), IGNORE_INDEX, dtype=labels.dtype)
    only[torch.arange(len(positions)), positions] = labels[positions]
    batch = {key: value.expand(len(positions), -1) for key, value in example.items()
             if key != "labels"}
    batch["labels"] = only
    grads = build_store(loss, checkpoints, batch, projection=projection, options=options,
                        progress=False)
    return OutputTokens(grads, positions)
