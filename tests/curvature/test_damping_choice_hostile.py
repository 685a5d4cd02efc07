"""Choosing a damping never selects over all-NaN candidates (issue 31, finding 12).

A NaN training example made every candidate's held-out loss change NaN, and choose_damping
returned the first scale (0.01) silently; choose_damping_by_lds took the first of all-NaN LDS.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.curvature import Damping, choose_damping, fit_curvature
from tracinfunc.errors import IllConditionedError, InvalidArgumentError, NonFiniteGradientError
from tracinfunc.evaluate import RetrainResult, choose_damping_by_lds, draw_subsets


@pytest.fixture
def classifier():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(30, 4, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (30,), generator=g)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.4, name="a")]
    return loss, ckpts, (x[:24], y[:24]), (x[24:], y[24:])


def _batches(x, y, size=8):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_training_example_is_named(classifier, bad):
    loss, ckpts, (x, y), val = classifier
    curvature = fit_curvature(loss, ckpts, (x, y), kind="kfac")
    x = x.clone()
    x[11, 2] = bad  # the second batch of 8: index 11 in the data
    with pytest.raises(NonFiniteGradientError,
                       match=r"^choose_damping: the gradient of train_data example\(s\) 11 is "
                             r"NaN or infinite at checkpoint 0"):
        choose_damping(curvature, loss, ckpts, _batches(x, y), val)


def test_a_non_finite_validation_example_is_named(classifier):
    loss, ckpts, train, (x, y) = classifier
    curvature = fit_curvature(loss, ckpts, train, kind="kfac")
    x = x.clone()
    x[4, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError,
                       match=r"the loss of validation_data example\(s\) 4 is NaN"):
        choose_damping(curvature, loss, ckpts, train, _batches(x, y, size=3))


def test_ill_conditioned_candidates_are_skipped_never_chosen(classifier):
    loss, ckpts, train, val = classifier
    curvature = fit_curvature(loss, ckpts, train, kind="dense")
    with pytest.raises(IllConditionedError):
        curvature.with_damping(Damping(1e-12))
    choice = choose_damping(curvature, loss, ckpts, train, val, scales=(1e-12, 0.1, 1.0))
    assert math.isnan(choice.values[0]) and choice.scale in (0.1, 1.0)
    assert torch.isnan(choice.per_checkpoint[0]).all()
    with pytest.raises(InvalidArgumentError,
                       match=r"^choose_damping: no candidate damping gives a finite .*"
                             r"ill-conditioned, so not tried: scales \[1e-12, 1e-13\]"):
        choose_damping(curvature, loss, ckpts, train, val, scales=(1e-12, 1e-13))


def test_lds_choice_refuses_all_nan_and_skips_nan_candidates(classifier):
    loss, ckpts, train, test = classifier
    projection = tif.Projection(dim=64, seed=1)  # k > rank: singular
    store = tif.build_store(loss, ckpts, train, projection=projection, dtype=torch.float64,
                            progress=False)
    queries = tif.build_store(loss, ckpts, test, projection=projection, dtype=torch.float64,
                              progress=False)
    curvature = fit_curvature(loss, ckpts, train, projection=projection)
    subsets = draw_subsets(24, 30, seed=2)
    constant = RetrainResult(subsets=subsets, outputs=torch.ones(30, 6, dtype=torch.float64),
                             alpha=0.5, seed=2)  # Spearman of a constant: refused by lds
    with pytest.raises(InvalidArgumentError, match=r"constant ones for all"):
        choose_damping_by_lds(curvature, store, queries, constant, scales=(0.1, 1.0))
    truth = tif.score(store, queries, curvature=curvature.with_damping(Damping(1.0)))
    follows = RetrainResult(subsets=subsets, outputs=subsets.double() @ truth.T, alpha=0.5,
                            seed=2)
    with pytest.raises(InvalidArgumentError,
                       match=r"^choose_damping_by_lds: no candidate damping has a finite LDS"
                             r".*ill-conditioned, so not tried: scales \[1e-14, 1e-15\]"):
        choose_damping_by_lds(curvature, store, queries, follows, scales=(1e-14, 1e-15))
    choice = choose_damping_by_lds(curvature, store, queries, follows, scales=(1e-14, 1.0))
    assert math.isnan(choice.values[0]) and choice.details[0] is None and choice.scale == 1.0
