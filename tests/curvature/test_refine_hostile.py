"""Attacks on refinement (issue 33, item 6): NaN, zero or huge damping, non-convergence,
mismatched stores and curvatures, data that is empty or not finite, saving, frontends without
Fisher-vector products. Each is refused with the fix, or reported."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.curvature import classification_sampler, fit_curvature
from tracinfunc.curvature.test_grads import MARK, GradientPreconditioner
from tracinfunc.errors import (
    EmptyDataError,
    IllConditionedError,
    IncompatibleGradientsError,
    InvalidArgumentError,
    NonFiniteGradientError,
)

EXACT = classification_sampler(exact=True)
IDENTITY = tif.Projection(kind="identity")


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 4, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (24,), generator=g)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.5, name="a")]
    fitted = fit_curvature(loss, ckpts, (x[:20], y[:20]), kind="ekfac", damping=0.05,
                           sampler=EXACT)
    return model, loss, ckpts, (x[:20], y[:20]), (x[20:], y[20:]), fitted


@pytest.mark.parametrize("damping", [math.nan, -1.0, math.inf])
def test_nan_negative_or_infinite_damping_is_refused(setup, damping):
    *_, train, _, fitted = setup
    refined = fitted.with_refinement(train, steps=2, sampler=EXACT)
    with pytest.raises(InvalidArgumentError, match="damping must be a finite float"):
        refined.with_damping(damping)


def test_zero_damping_is_refused_with_the_damping_that_works(setup):
    *_, train, _, fitted = setup
    with pytest.raises(IllConditionedError, match=r"condition number.*with_damping\("):
        fitted.with_damping(0.0)  # the rule of every solve
    undamped = dataclasses.replace(fitted, damping=(0.0,))  # e.g. built or loaded so
    with pytest.raises(IllConditionedError, match=r"lambda must be positive.*with_damping\("):
        undamped.with_refinement(train, sampler=EXACT)
    refined = fitted.with_refinement(train, sampler=EXACT)
    with pytest.raises(IllConditionedError, match="condition number"):
        refined.with_damping(1e-12)  # re-damping a refined curvature checks again


def test_huge_damping_is_refused_as_changing_nothing(setup):
    *_, train, _, fitted = setup
    with pytest.raises(IllConditionedError, match="refinement would change nothing"):
        fitted.with_damping(1e30).with_refinement(train, sampler=EXACT)


def test_non_convergence_is_reported_with_the_residual(setup):
    _, loss, ckpts, train, test, fitted = setup
    refined = fitted.with_damping(1e-4).with_refinement(train, steps=1, sampler=EXACT,
                                                       tolerance=1e-6)
    with pytest.warns(RuntimeWarning, match=r"relative residual of [0-9.e-]+ after 1 steps"):
        queries = tif.preconditioned_test_grads(loss, ckpts, test, refined,
                                                projection=IDENTITY)
    residuals = queries.meta.extra[MARK]["residuals"]
    assert len(residuals) == 1 and len(residuals[0]) == 2 and residuals[0][-1] > 1e-6


@pytest.mark.parametrize("bad", [
    {"steps": 0}, {"steps": 2.5}, {"steps": True}, {"tolerance": 0.0},
    {"tolerance": math.nan}, {"max_examples": 0},
])
def test_bad_refinement_arguments_are_refused(setup, bad):
    *_, train, _, fitted = setup
    with pytest.raises(InvalidArgumentError):
        fitted.with_refinement(train, **bad)


def test_a_projected_curvature_cannot_be_refined(setup):
    _, loss, ckpts, train, _, _ = setup
    projected = fit_curvature(loss, ckpts, train, projection=tif.Projection(dim=8, seed=0),
                              sampler=EXACT)
    with pytest.raises(InvalidArgumentError, match="'projected' curvature acts on projected"):
        projected.with_refinement(train)


def test_empty_or_non_finite_refinement_data_is_refused(setup):
    _, loss, ckpts, train, test, fitted = setup
    with pytest.raises(EmptyDataError, match="no training examples to refine"):
        fitted.with_refinement([])
    poisoned = train[0].clone()
    poisoned[3, 1] = math.nan
    refined = fitted.with_refinement((poisoned, train[1]), sampler=EXACT)
    with pytest.raises(NonFiniteGradientError):
        tif.preconditioned_test_grads(loss, ckpts, test, refined, projection=IDENTITY)


def test_mismatched_store_or_checkpoints_are_refused(setup):
    model, loss, ckpts, train, test, fitted = setup
    refined = fitted.with_refinement(train, steps=2, sampler=EXACT)
    other = [tif.Checkpoint.from_module(model, lr=0.25, name="a")]  # another lr
    with pytest.raises(IncompatibleGradientsError, match="checkpoint 0 differs"):
        tif.preconditioned_test_grads(loss, other, test, refined, projection=IDENTITY)
    queries = tif.preconditioned_test_grads(loss, ckpts, test, refined, projection=IDENTITY)
    store = tif.build_store(loss, other, train, projection=IDENTITY, progress=False)
    with pytest.raises(IncompatibleGradientsError, match="checkpoint 0 differs"):
        tif.score(store, queries, curvature=refined)
    # Refined on other data: another digest, so queries of one are refused by the other.
    again = fitted.with_refinement((train[0][:10], train[1][:10]), steps=2, sampler=EXACT)
    good = tif.build_store(loss, ckpts, train, projection=IDENTITY, progress=False)
    with pytest.raises(IncompatibleGradientsError, match="another curvature"):
        tif.score(good, queries, curvature=again)


def test_a_refined_curvature_is_not_saved_silently_without_its_data(setup, tmp_path):
    *_, train, _, fitted = setup
    refined = fitted.with_refinement(train, sampler=EXACT)
    with pytest.raises(InvalidArgumentError, match="without_refinement"):
        tif.save_curvature(refined, tmp_path / "c.zarr")
    assert not (tmp_path / "c.zarr").exists()
    tif.save_curvature(refined.without_refinement(), tmp_path / "c.zarr")


def test_a_frontend_without_fisher_products_refuses_a_refined_curvature(setup):
    *_, train, _, fitted = setup
    refined = fitted.with_refinement(train, sampler=EXACT)
    with pytest.raises(InvalidArgumentError, match="without_refinement"):
        GradientPreconditioner(refined, 0, IDENTITY)  # what the JAX frontend builds


def test_saved_plain_curvature_on_refined_queries_gives_advice_that_works(setup, tmp_path):
    """A refined curvature cannot be saved, so the CLI meets refined queries with the saved
    plain one: refused (never scored as plain), and the advice (omit curvature=) gives the
    refined scores."""
    _, loss, ckpts, train, test, fitted = setup
    refined = fitted.with_refinement(train, steps=3, sampler=EXACT)
    with pytest.warns(RuntimeWarning):
        queries = tif.preconditioned_test_grads(loss, ckpts, test, refined, projection=IDENTITY)
    store = tif.build_store(loss, ckpts, train, projection=IDENTITY, progress=False)
    tif.save_curvature(fitted, str(tmp_path / "c.zarr"))
    loaded = tif.load_curvature(str(tmp_path / "c.zarr"))
    assert loaded.digest == fitted.digest != refined.digest
    with pytest.raises(IncompatibleGradientsError, match=r"refined.*omit curvature="):
        tif.score(store, queries, curvature=loaded)
    torch.testing.assert_close(tif.score(store, queries),
                               tif.score(store, queries, curvature=refined))


def test_nan_test_row_named_not_blamed_on_refinement(setup):
    _, loss, ckpts, train, test, fitted = setup
    refined = fitted.with_refinement(train, steps=2, sampler=EXACT)
    x = test[0].clone()
    x[1, 0] = math.nan
    with pytest.raises(NonFiniteGradientError) as err:
        tif.preconditioned_test_grads(loss, ckpts, (x, test[1]), refined, projection=IDENTITY)
    assert "refine with other data" not in str(err.value)
