"""Every way to score a store takes ``curvature=`` and gives ``score(..., curvature=)``'s result:
``score_chunks``, ``indexed_top_k``, the CLI's
``self-influence --curvature`` (issue 26). The reference is the float64 ``score`` path, itself
checked against explicit solves in ``test_curvature.py``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.cli import main
from tracinfunc.curvature import classification_sampler

PROJECTION = tif.Projection(dim=10, seed=4)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(60, 5, dtype=torch.float64, generator=g), torch.randint(0, 3, (60,))
    ckpts = [tif.Checkpoint.from_module(model, lr=0.3, name="a")]
    with torch.no_grad():
        model[0].weight.add_(0.5)
    ckpts.append(tif.Checkpoint.from_module(model, lr=0.2, name="b"))
    store = tif.build_store(loss, ckpts, (x[:50], y[:50]), projection=PROJECTION,
                            dtype=torch.float64, progress=False)
    tests = tif.build_store(loss, ckpts, (x[50:], y[50:]), projection=PROJECTION,
                            dtype=torch.float64, progress=False)
    curvatures = {kind: tif.fit_curvature(loss, ckpts, (x[:50], y[:50]), kind=kind,
                                          projection=PROJECTION,
                                          sampler=classification_sampler(exact=True))
                  for kind in ("projected", "kfac")}
    precond = tif.preconditioned_test_grads(loss, ckpts, (x[50:], y[50:]), curvatures["kfac"],
                                            projection=PROJECTION)
    return store, {"projected": tests, "kfac": precond}, curvatures


@pytest.mark.parametrize("kind", ["projected", "kfac"])
@pytest.mark.parametrize("normalize", [False, True])
def test_score_chunks_with_curvature_equal_score(setup, kind, normalize):
    store, tests, curvatures = setup
    expected = tif.score(store, tests[kind], curvature=curvatures[kind], normalize=normalize)
    blocks = dict(tif.score_chunks(store, tests[kind], curvature=curvatures[kind],
                                   normalize=normalize, chunk_rows=7))
    got = torch.cat([blocks[start] for start in sorted(blocks)], 1)
    torch.testing.assert_close(got, expected)
    plain = torch.cat([b for _, b in tif.score_chunks(store, tests["projected"])], 1)
    assert not torch.allclose(plain, got)


@pytest.mark.parametrize("kind", ["projected", "kfac"])
@pytest.mark.parametrize("largest", [True, False])
def test_indexed_top_k_with_curvature_equals_exact_top_k(setup, kind, largest):
    pytest.importorskip("faiss")
    store, tests, curvatures = setup
    index = tif.build_index(store, nlist=1, progress=False)
    values, indices = tif.indexed_top_k(store, tests[kind], 4, index=index, nprobe=1,
                                        n_candidates=50, largest=largest,
                                        curvature=curvatures[kind])
    expected_values, expected_indices = tif.top_k(store, tests[kind], 4, largest=largest,
                                                  curvature=curvatures[kind])
    torch.testing.assert_close(values, expected_values)
    assert torch.equal(indices, expected_indices)


def test_indexed_top_k_refuses_a_curvature_of_another_store(setup):
    pytest.importorskip("faiss")
    store, tests, curvatures = setup
    index = tif.build_index(store, nlist=1, progress=False)
    with pytest.raises(tif.errors.IncompatibleGradientsError,
                       match="indexed_top_k: a 'kfac' curvature preconditions gradients before"):
        tif.indexed_top_k(store, tests["projected"], 4, index=index, nprobe=1,
                          curvature=curvatures["kfac"])


def test_cli_self_influence_with_a_saved_curvature(setup, tmp_path):
    store, _, curvatures = setup
    tif.save_store(store, tmp_path / "grads.zarr")
    tif.save_curvature(curvatures["projected"], tmp_path / "curvature.zarr")
    out = tmp_path / "si.json"
    assert main(["self-influence", str(tmp_path / "grads.zarr"), "--curvature",
                 str(tmp_path / "curvature.zarr"), "--output", str(out), "--quiet"]) == 0
    expected = tif.self_influence(store, curvature=curvatures["projected"])
    np.testing.assert_allclose(json.loads(out.read_text())["self_influence"], expected.numpy())
    assert not np.allclose(expected.numpy(), tif.self_influence(store).numpy())
