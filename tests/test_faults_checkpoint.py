"""Checkpoint loaders compare shapes (issue 25 item 13): before, a 6-64-3 state dict loaded
into a 6-8-3 model and a rank-2 LoRA file into a rank-8 peft model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tracinfunc as tif
from tracinfunc.errors import InvalidArgumentError


def _mlp(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 3))


def test_checkpoint_load_refuses_a_state_dict_of_other_shapes(tmp_path):
    torch.save(_mlp(64).state_dict(), tmp_path / "wide.pt")
    with pytest.raises(InvalidArgumentError,
                       match=r"Checkpoint.load: parameter '0.weight' has shape \[64, 6\] in the "
                             r"loaded weights but \[8, 6\] in the model \(3 tensors differ"):
        tif.Checkpoint.load(tmp_path / "wide.pt", _mlp(8))
    with pytest.raises(InvalidArgumentError, match="Checkpoint.from_state_dict: parameter"):
        tif.Checkpoint.from_state_dict(_mlp(64).state_dict(), _mlp(8))
    # torch itself refuses the same, so the two agree
    with pytest.raises(RuntimeError, match="size mismatch"):
        _mlp(8).load_state_dict(_mlp(64).state_dict())


def test_checkpoint_load_of_matching_shapes_still_loads(tmp_path):
    model = _mlp(8)
    torch.save(model.state_dict(), tmp_path / "same.pt")
    ckpt = tif.Checkpoint.load(tmp_path / "same.pt", _mlp(8), lr=0.5, name="same")
    assert ckpt.name == "same" and ckpt.lr == 0.5
    assert all(torch.equal(ckpt.params[k], v) for k, v in model.named_parameters())


def test_a_batchnorm_buffer_of_another_size_is_refused():
    small, wide = (nn.Sequential(nn.Linear(6, h), nn.BatchNorm1d(h)) for h in (4, 9))
    state = {**small.state_dict(), "1.running_mean": wide.state_dict()["1.running_mean"]}
    with pytest.raises(InvalidArgumentError, match=r"'1.running_mean' has shape \[9\]"):
        tif.Checkpoint.from_state_dict(state, small)


def test_adapter_checkpoint_refuses_a_lora_file_of_another_rank(tmp_path):
    peft = pytest.importorskip("peft")
    from tests.lm_helpers import tiny_gpt2

    def lora(rank):
        config = peft.LoraConfig(r=rank, lora_alpha=8, target_modules=["c_attn"],
                                 lora_dropout=0.0, fan_in_fan_out=True)
        return peft.get_peft_model(tiny_gpt2(), config)

    lora(2).save_pretrained(tmp_path)
    with pytest.raises(InvalidArgumentError,
                       match=r"adapter_checkpoint: parameter '.*lora_A.default.weight' has shape "
                             r"\[2, 32\] in the loaded weights but \[8, 32\] .*LoraConfig"):
        tif.adapter_checkpoint(tmp_path, lora(8))
    assert tif.adapter_checkpoint(tmp_path, lora(2)).params  # the right rank loads
