"""Exact routes of the batched kronecker path (issue 34): biases and norms by one stacked matmul,
layer outputs differentiated without taps, and the once-said loss-form warning, each against
the brute-force reference (autograd per example, float64, explicit Kronecker matrices)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import tracinfunc as tif
from tests.lm_helpers import explicit_kronecker, hf_loop_grads, tiny_gpt2, token_batch
from tracinfunc.grads.factorized import factorized_projected_grads
from tracinfunc.grads.factorized_batched import BatchedPathWarning, LossFormWarning
from tracinfunc.grads.factorized_vectors import VectorBlocks, split_vectors
from tracinfunc.projection import canonical_layout, make_projector

SPEC = tif.Projection(dim=64, seed=5, kind="kronecker")


def params_of(model):
    return {k: v.detach() for k, v in model.named_parameters()}


def plan_of(fn):
    cells = [c.cell_contents for c in fn.__closure__ if isinstance(c.cell_contents, dict)]
    (plan,) = [p for plans in cells for p in plans.values()]
    return plan


def test_stacked_vector_blocks_equal_the_projector_of_each_parameter():
    g = torch.Generator().manual_seed(0)
    vectors = {"b.bias": torch.randn(7, dtype=torch.float64, generator=g),
               "a.weight": torch.randn(5, dtype=torch.float64, generator=g),
               "c.scale": torch.randn((), dtype=torch.float64, generator=g)}
    names, others = split_vectors(SPEC, {**vectors, "m.weight": torch.zeros(3, 2)})
    assert names == ["a.weight", "b.bias", "c.scale"] and others == ["m.weight"]
    blocks = VectorBlocks(SPEC, vectors, device=torch.device("cpu"), dtype=torch.float64)
    projector = make_projector(SPEC, canonical_layout(vectors), dtype=torch.float64)
    torch.testing.assert_close(blocks(vectors) * projector.scale, projector(vectors),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [64, 61])  # 61: the last byte of each packed row is partial
def test_packed_vector_block_over_several_row_slices_equals_the_projector(dim):
    # 5,000 + 3 rows at k=61 span two CPU row slices (2**18 // 61 = 4,297 rows each)
    spec = tif.Projection(dim=dim, seed=9, kind="kronecker")
    g = torch.Generator().manual_seed(1)
    vectors = {"big.bias": torch.randn(5000, dtype=torch.float64, generator=g),
               "ln.weight": torch.randn(3, dtype=torch.float64, generator=g)}
    blocks = VectorBlocks(spec, vectors, device=torch.device("cpu"), dtype=torch.float64)
    assert blocks.bits.dtype == torch.uint8 and blocks.bits.shape == (5003, -(-dim // 8))
    projector = make_projector(spec, canonical_layout(vectors), dtype=torch.float64)
    batch = {name: torch.randn(3, *v.shape, dtype=torch.float64, generator=g)
             for name, v in vectors.items()}
    expected = torch.func.vmap(projector)(batch)  # [3, k], blocks from the spec's hash
    torch.testing.assert_close(blocks.batched(batch) * projector.scale, expected,
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.func.vmap(blocks)(batch) * projector.scale, expected,
                               rtol=1e-12, atol=1e-12)


def test_gpt2_small_sized_vector_stack_stays_on_the_packed_route():
    # GPT-2 small: 121,344 vector rows x k=4096 is 2 GB in float32, 62 MB as bits
    spec = tif.Projection(dim=4096, kind="kronecker")
    rest = {"h.bias": torch.empty(121_344, device="meta"),
            "wte.weight": torch.empty(2, 3, device="meta")}
    assert split_vectors(spec, rest) == (["h.bias"], ["wte.weight"])
    over = {"h.bias": torch.empty(2**21 + 1, device="meta")}  # > 1 GiB of bits
    assert split_vectors(spec, over) == ([], ["h.bias"])


def test_all_parameter_rows_equal_the_brute_force_reference():
    model, batch = tiny_gpt2(), token_batch(n=5)  # padded: masked tokens drop out
    params = params_of(model)
    fn = factorized_projected_grads(tif.causal_lm_loss(model), SPEC)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchedPathWarning)
        got = fn(params, batch)
    plan = plan_of(fn)
    assert plan.batched == "forward" and plan.vectors is not None and plan.rest is None
    assert any("ln_" in name for name in plan.vectors.names)  # norms and biases stacked
    expected = explicit_kronecker(hf_loop_grads(model, params, batch), SPEC)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)


class _InPlace(nn.Module):
    """Layer outputs scaled in place after their layer returned them: the first layer's
    (needs no gradient: a zero tap is differentiated) or the second's (differentiated
    itself)."""

    def __init__(self, which: int):
        super().__init__()
        self.which = which
        self.fc, self.mid, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc(x)
        if self.which == 0:
            h.mul_(2.0)
        h = self.mid(torch.tanh(h))
        if self.which == 1:
            h.mul_(2.0)
        return self.out(torch.tanh(h))


def _loop_rows(model, params, x, y):
    def one(p, i):
        return F.cross_entropy(functional_call(model, p, (x[i:i + 1],)), y[i:i + 1])

    grads = {name: [] for name in sorted(params)}
    for i in range(x.shape[0]):
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        for name, g in zip(sorted(params), torch.autograd.grad(
                one(leaves, i), [leaves[k] for k in sorted(params)]), strict=True):
            grads[name].append(g)
    return explicit_kronecker({k: torch.stack(v) for k, v in grads.items()}, SPEC)


@pytest.mark.parametrize("which", [0, 1])
def test_outputs_modified_in_place_keep_exact_rows(which):
    torch.manual_seed(0)
    model = _InPlace(which).double().eval()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    loss, params = tif.loss_from_module(model, F.cross_entropy), params_of(model)
    fn = factorized_projected_grads(loss, SPEC)
    if which == 0:  # a tapped output: one batched forward still applies
        with warnings.catch_warnings():
            warnings.simplefilter("error", BatchedPathWarning)
            got = fn(params, (x, y))
        assert plan_of(fn).batched == "forward"
    else:  # an output differentiated itself: refused, the next mode is exact
        with pytest.warns(BatchedPathWarning, match="modified in place"):
            got = fn(params, (x, y))
        assert plan_of(fn).batched == "vmap"
    torch.testing.assert_close(got, _loop_rows(model, params, x, y), rtol=1e-9, atol=1e-11)


def test_a_plain_functional_loss_is_told_once_which_form_is_fast():
    model, batch = tiny_gpt2(seed=1), {"input_ids": token_batch(n=3)["input_ids"]}
    params = params_of(model)

    def hand_written(p, example):
        ids = example["input_ids"][None]
        return functional_call(model, p, (), {"input_ids": ids, "labels": ids}).loss

    with pytest.warns(LossFormWarning, match=r"tif\.causal_lm_loss\(model\)"):
        got = factorized_projected_grads(hand_written, SPEC)(params, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossFormWarning)  # once per loss, not per function
        again = factorized_projected_grads(hand_written, SPEC)(params, batch)
    grads = {name: [] for name in sorted(params)}
    for i in range(3):  # the reference: autograd of the hand-written loss, one example at a time
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        value = hand_written(leaves, {"input_ids": batch["input_ids"][i]})
        for name, g in zip(sorted(params), torch.autograd.grad(
                value, [leaves[k] for k in sorted(params)]), strict=True):
            grads[name].append(g)
    expected = explicit_kronecker({k: torch.stack(v) for k, v in grads.items()}, SPEC)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(again, got, rtol=1e-12, atol=1e-12)
    # The adapter the message names gives the same rows by one forward (up to HF computing its
    # cross-entropy in float32: logits.float()).
    fast = factorized_projected_grads(tif.causal_lm_loss(model), SPEC)
    torch.testing.assert_close(fast(params, batch), got, rtol=1e-4, atol=1e-7)
    assert plan_of(fast).batched == "forward"
