"""One meaning of damping across kinds (issue 33): every kind applies ``(H + lambda I)^-1`` to
its own estimate ``H``, checked against the explicit float64 matrix built from the same
estimate (``torch.kron``, ``torch.linalg.solve``; no library code)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.curvature import classification_sampler, fit_curvature

EXACT = classification_sampler(exact=True)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(14, 4, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (14,), generator=g)
    return loss, [tif.Checkpoint.from_module(model, name="a")], (x[:10], y[:10]), (x[10:], y[10:])


def _explicit_h(curvature, name: str, layer) -> torch.Tensor:
    """The estimate of one layer's block ``[d_out d_a, d_out d_a]`` (row-major ``vec(G)``)."""
    estimate = curvature.estimates[0]
    if curvature.kind == "kfac":
        return torch.kron(estimate[f"{name}:S"], estimate[f"{name}:A"])
    q = torch.kron(estimate[f"{name}:QS"], estimate[f"{name}:QA"])
    return q @ torch.diag(estimate[f"{name}:eigen"].reshape(-1)) @ q.T


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
@pytest.mark.parametrize("lam", [1e-3, 0.05, 3.0])
def test_kronecker_kinds_solve_the_damped_estimate_exactly(setup, kind, lam):
    loss, ckpts, train, test = setup
    curvature = fit_curvature(loss, ckpts, train, kind=kind, damping=lam, sampler=EXACT)
    grads = tif.per_sample_grads(loss)(dict(ckpts[0].params), test)
    got = curvature.precondition(0, grads)
    for layer in curvature.layers:
        h = _explicit_h(curvature, layer.weight, layer)
        g = torch.cat([grads[layer.weight], grads[layer.bias][:, :, None]], 2)  # [b, o, i + 1]
        eye = torch.eye(h.shape[0], dtype=torch.float64)
        solved = torch.linalg.solve(h + lam * eye, g.reshape(g.shape[0], -1).T).T
        solved = solved.reshape(g.shape)
        torch.testing.assert_close(got[layer.weight], solved[:, :, :-1], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got[layer.bias], solved[:, :, -1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("lam", [1e-3, 0.05, 3.0])
def test_dense_solves_the_damped_estimate_exactly(setup, lam):
    loss, ckpts, train, test = setup
    curvature = fit_curvature(loss, ckpts, train, kind="dense", damping=lam, sampler=EXACT)
    params = dict(ckpts[0].params)
    grads = tif.per_sample_grads(loss)(params, test)
    names = sorted(params)
    flat = torch.cat([grads[n].reshape(grads[n].shape[0], -1) for n in names], 1)
    h = curvature.estimates[0]["matrix"]
    solved = torch.linalg.solve(h + lam * torch.eye(h.shape[0], dtype=torch.float64), flat.T).T
    got = curvature.precondition(0, grads)
    got = torch.cat([got[n].reshape(got[n].shape[0], -1) for n in names], 1)
    torch.testing.assert_close(got, solved, rtol=1e-9, atol=1e-12)


def test_a_float_damping_is_the_same_lambda_for_every_kind(setup):
    loss, ckpts, train, _ = setup
    for kind in ("dense", "kfac", "ekfac"):
        curvature = fit_curvature(loss, ckpts, train, kind=kind, damping=0.25, sampler=EXACT)
        assert curvature.damping == (0.25,)
        assert curvature.with_damping(0.5).damping == (0.5,)
