"""The command line builds LESS/TrackStar stores from a recording, shows the preconditioner,
and selects training data; a Preconditioner prints as a summary."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.cli.test_cli import SPEC, _tiny_spec, cli_here


def _record(directory: Path) -> None:
    """Three Adam steps of the tiny spec's model, a checkpoint after each."""
    model = _tiny_spec().model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    recorder = tif.training.CheckpointRecorder(directory, model, optimizer)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        recorder.step()


@pytest.mark.parametrize("kind", ["adam", "trackstar"])
def test_build_with_a_preconditioner_equals_the_api(tmp_path, kind):
    _record(tmp_path / "ckpts")
    result = cli_here("build", "--spec", f"{SPEC}:make", "--out", "less.zarr", "--recorded",
                      "ckpts", "--preconditioner", kind, "--projection", "rademacher:16:0",
                      "--quiet", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    spec = _tiny_spec()
    expected = tif.build_store(
        spec.loss, tif.load_recorded_checkpoints(tmp_path / "ckpts", spec.model), spec.train,
        projection=tif.Projection(dim=16, seed=0),
        preconditioners=tif.load_recorded_preconditioners(tmp_path / "ckpts", spec.model,
                                                          kind=kind))
    store = tif.open_store(str(tmp_path / "less.zarr"))
    assert store.meta.preconditioner == kind
    assert store.meta.lrs == expected.meta.lrs
    for c in range(store.meta.n_ckpt):
        torch.testing.assert_close(store.read_rows(c, 0, 24), expected.read_rows(c, 0, 24))
    info = cli_here("info", "less.zarr", cwd=tmp_path)
    assert f"preconditioner  {kind}" in info.stdout
    # Test gradients for it: plain, at the same recorded checkpoints.
    scored = cli_here("score", "less.zarr", "--spec", f"{SPEC}:make", "--recorded", "ckpts",
                      "--normalize", "--output", "scores.npy", "--quiet", cwd=tmp_path)
    assert scored.returncode == 0, scored.stderr
    assert np.load(tmp_path / "scores.npy").shape == (6, 24)


def test_preconditioner_flag_needs_a_recording(tmp_path):
    result = cli_here("build", "--spec", f"{SPEC}:make", "--out", "x.zarr", "--preconditioner",
                      "adam", "--quiet", cwd=tmp_path)
    assert result.returncode == 1
    assert "--preconditioner adam needs the optimizer state" in result.stderr


def test_info_of_a_plain_store_says_none(tmp_path):
    result = cli_here("build", "--spec", f"{SPEC}:make", "--out", "plain.zarr",
                      "--projection", "rademacher:8:0", "--quiet", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "preconditioner  none" in cli_here("info", "plain.zarr", cwd=tmp_path).stdout


def test_select_writes_the_chosen_rows(tmp_path):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 40, generator=g, dtype=torch.float64)
    np.save(tmp_path / "scores.npy", scores.numpy())
    result = cli_here("select", "scores.npy", "--fraction", "0.1", "--n-tasks", "3",
                      "--output", "chosen.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    expected = tif.select_training_data(scores, fraction=0.1, tasks=[0, 0, 1, 1, 2, 2])
    written = json.loads((tmp_path / "chosen.json").read_text())
    assert written["indices"] == expected.indices.tolist()
    np.testing.assert_allclose(written["scores"], expected.scores.numpy())
    (tmp_path / "tasks.json").write_text(json.dumps(["a", "b", "a", "b", "c", "c"]))
    result = cli_here("select", "scores.npy", "--top-k", "5", "--tasks", "tasks.json",
                      "--output", "chosen.npy", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    expected = tif.select_training_data(scores, k=5, tasks=["a", "b", "a", "b", "c", "c"])
    assert np.load(tmp_path / "chosen.npy").tolist() == expected.indices.tolist()
    # Outputs are never clobbered, and only .json/.npy are written.
    again = cli_here("select", "scores.npy", "--top-k", "5", "--output", "chosen.npy",
                     cwd=tmp_path)
    assert again.returncode == 1 and "exists" in again.stderr
    csv = cli_here("select", "scores.npy", "--top-k", "5", "--output", "chosen.csv",
                   cwd=tmp_path)
    assert csv.returncode == 1 and "must end in .json" in csv.stderr
    uneven = cli_here("select", "scores.npy", "--top-k", "5", "--n-tasks", "4", "--output",
                      "c.json", cwd=tmp_path)
    assert uneven.returncode == 1 and "does not divide the 6 test rows" in uneven.stderr


def test_preconditioner_prints_a_summary():
    model = torch.nn.Linear(200, 100)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 200)).sum().backward()
    optimizer.step()
    shown = repr(tif.Preconditioner.from_optimizer(optimizer, model, kind="adam"))
    assert shown == ("Preconditioner(kind='adam', 2 parameters, 20,100 values, step=1, "
                     "betas=(0.9, 0.999), eps=1e-08)")


def test_select_reads_the_json_that_score_and_self_influence_write(tmp_path):
    (tmp_path / "scores.json").write_text(json.dumps({"scores": [[0.1, 0.9, 0.5]]}))
    result = cli_here("select", "scores.json", "--top-k", "2", "--output", "a.npy", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert np.load(tmp_path / "a.npy").tolist() == [1, 2]
    (tmp_path / "si.json").write_text(json.dumps({"self_influence": [3.0, 1.0, 2.0]}))
    result = cli_here("select", "si.json", "--fraction", "0.5", "--output", "b.json",
                      cwd=tmp_path)
    assert json.loads((tmp_path / "b.json").read_text())["indices"] == [0]
    (tmp_path / "top.json").write_text(json.dumps({"values": [[1.0]], "indices": [[0]]}))
    result = cli_here("select", "top.json", "--top-k", "1", "--output", "c.json", cwd=tmp_path)
    assert result.returncode == 1 and "holds no 'scores'" in result.stderr


@pytest.mark.parametrize(("files", "args", "match"), [
    ({"ragged.json": json.dumps({"scores": [[1.0, 2.0], [3.0]]})}, ["ragged.json"],
     "select: scores 'ragged.json' are not a numeric"),  # was a raw ValueError
    ({"bad.json": "not json"}, ["scores.npy", "--tasks", "bad.json"],
     "--tasks 'bad.json' is not a readable JSON file"),  # was a raw JSONDecodeError
    ({"t.json": json.dumps([0, 1, 0, 1])}, ["inf.npy", "--tasks", "t.json"],
     r"scores must be finite to be ranked, got 2 \+inf/-inf at \[test row, training row\] "
     r"\[0, 2\], \[1, 2\]"),  # was: the NaN mean of column 2 selected first
])
def test_select_refuses_hostile_files_in_one_line(tmp_path, files, args, match):
    np.save(tmp_path / "scores.npy", np.ones((4, 6)))
    with_inf = np.ones((4, 6))
    with_inf[0, 2], with_inf[1, 2] = np.inf, -np.inf
    np.save(tmp_path / "inf.npy", with_inf)
    np.save(tmp_path / "obj.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    result = cli_here("select", *args, "--top-k", "2", "--output", "c.json", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert re.search(match, result.stderr), result.stderr
    objects = cli_here("select", "obj.npy", "--top-k", "1", "--output", "c.json", cwd=tmp_path)
    assert objects.returncode == 1 and "are not a numeric" in objects.stderr
