"""Language models: any-structure losses, factorised projection of HF layers, masks, SDPA."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.lm_helpers import (
    class_reference,
    explicit_kronecker,
    hf_loop_grads,
    next_token_reference,
    own_loss,
    params_of,
    tiny_bert,
    tiny_gpt2,
    token_batch,
)

SPEC = tif.Projection(dim=16, seed=3, kind="kronecker")


def completion_batch():
    batch = token_batch()
    labels = tif.completion_labels(batch["input_ids"], torch.tensor([3, 2, 4, 1]))
    labels = labels.masked_fill(batch["attention_mask"] == 0, -100)  # HF's loss needs this
    return {**batch, "labels": labels}


def test_completion_labels_hide_the_prompt():
    ids = torch.arange(1, 7)
    assert tif.completion_labels(ids, 2).tolist() == [-100, -100, 3, 4, 5, 6]
    rows = tif.completion_labels(torch.ones(2, 3, dtype=torch.long), torch.tensor([1, 3]))
    assert rows.tolist() == [[-100, 1, 1], [-100, -100, -100]]


def test_causal_lm_loss_equals_the_models_own_loss_with_masks_and_prompts():
    model, batch = tiny_gpt2(), completion_batch()
    params, loss = params_of(model), tif.causal_lm_loss(model)
    for i in range(4):
        example = {k: v[i] for k, v in batch.items()}
        own = model(**{k: v[i:i + 1] for k, v in batch.items()}).loss  # float32 inside HF
        torch.testing.assert_close(loss(params, example), own.double(), rtol=1e-6, atol=1e-6)
        brute = next_token_reference(model(**{k: v[i:i + 1] for k, v in batch.items()
                                              if k != "labels"}),
                                     {k: v[i:i + 1] for k, v in batch.items()})
        torch.testing.assert_close(loss(params, example), brute, rtol=1e-12, atol=1e-12)


def test_kronecker_on_gpt2_equals_explicit_kronecker_projection():
    model, batch = tiny_gpt2(), completion_batch()
    params, loss = params_of(model), tif.causal_lm_loss(model)
    example = {k: v[0] for k, v in batch.items()}
    factorised = tif.grads.factorized_weights(loss, params, example)
    matrices = sorted(n for n, v in params.items() if v.dim() == 2)
    assert factorised == matrices  # every Conv1D, both embeddings, the tied head (wte)
    got = tif.projected_grads(loss, SPEC)(params, batch)
    expected = explicit_kronecker(hf_loop_grads(model, params, batch), SPEC)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)
    generic = tif.projected_grads(loss, SPEC, options=tif.GradientOptions(memory_budget=2**26))(
        params, batch
    )
    torch.testing.assert_close(got, generic, rtol=1e-9, atol=1e-11)


def test_padding_idx_rows_get_no_gradient():
    model = tiny_gpt2()
    model.transformer.wte.padding_idx = 0  # token 0's row is never updated
    batch = token_batch(3, 8)
    batch["input_ids"][:, -2:] = 0
    params, loss = params_of(model), tif.causal_lm_loss(model)
    got = tif.projected_grads(loss, SPEC)(params, batch)
    grads = tif.per_sample_grads(loss)(params, batch)
    torch.testing.assert_close(got, explicit_kronecker(grads, SPEC), rtol=1e-9, atol=1e-11)


def test_tensor_examples_with_a_criterion():
    model, ids = tiny_gpt2(), token_batch()["input_ids"]
    params = params_of(model)

    def criterion(outputs, example):  # next token over the whole sequence
        return F.cross_entropy(outputs.logits[0, :-1], example[0, 1:])

    loss = tif.loss_from_model(model, criterion=criterion)
    got = tif.projected_grads(loss, SPEC)(params, ids)
    reference = hf_loop_grads(model, params, {"input_ids": ids})
    torch.testing.assert_close(got, explicit_kronecker(reference, SPEC), rtol=1e-9, atol=1e-11)


def test_model_own_loss_from_labels():
    model, batch = tiny_gpt2(), completion_batch()
    params, loss = params_of(model), tif.loss_from_model(model)
    grads = tif.per_sample_grads(loss)(params, batch)
    reference = hf_loop_grads(model, params, batch, own_loss, labels_in=True)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-9, atol=1e-11)


def test_bert_with_a_2d_attention_mask_under_vmap():
    model, batch = tiny_bert(), token_batch()
    batch["labels"] = torch.tensor([0, 2, 1, 0])
    params, loss = params_of(model), tif.sequence_classification_loss(model)
    grads = tif.per_sample_grads(loss)(params, batch)
    reference = hf_loop_grads(model, params, batch, class_reference)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-9, atol=1e-11)
    got = tif.projected_grads(loss, SPEC)(params, batch)
    torch.testing.assert_close(got, explicit_kronecker(reference, SPEC), rtol=1e-9, atol=1e-11)


def test_sdpa_runs_without_the_per_example_fallback():
    model, batch = tiny_gpt2(dtype=torch.float32), token_batch()
    params, loss = params_of(model), tif.causal_lm_loss(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tif.projected_grads(loss, tif.Projection(dim=16, kind="sjlt"))(params, batch)
    assert not [w for w in caught if "performance drop" in str(w.message)]


def test_select_and_last_layers_on_a_tied_head():
    model, batch = tiny_gpt2(), completion_batch()
    params, loss = params_of(model), tif.causal_lm_loss(model)
    assert tif.select_params(params, tif.last_layers(1)) .keys() == {
        "transformer.ln_f.weight", "transformer.ln_f.bias"}  # names alone: ln_f
    head = tif.select_params(params, tif.last_layers(1, model=model))
    assert list(head) == ["transformer.wte.weight"]  # the tied lm_head's weight
    got = tif.projected_grads(
        loss, SPEC, options=tif.GradientOptions(select=tif.last_layers(1, model=model))
    )(params, batch)
    grads = hf_loop_grads(model, params, batch)
    expected = explicit_kronecker({"transformer.wte.weight": grads["transformer.wte.weight"]},
                                  SPEC)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)
