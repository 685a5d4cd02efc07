"""Checks of :func:`~tracinfunc.token_scores`' inputs, run before any gradient work."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from tracinfunc.errors import (
    EmptyDataError,
    IncompatibleGradientsError,
    InvalidArgumentError,
    InvalidTypeError,
    TrainModeError,
)
from tracinfunc.interop import tensor_if_array
from tracinfunc.store.meta import check_compatible
from tracinfunc.store.protocols import GradientStore

__all__ = ["check_documents", "check_eval", "check_rows", "check_test_grads"]

_KEYS = ("input_ids", "attention_mask", "labels")


def check_test_grads(store: GradientStore, test_grads: Any) -> Tensor:
    """``[n_ckpt, n_test, k]`` test rows, finite, matching the store."""
    meta = store.meta
    if isinstance(test_grads, GradientStore):
        check_compatible(meta, test_grads.meta)
        n = test_grads.meta.n_train
        test = torch.stack([test_grads.read_rows(c, 0, n) for c in range(meta.n_ckpt)])
    else:
        test = tensor_if_array(test_grads)
        if not isinstance(test, Tensor):
            raise InvalidTypeError(
                "token_scores: test_grads must be a GradientStore or a tensor "
                f"[n_ckpt, n_test, k], got {type(test_grads).__name__}.")
    expected = (meta.n_ckpt, meta.k)
    if test.dim() != 3 or (test.shape[0], test.shape[2]) != expected or not (
            test.is_floating_point()):
        raise IncompatibleGradientsError(
            f"token_scores: test_grads must be floating [n_ckpt={meta.n_ckpt}, n_test, "
            f"k={meta.k}], got {tuple(test.shape)} {test.dtype}; build them with "
            "projection=store.projection and the store's checkpoints.")
    if test.shape[1] == 0:
        raise EmptyDataError("token_scores: test_grads has no rows; pass at least one.")
    if not torch.isfinite(test).all():
        raise InvalidArgumentError(
            "token_scores: test_grads holds NaN or infinite values; recompute them (a loss "
            "that overflowed, or a model in float16).")
    return test


def check_documents(module: nn.Module, documents: Any) -> dict[str, Tensor]:
    """Token batches ``{key: [n_docs, T]}``: integer ids inside the vocabulary and positions."""
    if not isinstance(documents, Mapping) or "input_ids" not in documents:
        raise InvalidTypeError(
            "token_scores: documents must be a batch {'input_ids': [n_docs, T], ...} as given "
            f"to build_store, got {type(documents).__name__}.")
    unknown = sorted(set(documents) - set(_KEYS))
    if unknown:
        raise InvalidArgumentError(
            f"token_scores: documents has keys {unknown}; expected only {list(_KEYS)}.")
    docs = {key: tensor_if_array(value) for key, value in documents.items()}
    ids = docs["input_ids"]
    for key, value in docs.items():
        if not isinstance(value, Tensor) or value.is_floating_point() or value.dtype == torch.bool:
            raise InvalidTypeError(
                f"token_scores: documents[{key!r}] must be an integer tensor, got "
                f"{getattr(value, 'dtype', type(value).__name__)}; pass token ids as int64.")
        if value.dim() != 2 or value.shape != ids.shape:
            raise InvalidArgumentError(
                f"token_scores: documents[{key!r}] has shape {tuple(value.shape)}; every key "
                "must be [n_docs, T] like input_ids (add the batch dimension).")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise EmptyDataError(
            f"token_scores: documents are empty (input_ids {tuple(ids.shape)}); pass at least "
            "one document of at least one token.")
    _check_vocabulary(module, ids)
    _check_length(module, ids.shape[1])
    return {key: value.long() for key, value in docs.items()}


def _check_vocabulary(module: nn.Module, ids: Tensor) -> None:
    embeddings = getattr(module, "get_input_embeddings", lambda: None)()
    vocab = getattr(embeddings, "num_embeddings", None)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        raise InvalidArgumentError(
            f"token_scores: token ids must lie in [0, {vocab}), got [{low}, {high}]; tokenise "
            "with the model's own tokenizer (padding with a real id, masked by attention_mask).")


def _check_length(module: nn.Module, length: int) -> None:
    config = getattr(module, "config", None)
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings",
                                                            None)
    if isinstance(limit, int) and length > limit:
        raise InvalidArgumentError(
            f"token_scores: documents have {length} tokens but the model has {limit} "
            "positions; cut them to the length given to build_store.")


def check_rows(store: GradientStore, rows: Any, n_docs: int) -> Tensor | None:
    """``[n_docs]`` int64 store rows, or ``None``."""
    if rows is None:
        return None
    rows = tensor_if_array(rows)
    if not isinstance(rows, Tensor):
        rows = torch.as_tensor(rows)
    if rows.is_floating_point() or rows.dtype == torch.bool or rows.dim() != 1 or (
            len(rows) != n_docs):
        raise InvalidArgumentError(
            f"token_scores: rows must be {n_docs} integer store rows (one per document), got "
            f"{tuple(rows.shape)} {rows.dtype}; pass top_k's indices for one query.")
    n_train = store.meta.n_train
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= n_train):
        raise InvalidArgumentError(
            f"token_scores: rows must lie in [0, {n_train}), got [{int(rows.min())}, "
            f"{int(rows.max())}].")
    return rows.long().cpu()


def check_eval(module: nn.Module) -> None:
    """Refuse active dropout: random per-token terms would not sum to the stored score."""
    active = [name or type(module).__name__ for name, layer in module.named_modules()
              if isinstance(layer, nn.modules.dropout._DropoutNd) and layer.training
              and layer.p > 0]
    if active:
        raise TrainModeError(
            f"token_scores: dropout layers {active[:3]} are in train mode, so every pass "
            "would drop different units and the tokens would not sum to the store's score; "
            "call model.eval() first (as for build_store).")
