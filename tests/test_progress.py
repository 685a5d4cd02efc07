"""Progress bars: shown when asked, silent when not, never changing results."""

from __future__ import annotations

import pytest
import torch

import tracinfunc as tif
from tracinfunc.progress import progress_bar


@pytest.fixture()
def tiny(mlp_setup32):
    loss, checkpoints, train, _ = mlp_setup32
    return loss, checkpoints, train


def test_progress_true_draws_a_bar_and_false_is_silent(tiny, capsys):
    loss, checkpoints, (x, y) = tiny
    projection = tif.Projection(dim=16, seed=0)
    batches = [(x[i : i + 5], y[i : i + 5]) for i in range(0, len(x), 5)]
    shown = tif.build_store(loss, checkpoints, batches, projection=projection, progress=True)
    err = capsys.readouterr().err
    assert "build_store" in err and f"{len(x)}/{len(x)}" in err
    silent = tif.build_store(loss, checkpoints, batches, projection=projection, progress=False)
    assert capsys.readouterr().err == ""
    assert torch.equal(shown.read_rows(0, 0, len(x)), silent.read_rows(0, 0, len(x)))
    tif.score(shown, shown, progress=True)
    assert "score" in capsys.readouterr().err
    tif.top_k(shown, shown, k=2, progress=False)
    assert capsys.readouterr().err == ""


def test_automatic_progress_is_silent_off_a_terminal(tiny, capsys):
    loss, checkpoints, (x, y) = tiny
    store = tif.build_store(loss, checkpoints, (x, y), projection=tif.Projection(dim=8))
    tif.score(store, store)
    assert capsys.readouterr().err == ""  # pytest's captured stderr is not a terminal


def test_progress_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        progress_bar("yes", total=1, desc="build_store", unit="ex")


def test_conversions_report_progress_when_asked(tiny, capsys, tmp_path):
    loss, checkpoints, (x, y) = tiny
    store = tif.build_store(loss, checkpoints, (x, y), projection=tif.Projection(dim=8))
    copy = tif.save_store(store, tmp_path / "s.zarr", progress=True)
    assert "save_store" in capsys.readouterr().err
    memory = tif.to_memory(copy, progress=False)
    assert capsys.readouterr().err == ""
    assert torch.equal(memory.read_rows(1, 0, len(x)), store.read_rows(1, 0, len(x)))
