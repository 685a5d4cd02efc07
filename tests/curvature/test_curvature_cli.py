"""``tracinfunc score --curvature PATH`` and the curvature benchmark's quick mode (issue 26)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tracinfunc as tif
from tracinfunc.cli import main
from tracinfunc.cli.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPEC = str(ROOT / "tests" / "data" / "tiny_spec.py")


@pytest.mark.parametrize("kind", ["projected", "kfac"])
def test_score_with_a_saved_curvature_matches_the_api(tmp_path, kind):
    spec = load_spec(f"{SPEC}:make")
    projection = tif.Projection(dim=16, seed=2)
    store = tif.build_store(spec.loss, spec.checkpoints, spec.train, projection=projection,
                            store=str(tmp_path / "grads.zarr"), progress=False)
    curvature = tif.fit_curvature(spec.loss, spec.checkpoints, spec.train, kind=kind,
                                  projection=projection)
    tif.save_curvature(curvature, tmp_path / "curvature.zarr")
    out = tmp_path / "top.json"
    code = main(["score", str(tmp_path / "grads.zarr"), "--spec", f"{SPEC}:make",
                 "--curvature", str(tmp_path / "curvature.zarr"), "--top-k", "3",
                 "--output", str(out), "--quiet"])
    assert code == 0
    if kind == "projected":
        test = tif.build_store(spec.loss, spec.checkpoints, spec.test["test"],
                               projection=projection, progress=False)
    else:
        test = tif.preconditioned_test_grads(spec.loss, spec.checkpoints, spec.test["test"],
                                             curvature, projection=projection)
    values, indices = tif.top_k(store, test, 3, curvature=curvature)
    saved = json.loads(out.read_text())
    assert saved["indices"] == indices.tolist()
    np.testing.assert_allclose(saved["values"], values.numpy(), rtol=1e-5)
    plain, _ = tif.top_k(store, tif.build_store(spec.loss, spec.checkpoints, spec.test["test"],
                                                projection=projection, progress=False), 3)
    assert not np.allclose(plain.numpy(), values.numpy())

