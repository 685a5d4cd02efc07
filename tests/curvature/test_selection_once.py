"""The selection is given once (issue 33, item 5): ``fit_curvature(options=GradientOptions(
select=...))`` as ``build_store`` and ``preconditioned_test_grads``; K-FAC's refusal names
the exact selection that works."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.curvature import classification_sampler, fit_curvature
from tracinfunc.errors import InvalidArgumentError

EXACT = classification_sampler(exact=True)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(),
                          nn.Linear(5, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    x, y = torch.randn(12, 4, dtype=torch.float64), torch.randint(0, 3, (12,))
    return loss, [tif.Checkpoint.from_module(model, name="a")], (x, y)


def test_the_selection_is_given_once_through_options(setup):
    """0.2.0 is the first release: fit_curvature takes the store's options, no select=."""
    loss, ckpts, data = setup
    select = ["0.weight", "0.bias", "3.weight", "3.bias"]
    curvature = fit_curvature(loss, ckpts, data, kind="kfac", sampler=EXACT,
                              options=tif.GradientOptions(select=select))
    assert sorted(name for name, _ in curvature.layout) == sorted(select)
    with pytest.raises(TypeError, match="select"):
        fit_curvature(loss, ckpts, data, kind="kfac", select=select)


def test_kfac_refusal_gives_the_selection_that_works_for_store_and_curvature(setup):
    """The advice no longer loops (store's selection -> BatchNorm -> refused): it names the
    exact parameters, and that selection then fits and scores."""
    loss, ckpts, data = setup
    with pytest.raises(InvalidArgumentError, match="build the store AND fit") as caught:
        fit_curvature(loss, ckpts, data, kind="kfac", sampler=EXACT)
    advised = eval(re.search(r"select=(\[[^\]]*\])", str(caught.value)).group(1))
    assert advised == ["0.bias", "0.weight", "3.bias", "3.weight"]
    options = tif.GradientOptions(select=advised)
    curvature = fit_curvature(loss, ckpts, data, kind="kfac", sampler=EXACT, options=options)
    store = tif.build_store(loss, ckpts, data, options=options, progress=False,
                            projection=tif.Projection(kind="identity"))
    queries = tif.preconditioned_test_grads(loss, ckpts, data, curvature,
                                            projection=store.projection, options=options)
    assert tif.score(store, queries, curvature=curvature).isfinite().all()
