"""``tracinfunc evaluate``: the LDS of saved scores, as tracinfunc.evaluate.lds computes it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tracinfunc.cli import main
from tracinfunc.evaluate import lds, retrain_subsets


def test_evaluate_prints_and_writes_the_lds_of_saved_scores(tmp_path, capsys):
    n_train, n_test = 12, 3
    weights = torch.randn(n_test, n_train, generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)

    def train_fn(indices):  # a "model" whose output is linear in the subset, plus noise
        noise = torch.sin(indices.sum().double() + torch.arange(n_test))
        return weights[:, indices].sum(dim=1) + 0.1 * noise

    run = retrain_subsets(train_fn, n_train, 20, path=tmp_path / "run.zarr", progress=False)
    scores = weights + 0.05 * torch.randn(n_test, n_train, dtype=torch.float64,
                                          generator=torch.Generator().manual_seed(1))
    np.save(tmp_path / "scores.npy", scores.numpy())
    expected = lds(scores, run.subsets, run.outputs, n_bootstrap=50, seed=3)

    code = main(["evaluate", str(tmp_path / "scores.npy"), str(tmp_path / "run.zarr"),
                 "--bootstrap", "50", "--seed", "3", "--output", str(tmp_path / "lds.json")])
    assert code == 0
    assert f"LDS {expected.mean:.4f}" in capsys.readouterr().out
    saved = json.loads((tmp_path / "lds.json").read_text())
    assert saved["lds"] == pytest.approx(expected.mean) and saved["n_subsets"] == 20
    assert saved["low"] <= saved["lds"] <= saved["high"]
    assert expected.mean > 0.8  # the scores are the weights the outputs are made of


def test_evaluate_refuses_a_missing_scores_file(tmp_path, capsys):
    code = main(["evaluate", str(tmp_path / "nope.npy"), str(tmp_path / "run.zarr")])
    assert code == 1
    assert "expected an existing .npy or .pt file" in capsys.readouterr().err
