"""Checkpoint construction, copying semantics and fingerprints."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import tracinfunc as tif
from tests.conftest import make_mlp


def test_from_module_copies_trainable_params():
    model = make_mlp(dtype=torch.float32)
    model[0].bias.requires_grad_(False)
    ckpt = tif.Checkpoint.from_module(model, lr=0.5, name="e1")
    assert sorted(ckpt.params) == ["0.weight", "2.bias", "2.weight"]
    before = ckpt.params["0.weight"].clone()
    with torch.no_grad():
        model[0].weight.add_(1.0)  # training continues: the snapshot must not move
    assert torch.equal(ckpt.params["0.weight"], before)
    assert ckpt.lr == 0.5 and ckpt.name == "e1"


def test_params_mapping_is_read_only():
    ckpt = tif.Checkpoint.from_module(make_mlp())
    with pytest.raises(TypeError):
        ckpt.params["0.weight"] = torch.zeros(1)
    with pytest.raises(AttributeError):
        ckpt.lr = 2.0


def test_from_state_dict_and_load(tmp_path):
    model = make_mlp(dtype=torch.float32)
    model.register_buffer("step", torch.tensor(3))
    path = tmp_path / "epoch.pt"
    torch.save(model.state_dict(), path)
    ckpt = tif.Checkpoint.load(path, model, lr=0.1)
    assert sorted(ckpt.params) == sorted(k for k, _ in model.named_parameters())
    assert ckpt.fingerprint == tif.Checkpoint.from_module(model).fingerprint
    with pytest.raises(KeyError, match="lacks parameters"):
        tif.Checkpoint.from_state_dict({"0.weight": model[0].weight}, model)


def test_fingerprint_is_stable_across_processes_and_sensitive_to_values():
    model = make_mlp(dtype=torch.float32)
    ckpt = tif.Checkpoint.from_module(model)
    code = (
        "import torch, tracinfunc as tif; from tests.conftest import make_mlp;"
        "print(tif.Checkpoint.from_module(make_mlp(dtype=torch.float32)).fingerprint)"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert other == ckpt.fingerprint
    changed = {k: v + (k == "2.bias") * 1e-6 for k, v in ckpt.params.items()}
    assert tif.checkpoint.params_fingerprint(changed) != ckpt.fingerprint


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"params": {}}, TypeError, "non-empty dict"),
        ({"params": {"w": [1.0]}}, TypeError, "map str names to tensors"),
        ({"params": {"w": torch.zeros(2, dtype=torch.long)}}, TypeError, "floating-point"),
        ({"params": {"w": torch.zeros(2)}, "lr": float("nan")}, ValueError, "finite"),
        ({"params": {"w": torch.zeros(2)}, "lr": "0.1"}, TypeError, "must be a number"),
    ],
)
def test_invalid_checkpoints_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        tif.Checkpoint(**kwargs)
