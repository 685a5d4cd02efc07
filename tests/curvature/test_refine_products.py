"""Refinement's Fisher-vector products and stopping (issue 33, ask 1's cost target).

The product by matrix multiplication over per-example gradients kept once per checkpoint
equals the functional jvp/vjp product (the reference for large models) and the explicit
``G^T diag(w) G / sum w`` (float64); it is chosen under ``GRADIENT_BUDGET`` and falls back
above it; conjugate gradient stops each query at the tolerance, independently of the others.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tests.reference import flat_loop_grads
from tracinfunc.curvature import classification_sampler, fisher, fit_curvature
from tracinfunc.curvature.fisher import (
    checkpoint_product,
    fisher_product,
    gradient_product,
    sampled_gradients,
)
from tracinfunc.curvature.flat import flat_map
from tracinfunc.curvature.refine import finite_rows, pcg, pcg_flat
from tracinfunc.curvature.test_grads import MARK
from tracinfunc.errors import IncompatibleGradientsError

EXACT = classification_sampler(exact=True)
IDENTITY = tif.Projection(kind="identity")


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(30, 4, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (30,), generator=g)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.5, name="a")]
    fitted = fit_curvature(loss, ckpts, (x[:20], y[:20]), kind="ekfac", damping=0.05,
                           sampler=EXACT)
    return loss, ckpts, (x[:20], y[:20]), (x[20:], y[20:]), fitted


def _labelled(loss, params, train):
    """The exact sampler's draws: every class of every input, weighted by its probability."""
    return [EXACT(loss, params, batch, torch.Generator().manual_seed(0))
            for batch in ((train[0][:12], train[1][:12]), (train[0][12:], train[1][12:]))
            if len(batch[1])]


def _vectors(params, names, t=3):
    g = torch.Generator().manual_seed(1)
    return {name: torch.randn(t, *params[name].shape, dtype=torch.float64, generator=g)
            for name in names}


def test_gradient_product_equals_functional_and_explicit(setup):
    loss, ckpts, train, _, _ = setup
    params = dict(ckpts[0].params)
    names = sorted(params)[::-1]  # out of the module's order
    labelled = _labelled(loss, params, train)
    gradients, weights = sampled_gradients(loss, params, names, labelled)  # [m, p], [m]
    assert gradients.shape == (sum(w.shape[0] for _, w in labelled), 43)
    rows = torch.cat([flat_loop_grads(loss, params, batch) for batch, _ in labelled])
    order = sorted(params)  # flat_loop_grads' columns: sorted names
    sizes = [params[n].numel() for n in order]
    blocks = dict(zip(order, rows.split(sizes, dim=1), strict=True))
    torch.testing.assert_close(gradients, torch.cat([blocks[n] for n in names], dim=1))

    vectors = _vectors(params, names)
    shapes = {name: tuple(params[name].shape) for name in names}
    by_matmul = gradient_product(gradients, weights, shapes)(vectors)
    matrix = (gradients.T * weights) @ gradients / weights.sum()
    by_matrix = gradient_product(matrix, None, shapes)(vectors)
    functional = fisher_product(loss, params, names, labelled)(vectors)
    flat_v = torch.cat([vectors[n].reshape(3, -1) for n in names], dim=1)
    explicit = flat_v @ (gradients.T * weights) @ gradients / weights.sum()
    for name, part in zip(names, explicit.split([params[n].numel() for n in names], dim=1),
                          strict=True):
        torch.testing.assert_close(by_matmul[name], functional[name], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(by_matrix[name], functional[name], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(by_matmul[name], part.reshape(3, *shapes[name]),
                                   rtol=1e-12, atol=1e-14)
    # the flat maps conjugate gradient runs on: the same products, columns in names' order
    for product in (gradient_product(gradients, weights, shapes),
                    gradient_product(matrix, None, shapes),
                    fisher_product(loss, params, names, labelled)):
        torch.testing.assert_close(product.flat(flat_v), explicit, rtol=1e-12, atol=1e-14)


def test_pcg_on_named_vectors_equals_pcg_on_flat_rows_and_an_explicit_solve(setup):
    """pcg (named vectors, any key order) is pcg_flat on the flattened rows: the same
    iterates and residuals; run to convergence, it gives (H + lambda I)^-1 g (float64)."""
    loss, ckpts, train, test, fitted = setup
    params = dict(ckpts[0].params)
    names = sorted(params)[::-1]
    labelled = _labelled(loss, params, train)
    gradients, weights = sampled_gradients(loss, params, names, labelled)
    product = gradient_product(gradients, weights, {n: tuple(params[n].shape) for n in names})
    rhs = {n: v.double() for n, v in tif.per_sample_grads(
        loss, options=tif.GradientOptions(select=names))(params, test).items()}
    layout = tuple((n, tuple(params[n].shape)) for n in names)
    flat_rhs = torch.cat([rhs[n].reshape(10, -1) for n in names], dim=1)  # [10, p]

    def precondition(v):
        return fitted.precondition(0, v)

    named, history = pcg(product, precondition, 0.05, rhs, 3)  # rhs in another key order
    flat, flat_history = pcg_flat(product.flat, flat_map(precondition, layout), 0.05, flat_rhs, 3)
    torch.testing.assert_close(history, flat_history, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(torch.cat([named[n].reshape(10, -1) for n in names], dim=1),
                               flat, rtol=1e-12, atol=1e-15)
    flat, flat_history = pcg_flat(product.flat, flat_map(precondition, layout), 0.05, flat_rhs,
                                  100, 1e-11)
    assert float(flat_history[-1].max()) <= 1e-11
    fisher_matrix = (gradients.T * weights) @ gradients / weights.sum()
    exact = torch.linalg.solve(fisher_matrix + 0.05 * torch.eye(43, dtype=torch.float64),
                               flat_rhs.T).T
    # residual <= 1e-11 times the condition number (14 here) bounds each row's error
    assert float(((flat - exact).norm(dim=1) / exact.norm(dim=1)).max()) <= 1e-8


@pytest.mark.parametrize("inputs, method", [(20, "matrix"), (4, "gradients")])
def test_matmul_chosen_under_the_budget_functional_above(setup, inputs, method):
    """m = 3 x inputs labelled rows, p = 43: H [p, p] kept when p < 2m, G [m, p] otherwise;
    over the budget (G's bytes) neither is formed."""
    loss, ckpts, train, _, _ = setup
    params = dict(ckpts[0].params)
    names = sorted(params)
    labelled = _labelled(loss, params, (train[0][:inputs], train[1][:inputs]))
    calls = []

    def label():
        calls.append(1)
        return labelled

    needed = sum(w.shape[0] for _, w in labelled) * 43 * 8  # m x p float64 bytes
    cache: dict = {}
    under = checkpoint_product(cache, "a", loss, params, names, label, budget=needed)
    assert under.method == method and list(cache) == ["a"]
    again = checkpoint_product(cache, "a", loss, params, names, label, budget=needed)
    assert again.method == method and len(calls) == 1  # kept: no second labelling
    over = checkpoint_product({}, "a", loss, params, names, label, budget=needed - 1)
    assert over.method == "functional"
    vectors = _vectors(params, names)
    for name, value in under(vectors).items():
        torch.testing.assert_close(value, over(vectors)[name], rtol=1e-12, atol=1e-14)
    # a second key over the budget left: the oldest is dropped, never more than the budget
    checkpoint_product(cache, "b", loss, params, names, label, budget=needed)
    assert list(cache) == ["b"]
    assert fisher.GRADIENT_BUDGET == 256 * 2**20  # the documented default


def test_refined_queries_equal_with_either_product(setup, monkeypatch):
    loss, ckpts, train, test, fitted = setup
    refined = fitted.with_refinement(train, steps=4, sampler=EXACT, tolerance=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        kept = tif.preconditioned_test_grads(loss, ckpts, test, refined, projection=IDENTITY)
        assert len(refined.refinement.gradients) == 1  # one checkpoint's G, kept
        monkeypatch.setattr(fisher, "GRADIENT_BUDGET", 0)
        fresh = fitted.with_refinement(train, steps=4, sampler=EXACT, tolerance=1e-12)
        functional = tif.preconditioned_test_grads(loss, ckpts, test, fresh,
                                                   projection=IDENTITY)
    assert not fresh.refinement.gradients  # over the budget: nothing kept
    torch.testing.assert_close(kept.read_rows(0, 0, 10), functional.read_rows(0, 0, 10),
                               rtol=1e-10, atol=1e-12)


def test_kept_gradients_follow_the_parameters(setup):
    """Parameters changed in place are not served the old gradients; with_damping shares."""
    loss, ckpts, train, test, fitted = setup
    refined = fitted.with_refinement(train, steps=3, sampler=EXACT, tolerance=1e-12)
    changed = tif.Checkpoint({k: v.clone() for k, v in ckpts[0].params.items()}, lr=0.5,
                             name="a")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        before = tif.preconditioned_test_grads(loss, [changed], test, refined,
                                               projection=IDENTITY).read_rows(0, 0, 10)
        with torch.no_grad():
            changed.params["0.weight"].mul_(1.5)
        after = tif.preconditioned_test_grads(loss, [changed], test, refined,
                                              projection=IDENTITY).read_rows(0, 0, 10)
        alone = fitted.with_refinement(train, steps=3, sampler=EXACT, tolerance=1e-12)
        expected = tif.preconditioned_test_grads(loss, [changed], test, alone,
                                                 projection=IDENTITY).read_rows(0, 0, 10)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected, rtol=1e-12, atol=1e-14)
    assert len(refined.refinement.gradients) == 2
    assert refined.with_damping(0.07).refinement.gradients is refined.refinement.gradients


def test_pcg_stops_each_system_at_the_tolerance_alone(setup):
    """A system below the tolerance keeps its answer (its residual stays), the others go on;
    its answer equals solving it alone; the loop ends once all are below."""
    loss, ckpts, train, test, fitted = setup
    params = dict(ckpts[0].params)
    names = [name for name, _ in fitted.layout]
    product = fisher_product(loss, params, names, _labelled(loss, params, train))
    rhs = {name: value.double() for name, value in
           tif.per_sample_grads(loss, options=tif.GradientOptions(select=names))(
               params, test).items()}  # [10, *shape]

    def precondition(v):
        return fitted.precondition(0, v)

    x, residuals = pcg(product, precondition, 0.05, rhs, 40, 1e-4)  # [taken + 1, 10]
    below = residuals <= 1e-4
    first = below.float().argmax(0)  # each system's first step at or below the tolerance
    assert bool(below[-1].all()) and not bool(below[-2].all())  # ended when all were below
    assert len(set(first.tolist())) > 1  # systems stopped at different steps ...
    for i in range(10):  # ... each kept from then on, and equal to its solve alone
        assert bool((residuals[first[i]:, i] == residuals[first[i], i]).all())
        alone, history = pcg(product, precondition, 0.05,
                             {n: v[i:i + 1] for n, v in rhs.items()}, 40, 1e-4)
        assert history.shape[0] == int(first[i]) + 1
        for name in names:
            torch.testing.assert_close(alone[name][0], x[name][i], rtol=1e-12, atol=1e-14)


def test_refined_queries_stop_early_whatever_they_are_batched_with(setup):
    loss, ckpts, train, test, fitted = setup
    refined = fitted.with_refinement(train, steps=40, sampler=EXACT, tolerance=1e-4)
    together = tif.preconditioned_test_grads(loss, ckpts, test, refined, projection=IDENTITY)
    residuals = together.meta.extra[MARK]["residuals"][0]
    assert residuals[-1] <= 1e-4 < residuals[-2] and len(residuals) < 41  # stopped early
    one_by_one = tif.preconditioned_test_grads(
        loss, ckpts, [(test[0][i:i + 1], test[1][i:i + 1]) for i in range(10)], refined,
        projection=IDENTITY)
    assert one_by_one.meta.extra[MARK]["residuals"][0] == pytest.approx(residuals, rel=1e-10)
    torch.testing.assert_close(one_by_one.read_rows(0, 0, 10), together.read_rows(0, 0, 10),
                               rtol=1e-12, atol=1e-14)


def test_steps_and_tolerance_are_in_the_digest(setup):
    loss, ckpts, train, test, fitted = setup
    store = tif.build_store(loss, ckpts, train, projection=IDENTITY, progress=False)
    a = fitted.with_refinement(train, steps=5, sampler=EXACT, tolerance=1e-2)
    b = fitted.with_refinement(train, steps=5, sampler=EXACT, tolerance=1e-3)
    c = fitted.with_refinement(train, steps=6, sampler=EXACT, tolerance=1e-2)
    assert len({a.digest, b.digest, c.digest}) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        queries = tif.preconditioned_test_grads(loss, ckpts, test, a, projection=IDENTITY)
    tif.score(store, queries, curvature=a)
    for other in (b, c):
        with pytest.raises(IncompatibleGradientsError, match="another curvature"):
            tif.score(store, queries, curvature=other)


def test_finite_rows_equals_isfinite_on_every_kind_of_non_finite_value():
    """The cheap per-row check the refined solve uses (max and min) against isfinite."""
    rows = torch.zeros(7, 5, dtype=torch.float64)
    rows[1, 2] = float("nan")
    rows[2, 0] = float("inf")
    rows[3, 4] = float("-inf")
    rows[4, 1], rows[4, 3] = float("inf"), float("-inf")
    rows[5, 2] = 1e308
    rows[6] = float("nan")
    assert finite_rows(rows).tolist() == rows.isfinite().all(1).tolist()
    assert finite_rows(rows).tolist() == [True, False, False, False, False, True, False]
    assert finite_rows(torch.zeros(0, 5)).shape == (0,)
    assert finite_rows(torch.zeros(3, 0)).tolist() == [True] * 3
