"""Batches from text for the language-model losses: tokenised pairs, a collate_fn, and test
examples from the model's own generations."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

import tracinfunc as tif

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away", "and", "slept"]


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level HF tokenizer built in memory (no download): BOS added, PAD 0, EOS 3."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[PAD]": 0, "[UNK]": 1, "[BOS]": 2, "[EOS]": 3} | {w: i + 4 for i, w in
                                                                enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A",
                                                       special_tokens=[("[BOS]", 2)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]",
                                                eos_token="[EOS]", bos_token="[BOS]",
                                                unk_token="[UNK]")


def word_gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=4 + len(WORDS),
                                     n_positions=32, bos_token_id=2, eos_token_id=3,
                                     pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    return model.to(torch.float64).eval()


def test_completion_batch_tokenises_pads_and_labels_only_completions():
    tok = word_tokenizer()
    batch = tif.completion_batch(tok, ["the cat", "a dog ran"], ["sat", "far away"])
    ids = [[2, 4, 5, 6, 3, 0], [2, 9, 10, 11, 12, 13, 3]]  # [BOS] prompt completion [EOS]
    assert batch["input_ids"].tolist() == [ids[0] + [0], ids[1]]
    assert batch["attention_mask"].tolist() == [[1] * 5 + [0, 0], [1] * 7]
    assert batch["labels"].tolist() == [[-100, -100, -100, 6, 3, -100, -100],
                                        [-100, -100, -100, -100, 12, 13, 3]]
    # HF's own loss on these labels is the completion-only loss of the ready-made loss.
    model = word_gpt2()
    loss = tif.causal_lm_loss(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    for i in range(2):
        row = {k: v[i] for k, v in batch.items()}
        hf = model(**{k: v[None] for k, v in row.items()}).loss
        torch.testing.assert_close(loss(params, row), hf.double(), rtol=1e-6, atol=1e-7)
    collate = tif.completion_collator(tok)
    for items in ([{"prompt": "the cat", "completion": "sat"},
                   {"prompt": "a dog ran", "completion": "far away"}],
                  [("the cat", "sat"), ("a dog ran", "far away")]):
        collated = collate(items)
        assert all(torch.equal(collated[k], batch[k]) for k in batch)


def test_completion_batch_truncates_and_refuses_prompts_that_fill_max_length():
    tok = word_tokenizer()
    cut = tif.completion_batch(tok, ["the cat"], ["sat on the mat"], max_length=5)
    assert cut["input_ids"].tolist() == [[2, 4, 5, 6, 7]]
    assert cut["labels"].tolist() == [[-100, -100, -100, 6, 7]]
    with pytest.raises(tif.errors.InvalidArgumentError, match=r"rows \[0\] fill max_length=3"):
        tif.completion_batch(tok, ["the cat"], ["sat"], max_length=3)
    with pytest.raises(tif.errors.InvalidArgumentError, match="equal length"):
        tif.completion_batch(tok, ["the cat"], ["sat", "ran"])


def test_generation_batch_scores_the_models_greedy_continuation():
    tok, model = word_tokenizer(), word_gpt2()
    batch, texts = tif.generation_batch(model, tok, ["the cat", "a dog"], max_new_tokens=4)
    for i, prompt in enumerate([[2, 4, 5], [2, 9, 10]]):
        ids = torch.tensor([prompt])
        for _ in range(4):  # greedy by hand
            next_id = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
            if next_id == 3:
                break
        generated = ids[0, 3:].tolist()
        n = len(prompt) + len(generated)
        assert batch["input_ids"][i, :n].tolist() == prompt + generated
        assert batch["labels"][i, :n].tolist() == [-100] * 3 + generated
        assert (batch["labels"][i, n:] == -100).all()
        assert texts[i] == tok.decode(generated, skip_special_tokens=True)
