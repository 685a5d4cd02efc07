"""Damping chosen from the data (issue 26): by held-out loss change, and by LDS.

Held-out: on linear least squares the Gauss-Newton matrix is exact, and the damped Newton step
from ``w`` lands on the ridge solution ``argmin_v L_train(v) + lambda / 2 ||v - w||^2``, so the
criterion must equal ridge regression's validation loss change, written out here in float64.
LDS: retrained outputs are made to equal one candidate's predictions, so that candidate must be
chosen with LDS 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.curvature import Damping, choose_damping, classification_sampler, fit_curvature
from tracinfunc.errors import IncompatibleGradientsError, InvalidArgumentError, InvalidTypeError
from tracinfunc.evaluate import RetrainResult, choose_damping_by_lds, draw_subsets, lds

SCALES = (0.001, 0.01, 0.1, 1.0, 10.0, 100.0)


def _half_squares(out, y):
    return 0.5 * (out[:, 0] - y).square().sum()


def _gaussian_sampler(loss, params, batch, generator):
    """Labels ``f(x) -/+ 1`` weighted 1/2: ``E[g g^T] = x x^T``, the exact Gauss-Newton matrix
    of ``(f - y)^2 / 2`` for a linear ``f``."""
    x, _ = batch
    f = (x @ params["weight"].T)[:, 0]
    labels = torch.cat([f - 1, f + 1])
    return (torch.cat([x, x]), labels), torch.full((2 * x.shape[0],), 0.5, dtype=torch.float64)


@pytest.fixture
def regression():
    g = torch.Generator().manual_seed(0)
    d, n_train, n_val = 8, 12, 60
    truth = torch.randn(d, dtype=torch.float64, generator=g)
    x = torch.randn(n_train + n_val, d, dtype=torch.float64, generator=g)
    y = x @ truth + 1.5 * torch.randn(n_train + n_val, dtype=torch.float64, generator=g)
    model = nn.Linear(d, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, d, dtype=torch.float64, generator=g))
    loss = tif.loss_from_module(model, _half_squares)
    ckpts = [tif.Checkpoint.from_module(model, lr=1.0, name="w0")]
    return loss, ckpts, (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def _ridge_changes(ckpt, train, val, scales, mean_eig):
    """Validation loss change of the ridge solution around ``w0``, per scale, explicitly."""
    w0 = ckpt.params["weight"][0]
    x, y = train
    n = x.shape[0]
    h = x.T @ x / n
    out = []
    for s in scales:
        lam = s * mean_eig
        v = torch.linalg.solve(h + lam * torch.eye(len(w0), dtype=h.dtype), x.T @ y / n + lam * w0)
        val_loss = lambda w: 0.5 * (val[0] @ w - val[1]).square().mean()  # noqa: E731
        out.append(float(val_loss(v) - val_loss(w0)))
    return torch.tensor(out, dtype=torch.float64)


def test_heldout_choice_is_ridge_regressions_validation_choice(regression):
    loss, ckpts, train, val = regression
    curvature = fit_curvature(loss, ckpts, train, kind="dense", sampler=_gaussian_sampler)
    x = train[0]
    torch.testing.assert_close(curvature.estimates[0]["matrix"], x.T @ x / x.shape[0])
    choice = choose_damping(curvature, loss, ckpts, train, val, scales=SCALES)
    mean_eig = float((x.T @ x).trace()) / x.shape[0] / x.shape[1]
    expected = _ridge_changes(ckpts[0], train, val, SCALES, mean_eig)
    torch.testing.assert_close(choice.per_checkpoint[:, 0], expected)
    assert choice.scale == SCALES[int(expected.argmin())]
    assert choice.scale not in (SCALES[0], SCALES[-1])  # an interior optimum on this data
    assert choice.curvature.damping[0] == pytest.approx(choice.scale * mean_eig)
    assert choice.criterion == "heldout"
    assert choice.values == pytest.approx(tuple(expected.tolist()))
    # On the training data itself the undamped Newton step is best: the smallest candidate.
    on_train = choose_damping(curvature, loss, ckpts, train, train, scales=SCALES)
    assert on_train.scale == SCALES[0]


def test_heldout_step_of_a_projected_curvature_is_the_projected_preconditioner(regression):
    loss, ckpts, train, val = regression
    projection = tif.Projection(dim=5, seed=3)
    curvature = fit_curvature(loss, ckpts, train, projection=projection,
                              sampler=_gaussian_sampler)
    choice = choose_damping(curvature, loss, ckpts, train, val, scales=(0.1, 1.0))
    layout = tif.projection.canonical_layout(ckpts[0].params)
    project = tif.projection.make_projector(projection, layout, dtype=torch.float64)
    p_matrix = torch.stack([project({"weight": e.reshape(1, -1)})
                            for e in torch.eye(8, dtype=torch.float64)], 1)  # [k, p]
    x, y = train
    w0 = ckpts[0].params["weight"][0]
    grad = x.T @ (x @ w0 - y) / x.shape[0]
    fisher = curvature.estimates[0]["matrix"]
    torch.testing.assert_close(fisher, p_matrix @ (x.T @ x / x.shape[0]) @ p_matrix.T)
    for j, scale in enumerate((0.1, 1.0)):
        lam = scale * float(fisher.trace()) / 5
        step = -p_matrix.T @ torch.linalg.solve(fisher + lam * torch.eye(5, dtype=torch.float64),
                                                p_matrix @ grad)
        val_loss = lambda w: 0.5 * (val[0] @ w - val[1]).square().mean()  # noqa: E731
        expected = float(val_loss(w0 + step) - val_loss(w0))
        assert choice.per_checkpoint[j, 0].item() == pytest.approx(expected, rel=1e-9)


@pytest.fixture
def classifier():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(30, 4, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (30,), generator=g)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.4, name="a")]
    with torch.no_grad():
        model[0].weight.mul_(1.5)
    ckpts.append(tif.Checkpoint.from_module(model, lr=0.2, name="b"))
    return loss, ckpts, (x[:24], y[:24]), (x[24:], y[24:])


@pytest.mark.parametrize("kind", ["dense", "kfac", "ekfac", "projected"])
def test_with_damping_equals_fitting_with_that_damping(classifier, kind):
    loss, ckpts, train, _ = classifier
    projection = tif.Projection(dim=6, seed=0)
    exact = classification_sampler(exact=True)
    fitted = fit_curvature(loss, ckpts, train, kind=kind, projection=projection, sampler=exact,
                           damping=Damping(7.0))
    default = fit_curvature(loss, ckpts, train, kind=kind, projection=projection, sampler=exact)
    redamped = default.with_damping(Damping(7.0))
    assert redamped.damping == pytest.approx(fitted.damping)
    assert redamped.digest == fitted.digest
    assert default.with_damping(0.5).damping == (0.5, 0.5)


@pytest.mark.parametrize("kind", ["projected", "kfac"])
def test_lds_choice_picks_the_candidate_the_retrained_outputs_follow(classifier, kind):
    loss, ckpts, train, test = classifier
    projection = tif.Projection(dim=10, seed=1)
    store = tif.build_store(loss, ckpts, train, projection=projection, dtype=torch.float64,
                            progress=False)
    curvature = fit_curvature(loss, ckpts, train, kind=kind, projection=projection,
                              sampler=classification_sampler(exact=True))
    if kind == "projected":
        queries = tif.build_store(loss, ckpts, test, projection=projection, dtype=torch.float64,
                                  progress=False)
    else:
        def queries(c):
            return tif.preconditioned_test_grads(loss, ckpts, test, c, projection=projection)
    scales = (0.01, 1.0, 100.0)
    target = curvature.with_damping(Damping(1.0))
    target_queries = queries if kind == "projected" else queries(target)
    truth = tif.score(store, target_queries, curvature=target)
    subsets = draw_subsets(24, 30, seed=2)
    retrained = RetrainResult(subsets=subsets, outputs=subsets.double() @ truth.T, alpha=0.5,
                              seed=2)
    choice = choose_damping_by_lds(curvature, store, queries, retrained, scales=scales)
    assert choice.scale == 1.0 and choice.values[1] == pytest.approx(1.0)
    assert choice.criterion == "lds" and choice.curvature.digest == target.digest
    for j, scale in enumerate(scales):
        damped = curvature.with_damping(Damping(scale))
        q = queries if kind == "projected" else queries(damped)
        expected = lds(tif.score(store, q, curvature=damped), subsets, retrained.outputs,
                       n_bootstrap=0).mean
        assert choice.values[j] == pytest.approx(expected)
        assert choice.details[j].mean == pytest.approx(expected)
    assert min(choice.values) < 0.999  # the curve is not flat: damping matters here


def test_damping_choice_errors(classifier):
    loss, ckpts, train, test = classifier
    curvature = fit_curvature(loss, ckpts, train, kind="kfac")
    with pytest.raises(InvalidArgumentError, match="choose_damping: scales must be a non-empty"):
        choose_damping(curvature, loss, ckpts, train, test, scales=())
    with pytest.raises(InvalidArgumentError, match="scale must be a positive finite number"):
        choose_damping(curvature, loss, ckpts, train, test, scales=(1.0, -2.0))
    with pytest.raises(IncompatibleGradientsError, match="choose_damping: the curvature was "
                                                         "fitted at 2 checkpoints"):
        choose_damping(curvature, loss, ckpts[:1], train, test)
    store = tif.build_store(loss, ckpts, train, projection=tif.Projection(dim=4), progress=False)
    with pytest.raises(InvalidTypeError, match="choose_damping_by_lds: retrained must be"):
        choose_damping_by_lds(curvature, store, None, (None, None))
