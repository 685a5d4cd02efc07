"""Rank-aware damping (issue 33, item 3): ``Damping(over="rank")`` multiplies
``tr(H) / rank(H)``, checked against explicit float64 spectra (``torch.linalg.eigvalsh`` of
the matrix or of ``torch.kron`` of the factors)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.curvature import Damping, classification_sampler, fit_curvature
from tracinfunc.errors import InvalidArgumentError

EXACT = classification_sampler(exact=True)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))  # 5 * 2 < p
    return loss, [tif.Checkpoint.from_module(model, name="a")], (x, y)


def _explicit_spectrum(curvature) -> torch.Tensor:
    estimate = curvature.estimates[0]
    if curvature.kind == "dense":
        return torch.linalg.eigvalsh(estimate["matrix"])
    parts = []
    for layer in curvature.layers:
        w = layer.weight
        if curvature.kind == "kfac":
            h = torch.kron(estimate[f"{w}:S"], estimate[f"{w}:A"])
        else:
            q = torch.kron(estimate[f"{w}:QS"], estimate[f"{w}:QA"])
            h = q @ torch.diag(estimate[f"{w}:eigen"].reshape(-1)) @ q.T
        parts.append(torch.linalg.eigvalsh(h))
    return torch.cat(parts)


@pytest.mark.parametrize("kind", ["dense", "kfac", "ekfac"])
def test_rank_mean_is_trace_over_the_explicit_rank(setup, kind):
    loss, ckpts, data = setup
    curvature = fit_curvature(loss, ckpts, data, kind=kind, sampler=EXACT)
    values = _explicit_spectrum(curvature)
    rank = int((values > 1e-10 * values.max()).sum())
    assert curvature.ranks() == (rank,)
    if kind == "dense":
        assert rank <= 5 * 2 < curvature.dim  # 5 examples, 3 classes: rank <= 10 of p = 51
    assert curvature.mean_eigenvalues("rank")[0] == pytest.approx(
        float(values.sum()) / rank, rel=1e-8)
    assert curvature.mean_eigenvalues()[0] == pytest.approx(
        float(values.sum()) / curvature.dim, rel=1e-8)
    damped = curvature.with_damping(Damping(2.0, over="rank"))
    assert damped.damping[0] == pytest.approx(2.0 * float(values.sum()) / rank, rel=1e-8)
    fitted = fit_curvature(loss, ckpts, data, kind=kind, sampler=EXACT,
                           damping=Damping(2.0, over="rank"))
    assert fitted.damping == pytest.approx(damped.damping)
    assert fitted.info["damping"] == "2 x mean eigenvalue over the rank"


def test_an_unknown_over_is_refused():
    with pytest.raises(InvalidArgumentError, match="over must be one of"):
        Damping(over="trace")
