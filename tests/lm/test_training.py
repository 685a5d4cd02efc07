"""Training hooks: a plain-loop recorder and a HF Trainer callback, read back as checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_data, make_mlp


def _train_plain(directory, *, steps=6, every=2, save_optimizer_state=True):
    """SGD-free Adam loop with a step scheduler; returns snapshots of (params, lr) we expect."""
    model = make_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    recorder = tif.training.CheckpointRecorder(directory, model, optimizer, every=every,
                                      scheduler=scheduler,
                                      save_optimizer_state=save_optimizer_state)
    x, y = make_data(8)
    expected = []
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        scheduler.step()
        entry = recorder.step()
        assert (entry is not None) == (step % every == 0)
        if entry is not None:
            snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
            state = {n: optimizer.state[p]["exp_avg_sq"].clone()
                     for n, p in model.named_parameters()}
            # The mean of the lrs its steps used (step t, 0-based, uses 0.1 * 0.5**t).
            lr = sum(0.1 * 0.5**t for t in range(step - every, step)) / every
            expected.append((step, lr, snapshot, state))
    return model, expected


def test_recorder_saves_every_n_steps_with_the_lr_in_force(tmp_path):
    model, expected = _train_plain(tmp_path)
    checkpoints = tif.load_recorded_checkpoints(tmp_path, model)
    assert [c.name for c in checkpoints] == [f"checkpoint-{s}" for s, *_ in expected]
    for ckpt, (_, lr, snapshot, _) in zip(checkpoints, expected, strict=True):
        assert ckpt.lr == pytest.approx(lr, rel=1e-12)
        assert set(ckpt.params) == set(snapshot)
        for name, value in snapshot.items():
            assert torch.equal(ckpt.params[name], value)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [e["step"] for e in manifest["checkpoints"]] == [2, 4, 6]


def test_recorded_preconditioners_hold_each_checkpoints_state(tmp_path):
    model, expected = _train_plain(tmp_path)
    preconditioners = tif.load_recorded_preconditioners(tmp_path, model, kind="trackstar")
    assert [p.kind for p in preconditioners] == ["trackstar"] * 3
    for precondition, (step, _, _, state) in zip(preconditioners, expected, strict=True):
        for name, value in state.items():
            assert torch.equal(precondition.state[name].exp_avg_sq, value)
            assert precondition.state[name].step == step
    # They feed build_store directly, one per recorded checkpoint.
    checkpoints = tif.load_recorded_checkpoints(tmp_path, model)
    store = tif.build_store(tif.loss_from_module(model.eval(), F.cross_entropy), checkpoints,
                            make_data(4), projection=tif.Projection(dim=8),
                            preconditioners=preconditioners, dtype=torch.float64)
    assert store.meta.preconditioner == "trackstar"
    assert store.meta.lrs == tuple(c.lr for c in checkpoints)


def test_recorder_errors(tmp_path):
    model = make_mlp()
    optimizer = torch.optim.Adam(model.parameters())
    with pytest.raises(tif.errors.InvalidArgumentError, match="every must be a positive int"):
        tif.training.CheckpointRecorder(tmp_path, model, optimizer, every=0)
    with pytest.raises(tif.errors.InvalidArgumentError, match="no manifest.json"):
        tif.load_recorded_checkpoints(tmp_path / "empty", model)
    _train_plain(tmp_path / "plain", steps=2, save_optimizer_state=False)
    with pytest.raises(tif.errors.InvalidArgumentError, match="without optimizer state"):
        tif.load_recorded_preconditioners(tmp_path / "plain", model)


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def test_trainer_callback_records_checkpoints_lrs_and_optimizer_state(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = _tiny_gpt2()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (8, 8), generator=g)
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=4, per_device_train_batch_size=4,
        learning_rate=1e-2, lr_scheduler_type="linear", save_strategy="steps", save_steps=2,
        report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True,
        seed=0)
    record = tmp_path / "tracin"
    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      callbacks=[tif.trainer_callback(record)])
    trainer.train()

    # Linear decay from 1e-2 to 0 over 4 steps: steps use 1e-2, 7.5e-3, 5e-3, 2.5e-3, and
    # each checkpoint gets the mean of its two; the last (the final model) is kept.
    manifest = json.loads((record / "manifest.json").read_text())["checkpoints"]
    assert [e["name"] for e in manifest] == ["checkpoint-2", "checkpoint-4"]
    assert [e["lr"] for e in manifest] == pytest.approx([8.75e-3, 3.75e-3], abs=1e-12)
    checkpoints = tif.load_recorded_checkpoints(record, model)
    assert [c.name for c in checkpoints] == ["checkpoint-2", "checkpoint-4"]
    final = tif.Checkpoint.load(record / manifest[-1]["weights"], model, lr=1.0)
    for name, value in model.named_parameters():
        assert torch.equal(final.params[name], value.detach())
    # The Trainer's own optimizer.pt, read in the Trainer's parameter order, matches.
    ours = tif.load_recorded_preconditioners(record, model)[0]
    theirs = tif.Preconditioner.load(tmp_path / "hf" / "checkpoint-2" / "optimizer.pt",
                                     tif.precondition.trainer_param_names(model))
    assert ours.names == theirs.names
    for name in ours.names:
        assert torch.equal(ours.state[name].exp_avg, theirs.state[name].exp_avg)
        assert ours.state[name].step == theirs.state[name].step == 2


def test_trainer_callback_every_n_steps(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = _tiny_gpt2()
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=3,
                             per_device_train_batch_size=2, save_strategy="no",
                             report_to=[], use_cpu=True, logging_strategy="no",
                             disable_tqdm=True)
    callback = tif.trainer_callback(tmp_path / "rec", every=1, save_optimizer_state=False)
    Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
            callbacks=[callback]).train()
    manifest = json.loads((tmp_path / "rec" / "manifest.json").read_text())
    assert [(e["step"], e["optimizer"]) for e in manifest["checkpoints"]] == [
        (1, None), (2, None), (3, None)]
