"""The direct refined solve (issue 33): where the sampled Fisher is kept, ``(H + lambda I) x = g``
is solved exactly (Cholesky of ``H + lambda I`` when ``H [p, p]`` is kept, Woodbury through an
``[m, m]`` Cholesky when ``G [m, p]`` is), checked against the explicit float64 solve with the
Fisher built by hand (``tests.reference.flat_loop_grads`` at every class, by its probability)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tests.curvature.cli_setup import saved_for_cli
from tests.reference import flat_loop_grads
from tracinfunc.curvature import classification_sampler, fisher, fit_curvature
from tracinfunc.curvature.test_grads import MARK
from tracinfunc.errors import InvalidArgumentError

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


def _explicit_solution(model, loss, ckpt, inputs, test, lam) -> torch.Tensor:
    """``(H + lam I)^-1 g`` ``[n_test, p]``, ``H = sum_i sum_c p_ic g_ic g_ic^T / n``."""
    params = dict(ckpt.params)
    with torch.no_grad():
        probs = torch.func.functional_call(model, params, (inputs,)).softmax(-1)  # [n, C]
    fisher_matrix = 0
    for c in range(probs.shape[1]):
        grads = flat_loop_grads(loss, params, (inputs, torch.full((inputs.shape[0],), c)))
        fisher_matrix = fisher_matrix + (grads * probs[:, c:c + 1]).T @ grads
    fisher_matrix = fisher_matrix / inputs.shape[0]
    g = flat_loop_grads(loss, params, test)
    eye = torch.eye(fisher_matrix.shape[0], dtype=torch.float64)
    return torch.linalg.solve(fisher_matrix + lam * eye, g.T).T


def _query(loss, ckpts, test, refined):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a direct solve converges: no warning
        return tif.preconditioned_test_grads(loss, ckpts, test, refined, projection=IDENTITY)


# 20 examples x 3 classes = 60 rows, p = 43 < 2 x 60: H [43, 43] kept; 5 examples: 15 rows,
# 43 >= 30: G [15, 43] kept (the Woodbury path)
@pytest.mark.parametrize(("examples", "kept"), [(None, "H"), (5, "G")])
def test_direct_solve_equals_the_explicit_float64_solve(setup, examples, kept):
    model, loss, ckpts, train, test, fitted = setup
    refined = fitted.with_refinement(train, sampler=EXACT, max_examples=examples,
                                     solver="direct", tolerance=1e-10)
    queries = _query(loss, ckpts, test, refined)
    n = 20 if examples is None else examples
    expected = _explicit_solution(model, loss, ckpts[0], train[0][:n], test, 0.05)
    torch.testing.assert_close(queries.read_rows(0, 0, 4), expected, rtol=1e-9, atol=1e-11)
    mark = queries.meta.extra[MARK]
    assert mark["solvers"] == ["direct"]
    assert len(mark["residuals"][0]) == 1 and mark["residuals"][0][0] < 1e-12
    (entry,) = refined.refinement.gradients.values()
    assert (entry.weights is None) == (kept == "H")
    assert entry.factor is not None and entry.factor[0] == 0.05


def test_direct_equals_converged_cg_and_plain_is_not_it(setup):
    _, loss, ckpts, train, test, fitted = setup
    direct = _query(loss, ckpts, test, fitted.with_refinement(train, sampler=EXACT,
                                                              solver="direct"))
    cg = fitted.with_refinement(train, sampler=EXACT, steps=200, tolerance=1e-13)  # default
    converged = _query(loss, ckpts, test, cg)
    torch.testing.assert_close(direct.read_rows(0, 0, 4), converged.read_rows(0, 0, 4),
                               rtol=1e-8, atol=1e-10)
    assert converged.meta.extra[MARK]["solvers"] == ["cg"]
    plain = tif.preconditioned_test_grads(loss, ckpts, test, fitted, projection=IDENTITY)
    assert not torch.allclose(plain.read_rows(0, 0, 4), direct.read_rows(0, 0, 4), rtol=1e-3)


def test_factor_is_kept_per_damping_and_replaced_at_another(setup, monkeypatch):
    model, loss, ckpts, train, test, fitted = setup
    refined = fitted.with_refinement(train, sampler=EXACT, solver="direct")
    calls = []
    factorise = fisher.KeptFisher._factorise
    monkeypatch.setattr(fisher.KeptFisher, "_factorise",
                        lambda self, damping: calls.append(damping) or factorise(self, damping))
    first = _query(loss, ckpts, test, refined)
    again = _query(loss, ckpts, test, refined)
    assert calls == [0.05]  # one factor, reused by the second query
    torch.testing.assert_close(first.read_rows(0, 0, 4), again.read_rows(0, 0, 4), rtol=0,
                               atol=0)
    other = refined.with_damping(0.2)  # shares the kept Fisher; its own factor
    got = _query(loss, ckpts, test, other)
    assert calls == [0.05, 0.2]
    expected = _explicit_solution(model, loss, ckpts[0], train[0], test, 0.2)
    torch.testing.assert_close(got.read_rows(0, 0, 4), expected, rtol=1e-9, atol=1e-11)
    back = _query(loss, ckpts, test, refined)  # the old damping again: factorised again
    assert calls == [0.05, 0.2, 0.05]
    torch.testing.assert_close(back.read_rows(0, 0, 4), first.read_rows(0, 0, 4), rtol=1e-12,
                               atol=1e-14)


def test_over_the_budget_direct_is_refused_and_cg_still_works(setup, monkeypatch):
    _, loss, ckpts, train, test, fitted = setup
    # H [43, 43] fits, but not with its factor: the direct solve cannot keep one
    monkeypatch.setattr(fisher, "GRADIENT_BUDGET", 60 * 43 * 8)
    direct = fitted.with_refinement(train, sampler=EXACT, solver="direct")
    with pytest.raises(InvalidArgumentError, match=r"solver='direct'.*GRADIENT_BUDGET"):
        tif.preconditioned_test_grads(loss, ckpts, test, direct, projection=IDENTITY)
    assert not direct.refinement.gradients  # nothing kept for it
    cg = fitted.with_refinement(train, sampler=EXACT, steps=100, tolerance=1e-9)
    queries = _query(loss, ckpts, test, cg)
    assert queries.meta.extra[MARK]["solvers"] == ["cg"]
    assert len(cg.refinement.gradients) == 1  # CG keeps H: the budget has no factor in it
    monkeypatch.setattr(fisher, "GRADIENT_BUDGET", 60 * 43 * 8 + 43 * 43 * 8)  # room for L
    fresh = fitted.with_refinement(train, sampler=EXACT, solver="direct")
    assert _query(loss, ckpts, test, fresh).meta.extra[MARK]["solvers"] == ["direct"]


def _negative_sampler(loss, params, batch, generator):
    """Every class, one weight made negative (an indefinite "Fisher")."""
    labelled, weights = EXACT(loss, params, batch, generator)
    return labelled, torch.where(torch.arange(weights.shape[0]) == 0, -weights, weights)


def test_negative_weights_with_g_kept_are_refused_by_direct(setup):
    """With ``G`` kept (5 examples), ``sqrt(w) G`` is not real: refused, with the way out."""
    _, loss, ckpts, train, test, fitted = setup
    direct = fitted.with_refinement(train, sampler=_negative_sampler, solver="direct",
                                    max_examples=5)
    with pytest.raises(InvalidArgumentError, match="negative weights"):
        tif.preconditioned_test_grads(loss, ckpts, test, direct, projection=IDENTITY)


def test_an_indefinite_kept_fisher_is_refused_not_solved():
    """``H + lambda I`` not positive definite (``H`` from negative weights): a clear error."""
    h = torch.diag(torch.tensor([1.0, -0.5, 0.2], dtype=torch.float64))
    with pytest.raises(tif.errors.IllConditionedError, match="not positive definite"):
        fisher.KeptFisher(h, None).solve(0.1, torch.ones(2, 3, dtype=torch.float64))
    nan = fisher.KeptFisher(torch.full((2, 3), torch.nan, dtype=torch.float64),
                            torch.ones(2, dtype=torch.float64))
    with pytest.raises(tif.errors.NonFiniteGradientError, match="NaN or infinite"):
        nan.solve(0.1, torch.ones(2, 3, dtype=torch.float64))


def test_a_nan_test_example_is_named(setup):
    _, loss, ckpts, train, test, fitted = setup
    refined = fitted.with_refinement(train, sampler=EXACT)
    x = test[0].clone()
    x[1, 0] = float("nan")
    with pytest.raises(tif.errors.NonFiniteGradientError, match=r"examples \[1\]"):
        tif.preconditioned_test_grads(loss, ckpts, (x, test[1]), refined, projection=IDENTITY)


@pytest.mark.parametrize("solver", ["Direct", "auto", "exact", 1, None])
def test_bad_solver_is_refused_with_the_choices(setup, solver):
    _, _, _, train, _, fitted = setup
    with pytest.raises(InvalidArgumentError, match=r"'cg', 'direct'"):
        fitted.with_refinement(train, solver=solver)


def test_solvers_have_their_own_digests(setup):
    _, _, _, train, _, fitted = setup
    digests = {fitted.with_refinement(train, sampler=EXACT, solver=solver).digest
               for solver in ("direct", "cg")}
    assert len(digests) == 2


@pytest.mark.parametrize("solver", ["direct", "cg"])
def test_cli_refine_solver_matches_the_api(tmp_path, capsys, solver):

    import numpy as np

    from tracinfunc.cli import main

    saved = saved_for_cli(tmp_path)
    spec_path, spec, projection, store, curvature = (
        saved.spec_path, saved.spec, saved.projection, saved.store, saved.curvature)
    out = tmp_path / "scores.npy"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        code = main(["score", str(tmp_path / "grads.zarr"), "--spec", f"{spec_path}:make",
                     "--curvature", str(tmp_path / "curvature.zarr"), "--refine-steps", "1",
                     "--refine-examples", "8", "--refine-solver", solver, "--output", str(out),
                     "--quiet"])
        assert code == 0
        queries = {name: tif.preconditioned_test_grads(
            spec.loss, spec.checkpoints, spec.test["test"],
            curvature.with_refinement(spec.train, steps=1, max_examples=8, solver=name),
            projection=projection) for name in ("direct", "cg")}
    assert queries[solver].meta.extra[MARK]["solvers"] == [solver] * len(spec.checkpoints)
    refined = curvature.with_refinement(spec.train, steps=1, max_examples=8, solver=solver)
    expected = tif.score(store, queries[solver], curvature=refined).numpy()
    np.testing.assert_allclose(np.load(out), expected, rtol=1e-5, atol=1e-6)
    # one conjugate-gradient step is not the exact solve: the flag changes the scores
    assert not np.allclose(queries["direct"].read_rows(0, 0, 2).numpy(),
                           queries["cg"].read_rows(0, 0, 2).numpy(), rtol=1e-4)
    with pytest.raises(SystemExit) as exited:  # a usage error, as argparse's own
        main(["score", str(tmp_path / "grads.zarr"), "--spec", f"{spec_path}:make",
              "--curvature", str(tmp_path / "curvature.zarr"), "--refine-solver", solver,
              "--output", str(tmp_path / "x.npy"), "--quiet"])
    assert exited.value.code == 2
    assert "--refine-solver goes with --refine-steps" in capsys.readouterr().err
    assert not (tmp_path / "x.npy").exists()


@pytest.mark.parametrize("kept", ["H", "G"])
def test_reported_residual_is_the_true_residual_of_an_inexact_solve(monkeypatch, kept):
    """The residual a direct solve reports is ``||g - (H + l I) x|| / ||g||`` of the ``x`` it
    returns, also when its inner solve is off (simulated: the Cholesky solve scaled by 1.01).
    With ``G`` kept it is computed in ``[m, m]``, so this checks that algebra."""
    gen = torch.Generator().manual_seed(0)
    gradients = torch.randn(6, 20, dtype=torch.float64, generator=gen)
    weights = torch.rand(6, dtype=torch.float64, generator=gen)
    hessian = (gradients.T * (weights / weights.sum())) @ gradients
    entry = fisher.KeptFisher(hessian, None) if kept == "H" else \
        fisher.KeptFisher(gradients, weights)
    rhs = torch.randn(3, 20, dtype=torch.float64, generator=gen)
    exact, residuals = entry.solve(0.1, rhs)
    system = hessian + 0.1 * torch.eye(20, dtype=torch.float64)
    torch.testing.assert_close(exact, torch.linalg.solve(system, rhs.T).T, rtol=1e-10,
                               atol=1e-12)
    assert float(residuals.max()) < 1e-13
    solve = torch.cholesky_solve
    monkeypatch.setattr(torch, "cholesky_solve", lambda b, factor: solve(b, factor) * 1.01)
    entry.factor = None
    off, reported = entry.solve(0.1, rhs)
    true = (rhs - off @ system).norm(dim=1) / rhs.norm(dim=1)
    assert float(true.min()) > 1e-4  # the simulated solve is off ...
    torch.testing.assert_close(reported, true, rtol=1e-6, atol=0)  # ... and says by how much


def test_early_refusal_says_the_query_checks_the_sampled_fisher_too(setup):
    """with_refinement judges the fitted estimate (it has no loss to sample with); its advice
    says the query checks the sampled Fisher again, so a second advice is no surprise."""
    _, loss, ckpts, train, _, _ = setup
    # a fit at a tiny damping passes its own conditioning (EK-FAC's smallest eigenvalue is
    # positive) but not refinement's rule, which assumes a rank-deficient sampled Fisher
    tiny = fit_curvature(loss, ckpts, train, kind="ekfac", damping=1e-9, sampler=EXACT)
    with pytest.raises(tif.errors.IllConditionedError,
                       match="checks the sampled Fisher's own largest eigenvalue too"):
        tiny.with_refinement(train, sampler=EXACT)
