"""tif.Contrast (issue 35): a contrastive query equals the difference of two scores, through
every query function, with curvature and cosine; empty, foreign and NaN controls refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tests.reference import exact_tracin
from tracinfunc.curvature import classification_sampler
from tracinfunc.errors import (
    IncompatibleGradientsError,
    InvalidArgumentError,
    InvalidTypeError,
    NonFiniteGradientError,
)

PROJECTION = tif.Projection(dim=12, seed=1)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(52, 5, dtype=torch.float64, generator=g), torch.randint(0, 3, (52,))
    ckpts = [tif.Checkpoint.from_module(model, lr=0.3, name="a")]
    with torch.no_grad():
        model[2].weight.mul_(1.5)
    ckpts.append(tif.Checkpoint.from_module(model, lr=0.1, name="b"))
    build = dict(projection=PROJECTION, dtype=torch.float64, progress=False)
    data = {"train": (x[:40], y[:40]), "test": (x[40:45], y[40:45]), "ctrl": (x[45:], y[45:])}
    stores = {name: tif.build_store(loss, ckpts, batch, **build) for name, batch in data.items()}
    return stores, data, (loss, ckpts)


def _rows(store):
    return torch.stack([store.read_rows(c, 0, store.meta.n_train)
                        for c in range(store.meta.n_ckpt)])


@pytest.mark.parametrize("normalize", [False, True])
def test_shared_contrast_is_the_test_score_minus_the_mean_control_score(setup, normalize):
    stores, _, _ = setup
    store, test, ctrl = stores["train"], stores["test"], stores["ctrl"]
    query = tif.Contrast(test, ctrl, weight=0.7, name="ctrl")
    got = tif.score(store, query, normalize=normalize)
    expected = (tif.score(store, test, normalize=normalize)
                - 0.7 * tif.score(store, ctrl, normalize=normalize).mean(0, keepdim=True))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    scale = expected.abs().max()
    assert float((got - expected).abs().max() / scale) < 1e-5


def test_the_contrast_matches_the_brute_force_reference(setup):
    _, data, (loss, ckpts) = setup
    identity = tif.Projection(kind="identity")
    build = dict(projection=identity, dtype=torch.float64, progress=False)
    train = tif.build_store(loss, ckpts, data["train"], **build)
    test = tif.build_store(loss, ckpts, data["test"], **build)
    ctrl = tif.build_store(loss, ckpts, data["ctrl"], **build)
    truth = exact_tracin(loss, ckpts, data["train"], data["test"])
    control = exact_tracin(loss, ckpts, data["train"], data["ctrl"])
    got = tif.score(train, tif.Contrast(test, ctrl, weight=2.0))
    torch.testing.assert_close(got, truth - 2.0 * control.mean(0), rtol=1e-9, atol=1e-10)


def test_paired_contrast_subtracts_row_for_row(setup):
    stores, _, _ = setup
    store, test = stores["train"], stores["test"]
    paired = _rows(stores["ctrl"])[:, :5]
    got = tif.score(store, tif.Contrast(_rows(test), paired.numpy(), paired=True))
    expected = tif.score(store, test) - tif.score(store, paired)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_every_query_function_takes_a_contrast_with_curvature(setup):
    stores, data, (loss, ckpts) = setup
    store, test, ctrl = stores["train"], stores["test"], stores["ctrl"]
    curvature = tif.fit_curvature(loss, ckpts, data["train"], kind="projected",
                                  projection=PROJECTION,
                                  sampler=classification_sampler(exact=True))
    query = tif.Contrast(test, ctrl, weight=0.5)
    expected = (tif.score(store, test, curvature=curvature)
                - 0.5 * tif.score(store, ctrl, curvature=curvature).mean(0, keepdim=True))
    torch.testing.assert_close(tif.score(store, query, curvature=curvature), expected,
                               rtol=1e-10, atol=1e-12)
    values, indices = tif.top_k(store, query, 4, curvature=curvature)
    torch.testing.assert_close(values, expected.gather(1, indices), rtol=1e-10, atol=1e-12)
    blocks = dict(tif.score_chunks(store, query, chunk_rows=16, curvature=curvature))
    torch.testing.assert_close(torch.cat([blocks[s] for s in sorted(blocks)], 1), expected,
                               rtol=1e-10, atol=1e-12)
    chosen = indices.flip(1)
    torch.testing.assert_close(tif.score(store, query, curvature=curvature, candidates=chosen),
                               expected.gather(1, chosen), rtol=1e-10, atol=1e-12)


def test_the_contrast_is_printable_and_recorded(setup):
    stores, _, _ = setup
    query = tif.Contrast(stores["test"], stores["ctrl"], weight=1, name="generic")
    assert "store[2, 7, 12]" in repr(query) and "name='generic'" in repr(query)
    assert query.describe() == "minus 1 x mean of control 'generic' (7 rows)"
    assert isinstance(query.weight, float)


def test_bad_contrasts_are_refused(setup):
    stores, _, _ = setup
    store, test, ctrl = stores["train"], stores["test"], stores["ctrl"]
    rows = _rows(ctrl)
    other = tif.store.MemoryStore(ctrl.meta.replace(projection=tif.Projection(dim=12, seed=9)),
                                  rows, rows.norm(dim=-1))
    poisoned = rows.clone()
    poisoned[0, 1, 2] = float("nan")
    cases = [
        (tif.Contrast(test, rows[:, :0]), InvalidArgumentError, "control set is empty"),
        (tif.Contrast(test, other), IncompatibleGradientsError, "control: control gradients "
                                                                "were projected with"),
        (tif.Contrast(test, poisoned), NonFiniteGradientError, "control: control gradients "
                                                               "contain NaN"),
        (tif.Contrast(test, rows[:, :, :5]), IncompatibleGradientsError, r"control: control "
                                                                         r"gradients must be \["),
        (tif.Contrast(test, rows, paired=True), InvalidArgumentError, "one control per test "
                                                                      r"example \(5\), got 7"),
    ]
    for query, error, message in cases:
        for call in (lambda q: tif.score(store, q), lambda q: tif.top_k(store, q, 2)):
            with pytest.raises(error, match=message):
                call(query)
    for weight in (float("nan"), float("inf"), True, "1", None):
        with pytest.raises((InvalidArgumentError, InvalidTypeError), match="weight must be"):
            tif.Contrast(test, ctrl, weight=weight)
    with pytest.raises(InvalidTypeError, match="control must be a GradientStore or an array"):
        tif.Contrast(test, [[1.0]])
    with pytest.raises(InvalidTypeError, match="test must be"):
        tif.Contrast(tif.Contrast(test, ctrl), ctrl)
    import numpy as np

    assert tif.Contrast(test, ctrl, weight=np.float32(0.5)).weight == 0.5
    assert tif.Contrast(test, ctrl, weight=torch.tensor(2.0)).weight == 2.0  # a 0-d array
    assert tif.Contrast(test, ctrl, weight=np.array(3)).weight == 3.0
    with pytest.raises(InvalidArgumentError, match="weight must be a finite real number"):
        tif.Contrast(test, ctrl, weight=torch.tensor([1.0, 2.0]))


def test_a_full_space_curvature_needs_preconditioned_controls_too(setup):
    stores, data, (loss, ckpts) = setup
    store, test, ctrl = stores["train"], stores["test"], stores["ctrl"]
    kfac = tif.fit_curvature(loss, ckpts, data["train"], kind="kfac")
    made = {name: tif.preconditioned_test_grads(loss, ckpts, data[name], kfac,
                                                projection=PROJECTION) for name in ("test", "ctrl")}
    with pytest.raises(IncompatibleGradientsError,
                       match="^score: the contrast's control: a 'kfac' curvature"):
        tif.score(store, tif.Contrast(made["test"], ctrl), curvature=kfac)
    got = tif.score(store, tif.Contrast(made["test"], made["ctrl"]), curvature=kfac)
    expected = (tif.score(store, made["test"], curvature=kfac)
                - tif.score(store, made["ctrl"], curvature=kfac).mean(0, keepdim=True))
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert test.meta.n_train == 5
