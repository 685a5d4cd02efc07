"""Curvature surfaces under attack (issue 31): non-finite data in fit_curvature, an
optimizer-aware store (finding 13), a saved curvature edited on disk, float16 parameters."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.curvature import fit_curvature
from tracinfunc.errors import CorruptStoreError, IncompatibleGradientsError, NonFiniteGradientError

PROJECTION = tif.Projection(dim=8, seed=0)


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    return model, loss, [tif.Checkpoint.from_module(model, lr=0.5, name="a")], (x, y)


def _batches(x, y, size=8):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


@pytest.mark.parametrize("kind", ["projected", "dense", "kfac", "ekfac"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_example_is_named_not_a_multinomial_error(setup, kind, bad):
    _, loss, ckpts, (x, y) = setup
    x = x.clone()
    x[10, 1] = bad  # second batch of 8: index 10 in the data
    with pytest.raises(NonFiniteGradientError,
                       match=r"^fit_curvature: the input for data example\(s\) 10 is "
                             r"NaN or infinite at checkpoint 'a'.*Remove or fix"):
        fit_curvature(loss, ckpts, _batches(x, y), kind=kind, projection=PROJECTION)


def test_non_finite_logits_from_finite_inputs_are_named(setup):
    _, _, _, (x, y) = setup
    model = nn.Linear(4, 3).eval()
    nn.init.constant_(model.weight, 10.0)
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.5, name="a")]
    x = x.clone()
    x[5] = 1e38  # a finite input whose logits overflow float32
    with pytest.raises(NonFiniteGradientError,
                       match=r"^fit_curvature: the model's output for data example\(s\) 5 is"):
        fit_curvature(loss, ckpts, _batches(x, y), projection=PROJECTION)


def _nan_label_sampler(loss, params, batch, generator):
    """A user's sampler that lets a NaN through (labels of a regression)."""
    x, _ = batch
    labels = torch.zeros(x.shape[0])
    labels[-1] = float("nan")
    return (x, labels), torch.ones(x.shape[0], dtype=torch.float64)


@pytest.mark.parametrize(("kind", "what"), [("projected", "a gradient"),
                                            ("kfac", "a layer's input or output gradient")])
def test_a_users_sampler_letting_nan_through_is_refused_by_batch(kind, what):
    torch.manual_seed(0)
    model = nn.Linear(4, 1).eval()
    loss = tif.loss_from_module(model, lambda out, y: (out[:, 0] - y).square().sum())
    ckpts = [tif.Checkpoint.from_module(model, lr=1.0, name="w")]
    x = torch.randn(12, 4)
    with pytest.raises(NonFiniteGradientError,
                       match=rf"^fit_curvature: {what} for data example\(s\) 0 to 5 \(one of "
                             r"them\) is NaN or infinite at checkpoint 'w'"):
        fit_curvature(loss, ckpts, _batches(x, torch.zeros(12), size=6), kind=kind,
                      projection=PROJECTION, sampler=_nan_label_sampler)


def _optimizer_aware_store(kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    model.eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.1, name="a")]
    preconditioner = tif.Preconditioner.from_optimizer(optimizer, model, kind=kind)
    store = tif.build_store(loss, ckpts, (x, y), projection=PROJECTION, progress=False,
                            preconditioners=[preconditioner])
    plain = tif.build_store(loss, ckpts, (x, y), projection=PROJECTION, progress=False)
    tests = tif.build_store(loss, ckpts, (x[:3], y[:3]), projection=PROJECTION, progress=False)
    return loss, ckpts, (x, y), store, plain, tests


@pytest.mark.parametrize("kind", ["adam", "trackstar"])
def test_curvature_for_an_optimizer_aware_store_is_refused(kind):
    loss, ckpts, data, store, plain, tests = _optimizer_aware_store(kind)
    curvature = fit_curvature(loss, ckpts, data, projection=PROJECTION)
    assert curvature.info["preconditioner"] is None
    refused = (rf"the curvature was fitted on raw gradients .* store's rows are "
               rf"optimizer-preconditioned gradients, '{kind}'.*without preconditioners=.*"
               r"without curvature=")
    with pytest.raises(IncompatibleGradientsError, match=r"^score: " + refused):
        tif.score(store, tests, curvature=curvature)
    with pytest.raises(IncompatibleGradientsError, match=r"^self_influence: " + refused):
        tif.self_influence(store, curvature=curvature)
    with pytest.raises(IncompatibleGradientsError, match=r"^top_k: " + refused):
        tif.top_k(store, tests, 2, curvature=curvature)
    dense = fit_curvature(loss, ckpts, data, kind="kfac")
    queries = tif.preconditioned_test_grads(loss, ckpts, (data[0][:3], data[1][:3]), dense,
                                            projection=PROJECTION)
    with pytest.raises(IncompatibleGradientsError, match=refused):
        tif.score(store, queries, curvature=dense)
    assert tif.score(plain, tests, curvature=curvature).isfinite().all()
    # A curvature saved before the key existed was fitted on raw gradients too.
    older = replace(curvature, info={k: v for k, v in curvature.info.items()
                                     if k != "preconditioner"})
    with pytest.raises(IncompatibleGradientsError, match=refused):
        tif.score(store, tests, curvature=older)
    assert torch.equal(tif.score(plain, tests, curvature=older),
                       tif.score(plain, tests, curvature=curvature))


def test_a_preconditioner_edited_into_a_saved_curvature_is_refused(setup, tmp_path):
    _, loss, ckpts, data = setup
    curvature = fit_curvature(loss, ckpts, data, projection=PROJECTION)
    path = tif.save_curvature(curvature, tmp_path / "c.zarr")
    assert tif.load_curvature(path).info["preconditioner"] is None
    root_json = Path(path) / "zarr.json"
    meta = json.loads(root_json.read_text())
    meta["attributes"]["tracinfunc_curvature"]["info"]["preconditioner"] = "adam"
    root_json.write_text(json.dumps(meta))
    with pytest.raises(CorruptStoreError, match="does not match its checksum"):
        tif.load_curvature(path)


@pytest.mark.parametrize("kind", ["dense", "kfac", "ekfac"])
def test_float16_parameters_fit_and_score_finite(kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)).eval().half()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.5, name="a")]
    x, y = torch.randn(16, 4).half(), torch.randint(0, 3, (16,))
    curvature = fit_curvature(loss, ckpts, (x, y), kind=kind)
    store = tif.build_store(loss, ckpts, (x, y), projection=PROJECTION, progress=False)
    queries = tif.preconditioned_test_grads(loss, ckpts, (x[:3], y[:3]), curvature,
                                            projection=PROJECTION)
    assert tif.score(store, queries, curvature=curvature).isfinite().all()


def test_float16_overflow_of_a_preconditioned_gradient_is_refused():
    """Accepted damping (condition number in range) can still divide a float16 gradient
    past 65504: refused by name instead of scoring NaN (observed before: NaN scores)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)).eval().half()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.5, name="a")]
    x, y = 10 * torch.randn(16, 4).half(), torch.randint(0, 3, (16,))
    curvature = fit_curvature(loss, ckpts, (x, y), kind="dense").with_damping(2e-7)
    with pytest.raises(NonFiniteGradientError,
                       match=r"^preconditioned_test_grads: .* beyond torch.float16's largest"):
        tif.preconditioned_test_grads(loss, ckpts, (x[:3], y[:3]), curvature,
                                      projection=PROJECTION)


def test_causal_lm_non_finite_logits_are_named():
    """Token ids cannot be NaN: an embedding row of NaN (one token) poisons the sequences
    that hold it, and only those are named."""

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(7, 4), nn.Linear(4, 7)

        def forward(self, input_ids, attention_mask=None):
            return self.head(torch.tanh(self.emb(input_ids)))

    torch.manual_seed(0)
    model = Tiny().eval()
    with torch.no_grad():
        model.emb.weight[6] = float("nan")
    ids = torch.randint(0, 6, (6, 5))
    ids[4, 1] = 6
    loss = tif.causal_lm_loss(model)
    ckpts = [tif.Checkpoint.from_module(model, name="a")]
    with pytest.raises(NonFiniteGradientError,
                       match=r"^fit_curvature: the model's output for data example\(s\) 4 is"):
        fit_curvature(loss, ckpts, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                      kind="kfac")


@pytest.mark.parametrize("kind", ["dense", "kfac"])
def test_preconditioned_test_grads_name_a_non_finite_test_example(setup, kind):
    """One check (marked_store) for the torch and JAX frontends: before, a NaN row of scores."""
    _, loss, ckpts, (x, y) = setup
    curvature = fit_curvature(loss, ckpts, (x, y), kind=kind)
    xt = x[:6].clone()
    xt[2, 1] = float("inf")
    with pytest.raises(NonFiniteGradientError, match=r"checkpoint 'a'.*examples \[2\]"):
        tif.preconditioned_test_grads(loss, ckpts, (xt, y[:6]), curvature,
                                      projection=PROJECTION)
