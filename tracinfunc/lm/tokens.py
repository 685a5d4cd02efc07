"""Per-token attribution: which training tokens carry a document's TracIn score.

A causal LM's loss on a document is a sum over target positions ``t`` of per-position terms,
``L = sum_t l_t / N`` (``N`` scored targets), so its gradient is a sum of per-position
gradients and its TracIn score a sum of per-token scores::

    s_t = sum_c lr_c <test_c, P_c grad (l_t / N)(w_c)>,      sum_t s_t = score(document).

Token ``t``'s score is the influence of *predicting token t* (the term whose target is
``input_ids[t]``). Tokens that are not targets have no term and score exactly 0: the first
token, padding (``attention_mask == 0``) and labels equal to ``IGNORE_INDEX`` (a prompt).

The scores are computed without any per-token store: ``<test_c, P_c g> = <P_c^T test_c, g>``
and ``<v, grad l_t>`` is a directional derivative, so one forward-mode pass (``torch.func.jvp``)
of the per-position loss vector in the direction ``v_c = lr_c P_c^T test_c`` gives every
token's score of a document at once. ``P_c^T`` is the transpose of the store's own projector
(for ``kind="kronecker"``: ``P_out B P_in^T`` per weight, from the same side factors), so the
per-token scores add up to the store's document score for every projection kind and every
parameter (embeddings, norms, biases, LoRA adapters alike).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import jvp, vjp, vmap

from tracinfunc._attention import vmap_attention
from tracinfunc._validate import check_int, entry_point
from tracinfunc.checkpoint import Checkpoint, loss_at
from tracinfunc.errors import (
    IncompatibleGradientsError,
    InvalidArgumentError,
    InvalidTypeError,
    LossFunctionError,
)
from tracinfunc.lm.losses import IGNORE_INDEX, _logits, _next_token_loss
from tracinfunc.lm.token_checks import (
    check_documents,
    check_eval,
    check_rows,
    check_test_grads,
)
from tracinfunc.loss import ModuleLoss
from tracinfunc.projection import make_projector
from tracinfunc.store.protocols import GradientStore

__all__ = ["TokenScores", "next_token_terms", "token_scores"]


@dataclass(frozen=True)
class TokenScores:
    """Per-token TracIn scores of training documents for some test rows.

    Attributes:
        values: ``[n_test, n_docs, T]``: token ``t``'s share of the document's score; exactly
            0 where ``scored`` is False.
        scored: ``[n_docs, T]`` bool: the token is a loss target (not the first token, not
            padding, label not ``IGNORE_INDEX``).
        input_ids: ``[n_docs, T]``, the documents' tokens.
        rows: ``[n_docs]`` the documents' store rows, or ``None`` when not given.
    """

    values: Tensor
    scored: Tensor
    input_ids: Tensor
    rows: Tensor | None = None

    def document_scores(self) -> Tensor:
        """``[n_test, n_docs]``: the sum over tokens, the documents' TracIn scores."""
        return self.values.sum(-1)


def next_token_terms(logits: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
    """Per-position terms ``[b, T]`` of :func:`~tracinfunc.causal_lm_loss`, summing to it.

    Args:
        logits: ``[b, T, V]``.
        batch: ``{"input_ids": [b, T], "attention_mask"?: [b, T], "labels"?: [b, T]}``.

    Returns:
        ``[b, T]``: position ``t`` holds ``l_t / N``, the loss of predicting token ``t``
        divided by the row's number of scored targets; position 0 and unscored targets
        hold exactly 0.
    """
    labels = batch.get("labels", batch["input_ids"])
    mask = batch.get("attention_mask")
    if mask is not None:
        labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    targets = labels[:, 1:]  # [b, T - 1]
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(),
                                ignore_index=IGNORE_INDEX, reduction="none")
    per_token = per_token.reshape(targets.shape)
    scored = (targets != IGNORE_INDEX).to(per_token.dtype).sum(1, keepdim=True)
    terms = per_token / scored.clamp_min(1)  # [b, T - 1]
    return torch.cat([terms.new_zeros(terms.shape[0], 1), terms], dim=1)


def _logits_only(outputs: Any, example: Mapping[str, Tensor]) -> Tensor:
    return _logits(outputs)


def _terms_loss(loss: Any) -> ModuleLoss:
    if not isinstance(loss, ModuleLoss) or loss.criterion is not _next_token_loss:
        raise LossFunctionError(
            f"token_scores: loss must be tif.causal_lm_loss(model) (its per-position terms "
            f"are what is attributed), got {type(loss).__name__}; build the store and the "
            "test gradients with loss=tif.causal_lm_loss(model) and pass that loss."
        )
    return dataclasses.replace(loss, criterion=_logits_only)


def _check_checkpoints(store: GradientStore, checkpoints: Sequence[Checkpoint]) -> None:
    if isinstance(checkpoints, Checkpoint) or not all(
            isinstance(c, Checkpoint) for c in checkpoints):
        raise InvalidTypeError(
            "token_scores: checkpoints must be a list of tif.Checkpoint (the store's), got "
            f"{type(checkpoints).__name__}; pass the list given to build_store."
        )
    stored = store.meta.checkpoints
    if len(checkpoints) != len(stored) or any(
            c.fingerprint != s.fingerprint for c, s in zip(checkpoints, stored, strict=False)):
        raise IncompatibleGradientsError(
            f"token_scores: the {len(checkpoints)} checkpoints given are not the store's "
            f"{len(stored)} (parameter fingerprints differ); pass the same checkpoints, in the "
            "same order, as to build_store."
        )


def _directions(store: GradientStore, checkpoint: Checkpoint, index: int, test: Tensor):
    """``i -> lr_c P_c^T test_c[i]`` ``{name: [*shape]}``: the projector's transpose (a VJP),
    one test row at a time (each direction is as large as the parameters)."""
    meta = store.meta
    params = checkpoint.params
    names = [name for name, _ in meta.layout]
    first = params[names[0]]
    projection = meta.projection.for_checkpoint(meta.checkpoints[index].name)
    projector = make_projector(projection, meta.layout, dtype=first.dtype, device=first.device)
    zeros = {name: torch.zeros_like(params[name]) for name in names}
    _, pullback = vjp(projector, zeros)
    rows = test.to(dtype=first.dtype, device=first.device) * meta.checkpoints[index].lr
    return lambda i: pullback(rows[i])[0]


@entry_point("token_scores")
def token_scores(store: GradientStore, test_grads: GradientStore | Tensor, loss: ModuleLoss,
                 checkpoints: Sequence[Checkpoint], documents: Mapping[str, Tensor], *,
                 rows: Sequence[int] | Tensor | None = None,
                 chunk_size: int = 64) -> TokenScores:
    """Per-token TracIn scores of training documents, summing to their store scores.

    Args:
        store: The training store (its projection, layout and learning rates are used; its
            rows only to check ``rows``). Not preconditioned.
        test_grads: ``[n_ckpt, n_test, k]`` or a GradientStore of test rows, made with
            ``projection=store.projection`` (e.g. :func:`output_token_grads`' rows).
        loss: The store's ``tif.causal_lm_loss(model)``.
        checkpoints: The store's checkpoints, in order (checked by fingerprint).
        documents: ``{"input_ids": [n_docs, T], "attention_mask"?: [n_docs, T],
            "labels"?: [n_docs, T]}`` exactly as given to ``build_store`` (e.g. the
            training rows of ``top_k``'s candidates).
        rows: ``[n_docs]`` the documents' rows in the store: when given, each document's
            summed score is checked against ``store``'s row (a document that is not that row
            raises).
        chunk_size: Documents per forward-mode pass (memory grows with it).

    Returns:
        :class:`TokenScores`: ``values [n_test, n_docs, T]`` in the checkpoints' dtype on
        their device, whose sum over ``T`` is ``tif.score(store, test_grads)[:, rows]`` up to
        float rounding.

    Raises:
        IncompatibleGradientsError: test rows, checkpoints or documents do not belong to the
            store.
        LossFunctionError: ``loss`` is not a ``causal_lm_loss``.
        TrainModeError: the model's dropout is active (call ``model.eval()``).
        InvalidArgumentError: tokens outside the vocabulary, documents longer than the
            model's positions, a preconditioned store, bad ``rows``.
    """
    terms_loss = _terms_loss(loss)
    check_eval(loss.module)
    if store.meta.preconditioner is not None:
        raise InvalidArgumentError(
            f"token_scores: the store is preconditioned ({store.meta.preconditioner!r}); "
            "per-token scores need a plain store. Build one without preconditioners."
        )
    chunk_size = check_int(chunk_size, "chunk_size")
    _check_checkpoints(store, checkpoints)
    test = check_test_grads(store, test_grads)  # [n_ckpt, n_test, k]
    documents = check_documents(loss.module, documents)
    row_ids = check_rows(store, rows, documents["input_ids"].shape[0])
    values = None
    for index, checkpoint in enumerate(checkpoints):
        part = _checkpoint_scores(store, terms_loss, checkpoint, index, test[index], documents,
                                  chunk_size)
        values = part if values is None else values + part
    scored = _scored(documents)
    result = TokenScores(values * scored, scored, documents["input_ids"], row_ids)
    if row_ids is not None:
        _check_sums(store, test, result)
    return result


def _checkpoint_scores(store, terms_loss, checkpoint, index, test, documents, chunk_size):
    """``[n_test, n_docs, T]`` of one checkpoint: a JVP per test row and chunk of documents.

    A chunk runs as one batched forward (``ModuleLoss.per_example``); the first two documents
    are also run example by example under ``vmap`` and, if the two differ (rows that
    interact), every chunk takes the vmapped path.
    """
    direction_of = _directions(store, checkpoint, index, test)
    loss_c = loss_at(terms_loss, checkpoint)
    params = checkpoint.params
    device = next(iter(params.values())).device
    chosen = {name: params[name] for name, _ in store.meta.layout}
    fixed = {n: v for n, v in params.items() if n not in chosen}

    def batched(direction, chunk):
        def terms(selected):
            logits = loss_c.per_example({**fixed, **selected}, chunk)[:, 0]  # [b, T, V]
            return next_token_terms(logits, chunk)  # [b, T]
        with vmap_attention():
            return jvp(terms, (chosen,), (direction,))[1]

    def one(direction, example):
        def terms(selected):
            logits = loss_c({**fixed, **selected}, example)  # [1, T, V]
            return next_token_terms(logits, {k: v[None] for k, v in example.items()})[0]
        return jvp(terms, (chosen,), (direction,))[1]

    def vmapped(direction, chunk):
        return vmap(one, in_dims=(None, 0))(direction, chunk)

    docs = {key: value.to(device) for key, value in documents.items()}
    n_docs = docs["input_ids"].shape[0]
    chunks = [{k: v[lo:lo + chunk_size] for k, v in docs.items()}
              for lo in range(0, n_docs, chunk_size)]
    path = None
    out = []
    for i in range(test.shape[0]):
        direction = direction_of(i)
        if path is None:
            probe = {k: v[:2] for k, v in chunks[0].items()}
            path = _proven_path(batched, vmapped, direction, probe)
        out.append(torch.cat([path(direction, chunk) for chunk in chunks]))
    return torch.stack(out)


def _proven_path(batched, vmapped, direction, chunk):
    """``batched`` when it gives ``vmapped``'s numbers on ``chunk`` (up to rounding)."""
    try:
        fast = batched(direction, chunk)
    except Exception:  # a model whose batched forward has no forward-mode rule: vmap instead
        return vmapped
    slow = vmapped(direction, chunk)
    scale = float(slow.abs().max()) if slow.numel() else 0.0
    tolerance = 1e-4 if slow.dtype != torch.float64 else 1e-9
    if torch.allclose(fast, slow, rtol=tolerance, atol=tolerance * scale + 1e-30):
        return batched
    return vmapped


def _scored(documents: Mapping[str, Tensor]) -> Tensor:
    labels = documents.get("labels", documents["input_ids"])
    mask = documents.get("attention_mask")
    scored = labels != IGNORE_INDEX
    if mask is not None:
        scored = scored & (mask != 0)
    scored[:, 0] = False
    return scored


def _check_sums(store: GradientStore, test: Tensor, result: TokenScores) -> None:
    """Each document's summed score against its stored row (a cheap binding check)."""
    meta = store.meta
    got = result.document_scores().double().cpu()  # [n_test, n_docs]
    expected = torch.zeros_like(got)
    scale = torch.zeros_like(got)
    for c, ckpt in enumerate(meta.checkpoints):
        train = torch.stack([store.read_rows(c, r, r + 1)[0] for r in result.rows.tolist()])
        train, rows = train.double(), test[c].double().cpu()
        expected += ckpt.lr * rows @ train.T
        scale += ckpt.lr * rows.norm(dim=1, keepdim=True) * train.norm(dim=1)[None]
    loose = meta.quantization is not None or meta.dtype in ("float16", "bfloat16")
    tolerance = (5e-2 if loose else 1e-3) * scale + 1e-12
    bad = ((got - expected).abs() > tolerance).any(0).nonzero().flatten()
    if len(bad):
        doc = int(bad[0])
        raise IncompatibleGradientsError(
            f"token_scores: document {doc}'s tokens sum to {float(got[:, doc].max()):.6g} but "
            f"store row {int(result.rows[doc])} scores {float(expected[:, doc].max()):.6g} "
            f"({len(bad)} of {got.shape[1]} documents differ): the documents are not those "
            "rows of this store. Pass the store's own rows (the data given to build_store, "
            "indexed by top_k's indices) or leave rows=None."
        )

