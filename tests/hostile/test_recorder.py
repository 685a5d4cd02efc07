"""Hostile pass on the checkpoint recorder (CheckpointRecorder, trainer_callback,
load_recorded_checkpoints) (0.2.0). Tests marked HELD guard behaviour that held; the others
fail now and assert what a demanding user expects."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import tracinfunc as tif
from tracinfunc.errors import TracInFuncError

from ._tiny import X, Y, build, files, frozen_base, model, train

RecordingExists = tif.errors.RecordingExistsError
Corrupt = tif.errors.CorruptRecordingError


# ---------------------------------------------------------------- failures (fail now)


@pytest.mark.parametrize("where", ["store", "store/rows", "store/ck"])
def test_a_recorder_never_writes_into_a_store(tmp_path, where):
    """CheckpointRecorder pointed at a finished store (or a directory inside it). Observed:
    checkpoint-*.pt, optimizer-*.pt and manifest.json are written into g.zarr (it still opens,
    so nothing flags it); a later save_store(..., overwrite=True) of the store deletes the
    recording. Expected: refused (the directory is a gradient store), nothing written."""
    store = tmp_path / "g.zarr"
    build(store=str(store))
    before = files(store)
    target = {"store": store, "store/rows": store / "rows", "store/ck": store / "ck"}[where]
    with pytest.raises(TracInFuncError, match="store"):
        train(str(target))
    assert files(store) == before


def test_trainer_callback_never_writes_into_a_store(tmp_path):
    """The same through tif.trainer_callback and a HF Trainer (observed: recorded into g.zarr)."""
    pytest.importorskip("transformers")
    store = tmp_path / "g.zarr"
    build(store=str(store))
    before = files(store)
    with pytest.raises(TracInFuncError, match="store"):
        cb = tif.trainer_callback(str(store))
        _run_trainer(tmp_path, cb)
    assert files(store) == before


def test_a_store_is_never_built_inside_a_recording(tmp_path):
    """build_store(store='run/g.zarr') into a recording directory. Observed: written (the
    recording now holds a store its manifest does not list). Expected: refused, naming the
    recording."""
    train(str(tmp_path / "run"))
    before = files(tmp_path / "run")
    with pytest.raises(TracInFuncError, match="recording"):
        build(store=str(tmp_path / "run" / "g.zarr"))
    assert files(tmp_path / "run") == before


@pytest.mark.parametrize("target", ["afile", "g.zarr/zarr.json"])
def test_a_recorder_at_a_file_is_the_librarys_error(tmp_path, target):
    """Observed: raw FileExistsError '[Errno 17] File exists'. Expected: the library's error
    naming the path and that it is a file (inside a store for zarr.json); the file untouched."""
    build(store=str(tmp_path / "g.zarr"))
    (tmp_path / "afile").write_text("x")
    before = (tmp_path / target).read_bytes()
    with pytest.raises(TracInFuncError):
        train(str(tmp_path / target))
    assert (tmp_path / target).read_bytes() == before


def test_resume_with_another_frozen_base_is_refused(tmp_path):
    """A LoRA-like run recorded over base A, resumed (resume=True, a new recorder) over base B.
    Observed: accepted; the manifest now holds two frozen fingerprints and the whole recording
    can no longer be loaded with either base (class 2/3: two runs mixed). Expected: the resumed
    recorder compares the frozen base with the recording's and refuses before writing."""
    run = str(tmp_path / "run")
    train(run, m=frozen_base(0))
    before = files(run)
    with pytest.raises(TracInFuncError, match="frozen|base"):
        train(run, m=frozen_base(1), resume=True)
    assert files(run) == before
    assert len(tif.load_recorded_checkpoints(run, frozen_base(0))) == 2


def test_resume_with_another_architecture_is_refused(tmp_path):
    """Resumed with a model of other shapes (Linear(6, 16) for Linear(6, 8)). Observed:
    accepted; the recording then loads with neither model ('was the state dict saved from
    another model'). Expected: refused at resume, naming the parameter that differs."""
    run = str(tmp_path / "run")
    train(run)
    before = files(run)
    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).train()
    with pytest.raises(TracInFuncError, match="0.weight|shape"):
        train(run, m=big, resume=True)
    assert files(run) == before


def test_overwrite_with_an_edited_manifest_removes_nothing(tmp_path):
    """manifest.json edited so entries point outside the directory ('../vdir', an absolute
    path). overwrite=True keeps the outside files (good) but removes the old manifest and
    part of the recording, then the new run fails at its first step on a leftover
    ('optimizer-2.pt exists but is not part of this recording'): the old recording is gone
    and no new one exists. Expected: the edited manifest refused (CorruptRecordingError)
    before anything is removed."""
    (tmp_path / "victim.txt").write_text("precious")
    (tmp_path / "vdir").mkdir()
    run = tmp_path / "run"
    train(str(run))
    man = json.loads((run / "manifest.json").read_text())
    man["checkpoints"][0]["optimizer"] = "../vdir"
    man["checkpoints"][1]["weights"] = str(tmp_path / "victim.txt")
    (run / "manifest.json").write_text(json.dumps(man))
    before = files(run)
    with pytest.raises(Corrupt):
        train(str(run), overwrite=True)
    assert files(run) == before
    assert (tmp_path / "victim.txt").read_text() == "precious"


# ---------------------------------------------------------------- HELD (regression guards)


def test_held_restart_into_a_used_directory(tmp_path):
    run = str(tmp_path / "run")
    train(run)
    before = files(run)
    with pytest.raises(RecordingExists):
        train(run)
    with pytest.raises(RecordingExists):
        train(run, resume=True, start_step=0)
    with pytest.raises(tif.errors.InvalidArgumentError):
        train(run, resume=True, overwrite=True)
    assert files(run) == before
    train(run, resume=True)
    assert [c.name for c in tif.load_recorded_checkpoints(run, model())] == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
        "checkpoint-8",
    ]


def test_held_a_planted_file_is_never_overwritten(tmp_path):
    run = tmp_path / "run"
    train(str(run))
    shutil.copy(run / "checkpoint-2.pt", run / "checkpoint-6.pt")
    planted = (run / "checkpoint-6.pt").read_bytes()
    with pytest.raises(RecordingExists):
        train(str(run), resume=True)
    assert (run / "checkpoint-6.pt").read_bytes() == planted


@pytest.mark.parametrize(
    "edit", ["swap", "truncate", "duplicate", "reverse", "missing_optimizer", "deep_json"]
)
def test_held_tampered_recordings_are_refused(tmp_path, edit):
    run = tmp_path / "run"
    train(str(run))
    if edit == "swap":
        os.rename(run / "checkpoint-2.pt", run / "t")
        os.rename(run / "checkpoint-4.pt", run / "checkpoint-2.pt")
        os.rename(run / "t", run / "checkpoint-4.pt")
    elif edit == "truncate":
        with open(run / "checkpoint-2.pt", "r+b") as f:
            f.truncate(100)
    elif edit == "duplicate":
        shutil.copy(run / "checkpoint-2.pt", run / "checkpoint-4.pt")
    elif edit == "reverse":
        man = json.loads((run / "manifest.json").read_text())
        man["checkpoints"].reverse()
        (run / "manifest.json").write_text(json.dumps(man))
    elif edit == "missing_optimizer":
        os.remove(run / "optimizer-4.pt")
        with pytest.raises(Corrupt):
            tif.training.load_recorded_preconditioners(str(run), model())
        return
    elif edit == "deep_json":
        (run / "manifest.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(Corrupt):
        tif.load_recorded_checkpoints(str(run), model())


def test_held_a_swapped_frozen_base_is_refused_on_loading(tmp_path):
    run = str(tmp_path / "run")
    train(run, m=frozen_base(0))
    assert len(tif.load_recorded_checkpoints(run, frozen_base(0))) == 2
    permuted = frozen_base(0)
    with torch.no_grad():
        permuted[0].weight[[0, 1]] = permuted[0].weight[[1, 0]]
    for other in (frozen_base(1), permuted):
        with pytest.raises(tif.errors.InvalidArgumentError, match="frozen"):
            tif.load_recorded_checkpoints(run, other)


def test_held_two_recorders(tmp_path):
    run = str(tmp_path / "run")
    m = model(0).train()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    first = tif.training.CheckpointRecorder(run, m, opt, every=1)
    nn.functional.cross_entropy(m(X), Y).backward()
    opt.step()
    first.step()
    code = textwrap.dedent(
        f"""
        import sys; sys.path[:0] = [{str(Path(__file__).parents[2])!r}]
        from tests.hostile._tiny import *
        m = model(0).train(); o = torch.optim.SGD(m.parameters(), lr=0.1)
        try:
            tif.training.CheckpointRecorder({run!r}, m, o, every=1, resume=True); print('GOT IT')
        except tif.errors.StoreLockedError: print('refused')
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "refused", out.stderr[-2000:]
    second = tif.training.CheckpointRecorder(run, m, opt, every=1, resume=True)
    with pytest.raises(tif.errors.StoreLockedError):
        first.step()
    first.close()  # the earlier one closing does not free the later one's directory
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "refused", out.stderr[-2000:]
    second.close()


def _run_trainer(tmp_path, callback, *, steps=4, resume_from=None, out="out"):
    import torch.nn.functional as F
    from transformers import Trainer, TrainingArguments

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

        def forward(self, x, labels=None):
            o = self.net(x)
            return {"loss": F.cross_entropy(o, labels), "logits": o}

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return {"x": X[i], "labels": Y[i]}

    args = TrainingArguments(
        output_dir=str(tmp_path / out),
        max_steps=steps,
        per_device_train_batch_size=10,
        save_steps=2,
        report_to=[],
        use_cpu=True,
        learning_rate=0.01,
        logging_steps=100,
        disable_tqdm=True,
    )
    Trainer(model=M(), args=args, train_dataset=DS(), callbacks=[callback]).train(
        resume_from_checkpoint=resume_from
    )


def test_held_trainer_callback_resume_before_the_last_step_is_refused(tmp_path):
    pytest.importorskip("transformers")
    rec = str(tmp_path / "rec")
    _run_trainer(tmp_path, tif.trainer_callback(rec))
    before = files(rec)
    with pytest.raises(RecordingExists):
        _run_trainer(tmp_path, tif.trainer_callback(rec))
    with pytest.raises(RecordingExists):
        _run_trainer(
            tmp_path,
            tif.trainer_callback(rec, resume=True),
            resume_from=str(tmp_path / "out" / "checkpoint-2"),
            steps=6,
        )
    assert files(rec) == before
