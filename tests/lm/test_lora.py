"""LoRA adapters (peft): selection by glob, adapter-only checkpoints, adapter files, factorised."""

from __future__ import annotations

import peft
import pytest
import torch

import tracinfunc as tif
from tests.lm_helpers import explicit_kronecker, hf_loop_grads, tiny_gpt2, token_batch
from tracinfunc.errors import MissingParametersError

SPEC = tif.Projection(dim=16, seed=7, kind="kronecker")


def lora_gpt2():
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                             lora_dropout=0.0, fan_in_fan_out=True)
    model = peft.get_peft_model(tiny_gpt2(), config).eval()
    with torch.no_grad():  # lora_B starts at zero: make the adapters non-trivial
        for name, value in model.named_parameters():
            if "lora_B" in name:
                value.normal_(0, 0.1)
    return model


def test_checkpoint_of_a_peft_model_holds_only_the_adapters():
    model = lora_gpt2()
    ckpt = tif.Checkpoint.from_module(model)
    assert ckpt.params and all("lora_A" in n or "lora_B" in n for n in ckpt.params)
    assert len(ckpt.params) == 2 * 2 * 2  # 2 layers x (c_attn, c_fc) x (A, B)


def test_lora_factorised_equals_explicit_kronecker_projection():
    model, batch = lora_gpt2(), token_batch()
    params = dict(tif.Checkpoint.from_module(model).params)
    loss = tif.causal_lm_loss(model)
    example = {k: v[0] for k, v in batch.items()}
    assert tif.grads.factorized_weights(loss, params, example) == sorted(params)
    got = tif.projected_grads(loss, SPEC)(params, batch)
    expected = explicit_kronecker(hf_loop_grads(model, params, batch), SPEC)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)


def test_select_by_glob_on_peft_names():
    model, batch = lora_gpt2(), token_batch()
    params = dict(tif.Checkpoint.from_module(model).params)
    loss = tif.causal_lm_loss(model)
    names = tif.select_params(params, "*lora_B*")
    assert names and all("lora_B" in n for n in names)
    got = tif.projected_grads(loss, SPEC, options=tif.GradientOptions(select="*lora_B*"))(
        params, batch
    )
    grads = hf_loop_grads(model, params, batch)
    expected = explicit_kronecker({n: grads[n] for n in names}, SPEC)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)


def test_an_adapter_file_loads_onto_the_live_model(tmp_path):
    model = lora_gpt2()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").exists()
    ckpt = tif.adapter_checkpoint(tmp_path, model, lr=0.5, name="step-10")
    live = tif.Checkpoint.from_module(model)
    assert ckpt.params.keys() == live.params.keys() and ckpt.lr == 0.5
    for name in live.params:
        torch.testing.assert_close(ckpt.params[name], live.params[name], rtol=0, atol=0)
    other = peft.get_peft_model(tiny_gpt2(), peft.LoraConfig(r=4, target_modules=["c_proj"],
                                                             fan_in_fan_out=True))
    with pytest.raises(MissingParametersError, match="adapter_checkpoint: the adapter file"):
        tif.adapter_checkpoint(tmp_path, other)
