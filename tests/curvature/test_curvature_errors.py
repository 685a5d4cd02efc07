"""Curvature: refusals that name the difference, persistence, tampering, samplers (issue 26)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.curvature import (
    Damping,
    causal_lm_sampler,
    classification_sampler,
    fit_curvature,
)
from tracinfunc.errors import (
    CorruptStoreError,
    IncompatibleGradientsError,
    InvalidArgumentError,
    InvalidTypeError,
    MemoryBudgetError,
)

PROJECTION = tif.Projection(dim=8, seed=0)


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    x, y = torch.randn(12, 4), torch.randint(0, 3, (12,))
    ckpts = [tif.Checkpoint.from_module(model, lr=0.5, name="a")]
    store = tif.build_store(loss, ckpts, (x, y), projection=PROJECTION, progress=False)
    tests = tif.build_store(loss, ckpts, (x[:3], y[:3]), projection=PROJECTION, progress=False)
    return model, loss, ckpts, (x, y), store, tests


def test_curvature_of_another_projection_is_refused(setup):
    _, loss, ckpts, data, store, tests = setup
    other = fit_curvature(loss, ckpts, data, projection=tif.Projection(dim=8, seed=1))
    with pytest.raises(IncompatibleGradientsError, match="fitted in the space of.*seed=1"):
        tif.score(store, tests, curvature=other)


def test_curvature_of_other_checkpoints_is_refused(setup):
    model, loss, ckpts, data, store, tests = setup
    with torch.no_grad():
        model[0].weight.add_(1.0)
    moved = [tif.Checkpoint.from_module(model, lr=0.5, name="a")]
    other = fit_curvature(loss, moved, data, projection=PROJECTION)
    with pytest.raises(IncompatibleGradientsError, match="checkpoint 0 differs.*fingerprint"):
        tif.top_k(store, tests, 2, curvature=other)
    renamed = fit_curvature(loss, [tif.Checkpoint(ckpts[0].params, lr=0.5, name="z")], data,
                            projection=PROJECTION)
    with pytest.raises(IncompatibleGradientsError, match="has name 'a'.*has 'z'|name"):
        tif.score(store, tests, curvature=renamed)


def test_curvature_of_another_layout_is_refused(setup):
    _, loss, ckpts, data, store, _ = setup
    other = fit_curvature(loss, ckpts, data, projection=PROJECTION,
                          options=tif.GradientOptions(select=["2.*"]))
    with pytest.raises(IncompatibleGradientsError, match="other parameters.*missing '0.bias'"):
        tif.self_influence(store, curvature=other)


def test_full_space_curvature_refuses_plain_projected_test_grads(setup):
    _, loss, ckpts, data, store, tests = setup
    kfac = fit_curvature(loss, ckpts, data, kind="kfac")
    with pytest.raises(IncompatibleGradientsError, match="preconditioned_test_grads"):
        tif.score(store, tests, curvature=kfac)
    with pytest.raises(IncompatibleGradientsError, match="needs a 'projected' curvature"):
        tif.self_influence(store, curvature=kfac)
    queries = tif.preconditioned_test_grads(loss, ckpts, (data[0][:3], data[1][:3]), kfac,
                                            projection=PROJECTION)
    assert tif.score(store, queries, curvature=kfac).shape == (3, 12)
    other = fit_curvature(loss, ckpts, data, kind="kfac", damping=10.0)
    with pytest.raises(IncompatibleGradientsError, match="another curvature"):
        tif.score(store, queries, curvature=other)


def test_fit_errors_say_what_was_expected(setup):
    model, loss, ckpts, data, _, _ = setup
    with pytest.raises(InvalidArgumentError, match="kind must be one of"):
        fit_curvature(loss, ckpts, data, kind="hessian")
    with pytest.raises(InvalidTypeError, match="projection must be a tracinfunc.Projection"):
        fit_curvature(loss, ckpts, data, kind="projected")
    with pytest.raises(InvalidArgumentError, match="damping must be a finite float >= 0"):
        fit_curvature(loss, ckpts, data, projection=PROJECTION, damping=-1.0)
    with pytest.raises(InvalidArgumentError, match="scale must be a positive"):
        Damping(scale=0)
    with pytest.raises(InvalidArgumentError, match="cannot tell how to sample labels"):
        fit_curvature(lambda p, e: model(e[0]).sum(), ckpts, data, projection=PROJECTION)
    with pytest.raises(InvalidArgumentError, match="sampler must be callable"):
        fit_curvature(loss, ckpts, data, projection=PROJECTION, sampler="exact")
    with pytest.raises(InvalidTypeError, match="curvature must be a tracinfunc.Curvature"):
        tif.score(tif.build_store(loss, ckpts, data, projection=PROJECTION, progress=False),
                  torch.zeros(1, 2, 8), curvature="dense")


def test_kfac_names_the_parameters_it_cannot_cover():
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 3)).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = [tif.Checkpoint.from_module(model)]
    data = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    with pytest.raises(InvalidArgumentError,
                       match=r"'1.weight' \(LayerNorm\).*build the store AND fit"):
        fit_curvature(loss, ckpts, data, kind="kfac")
    ok = fit_curvature(loss, ckpts, data, kind="kfac",
                       options=tif.GradientOptions(select=["0.*", "2.*"]))
    assert [layer.weight for layer in ok.layers] == ["0.weight", "2.weight"]


def test_dense_refuses_large_models():
    model = nn.Linear(200, 101).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    with pytest.raises(MemoryBudgetError, match="p=20301 is over"):
        fit_curvature(loss, [tif.Checkpoint.from_module(model)],
                      (torch.randn(2, 200), torch.zeros(2, dtype=torch.long)), kind="dense")


@pytest.mark.parametrize("kind", ["projected", "kfac", "ekfac", "dense"])
def test_saved_curvature_loads_equal(setup, tmp_path, kind):
    _, loss, ckpts, data, _, _ = setup
    curvature = fit_curvature(loss, ckpts, data, kind=kind, projection=PROJECTION)
    tif.save_curvature(curvature, tmp_path / "c.zarr")
    loaded = tif.load_curvature(tmp_path / "c.zarr")
    assert loaded.digest == curvature.digest
    assert loaded.kind == kind and loaded.damping == curvature.damping
    for ours, theirs in zip(curvature.estimates, loaded.estimates, strict=True):
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[key], theirs[key]) for key in ours)


def test_tampered_curvature_is_refused(setup, tmp_path):
    _, loss, ckpts, data, _, _ = setup
    curvature = fit_curvature(loss, ckpts, data, projection=PROJECTION)
    path = tif.save_curvature(curvature, tmp_path / "c.zarr")
    with pytest.raises(Exception, match="exists"):
        tif.save_curvature(curvature, path)
    root_json = Path(path) / "zarr.json"
    original = root_json.read_text()
    meta = json.loads(original)
    meta["attributes"]["tracinfunc_curvature"]["damping"] = [123.0]
    root_json.write_text(json.dumps(meta))
    with pytest.raises(CorruptStoreError, match="does not match its checksum"):
        tif.load_curvature(path)
    root_json.write_text(original)
    chunk = next(p for p in (Path(path) / "0").rglob("*") if p.is_file() and p.name != "zarr.json")
    data_bytes = bytearray(chunk.read_bytes())
    data_bytes[-1] ^= 0xFF
    chunk.write_bytes(bytes(data_bytes))
    with pytest.raises(CorruptStoreError):
        tif.load_curvature(path)


def test_classification_sampler_draws_from_the_model():
    torch.manual_seed(0)
    model = nn.Linear(4, 3).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    params = dict(model.named_parameters())
    batch = (torch.randn(5, 4), torch.zeros(5, dtype=torch.long))
    (x, y), w = classification_sampler(exact=True)(loss, params, batch,
                                                   torch.Generator().manual_seed(0))
    assert x.shape == (15, 4) and y.tolist() == [0, 1, 2] * 5
    torch.testing.assert_close(w.reshape(5, 3),
                               model(batch[0]).softmax(-1).double().detach())
    (_, y), w = classification_sampler(samples=2)(loss, params, batch,
                                                  torch.Generator().manual_seed(0))
    assert y.shape == (10,) and torch.allclose(w, torch.full((10,), 0.5, dtype=torch.float64))


def test_causal_lm_sampler_keeps_ignored_positions():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(7, 4), nn.Linear(4, 7)

        def forward(self, input_ids, attention_mask=None):
            return self.head(self.emb(input_ids))

    model = Tiny().eval()
    loss = tif.causal_lm_loss(model)
    ids = torch.randint(0, 7, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    labels = tif.completion_labels(ids, 2)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    labelled, w = causal_lm_sampler()(loss, dict(model.named_parameters()), batch,
                                      torch.Generator().manual_seed(0))
    drawn = labelled["labels"]
    assert drawn.shape == (2, 5) and w.tolist() == [1.0, 1.0]
    assert (drawn[:, :2] == -100).all() and (drawn[1, 3:] == -100).all()
    assert ((drawn[0, 2:] >= 0) & (drawn[0, 2:] < 7)).all()
    assert torch.equal(labelled["input_ids"], ids)


def test_causal_lm_curvature_end_to_end():
    """The default sampler of causal_lm_loss; K-FAC covers the embedding (diagonal A over
    token ids at every position) and the head, or the head alone when selected."""

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(7, 4), nn.Linear(4, 7)

        def forward(self, input_ids, attention_mask=None):
            return self.head(torch.tanh(self.emb(input_ids)))

    torch.manual_seed(0)
    model = Tiny().eval()
    loss = tif.causal_lm_loss(model)
    ckpts = [tif.Checkpoint.from_module(model, name="a")]
    ids = torch.randint(0, 7, (6, 5))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    projection = tif.Projection(dim=8, seed=0)
    for kind, select in (("projected", None), ("kfac", ["head.*"]), ("kfac", None),
                         ("ekfac", None)):
        curvature = fit_curvature(loss, ckpts, data, kind=kind, projection=projection,
                                  options=tif.GradientOptions(select=select))
        store = tif.build_store(
            loss,
            ckpts,
            data,
            projection=projection,
            options=tif.GradientOptions(select=select),
            progress=False,
        )
        queries = tif.preconditioned_test_grads(loss, ckpts, data, curvature,
                                                projection=projection,
                                                options=tif.GradientOptions(select=select))
        scores = tif.score(store, queries, curvature=curvature)
        assert scores.shape == (6, 6) and torch.isfinite(scores).all()
        # self-scores of curvature-aware TracIn are g^T (H + l I)^-1 g > 0
        assert (scores.diagonal() > 0).all()
