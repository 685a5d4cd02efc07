"""Per-token scores against a brute-force loop: each position's loss term by autograd."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import tracinfunc as tif
from tests.lm_helpers import VOCAB, params_of, tiny_gpt2, token_batch
from tracinfunc.errors import (
    EmptyDataError,
    IncompatibleGradientsError,
    InvalidArgumentError,
    LossFunctionError,
    TrainModeError,
)
from tracinfunc.projection import make_projector


def two_checkpoints(model):
    params = params_of(model)
    later = {n: v + 0.01 * torch.randn_like(v) for n, v in params.items()}
    return [tif.Checkpoint(params, lr=0.3, name="a"), tif.Checkpoint(later, lr=0.1, name="b")]


def docs_with_prompts(n=3, length=10):
    batch = token_batch(n, length, seed=1)
    labels = batch["input_ids"].clone()
    labels[:, :3] = -100  # a prompt of 3 tokens: context only
    batch["labels"] = labels
    return batch


def brute_force(model, checkpoints, store, test, docs):
    """``[n_test, n_docs, T]``: for every token, autograd of its loss term, projected, dotted."""
    n_docs, length = docs["input_ids"].shape
    out = torch.zeros(test.shape[1], n_docs, length, dtype=torch.float64)
    names = [name for name, _ in store.meta.layout]
    for c, ckpt in enumerate(checkpoints):
        projector = make_projector(store.projection, store.meta.layout, dtype=torch.float64)
        for i in range(n_docs):
            ids, mask = docs["input_ids"][i], docs["attention_mask"][i]
            labels = docs.get("labels", docs["input_ids"])[i]
            targets = [t for t in range(1, length) if labels[t] != -100 and mask[t] != 0]
            for t in targets:
                leaves = {n: ckpt.params[n].clone().requires_grad_(True) for n in names}
                logits = functional_call(model, leaves, (), {
                    "input_ids": ids[None], "attention_mask": mask[None]}).logits[0]
                term = -torch.log_softmax(logits[t - 1], -1)[labels[t]] / len(targets)
                grads = torch.autograd.grad(term, [leaves[n] for n in names])
                row = projector(dict(zip(names, grads, strict=True)))
                out[:, i, t] += ckpt.lr * (test[c] @ row)
    return out


@pytest.mark.parametrize("projection", [tif.Projection(dim=None, kind="identity"),
                                        tif.Projection(dim=64, kind="kronecker", seed=3),
                                        tif.Projection(dim=48, kind="sjlt", nnz=2, seed=1)])
def test_per_token_scores_equal_the_brute_force_loop_and_sum_to_the_score(projection):
    model = tiny_gpt2()
    checkpoints, docs = two_checkpoints(model), docs_with_prompts()
    loss = tif.causal_lm_loss(model)
    store = tif.build_store(loss, checkpoints, docs, projection=projection, dtype=torch.float64)
    queries = token_batch(2, 8, seed=5)
    test = tif.build_store(loss, checkpoints, queries, projection=store.projection,
                           dtype=torch.float64)
    got = tif.token_scores(store, test, loss, checkpoints, docs, rows=[0, 1, 2])
    test_rows = torch.stack([test.read_rows(c, 0, 2) for c in range(2)])
    expected = brute_force(model, checkpoints, store, test_rows, docs)
    torch.testing.assert_close(got.values, expected, rtol=1e-9, atol=1e-12)
    scores = tif.score(store, test)
    torch.testing.assert_close(got.document_scores(), scores, rtol=1e-9, atol=1e-12)
    # prompt (IGNORE_INDEX), padding and the first token score exactly 0
    assert (got.values[:, ~got.scored] == 0).all()
    assert not got.scored[:, :3].any() and got.scored[0, 3:].all()


def test_a_lora_adapter_and_a_llama_model_sum_to_their_scores():
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=32)
    llama = transformers.LlamaForCausalLM(config).double().eval()
    lora = peft.get_peft_model(tiny_gpt2(), peft.LoraConfig(
        r=4, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)).eval()
    with torch.no_grad():
        for name, value in lora.named_parameters():
            if "lora_B" in name:
                value.normal_(0, 0.1)
    assert all("lora_" in n for n in tif.Checkpoint.from_module(lora).params)
    for model in (llama, lora):
        ckpts = [tif.Checkpoint.from_module(model, lr=0.2)]  # peft: the adapters only
        loss, docs = tif.causal_lm_loss(model), token_batch(3, 9, seed=2)
        spec = tif.Projection(dim=64, kind="kronecker")
        store = tif.build_store(loss, ckpts, docs, projection=spec, dtype=torch.float64)
        test = tif.build_store(loss, ckpts, token_batch(1, 7, seed=4), projection=spec,
                               dtype=torch.float64)
        got = tif.token_scores(store, test, loss, ckpts, docs)
        torch.testing.assert_close(got.document_scores(), tif.score(store, test),
                                   rtol=1e-7, atol=1e-10)


def test_output_token_rows_sum_to_the_sequence_row_and_spans_add_up():
    model = tiny_gpt2()
    ckpts, loss = two_checkpoints(model), tif.causal_lm_loss(model)
    spec = tif.Projection(dim=64, kind="kronecker")
    sequence = {"input_ids": torch.arange(1, 9), "labels": torch.tensor([-100] * 4 + [5, 6, 7, 8])}
    out = tif.output_token_grads(loss, ckpts, sequence, projection=spec)
    assert out.positions.tolist() == [4, 5, 6, 7]
    whole = tif.build_store(loss, ckpts, {k: v[None] for k, v in sequence.items()},
                            projection=spec)
    for c in range(2):  # the mean over 4 tokens: the per-token rows average to the whole row
        torch.testing.assert_close(out.grads.read_rows(c, 0, 4).mean(0),
                                   whole.read_rows(c, 0, 1)[0], rtol=1e-4, atol=1e-6)
    docs = token_batch(3, 10, seed=7)
    store = tif.build_store(loss, ckpts, docs, projection=spec)
    scores = tif.token_scores(store, out.grads, loss, ckpts, docs)
    assert scores.values.shape == (4, 3, 10)
    spans = tif.top_spans(scores, width=3, k=50, query=1)
    sums = tif.span_scores(scores, [(s.start, s.stop) for s in spans])
    for j, span in enumerate(spans):
        assert span.score == pytest.approx(float(sums[1, span.document, j]), rel=1e-6, abs=1e-9)
    assert [s.score for s in spans] == sorted((s.score for s in spans), reverse=True)
    by_doc = {}
    for span in spans:  # never overlapping within a document
        assert all(abs(span.start - other) >= 3 for other in by_doc.get(span.document, []))
        by_doc.setdefault(span.document, []).append(span.start)


def small_setup():
    model = tiny_gpt2()
    ckpts, loss, docs = two_checkpoints(model), tif.causal_lm_loss(model), token_batch(3, 8)
    spec = tif.Projection(dim=32, kind="kronecker")
    store = tif.build_store(loss, ckpts, docs, projection=spec)
    test = tif.build_store(loss, ckpts, token_batch(1, 8, seed=3), projection=spec)
    return model, ckpts, loss, docs, store, test


def test_hostile_inputs_are_refused_before_any_gradient_work():
    model, ckpts, loss, docs, store, test = small_setup()
    with pytest.raises(InvalidArgumentError, match="token ids must lie in"):
        tif.token_scores(store, test, loss, ckpts, {"input_ids": docs["input_ids"] + VOCAB})
    with pytest.raises(InvalidArgumentError, match="positions"):
        tif.token_scores(store, test, loss, ckpts, {"input_ids": torch.ones(1, 40).long()})
    with pytest.raises(EmptyDataError, match="empty"):
        tif.token_scores(store, test, loss, ckpts, {"input_ids": torch.ones(1, 0).long()})
    with pytest.raises(LossFunctionError, match="causal_lm_loss"):
        tif.token_scores(store, test, tif.loss_from_model(model), ckpts, docs)
    with pytest.raises(IncompatibleGradientsError, match="fingerprints"):
        tif.token_scores(store, test, loss, ckpts[::-1], docs)
    with pytest.raises(InvalidArgumentError, match="rows must lie"):
        tif.token_scores(store, test, loss, ckpts, docs, rows=[0, 1, 3])
    with pytest.raises(InvalidArgumentError, match="integer store rows"):
        tif.token_scores(store, test, loss, ckpts, docs, rows=[0.0, 1.0, 2.0])
    nan = torch.stack([test.read_rows(c, 0, 1) for c in range(2)])
    nan[0, 0, 0] = float("nan")
    with pytest.raises(InvalidArgumentError, match="NaN"):
        tif.token_scores(store, nan, loss, ckpts, docs)
    with pytest.raises(EmptyDataError, match="empty"):
        tif.token_scores(store, test, loss, ckpts, {"input_ids": torch.ones(0, 8).long()})
    with pytest.raises(InvalidArgumentError, match="keys"):
        tif.token_scores(store, test, loss, ckpts, {**docs, "token_type_ids": docs["input_ids"]})
    model.train()
    with pytest.raises(TrainModeError, match="eval"):
        tif.token_scores(store, test, loss, ckpts, docs)
    model.eval()
    with pytest.raises(InvalidArgumentError, match="span"):
        tif.span_scores(tif.token_scores(store, test, loss, ckpts, docs), [(3, 99)])


def test_documents_that_are_not_the_given_rows_are_caught():
    _, ckpts, loss, docs, store, test = small_setup()
    tif.token_scores(store, test, loss, ckpts, docs, rows=[0, 1, 2])  # the right rows pass
    with pytest.raises(IncompatibleGradientsError, match="not those rows"):
        tif.token_scores(store, test, loss, ckpts, docs, rows=[1, 0, 2])
    other = token_batch(3, 8, seed=9)  # documents from another data set, same shape
    with pytest.raises(IncompatibleGradientsError, match="not those rows"):
        tif.token_scores(store, test, loss, ckpts, other, rows=[0, 1, 2])


def test_a_one_token_document_and_k_beyond_the_windows():
    _, ckpts, loss, _, store, test = small_setup()
    one = tif.token_scores(store, test, loss, ckpts, {"input_ids": torch.tensor([[5]])})
    assert one.values.shape == (1, 1, 1) and (one.values == 0).all()
    assert len(tif.top_spans(one, width=1, k=10)) == 1  # k > windows: all there are
    with pytest.raises(InvalidArgumentError, match=r"width must be an int in \[1, T=1\]"):
        tif.top_spans(one, width=8, k=10)  # a window longer than the documents: refused


def test_the_docs_example_runs_as_written():
    """docs/attribution.md's first example, on a tiny GPT-2 (k and sizes shrunk only)."""
    model = tiny_gpt2()
    checkpoints = two_checkpoints(model)
    train, queries = token_batch(6, 8, seed=1), token_batch(2, 8, seed=2)
    loss = tif.causal_lm_loss(model)
    spec = tif.Projection(dim=64, kind="kronecker")
    store = tif.build_store(loss, checkpoints, train, projection=spec)
    query = {key: value[:1] for key, value in queries.items()}
    test = tif.build_store(loss, checkpoints, query, projection=store.projection)
    values, rows = tif.top_k(store, test, k=4)
    docs = {key: value[rows[0]] for key, value in train.items()}
    scores = tif.token_scores(store, test, loss, checkpoints, docs, rows=rows[0])
    torch.testing.assert_close(scores.document_scores().float(), values, rtol=1e-4, atol=1e-6)
    assert len(tif.top_spans(scores, width=8, k=5)) == 4  # one window per 8-token document
    assert tif.span_scores(scores, [(0, 4), (4, 8)]).shape == (1, 4, 2)


def test_the_batched_path_is_used_only_when_it_equals_the_vmapped_one():
    from tracinfunc.lm.tokens import _proven_path

    def vmapped(direction, chunk):
        return torch.ones(2, 3)

    def failing(direction, chunk):
        raise RuntimeError("no forward-mode rule")

    def different(direction, chunk):
        return torch.ones(2, 3) * 1.01

    def same(direction, chunk):
        return torch.ones(2, 3)

    assert _proven_path(failing, vmapped, None, None) is vmapped
    assert _proven_path(different, vmapped, None, None) is vmapped
    assert _proven_path(same, vmapped, None, None) is same


@pytest.mark.parametrize("case", ["per_checkpoint", "select", "int8"])
def test_per_checkpoint_projections_selections_and_quantised_stores(case):
    model = tiny_gpt2()
    ckpts, loss, docs = two_checkpoints(model), tif.causal_lm_loss(model), token_batch(3, 8)
    spec = tif.Projection(dim=32, kind="kronecker", per_checkpoint=case == "per_checkpoint")
    options = tif.GradientOptions(select="transformer.h.1.*") if case == "select" else None
    dtype = "int8" if case == "int8" else torch.float64
    store = tif.build_store(loss, ckpts, docs, projection=spec, options=options, dtype=dtype)
    test = tif.build_store(loss, ckpts, token_batch(1, 8, seed=3), projection=spec,
                           options=options, dtype=torch.float64)
    got = tif.token_scores(store, test, loss, ckpts, docs, rows=[0, 1, 2])  # rows check passes
    expected = tif.score(store, test).double()
    # int8 rows are rounded in storage; the per-token sums are those of the exact rows
    rtol = 2e-2 if case == "int8" else 1e-9
    torch.testing.assert_close(got.document_scores(), expected, rtol=rtol,
                               atol=rtol * float(expected.abs().max()))
