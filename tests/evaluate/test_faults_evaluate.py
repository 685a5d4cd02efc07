"""The evaluation harness trusts no input and no saved result (issue 25 item 11).

Before: all-NaN scores gave ``LDS -0.1177`` with exit 0; a deleted ``outputs`` chunk read as
NaN for a subset marked done and was never redone; flipped bytes were read silently; a run
killed between creating ``subsets`` and ``done`` could never resume (ContainsArrayError).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import zarr

import tracinfunc.evaluate as ev
from tests.evaluate.test_evaluate import Counting
from tracinfunc.cli import main
from tracinfunc.errors import CorruptStoreError, InvalidArgumentError

SETTINGS = {"n_train": 12, "n_subsets": 6, "seed": 1}


def _run(path, fn=None):
    return ev.retrain_subsets(fn or Counting(), **SETTINGS, path=path, progress=False)


def _chunk(path, j):
    return path / "outputs" / "c" / str(j) / "0"


def test_lds_refuses_nan_scores_or_outputs_naming_the_first():
    run = ev.retrain_subsets(Counting(), **SETTINGS, progress=False)
    scores = torch.randn(3, 12, dtype=torch.float64)
    with pytest.raises(InvalidArgumentError, match=r"finite scores, got 36 NaN/inf of 36 "
                                                   r"entries \(the first at \(0, 0\)\)"):
        ev.lds(torch.full((3, 12), math.nan), run.subsets, run.outputs)
    bad = scores.clone()
    bad[1, 5] = math.inf
    with pytest.raises(InvalidArgumentError, match=r"got 1 NaN/inf .* at \(1, 5\)"):
        ev.lds(bad, run.subsets, run.outputs)
    outputs = run.outputs.clone()
    outputs[2, 0] = math.nan
    with pytest.raises(InvalidArgumentError, match="finite outputs"):
        ev.lds(scores, run.subsets, outputs)


def test_cli_evaluate_of_nan_scores_exits_non_zero_with_the_reason(tmp_path, capsys):
    _run(tmp_path / "run.zarr")
    np.save(tmp_path / "scores.npy", np.full((3, 12), np.nan))
    code = main(["evaluate", str(tmp_path / "scores.npy"), str(tmp_path / "run.zarr")])
    captured = capsys.readouterr()
    assert code == 1
    assert "finite scores" in captured.err and "LDS" not in captured.out


def test_a_deleted_outputs_chunk_is_trained_again(tmp_path):
    whole = _run(tmp_path / "run")
    _chunk(tmp_path / "run", 2).unlink()
    with pytest.raises(CorruptStoreError, match=r"subsets \[2\] .* do not match"):
        ev.load_retrain(tmp_path / "run")
    counting = Counting()
    with pytest.warns(UserWarning, match=r"subsets \[2\] .* trained again"):
        again = _run(tmp_path / "run", counting)
    assert counting.calls == 1
    assert torch.equal(again.outputs, whole.outputs)
    assert torch.equal(ev.load_retrain(tmp_path / "run").outputs, whole.outputs)


@pytest.mark.parametrize("offset", [0, 5, -1])
def test_flipped_bytes_in_an_outputs_chunk_are_detected(tmp_path, offset):
    whole = _run(tmp_path / "run")
    chunk = _chunk(tmp_path / "run", 4)
    data = bytearray(chunk.read_bytes())
    data[offset] ^= 0x10
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError, match=r"subsets \[4\]"):
        ev.load_retrain(tmp_path / "run")
    with pytest.warns(UserWarning, match=r"subsets \[4\]"):
        again = _run(tmp_path / "run")
    assert torch.equal(again.outputs, whole.outputs)


def test_edited_subsets_are_refused(tmp_path):
    _run(tmp_path / "run")
    group = zarr.open_group(tmp_path / "run", mode="r+")
    subsets = group["subsets"][:]
    subsets[0] = ~subsets[0]
    group["subsets"][:] = subsets
    with pytest.raises(CorruptStoreError, match="subsets saved at .* are not the ones"):
        ev.load_retrain(tmp_path / "run")


def test_a_run_killed_while_creating_its_arrays_resumes(tmp_path, monkeypatch):
    whole = ev.retrain_subsets(Counting(), **SETTINGS, progress=False)
    real = zarr.Group.create_array

    def killed_at_outputs(self, name, **kwargs):
        if name == "outputs":
            raise KeyboardInterrupt  # killed after "subsets" exists, before "done"
        return real(self, name, **kwargs)

    monkeypatch.setattr(zarr.Group, "create_array", killed_at_outputs)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "run")
    monkeypatch.undo()
    assert (tmp_path / "run" / "subsets").exists()
    resumed = _run(tmp_path / "run")
    assert torch.equal(resumed.outputs, whole.outputs)
    assert torch.equal(ev.load_retrain(tmp_path / "run").outputs, whole.outputs)
