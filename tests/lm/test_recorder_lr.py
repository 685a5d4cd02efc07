"""The checkpoint recorder's lr weights (the mean over the steps each checkpoint stands for)
and what it saves (the trained parameters; the frozen base referenced, not re-saved)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_data, make_mlp

BASE_LR, STEPS, EVERY = 0.1, 6, 2


def _by_hand(kind: str, t: int) -> float:
    """The lr optimizer step ``t`` (0-based) uses, written out from each schedule's formula."""
    if kind == "constant":
        return BASE_LR
    if kind == "linear":  # to 0 at step STEPS, as HF's get_linear_schedule_with_warmup
        return BASE_LR * (STEPS - t) / STEPS
    if kind == "cosine":  # CosineAnnealingLR(T_max=STEPS, eta_min=0)
        return BASE_LR * (1 + math.cos(math.pi * t / STEPS)) / 2
    if kind == "warmup":  # 2 warm-up steps from 0, then linear decay to 0
        return BASE_LR * t / 2 if t < 2 else BASE_LR * (STEPS - t) / (STEPS - 2)
    raise AssertionError(kind)


def _scheduler(kind, optimizer):
    if kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: _by_hand(kind, t) / BASE_LR)


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine", "warmup"])
@pytest.mark.parametrize("scheduler_first", [True, False])
def test_each_checkpoint_gets_the_mean_lr_of_its_steps(tmp_path, kind, scheduler_first):
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    scheduler = _scheduler(kind, optimizer)
    recorder = tif.training.CheckpointRecorder(tmp_path, model, optimizer, every=EVERY,
                                      scheduler=scheduler)
    x, y = make_data(8)
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if scheduler_first:
            scheduler.step()
            recorder.step()
        else:
            recorder.step()
            scheduler.step()
    expected = [sum(_by_hand(kind, t) for t in range(end - EVERY, end)) / EVERY
                for end in range(EVERY, STEPS + 1, EVERY)]
    manifest = json.loads((tmp_path / "manifest.json").read_text())["checkpoints"]
    assert [e["lr"] for e in manifest] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # No checkpoint is at lr 0, so every one loads, the last (the final model) included.
    checkpoints = tif.load_recorded_checkpoints(tmp_path, model)
    assert [c.name for c in checkpoints] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    for name, value in model.named_parameters():
        assert torch.equal(checkpoints[-1].params[name], value.detach())


def test_save_after_the_loop_keeps_the_final_model_once(tmp_path):
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    scheduler = _scheduler("linear", optimizer)
    recorder = tif.training.CheckpointRecorder(tmp_path, model, optimizer, every=4)
    x, y = make_data(8)
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        scheduler.step()
        recorder.step()
    recorder.save()
    recorder.save()  # twice at one step: one entry, same lr
    manifest = json.loads((tmp_path / "manifest.json").read_text())["checkpoints"]
    assert [e["step"] for e in manifest] == [4, 6]
    assert [e["lr"] for e in manifest] == pytest.approx(
        [sum(_by_hand("linear", t) for t in range(4)) / 4,
         sum(_by_hand("linear", t) for t in (4, 5)) / 2], rel=1e-12)


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _train(tmp_path, model, *, max_steps=4, warmup_steps=0, every=None, save_steps=2):
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=max_steps, per_device_train_batch_size=4,
        learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=warmup_steps,
        save_strategy="steps" if every is None else "no", save_steps=save_steps,
        report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True, seed=0)
    record = tmp_path / "tracin"
    Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
            callbacks=[tif.trainer_callback(record, every=every)]).train()
    return record, json.loads((record / "manifest.json").read_text())


@pytest.mark.parametrize(("warmup_steps", "used"), [
    (0, [1e-2, 7.5e-3, 5e-3, 2.5e-3]),            # linear from 1e-2 to 0 over 4 steps
    (1, [0.0, 1e-2, 1e-2 * 2 / 3, 1e-2 / 3]),      # one warm-up step from 0, then linear
])
def test_trainer_linear_schedule_records_mean_lrs_and_keeps_the_last(tmp_path, warmup_steps,
                                                                     used):
    model = _tiny_gpt2()
    record, manifest = _train(tmp_path, model, warmup_steps=warmup_steps)
    entries = manifest["checkpoints"]
    assert [e["name"] for e in entries] == ["checkpoint-2", "checkpoint-4"]
    assert [e["lr"] for e in entries] == pytest.approx(
        [(used[0] + used[1]) / 2, (used[2] + used[3]) / 2], rel=1e-9)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is dropped at lr 0
        checkpoints = tif.load_recorded_checkpoints(record, model)
    assert [c.name for c in checkpoints] == ["checkpoint-2", "checkpoint-4"]
    for name, value in model.named_parameters():
        assert torch.equal(checkpoints[-1].params[name], value.detach())


def test_trainer_every_n_records_the_final_model_at_the_end(tmp_path):
    _, manifest = _train(tmp_path, _tiny_gpt2(), every=3)
    entries = manifest["checkpoints"]
    assert [e["step"] for e in entries] == [3, 4]
    used = [1e-2, 7.5e-3, 5e-3, 2.5e-3]
    assert [e["lr"] for e in entries] == pytest.approx([sum(used[:3]) / 3, used[3]], rel=1e-9)


def test_only_trained_parameters_are_saved_and_the_base_is_referenced_once(tmp_path):
    model = _tiny_gpt2()
    for name, value in model.named_parameters():  # adapter-like: only the last block trains
        value.requires_grad_(name.startswith("transformer.h.1."))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    record, manifest = _train(tmp_path, model)
    entries = manifest["checkpoints"]
    assert len({e["frozen"] for e in entries}) == 1
    frozen = manifest["frozen"][entries[0]["frozen"]]
    assert set(frozen) == {n for n, _ in model.named_parameters()} - trained
    for entry in entries:
        saved = torch.load(record / entry["weights"], weights_only=True)
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        assert set(saved) & params == trained
    saved = torch.load(record / entries[0]["weights"], weights_only=True)
    nbytes = sum(v.numel() * v.element_size() for v in saved.values())
    base = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    full = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    assert base > 0 and nbytes <= full - base
    # Loading gives whole checkpoints: the trainable parameters of the model passed in, the
    # frozen ones taken from it when it trains them too (after checking their values).
    checkpoints = tif.load_recorded_checkpoints(record, model)
    assert set(checkpoints[-1].params) == trained
    model.requires_grad_(True)
    everything = tif.load_recorded_checkpoints(record, model)
    for name, value in model.named_parameters():
        assert torch.equal(everything[-1].params[name], value.detach())
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.add_(1.0)
    with pytest.raises(tif.errors.InvalidArgumentError, match="differ .* from their values when"):
        tif.load_recorded_checkpoints(record, model)


def test_select_saves_only_the_selected_parameters(tmp_path):
    model = make_mlp()
    optimizer = torch.optim.SGD(model[2].parameters(), lr=BASE_LR)  # trains the last layer
    recorder = tif.training.CheckpointRecorder(tmp_path, model, optimizer, select="2")
    x, y = make_data(8)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    entry = recorder.step()
    assert set(torch.load(tmp_path / entry["weights"], weights_only=True)) == {
        "2.weight", "2.bias"}
    checkpoint = tif.load_recorded_checkpoints(tmp_path, model)[0]
    for name, value in model.named_parameters():
        assert torch.equal(checkpoint.params[name], value.detach())


def test_recordings_of_format_1_still_load(tmp_path):
    model = make_mlp()
    torch.save(model.state_dict(), tmp_path / "checkpoint-3.pt")
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 1, "checkpoints": [
        {"name": "checkpoint-3", "step": 3, "lr": 0.25, "weights": "checkpoint-3.pt",
         "optimizer": None, "optimizer_param_names": None}]}))
    with pytest.warns(RuntimeWarning, match="no file hashes"):  # loads, unverified
        [checkpoint] = tif.load_recorded_checkpoints(tmp_path, model)
    assert checkpoint.lr == 0.25
    for name, value in model.named_parameters():
        assert torch.equal(checkpoint.params[name], value.detach())


def test_a_peft_lora_run_records_adapters_only(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny_gpt2(), peft.LoraConfig(
        r=2, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False))
    record, manifest = _train(tmp_path, model, max_steps=2)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    [entry] = manifest["checkpoints"]
    saved = torch.load(record / entry["weights"], weights_only=True)
    assert {n for n in saved if "lora_" in n} == adapters
    assert not any(n.endswith("c_attn.base_layer.weight") for n in saved)
    assert len(manifest["frozen"][entry["frozen"]]) == sum(
        1 for _, p in model.named_parameters() if not p.requires_grad)
    [checkpoint] = tif.load_recorded_checkpoints(record, model)
    assert set(checkpoint.params) == adapters
    for name, value in model.named_parameters():
        if value.requires_grad:
            assert torch.equal(checkpoint.params[name], value.detach())
