"""Hostile pass over the checkpoint recorder (issue 31, findings 1-4, HOSTILE.md classes 2-3):
runs restarted or resumed into a used directory, files swapped on disk, a frozen base swapped,
a run killed between a checkpoint file and the manifest, two recorders on one directory."""

from __future__ import annotations

import fcntl
import json
import os

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_data, make_mlp
from tracinfunc.errors import (
    CorruptRecordingError,
    InvalidArgumentError,
    RecordingExistsError,
    StoreLockedError,
)

Recorder = tif.training.CheckpointRecorder


def _train(recorder, model, optimizer, steps):
    x, y = make_data(8)
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        recorder.step()


def _run(directory, *, lr, steps=2, every=1, model=None, optimizer=torch.optim.SGD, **flags):
    model = make_mlp() if model is None else model
    optimizer = optimizer(model.parameters(), lr=lr)
    recorder = Recorder(directory, model, optimizer, every=every, **flags)
    _train(recorder, model, optimizer, steps)
    recorder.close()
    return model


def _manifest(directory):
    return json.loads((directory / "manifest.json").read_text())


# Finding 1: a run restarted from scratch into a used directory mixed the two runs.
def test_a_new_run_into_a_used_directory_is_refused(tmp_path):
    model = _run(tmp_path, lr=0.5)
    with pytest.raises(RecordingExistsError, match=r"already holds .*resume=True.*overwrite=True"):
        _run(tmp_path, lr=0.1)
    assert [c.lr for c in tif.load_recorded_checkpoints(tmp_path, model)] == [0.5, 0.5]


def test_overwrite_replaces_the_recording_and_removes_only_its_files(tmp_path):
    _run(tmp_path, lr=0.5, steps=3)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "checkpoint-99.bin").write_text("mine too")
    old_id = _manifest(tmp_path)["run_id"]
    model = _run(tmp_path, lr=0.1, overwrite=True)
    assert _manifest(tmp_path)["run_id"] != old_id
    assert [c.lr for c in tif.load_recorded_checkpoints(tmp_path, model)] == [0.1, 0.1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-1.pt", "checkpoint-2.pt", "checkpoint-99.bin", "manifest.json", "notes.txt",
        "optimizer-1.pt", "optimizer-2.pt"]


def test_resume_and_overwrite_together_are_refused(tmp_path):
    model = make_mlp()
    with pytest.raises(InvalidArgumentError, match="resume=True or overwrite=True, not both"):
        Recorder(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1), resume=True,
                 overwrite=True)


# Finding 2: a resumed run counted from 0 and wrote step-50 weights over checkpoint-10.pt.
def test_resume_continues_from_the_last_recorded_step_and_keeps_every_file(tmp_path):
    model = _run(tmp_path, lr=0.5, steps=40, every=10)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*.pt")}
    model = _run(tmp_path, lr=0.1, steps=20, every=10, model=model, resume=True)
    entries = _manifest(tmp_path)["checkpoints"]
    assert [e["step"] for e in entries] == [10, 20, 30, 40, 50, 60]
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    ckpts = tif.load_recorded_checkpoints(tmp_path, model)
    assert [c.lr for c in ckpts] == pytest.approx([0.5] * 4 + [0.1] * 2, rel=1e-12)
    for name, value in model.named_parameters():
        assert torch.equal(ckpts[-1].params[name], value.detach())


def test_resume_with_an_explicit_start_step(tmp_path):
    model = _run(tmp_path, lr=0.5, steps=20, every=10)
    _run(tmp_path, lr=0.1, steps=10, every=10, model=model, resume=True, start_step=25)
    assert [e["step"] for e in _manifest(tmp_path)["checkpoints"]] == [10, 20, 30]


def test_a_recorded_checkpoint_is_never_overwritten(tmp_path):
    model = _run(tmp_path, lr=0.5, steps=40, every=10)
    before = (tmp_path / "checkpoint-10.pt").read_bytes()
    with pytest.raises(RecordingExistsError, match=r"checkpoint-40.*start_step=0"):
        _run(tmp_path, lr=0.1, steps=10, every=10, model=model, resume=True, start_step=0)
    assert (tmp_path / "checkpoint-10.pt").read_bytes() == before
    assert [e["step"] for e in _manifest(tmp_path)["checkpoints"]] == [10, 20, 30, 40]


def test_loading_refuses_a_manifest_out_of_training_order(tmp_path):
    model = _run(tmp_path, lr=0.5, steps=2)
    manifest = _manifest(tmp_path)
    manifest["checkpoints"].reverse()
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptRecordingError, match="step order"):
        tif.load_recorded_checkpoints(tmp_path, model)


# Finding 3: two checkpoint files swapped on disk loaded under each other's names and lrs.
@pytest.mark.parametrize("kind", ["checkpoint", "optimizer"])
def test_swapped_files_are_refused_by_name(tmp_path, kind):
    model = _run(tmp_path, lr=0.5, steps=2, optimizer=torch.optim.Adam)
    a, b = tmp_path / f"{kind}-1.pt", tmp_path / f"{kind}-2.pt"
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    load = (tif.load_recorded_checkpoints if kind == "checkpoint"
            else tif.load_recorded_preconditioners)
    with pytest.raises(CorruptRecordingError, match=f"{kind}-1.pt.*swapped"):
        load(tmp_path, model)


def test_a_truncated_file_is_refused(tmp_path):
    model = _run(tmp_path, lr=0.5, steps=1)
    path = tmp_path / "checkpoint-1.pt"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(CorruptRecordingError, match="checkpoint-1.pt.*size"):
        tif.load_recorded_checkpoints(tmp_path, model)


def test_a_recording_without_hashes_loads_with_a_warning(tmp_path):
    model = _run(tmp_path, lr=0.5, steps=1)
    manifest = _manifest(tmp_path)
    manifest["format_version"] = 2
    for entry in manifest["checkpoints"]:
        del entry["files"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(RuntimeWarning, match="no file hashes"):
        [ckpt] = tif.load_recorded_checkpoints(tmp_path, model)
    assert ckpt.lr == 0.5


# Finding 4: an adapters-only recording loaded into a model with another frozen base.
def _freeze_all_but_last(model):
    for name, value in model.named_parameters():
        value.requires_grad_(name.startswith("2."))
    return model


def test_a_different_frozen_base_is_refused(tmp_path):
    model = _freeze_all_but_last(make_mlp(seed=0))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    recorder = Recorder(tmp_path, model, optimizer)
    _train(recorder, model, optimizer, 1)
    recorder.close()
    other = _freeze_all_but_last(make_mlp(seed=1))  # same architecture, another base
    with pytest.raises(InvalidArgumentError, match=r"frozen .*0\.bias"):
        tif.load_recorded_checkpoints(tmp_path, other)
    assert len(tif.load_recorded_checkpoints(tmp_path, model)) == 1


def _tiny_gpt2(seed):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1,
                                      n_head=2, bos_token_id=0, eos_token_id=0))


def _lora(seed):
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(_tiny_gpt2(seed), peft.LoraConfig(
        r=2, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False))


def test_a_peft_adapter_recording_refuses_another_base(tmp_path):
    model = _lora(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    recorder = Recorder(tmp_path, model, optimizer)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    recorder.step()
    recorder.close()
    other = _lora(1)
    with pytest.raises(InvalidArgumentError, match="frozen base"):
        tif.load_recorded_checkpoints(tmp_path, other)
    [ckpt] = tif.load_recorded_checkpoints(tmp_path, model)
    assert all("lora_" in name for name in ckpt.params)


# HOSTILE.md class 2: killed between a checkpoint file and the manifest; two at once.
def test_a_run_killed_between_file_and_manifest_resumes_consistently(tmp_path, monkeypatch):
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    recorder = Recorder(tmp_path, model, optimizer)
    _train(recorder, model, optimizer, 1)
    manifest = importlib_manifest()
    real = manifest.write_manifest

    def killed(directory, written):  # the kill lands after the files, before the manifest
        if not written.get("pending"):
            raise KeyboardInterrupt
        real(directory, written)

    monkeypatch.setattr(manifest, "write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        _train(recorder, model, optimizer, 1)
    monkeypatch.setattr(manifest, "write_manifest", real)
    assert (tmp_path / "checkpoint-2.pt").exists()  # written, never listed
    del recorder
    assert [c.name for c in tif.load_recorded_checkpoints(tmp_path, model)] == ["checkpoint-1"]
    # The rerun resumes after step 1 and writes step 2 again (the half-recorded one).
    _run(tmp_path, lr=0.1, steps=2, model=model, resume=True)
    ckpts = tif.load_recorded_checkpoints(tmp_path, model)
    assert [(c.name, c.lr) for c in ckpts] == [
        ("checkpoint-1", 0.5), ("checkpoint-2", 0.1), ("checkpoint-3", 0.1)]
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def importlib_manifest():
    import importlib

    return importlib.import_module("tracinfunc.training.manifest")


def test_a_second_recorder_while_one_runs_is_refused(tmp_path):
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    tmp_path.mkdir(exist_ok=True)
    fd = os.open(tmp_path / ".recording.lock", os.O_RDWR | os.O_CREAT)  # another process's
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(StoreLockedError, match="another recorder"):
            Recorder(tmp_path, model, optimizer, resume=True)
    finally:
        os.close(fd)
    recorder = Recorder(tmp_path, model, optimizer, resume=True)
    _train(recorder, model, optimizer, 1)
    assert (tmp_path / "checkpoint-1.pt").exists()


def test_a_foreign_file_under_a_checkpoint_name_is_never_overwritten(tmp_path):
    (tmp_path / "checkpoint-1.pt").write_bytes(b"someone else's")
    with pytest.raises(RecordingExistsError, match="checkpoint-1.pt"):
        _run(tmp_path, lr=0.5, steps=1)
    assert (tmp_path / "checkpoint-1.pt").read_bytes() == b"someone else's"


# The HF Trainer callback gets the same protections (driven by hand: the callback API).
def test_trainer_callback_refuses_a_used_directory_and_resumes(tmp_path):
    pytest.importorskip("transformers")
    from transformers import TrainerControl, TrainerState, TrainingArguments

    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), report_to=[], use_cpu=True)

    def drive(callback, steps, start=0):
        state, control = TrainerState(), TrainerControl()
        state.global_step = start
        callback.on_train_begin(args, state, control, model=model, optimizer=optimizer)
        for _ in range(steps):
            callback.on_step_begin(args, state, control, optimizer=optimizer)
            _train(_NoRecorder(), model, optimizer, 1)
            state.global_step += 1
            callback.on_step_end(args, state, control, model=model, optimizer=optimizer)
        callback.on_train_end(args, state, control, model=model, optimizer=optimizer)

    drive(tif.trainer_callback(tmp_path / "rec", every=1), 2)
    with pytest.raises(RecordingExistsError, match="already holds"):
        drive(tif.trainer_callback(tmp_path / "rec", every=1), 2)
    with pytest.raises(RecordingExistsError, match="checkpoint-2"):
        drive(tif.trainer_callback(tmp_path / "rec", every=1, resume=True), 2)
    drive(tif.trainer_callback(tmp_path / "rec", every=1, resume=True), 1, start=2)
    assert [e["step"] for e in _manifest(tmp_path / "rec")["checkpoints"]] == [1, 2, 3]
    assert len(tif.load_recorded_checkpoints(tmp_path / "rec", model)) == 3


class _NoRecorder:
    def step(self):
        return None


def test_errors_name_the_public_function(tmp_path):
    model = _run(tmp_path, lr=0.5, steps=1)
    with pytest.raises(RecordingExistsError, match="^CheckpointRecorder: "):
        _run(tmp_path, lr=0.5, steps=1)
    (tmp_path / "checkpoint-1.pt").write_bytes(b"x")
    with pytest.raises(CorruptRecordingError, match="^load_recorded_checkpoints: "):
        tif.load_recorded_checkpoints(tmp_path, model)
