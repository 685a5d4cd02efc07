"""The batched factorised kronecker path (one backward of the summed loss) vs the vmapped one."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_convnet, make_data, make_mlp
from tests.lm_helpers import explicit_kronecker, hf_loop_grads, tiny_gpt2, token_batch
from tracinfunc.grads import factorized_batched
from tracinfunc.grads.factorized import factorized_projected_grads
from tracinfunc.grads.factorized_batched import BatchedPathWarning

SPEC = tif.Projection(dim=16, seed=3, kind="kronecker")
MATCHED = "transformer.h.*.c_*.weight"  # the blocks' Conv1D weights (bergson's default)


def params_of(model):
    return {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}


def both_paths(loss, params, batch, *, spec=SPEC, mode=None, **keywords):
    """``(batched rows, vmapped rows)``; the batched path must be taken (no fallback), by
    ``mode`` (``"forward"``: one batched forward; ``"vmap"``) when given."""
    fn = factorized_projected_grads(loss, spec, **keywords)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchedPathWarning)
        fast = fn(params, batch)
    if mode is not None:
        assert plan_of(fn).batched == mode
    slow = factorized_projected_grads(loss, spec, batched=False, **keywords)(params, batch)
    return fast, slow


def plan_of(fn):
    """The one plan a factorised function made (a test peeks at its closure)."""
    cells = [c.cell_contents for c in fn.__closure__ if isinstance(c.cell_contents, dict)]
    (plan,) = [p for plans in cells for p in plans.values()]
    return plan


def tolerances(dtype):
    return {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else \
        {"rtol": 2e-4, "atol": 1e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("select", [None, MATCHED])
def test_gpt2_conv1d_rows_equal_the_vmapped_path(dtype, select):
    model = tiny_gpt2(dtype=dtype)
    batch = token_batch(n=5)
    fast, slow = both_paths(tif.causal_lm_loss(model), params_of(model), batch, select=select,
                            mode="forward")
    assert fast.shape == (5, 16) and fast.dtype == dtype
    torch.testing.assert_close(fast, slow, **tolerances(dtype))


def test_gpt2_rows_equal_explicit_kronecker_of_loop_gradients():
    model, batch = tiny_gpt2(), token_batch(n=4)
    params = params_of(model)
    got = tif.projected_grads(tif.causal_lm_loss(model), SPEC)(params, batch)
    expected = explicit_kronecker(hf_loop_grads(model, params, batch), SPEC)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_linear_and_conv_rows_equal_the_vmapped_path(dtype, chunk_size):
    for model, batch in ((make_mlp(dtype=dtype), make_data(7, dtype=dtype)),
                         (make_convnet(dtype=dtype),
                          (torch.randn(5, 1, 8, 8, dtype=dtype), torch.randint(0, 3, (5,))))):
        loss = tif.loss_from_module(model.eval(), F.cross_entropy)
        fast, slow = both_paths(loss, params_of(model), batch, chunk_size=chunk_size,
                                mode="forward")
        torch.testing.assert_close(fast, slow, **tolerances(dtype))


def test_shared_layers_and_layer_norm_in_one_batched_forward():
    from tests.grads.test_factorized import Tokens

    model = Tokens().double().eval()  # a Linear called twice, a LayerNorm, biases
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(5, 3, 4, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (5,), generator=g))
    loss = tif.loss_from_module(model, F.cross_entropy)
    fast, slow = both_paths(loss, params_of(model), batch, mode="forward")
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)


class Scaled(torch.nn.Module):
    """A free parameter outside any layer: no rule gives its per-example gradient from
    one batched forward, so the vmap forward is used."""

    def __init__(self):
        super().__init__()
        self.fc, self.scale = torch.nn.Linear(6, 3), torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.fc(x) * self.scale


def test_a_parameter_outside_the_rules_keeps_the_vmap_forward():
    model = Scaled().double().eval()
    loss, batch = tif.loss_from_module(model, F.cross_entropy), make_data(5)
    params = params_of(model)
    fn = factorized_projected_grads(loss, SPEC)
    with pytest.warns(BatchedPathWarning, match=r"parameters \['scale'\]"):
        got = fn(params, batch)
    assert plan_of(fn).batched == "vmap"
    expected = factorized_projected_grads(loss, SPEC, batched=False)(params, batch)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lora_rows_equal_the_vmapped_path(dtype):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                             lora_dropout=0.0, fan_in_fan_out=True)
    model = peft.get_peft_model(tiny_gpt2(dtype=dtype), config).eval()
    with torch.no_grad():
        for name, value in model.named_parameters():
            if "lora_B" in name:
                value.normal_(0, 0.1)
    params = dict(tif.Checkpoint.from_module(model).params)
    fast, slow = both_paths(tif.causal_lm_loss(model), params, token_batch(n=4), mode="forward")
    torch.testing.assert_close(fast, slow, **tolerances(dtype))


class Interacting(torch.nn.Module):
    """Rows interact in a batched forward (each gets the batch mean added): per example the
    model is ``2 * fc(x)``, which vmap computes, but not one batched forward."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc(x)
        return self.head(torch.tanh(h + h.mean(dim=0, keepdim=True)))


def test_examples_that_interact_in_a_batched_forward_keep_the_vmap_forward():
    model = Interacting().double().eval()
    loss, batch = tif.loss_from_module(model, F.cross_entropy), make_data(6)
    params = params_of(model)
    weights = {name: value for name, value in params.items() if name.endswith("weight")}
    fn = factorized_projected_grads(loss, SPEC, select=list(weights))
    with pytest.warns(BatchedPathWarning, match="examples may interact"):
        got = fn(params, batch)
    assert plan_of(fn).batched == "vmap"
    expected = factorized_projected_grads(loss, SPEC, select=list(weights), batched=False)(
        params, batch)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_rows_that_disagree_on_the_first_batch_fall_back_with_the_reason(monkeypatch):
    model, batch = make_mlp(), make_data(6)
    loss, params = tif.loss_from_module(model.eval(), F.cross_entropy), params_of(model)
    expected = factorized_projected_grads(loss, SPEC, batched=False)(params, batch)
    real = factorized_batched.batched_rows
    monkeypatch.setattr(factorized_batched, "batched_rows",
                        lambda *args: real(*args) + 1.0)  # e.g. examples that interact
    fn = tif.projected_grads(loss, SPEC)
    with pytest.warns(BatchedPathWarning, match="differ from the per-example ones"):
        got = fn(params, batch)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once; later batches use the vmapped path
        torch.testing.assert_close(fn(params, batch), expected, rtol=1e-12, atol=1e-12)


def test_a_failing_batched_backward_falls_back_with_the_reason(monkeypatch):
    model, batch = make_mlp(), make_data(4)
    loss, params = tif.loss_from_module(model.eval(), F.cross_entropy), params_of(model)

    def fails(*args):
        raise RuntimeError("no autograd formula outside torch.func")

    monkeypatch.setattr(factorized_batched, "batched_rows", fails)
    with pytest.warns(BatchedPathWarning, match="no autograd formula"):
        got = tif.projected_grads(loss, SPEC)(params, batch)
    expected = factorized_projected_grads(loss, SPEC, batched=False)(params, batch)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_the_batched_path_neither_copies_nor_differentiates_the_weights():
    model = tiny_gpt2(dtype=torch.float32)
    params = {k: v.detach().requires_grad_(True) for k, v in model.named_parameters()}
    fn = factorized_projected_grads(tif.causal_lm_loss(model), SPEC)
    fn(params, token_batch(n=3))  # first batch: proven
    seen = []
    original = torch.Tensor.clone
    try:
        torch.Tensor.clone = lambda self, *a, **k: (seen.append(self.shape),
                                                    original(self, *a, **k))[1]
        fn(params, token_batch(n=3, seed=1))
    finally:
        torch.Tensor.clone = original
    big = [shape for shape in seen if shape.numel() >= 32 * 32]
    assert big == [] and all(p.grad is None for p in params.values())


def test_llm_throughput_benchmark_quick_mode_runs(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "llm_throughput.py"
    spec = importlib.util.spec_from_file_location("llm_throughput", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(["--quick"])
    assert [(r["method"], r["precondition"], r["functional"]) for r in rows] == [
        ("kronecker", None, False), ("kronecker", None, True),
        ("kronecker vectors", None, False), ("kronecker vectors", None, True),
        ("kronecker", "adam factored", False), ("identity", None, False)]
    assert all(r["tool_s"] > 0 and r["floor_s"] > 0 for r in rows)
    assert all(r["ops"] > 0 and r["floor_ops"] > 0 for r in rows)  # operations per call
    assert all(-1 <= r["r"] <= 1 for r in rows if r["method"] != "identity")
    assert "x floor" in capsys.readouterr().out


def test_module_loss_per_example_equals_vmap_of_the_loss():
    from torch.func import vmap

    model, batch = tiny_gpt2(), token_batch(n=4)  # right padding of varied lengths
    loss, params = tif.causal_lm_loss(model), params_of(model)
    torch.testing.assert_close(loss.per_example(params, batch),
                               vmap(loss, in_dims=(None, 0))(params, batch),
                               rtol=1e-10, atol=1e-12)
    own = tif.loss_from_model(model)  # outputs.loss: a batch mean, not per example
    with pytest.raises(tif.errors.LossFunctionError, match="pass criterion="):
        own.per_example(params, {**batch, "labels": batch["input_ids"]})
