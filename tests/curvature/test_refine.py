"""Iterative refinement (issue 33): preconditioned CG on ``(H + lambda I) x = g`` converges to
the explicit float64 solve, with ``H`` the sampled Fisher built by hand (per-example gradients
from ``tests.reference.flat_loop_grads`` at every class, weighted by its probability)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tests.curvature.cli_setup import saved_for_cli
from tests.reference import flat_loop_grads
from tracinfunc.curvature import classification_sampler, fit_curvature
from tracinfunc.curvature.refine import fisher_product
from tracinfunc.curvature.test_grads import MARK
from tracinfunc.errors import (
    IncompatibleGradientsError,
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
    return model, loss, ckpts, (x[:20], y[:20]), (x[20:], y[20:])


def _explicit_fisher(model, loss, params, x) -> torch.Tensor:
    """``sum_i sum_c p_ic g_ic g_ic^T / n`` ``[p, p]`` (sorted parameter names)."""
    with torch.no_grad():
        probs = torch.func.functional_call(model, params, (x,)).softmax(-1)  # [n, C]
    total = 0
    for c in range(probs.shape[1]):
        labels = torch.full((x.shape[0],), c)
        grads = flat_loop_grads(loss, params, (x, labels))  # [n, p]
        total = total + (grads * probs[:, c:c + 1]).T @ grads
    return total / x.shape[0]


def _explicit_solution(setup, lam):
    model, loss, ckpts, train, test = setup
    params = dict(ckpts[0].params)
    fisher = _explicit_fisher(model, loss, params, train[0])
    g = flat_loop_grads(loss, params, test)  # [n_test, p]
    eye = torch.eye(fisher.shape[0], dtype=torch.float64)
    return torch.linalg.solve(fisher + lam * eye, g.T).T


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_refined_queries_converge_to_the_explicit_damped_solve(setup, kind):
    _, loss, ckpts, train, test = setup
    lam = 0.05
    expected = _explicit_solution(setup, lam)
    fitted = fit_curvature(loss, ckpts, train, kind=kind, damping=lam, sampler=EXACT)
    plain = tif.preconditioned_test_grads(loss, ckpts, test, fitted, projection=IDENTITY)
    errors = []
    for steps in (1, 3, 60):
        refined = fitted.with_refinement(train, steps=steps, sampler=EXACT, tolerance=1e-12)
        with warnings.catch_warnings():  # not converged yet at 1 and 3 steps: tested below
            warnings.simplefilter("ignore" if steps < 60 else "error", RuntimeWarning)
            queries = tif.preconditioned_test_grads(loss, ckpts, test, refined,
                                                    projection=IDENTITY)
        residuals = queries.meta.extra[MARK]["residuals"][0]
        # every step until the tolerance is reached (60 steps: it is, before the last)
        assert all(r > 1e-12 for r in residuals[:-1]) and len(residuals) <= steps + 1
        assert len(residuals) == steps + 1 if steps < 60 else residuals[-1] <= 1e-12
        assert residuals[-1] < residuals[0]  # conjugate gradient reduces the residual
        errors.append(float((queries.read_rows(0, 0, 4) - expected).norm() / expected.norm()))
    initial = float((plain.read_rows(0, 0, 4) - expected).norm() / expected.norm())
    assert initial > 1e-3  # the fitted inverse alone is not the solve ...
    assert errors[0] < initial and errors[1] < errors[0]  # ... refinement approaches it ...
    torch.testing.assert_close(queries.read_rows(0, 0, 4), expected, rtol=1e-7, atol=1e-9)
    assert residuals[-1] < 1e-8  # ... and reaches it


def test_refinement_reaches_every_scoring_path_through_curvature(setup):
    _, loss, ckpts, train, test = setup
    refined = fit_curvature(loss, ckpts, train, kind="ekfac", damping=0.05, sampler=EXACT
                            ).with_refinement(train, steps=30, sampler=EXACT, tolerance=1e-12)
    store = tif.build_store(loss, ckpts, train, projection=IDENTITY, progress=False)
    queries = tif.preconditioned_test_grads(loss, ckpts, test, refined, projection=IDENTITY)
    expected = 0.5 * _explicit_solution(setup, 0.05) @ store.read_rows(0, 0, 20).double().T
    scores = tif.score(store, queries, curvature=refined)
    torch.testing.assert_close(scores.double(), expected, rtol=1e-5, atol=1e-7)
    _, indices = tif.top_k(store, queries, k=3, curvature=refined)
    torch.testing.assert_close(indices, expected.topk(3, dim=1).indices)
    # The unrefined curvature does not accept refined queries, nor the reverse.
    with pytest.raises(IncompatibleGradientsError, match="another curvature"):
        tif.score(store, queries, curvature=refined.without_refinement())


def test_cli_score_refines_like_the_api(tmp_path, capsys):

    import numpy as np

    from tracinfunc.cli import main

    saved = saved_for_cli(tmp_path)
    spec_path, spec, projection, store, curvature = (
        saved.spec_path, saved.spec, saved.projection, saved.store, saved.curvature)
    out = tmp_path / "scores.npy"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        code = main(["score", str(tmp_path / "grads.zarr"), "--spec", f"{spec_path}:make",
                     "--curvature", str(tmp_path / "curvature.zarr"), "--refine-steps", "2",
                     "--refine-examples", "8", "--output", str(out), "--quiet"])
        assert code == 0
        refined = curvature.with_refinement(spec.train, steps=2, max_examples=8)
        queries = tif.preconditioned_test_grads(spec.loss, spec.checkpoints, spec.test["test"],
                                                refined, projection=projection)
    expected = tif.score(store, queries, curvature=refined)
    np.testing.assert_allclose(np.load(out), expected.numpy(), rtol=1e-5, atol=1e-6)
    plain = tif.preconditioned_test_grads(spec.loss, spec.checkpoints, spec.test["test"],
                                          curvature, projection=projection)
    assert not np.allclose(tif.score(store, plain, curvature=curvature).numpy(),
                           expected.numpy())
    code = main(["score", str(tmp_path / "grads.zarr"), "--spec", f"{spec_path}:make",
                 "--refine-steps", "2", "--output", str(tmp_path / "x.npy"), "--quiet"])
    assert code != 0 and "--refine-steps needs --curvature" in capsys.readouterr().err
    assert not (tmp_path / "x.npy").exists()


def test_fisher_product_takes_vectors_in_any_key_order(setup):
    """``H v`` for vectors keyed in another order than the selection (found on GPT-Neo, whose
    k, v, q projections are registered out of name order): the explicit ``G^T G v / n``."""
    _, loss, ckpts, train, _ = setup
    params = dict(ckpts[0].params)
    names = sorted(params)  # the reference's flat order
    grads = flat_loop_grads(loss, params, train)  # [n, p]
    product = fisher_product(loss, params, names[::-1],
                             [(train, torch.ones(len(train[1]), dtype=torch.float64))])
    v = torch.randn(2, grads.shape[1], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))  # [t, p]
    sizes = [params[name].numel() for name in names]
    vectors = {name: part.reshape(2, *params[name].shape)
               for name, part in zip(names, v.split(sizes, dim=1), strict=True)}
    out = product(vectors)
    flat = torch.cat([out[name].reshape(2, -1) for name in names], dim=1)
    torch.testing.assert_close(flat, v @ grads.T @ grads / grads.shape[0])
