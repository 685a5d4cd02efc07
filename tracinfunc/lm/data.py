"""Batches for the ready-made language-model losses, from text, with any HF tokenizer.

:func:`completion_batch` tokenises (prompt, completion) pairs into the padded batch that
:func:`~tracinfunc.causal_lm_loss` and ``build_store`` take, with completion-only labels (the
prompt and the padding are ``-100``), as LESS scores instruction data;
:func:`completion_collator` does the same as a ``DataLoader``'s ``collate_fn``; and
:func:`generation_batch` builds test examples from prompts plus the model's own greedy
continuations ("which training data made the model say this?").

Only the tokenizer's ``__call__`` (``input_ids`` of one text), ``decode`` and its
``pad_token_id`` / ``eos_token_id`` are used, so any ``transformers`` tokenizer works.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from tracinfunc._validate import current_caller, entry_point
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError
from tracinfunc.lm.losses import completion_labels

__all__ = ["completion_batch", "completion_collator", "generation_batch"]

Batch = dict[str, Tensor]


@entry_point("completion_batch")
def completion_batch(tokenizer: Any, prompts: Sequence[str], completions: Sequence[str], *,
                     max_length: int | None = None, add_eos: bool = True) -> Batch:
    """Tokenise prompt + completion pairs into a right-padded batch with completion labels.

    The prompt is tokenised with the tokenizer's special tokens (a BOS, if it adds one), the
    completion without, followed by ``eos_token_id`` when ``add_eos``; the two are joined, so
    the prompt's length in tokens is exact.

    Args:
        tokenizer: A HF tokenizer (or anything with ``tokenizer(text)["input_ids"]`` and
            ``pad_token_id`` / ``eos_token_id``).
        prompts: ``b`` prompts.
        completions: ``b`` completions (the text that is scored).
        max_length: Cut each row to this many tokens (the completion's end goes first).
        add_eos: End each completion with ``eos_token_id`` (as LESS and most SFT recipes do).

    Returns:
        ``{"input_ids": [b, T], "attention_mask": [b, T], "labels": [b, T]}``, int64, padded
        with ``pad_token_id`` (else ``eos_token_id``); labels are ``-100`` on the prompt and
        the padding.

    Raises:
        InvalidArgumentError: the lists differ in length, or a prompt fills ``max_length``.
    """
    if isinstance(prompts, str) or isinstance(completions, str) or len(prompts) != len(
            completions) or not prompts:
        raise InvalidArgumentError(
            f"completion_batch: prompts and completions must be non-empty lists of equal "
            f"length, got {_count(prompts)} and {_count(completions)}."
        )
    prompt_ids = [_ids(tokenizer, p, special=True) for p in prompts]
    eos = [tokenizer.eos_token_id] if add_eos and tokenizer.eos_token_id is not None else []
    completion_ids = [_ids(tokenizer, c, special=False) + eos for c in completions]
    return padded_batch(prompt_ids, completion_ids, pad_id=_pad_id(tokenizer),
                        max_length=max_length)


def completion_collator(tokenizer: Any, *, max_length: int | None = None,
                        add_eos: bool = True, prompt_key: str = "prompt",
                        completion_key: str = "completion") -> Callable[[list[Any]], Batch]:
    """A ``collate_fn``: a list of ``{"prompt", "completion"}`` dicts (or pairs) to a batch.

    Example:
        >>> loader = DataLoader(pairs, batch_size=16, collate_fn=completion_collator(tok))
        >>> store = tif.build_store(tif.causal_lm_loss(model), checkpoints, loader, ...)
    """
    def collate(items: list[Any]) -> Batch:
        pairs = [(item[prompt_key], item[completion_key]) if isinstance(item, Mapping)
                 else tuple(item) for item in items]
        if not all(len(pair) == 2 for pair in pairs):
            raise InvalidTypeError(
                f"completion_collator: items must be dicts with {prompt_key!r} and "
                f"{completion_key!r} or (prompt, completion) pairs, got {items[0]!r:.80}."
            )
        prompts, completions = zip(*pairs, strict=True)
        return completion_batch(tokenizer, list(prompts), list(completions),
                                max_length=max_length, add_eos=add_eos)

    return collate


@entry_point("generation_batch")
def generation_batch(model: nn.Module, tokenizer: Any, prompts: Sequence[str], *,
                     max_new_tokens: int = 32, max_length: int | None = None,
                     **generate_kwargs: Any) -> tuple[Batch, list[str]]:
    """Test examples from prompts plus the model's own continuations, completion-scored.

    Each prompt is continued with ``model.generate`` (greedy unless ``generate_kwargs`` say
    otherwise) one at a time, so no padding enters generation; the generated token ids are
    used as they are (never decoded and re-tokenised), up to and including the first
    end-of-text token.

    Args:
        model: A HF causal LM (``.generate``), e.g. the fine-tuned (peft) model.
        tokenizer: Its tokenizer.
        prompts: ``n_test`` prompts.
        max_new_tokens: Longest continuation.
        max_length: As for :func:`completion_batch`.
        **generate_kwargs: Passed to ``model.generate``.

    Returns:
        ``(batch, completions)``: the batch as :func:`completion_batch` gives it, and the
        decoded continuations (for display).
    """
    pad, eos = _pad_id(tokenizer), tokenizer.eos_token_id
    kwargs = {"do_sample": False, "pad_token_id": pad, **generate_kwargs}
    prompt_ids, completion_ids = [], []
    for prompt in prompts:
        ids = _ids(tokenizer, prompt, special=True)
        device = next(model.parameters()).device
        inputs = torch.tensor([ids], device=device)
        with torch.no_grad():
            out = model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs),
                                 max_new_tokens=max_new_tokens, **kwargs)
        new = out[0, len(ids):].tolist()
        if eos is not None and eos in new:
            new = new[:new.index(eos) + 1]
        prompt_ids.append(ids)
        completion_ids.append(new)
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completion_ids]
    return padded_batch(prompt_ids, completion_ids, pad_id=pad, max_length=max_length), texts


def padded_batch(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                 *, pad_id: int, max_length: int | None = None) -> Batch:
    """Join token id lists, pad them on the right, label only the completions."""
    rows = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    if max_length is not None:
        long = [i for i, p in enumerate(prompt_ids) if len(p) >= max_length]
        if long:
            raise InvalidArgumentError(
                f"{current_caller()}: the prompts of rows {long[:5]} fill max_length="
                f"{max_length} tokens, leaving no completion to score; raise max_length or "
                "shorten those prompts."
            )
        rows = [row[:max_length] for row in rows]
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), length), dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
        mask[i, :len(row)] = 1
    lengths = torch.tensor([len(p) for p in prompt_ids])
    labels = completion_labels(ids, lengths, attention_mask=mask)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _ids(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    if not isinstance(text, str):
        raise InvalidTypeError(
            f"{current_caller()}: prompts and completions must be strings, got "
            f"{type(text).__name__} ({text!r:.60})."
        )
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _pad_id(tokenizer: Any) -> int:
    for pad in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if pad is not None:
            return int(pad)
    return 0  # padding is masked out wherever it is read, so any id serves


def _count(values: Any) -> str:
    return "a str" if isinstance(values, str) else f"{len(values)} items"
