"""The Neumann refined solve (``with_refinement(solver="neumann")``, issue 33 ask 1's ASTRA-style
variant): preconditioned Richardson iterations ``x <- x + eta M (g - (H_B + lambda I) x)``.

Checked against explicit float64 matrices: with every batch at every step it converges to
``(H + lambda I)^-1 g`` (the sampled Fisher built by hand, and the expected Fisher of an LM);
a product over some batches is the Fisher of those batches; one stochastic step's mean over
the draws is the full step; the draws depend on the seed and the checkpoint only, so a query's
answer does not depend on the queries solved with it.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import tracinfunc as tif
from tests.curvature.cli_setup import saved_for_cli
from tests.curvature.test_refine_direct import EXACT, IDENTITY, _explicit_solution
from tests.curvature.test_refine_direct import setup as _direct_setup
from tests.curvature.test_refine_expected import (
    LENGTH,
    VOCAB,
    explicit_lm_fisher,
    lm,  # noqa: F401 (a fixture)
    loop_grad,
)
from tracinfunc.curvature import fisher, fit_curvature
from tracinfunc.curvature.refine import neumann_flat
from tracinfunc.curvature.test_grads import MARK
from tracinfunc.errors import InvalidArgumentError

setup = _direct_setup  # the direct solve's fixture: an MLP, 20 training and 4 test examples


def _split(train, size=4):
    """``train`` in batches of ``size`` examples (the draws pick among them)."""
    x, y = train
    return [(x[i:i + size], y[i:i + size]) for i in range(0, x.shape[0], size)]


def _query(loss, ckpts, test, refined, *, record=False):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        queries = tif.preconditioned_test_grads(loss, ckpts, test, refined, projection=IDENTITY)
    return (queries, [str(w.message) for w in caught]) if record else queries


@pytest.mark.parametrize(("examples", "step_size"), [(None, None), (5, None), (None, 0.5)])
def test_every_batch_converges_to_the_explicit_float64_solve(setup, examples, step_size):
    model, loss, ckpts, train, test, fitted = setup
    refined = fitted.with_refinement(train, sampler=EXACT, max_examples=examples, steps=3000,
                                     tolerance=1e-10, solver="neumann", step_size=step_size)
    queries, caught = _query(loss, ckpts, test, refined, record=True)
    n = 20 if examples is None else examples
    expected = _explicit_solution(model, loss, ckpts[0], train[0][:n], test, 0.05)
    torch.testing.assert_close(queries.read_rows(0, 0, 4), expected, rtol=1e-7, atol=1e-8)
    mark = queries.meta.extra[MARK]
    assert mark["solvers"] == ["neumann"] and mark["residuals"][0][-1] <= 1e-10
    assert not caught  # converged: no warning
    plain = tif.preconditioned_test_grads(loss, ckpts, test, fitted, projection=IDENTITY)
    assert not torch.allclose(plain.read_rows(0, 0, 4), expected, rtol=1e-3)


def test_the_chosen_step_converges_where_step_one_diverges(setup):
    """EK-FAC underestimates this Fisher in some direction (``lambda_max(M (H + l I)) > 2``):
    the step ``1`` diverges and says so, naming the way out; the default step converges."""
    _, loss, ckpts, train, test, fitted = setup
    one = fitted.with_refinement(train, sampler=EXACT, steps=40, solver="neumann", step_size=1.0)
    _, caught = _query(loss, ckpts, test, one, record=True)
    assert any("diverged" in m and "smaller step_size" in m for m in caught), caught
    chosen = fitted.with_refinement(train, sampler=EXACT, steps=40, solver="neumann")
    queries = _query(loss, ckpts, test, chosen)
    residuals = queries.meta.extra[MARK]["residuals"][0]
    assert residuals[-1] < 0.1 * residuals[0]
    (key,) = [k for k in chosen.refinement.largest if k[0] == "neumann step"]
    assert 0 < chosen.refinement.largest[key] < 1  # below 1: the fixed step's divergence


def test_product_over_some_batches_is_the_unbiased_estimate(setup):
    """``batches=B`` gives ``(n / |B|) sum_{j in B} w_j g_j g_j^T / sum_all w_j`` (kept G;
    functional), on batches of unequal size: its mean over the draws is ``H``."""
    _, loss, ckpts, train, _, _ = setup
    params = dict(ckpts[0].params)
    names = sorted(params)
    batches = [(train[0][a:b], train[1][a:b]) for a, b in ((0, 3), (3, 10), (10, 11), (11, 20))]
    generator = torch.Generator().manual_seed(0)
    labelled = [EXACT(loss, params, batch, generator) for batch in batches]
    g, w = fisher.sampled_gradients(loss, params, names, labelled)
    starts = (0, *np.cumsum([int(lw.shape[0]) for _, lw in labelled]).tolist())
    shapes = {n: tuple(params[n].shape) for n in names}
    kept = fisher.gradient_product(g, w, shapes, starts)
    functional = fisher.fisher_product(loss, params, names, labelled)
    rows = torch.randn(3, g.shape[1], dtype=torch.float64, generator=generator)
    for chosen in ([1], [0, 3], [0, 1, 2, 3]):
        picked = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in chosen])
        matrix = (g[picked].T * (w[picked] / w.sum())) @ g[picked] * (4 / len(chosen))
        torch.testing.assert_close(kept.flat(rows, chosen), rows @ matrix, rtol=1e-10,
                                   atol=1e-12)
        torch.testing.assert_close(functional.flat(rows, batches=chosen), rows @ matrix,
                                   rtol=1e-9, atol=1e-11)
    full = (g.T * (w / w.sum())) @ g
    for product in (kept.flat, functional.flat):  # one batch drawn uniformly: mean is H
        mean = sum(product(rows, batches=[i]) for i in range(4)) / 4
        torch.testing.assert_close(mean, rows @ full, rtol=1e-9, atol=1e-11)
    with pytest.raises(InvalidArgumentError, match="needs the kept per-example gradients"):
        fisher.gradient_product(g.T @ g, None, shapes).flat(rows, [0])


def test_one_stochastic_step_averages_to_the_full_step(setup):
    """Over every draw of one batch of equal size and weight, a Neumann step's mean is the
    step with the whole Fisher (the iteration is linear in ``H_B``)."""
    _, loss, ckpts, train, _, _ = setup
    params = dict(ckpts[0].params)
    names = sorted(params)
    generator = torch.Generator().manual_seed(1)
    labelled = [EXACT(loss, params, batch, generator) for batch in _split(train, 5)]
    g, w = fisher.sampled_gradients(loss, params, names, labelled)
    starts = tuple(range(0, g.shape[0] + 1, 15))  # 5 examples x 3 classes per batch
    product = fisher.gradient_product(g, w, {n: tuple(params[n].shape) for n in names},
                                      starts).flat
    rhs = torch.randn(2, g.shape[1], dtype=torch.float64, generator=generator)
    precondition = lambda rows: rows / 3.0  # noqa: E731 (any fixed M)
    full, _ = neumann_flat(product, precondition, 0.1, rhs, 1, step_size=0.7)
    draws = [neumann_flat(product, precondition, 0.1, rhs, 1, step_size=0.7,
                          draws=[[b], None])[0] for b in range(4)]
    torch.testing.assert_close(torch.stack(draws).mean(0), full, rtol=1e-12, atol=1e-13)
    assert not torch.allclose(draws[0], full, rtol=1e-3)


def test_draws_depend_on_the_seed_and_checkpoint_only(setup):
    _, loss, ckpts, train, test, fitted = setup
    batches = _split(train)
    refined = fitted.with_refinement(batches, sampler=EXACT, steps=6, solver="neumann",
                                     batches_per_step=2, step_size=0.25)
    together = _query(loss, ckpts, test, refined).read_rows(0, 0, 4)
    alone = torch.cat([_query(loss, ckpts, (test[0][i:i + 1], test[1][i:i + 1]),
                              refined).read_rows(0, 0, 1) for i in range(4)])
    torch.testing.assert_close(alone, together, rtol=1e-10, atol=1e-12)
    again = fitted.with_refinement(batches, sampler=EXACT, steps=6, solver="neumann",
                                   batches_per_step=2, step_size=0.25)
    torch.testing.assert_close(_query(loss, ckpts, test, again).read_rows(0, 0, 4), together,
                               rtol=0, atol=0)
    other = fitted.with_refinement(batches, sampler=EXACT, steps=6, solver="neumann",
                                   batches_per_step=2, step_size=0.25, seed=1)
    assert not torch.allclose(_query(loss, ckpts, test, other).read_rows(0, 0, 4), together,
                              rtol=1e-6)
    draws = refined.refinement.draws(0)
    assert len(draws) == 7 and all(len(d) == 2 and d == sorted(d) for d in draws)
    assert refined.refinement.draws(1) != draws  # another checkpoint, other draws


def test_every_batch_per_step_is_the_deterministic_solver(setup):
    _, loss, ckpts, train, test, fitted = setup
    batches = _split(train)
    common = {"sampler": EXACT, "steps": 8, "solver": "neumann", "step_size": 0.5}
    some = fitted.with_refinement(batches, batches_per_step=len(batches), **common)
    assert some.refinement.draws(0) == [None] * 9
    every = fitted.with_refinement(batches, **common)
    torch.testing.assert_close(_query(loss, ckpts, test, some).read_rows(0, 0, 4),
                               _query(loss, ckpts, test, every).read_rows(0, 0, 4),
                               rtol=1e-12, atol=1e-13)


def test_stochastic_steps_keep_g_where_h_would_be_smaller(setup):
    """p = 43 < 2 x 60 rows: the other solvers keep H [43, 43]; batches drawn need G's rows."""
    _, loss, ckpts, train, test, fitted = setup
    refined = fitted.with_refinement(_split(train), sampler=EXACT, steps=3, solver="neumann",
                                     batches_per_step=3, step_size=0.25)
    _query(loss, ckpts, test, refined)
    (kept,) = [v for v in refined.refinement.gradients.values()]
    assert kept.weights is not None and kept.matrix.shape == (60, 43)
    assert kept.starts == tuple(range(0, 61, 12))


def test_expected_fisher_converges_to_the_explicit_solve(lm):  # noqa: F811
    model, loss, params, batch = lm
    ckpts = [tif.Checkpoint.from_module(model, lr=0.5, name="a")]
    # ten times the default damping: a better-conditioned system, converged in ~170 steps
    fitted = fit_curvature(loss, ckpts, batch, kind="ekfac")
    fitted = fitted.with_damping(10 * fitted.damping[0])
    refined = fitted.with_refinement(batch, steps=400, tolerance=1e-10, fisher="expected",
                                     solver="neumann")
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VOCAB, (3, LENGTH), generator=g)
    test = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    queries = tif.preconditioned_test_grads(loss, ckpts, test, refined, projection=IDENTITY)
    order = [n for n, _ in refined.layout]
    matrix = explicit_lm_fisher(model, params, batch, order)
    rhs = torch.stack([loop_grad(loss, params, {k: v[i] for k, v in test.items()}, order)
                       for i in range(3)])
    eye = torch.eye(matrix.shape[0], dtype=torch.float64)
    want = torch.linalg.solve(matrix + fitted.damping[0] * eye, rhs.T).T
    torch.testing.assert_close(queries.read_rows(0, 0, 3).double(), want, rtol=1e-6,
                               atol=1e-8)
    assert queries.meta.extra["curvature"]["solvers"] == ["neumann"]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"solver": "cg", "step_size": 0.5}, "step_size=0.5 belongs to solver='neumann'"),
    ({"solver": "direct", "batches_per_step": 2}, "batches_per_step=2 belongs to"),
    ({"solver": "neumann", "step_size": 0.0}, "step_size must be None"),
    ({"solver": "neumann", "step_size": 2.5}, "step_size must be None"),
    ({"solver": "neumann", "step_size": float("nan")}, "step_size must be None"),
    ({"solver": "neumann", "step_size": True}, "step_size must be None"),
    ({"solver": "neumann", "batches_per_step": 0}, "batches_per_step"),
    ({"solver": "neumann", "batches_per_step": 1.5}, "batches_per_step"),
    ({"solver": "neumann", "batches_per_step": 6}, "more than the 5 batch"),
])
def test_bad_neumann_arguments_are_refused_with_the_way_out(setup, kwargs, match):
    _, _, _, train, _, fitted = setup
    with pytest.raises(InvalidArgumentError, match=match):
        fitted.with_refinement(_split(train), sampler=EXACT, **kwargs)


def test_neumann_settings_have_their_own_digests(setup):
    _, _, _, train, _, fitted = setup
    batches = _split(train)
    digests = {fitted.with_refinement(batches, sampler=EXACT, **kw).digest for kw in (
        {}, {"solver": "neumann"}, {"solver": "neumann", "step_size": 0.5},
        {"solver": "neumann", "batches_per_step": 2},
        {"solver": "neumann", "batches_per_step": 3})}
    assert len(digests) == 5
    described = fitted.with_refinement(batches, sampler=EXACT).metadata()["refinement"]
    assert "step_size" not in described  # the other solvers' digests stay as they were


def test_cli_neumann_matches_the_api(tmp_path, capsys):

    from tracinfunc.cli import main

    saved = saved_for_cli(tmp_path)
    spec_path, spec, projection, store, curvature = (
        saved.spec_path, saved.spec, saved.projection, saved.store, saved.curvature)
    out = tmp_path / "scores.npy"
    base = ["score", str(tmp_path / "grads.zarr"), "--spec", f"{spec_path}:make",
            "--curvature", str(tmp_path / "curvature.zarr")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        code = main([*base, "--refine-steps", "3", "--refine-solver", "neumann",
                     "--refine-step-size", "0.5", "--output", str(out), "--quiet"])
        assert code == 0
        refined = curvature.with_refinement(spec.train, steps=3, solver="neumann",
                                            step_size=0.5)
        queries = tif.preconditioned_test_grads(spec.loss, spec.checkpoints,
                                                spec.test["test"], refined,
                                                projection=projection)
    assert queries.meta.extra[MARK]["solvers"] == ["neumann"] * len(spec.checkpoints)
    expected = tif.score(store, queries, curvature=refined).numpy()
    np.testing.assert_allclose(np.load(out), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(SystemExit) as exited:  # a usage error, nothing written
        main([*base, "--refine-steps", "3", "--refine-step-size", "0.5",
              "--output", str(tmp_path / "x.npy"), "--quiet"])
    assert exited.value.code == 2
    assert "--refine-step-size belongs to --refine-solver neumann" in capsys.readouterr().err
    assert not (tmp_path / "x.npy").exists()



def test_expected_product_over_some_batches_is_the_unbiased_estimate(lm):  # noqa: F811
    from tracinfunc.curvature.expected import expected_product

    model, loss, params, batch = lm
    names = sorted(params)
    split = ({k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()})
    product = expected_product(loss, params, names, split)
    rows = torch.randn(2, sum(params[n].numel() for n in names), dtype=torch.float64,
                       generator=torch.Generator().manual_seed(2))
    # batches of 2 and 3 inputs: batch b's estimate is 2 x (its inputs' sum) / 5
    for chosen, part in (([0], split[0]), ([1], split[1])):
        size = part["input_ids"].shape[0]
        matrix = explicit_lm_fisher(model, params, part, names) * (2 * size / 5)
        torch.testing.assert_close(product.flat(rows, batches=chosen), rows @ matrix,
                                   rtol=1e-10, atol=1e-12)


def test_expected_fisher_takes_a_seed_for_the_draws_only(lm):  # noqa: F811
    model, loss, _, batch = lm
    ckpts = [tif.Checkpoint.from_module(model, name="a")]
    fitted = fit_curvature(loss, ckpts, batch, kind="ekfac")
    split = [{k: v[i:i + 1] for k, v in batch.items()} for i in range(5)]
    refined = fitted.with_refinement(split, fisher="expected", solver="neumann", seed=3,
                                     batches_per_step=2)
    assert refined.refinement.seed == 3
    with pytest.raises(InvalidArgumentError, match="seed=3"):
        fitted.with_refinement(split, fisher="expected", seed=3)  # cg: nothing drawn
