"""Session 36 outside attack (black box, docs only) on issue 33's newest curvature surfaces:
``Curvature.with_refinement``, ``Damping`` (``over="rank"`` and its values), selection given
once, and K-FAC's BatchNorm advice. Reference values are explicit float64 matrices built here
from ``torch.func`` gradients, never from the library.

Tests marked ``# HELD`` passed when written (regression guards); the others failed.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import tracinfunc as tif
from tracinfunc.curvature import Damping, classification_sampler
from tracinfunc.errors import (
    IllConditionedError,
    IncompatibleGradientsError,
    InvalidArgumentError,
    TracInFuncError,
)

EXACT = classification_sampler(exact=True)


def _mlp(seed=0, d=5):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 6), nn.Tanh(), nn.Linear(6, 3)).eval()


def _data(n, seed, d=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g)


def _setup(model):
    loss = tif.loss_from_module(model, F.cross_entropy)
    ck = [tif.Checkpoint.from_module(model, lr=0.1, name="c0")]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)
    ck.append(tif.Checkpoint.from_module(model, lr=0.1, name="c1"))
    return loss, ck


@pytest.fixture(scope="module")
def fx():
    m = _mlp()
    loss, ck = _setup(m)
    x, y = _data(40, 0)
    xt, yt = _data(6, 100)
    proj = tif.Projection(kind="identity")
    store = tif.build_store(loss, ck, (x, y), projection=proj)
    return dict(m=m, loss=loss, ck=ck, x=x, y=y, xt=xt, yt=yt, proj=proj, store=store)


def _order(m):
    return sorted(n for n, _ in m.named_parameters())  # the identity projection's order


def _flat_grads(m, params, x, y):
    def f(p, xi, yi):
        return F.cross_entropy(functional_call(m, p, (xi[None],)), yi[None])

    g = vmap(grad(f), in_dims=(None, 0, 0))(dict(params), x, y)
    return torch.cat([g[n].reshape(len(x), -1) for n in _order(m)], 1).double()


def _exact_fisher(m, params, x):
    with torch.no_grad():
        p = torch.softmax(functional_call(m, dict(params), (x,)), -1).double()
    total = 0
    for c in range(p.shape[1]):
        g = _flat_grads(m, params, x, torch.full((len(x),), c))
        total = total + (g * p[:, c : c + 1]).T @ g
    return total / len(x)


def _explicit(fx, ckpt, lam, x=None):
    """(F + lam I)^-1 g_test in float64, F the exact Fisher of ``x`` at checkpoint ``ckpt``."""
    m, params = fx["m"], fx["ck"][ckpt].params
    fm = _exact_fisher(m, params, fx["x"] if x is None else x)
    g = _flat_grads(m, params, fx["xt"], fx["yt"])
    return torch.linalg.solve(fm + lam * torch.eye(len(fm), dtype=torch.float64), g.T).T


def _queries(fx, curvature, **kw):
    return tif.preconditioned_test_grads(
        fx["loss"], fx["ck"], (fx["xt"], fx["yt"]), curvature, projection=fx["proj"], **kw
    )


def _rel(got, want):
    got = torch.as_tensor(np.asarray(got)).double()
    return float((got - want).norm() / want.norm())


def _kfac(fx, kind="kfac", damping=0.05, **kw):
    return tif.fit_curvature(
        fx["loss"], fx["ck"], (fx["x"], fx["y"]), kind=kind, sampler=EXACT, damping=damping, **kw
    )


# ---------------------------------------------------------------- refinement reaches every kind


def test_dense_curvature_refinement_runs_and_solves(fx):
    """A1: docs: refinement refuses only "projected"; a "dense" curvature refined must give
    (F + lambda I)^-1 g (it is already exact, so the residual starts near 0)."""
    c = _kfac(fx, kind="dense")
    refined = c.with_refinement((fx["x"], fx["y"]), steps=3, sampler=EXACT)
    q = _queries(fx, refined)
    for i in range(2):
        assert _rel(q.read_rows(i, 0, 6), _explicit(fx, i, 0.05)) < 1e-5


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_refinement_converges_to_explicit_solve(fx, kind):  # HELD
    """A2: 60 steps reach (F + lambda I)^-1 g of the refinement data's exact Fisher (a
    tolerance that does not stop them first)."""
    refined = _kfac(fx, kind).with_refinement((fx["x"], fx["y"]), steps=60, sampler=EXACT,
                                              tolerance=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        q = _queries(fx, refined)
    for i in range(2):
        assert _rel(q.read_rows(i, 0, 6), _explicit(fx, i, 0.05)) < 1e-4


def test_refinement_past_exact_convergence_stays_finite(fx):
    """A3: CG on a p = 57 system converges exactly within 57 steps; 100 steps must not divide
    0 by 0 (NaN queries) but keep the answer (a tolerance no residual reaches: all 100 run)."""
    refined = _kfac(fx).with_refinement((fx["x"], fx["y"]), steps=100, sampler=EXACT,
                                        tolerance=1e-300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        q = _queries(fx, refined)
    for i in range(2):
        rows = np.asarray(q.read_rows(i, 0, 6))
        assert np.isfinite(rows).all()
        assert _rel(rows, _explicit(fx, i, 0.05)) < 1e-4
    res = q.meta.extra["curvature"]["residuals"]
    assert all(math.isfinite(r) for per in res for r in per)


# ---------------------------------------------------------------- refinement arguments


@pytest.mark.parametrize("steps", [0, -1, 2.5, "5", True, None])
def test_bad_steps_refused(fx, steps):  # HELD for 0, -1
    with pytest.raises((InvalidArgumentError, TypeError, TracInFuncError)) as err:
        _kfac(fx).with_refinement((fx["x"], fx["y"]), steps=steps)
    assert "steps" in str(err.value)


def test_numpy_and_torch_integer_steps_accepted(fx):
    c = _kfac(fx)
    a = _queries(fx, c.with_refinement((fx["x"], fx["y"]), steps=3, sampler=EXACT))
    for steps in (np.int64(3), torch.tensor(3)):
        b = _queries(fx, c.with_refinement((fx["x"], fx["y"]), steps=steps, sampler=EXACT))
        np.testing.assert_array_equal(a.read_rows(1, 0, 6), b.read_rows(1, 0, 6))


@pytest.mark.parametrize("tolerance", [float("nan"), -1.0, float("inf")])
def test_bad_tolerance_refused(fx, tolerance):
    with pytest.raises((InvalidArgumentError, TracInFuncError)) as err:
        _kfac(fx).with_refinement((fx["x"], fx["y"]), tolerance=tolerance)
    assert "tolerance" in str(err.value)


@pytest.mark.parametrize("max_examples", [0, -1, 2.5])
def test_bad_max_examples_refused(fx, max_examples):
    with pytest.raises((InvalidArgumentError, TracInFuncError)) as err:
        _kfac(fx).with_refinement((fx["x"], fx["y"]), max_examples=max_examples)
    assert "max_examples" in str(err.value)


def test_empty_refinement_data_refused(fx):  # HELD ([] and iter([]))
    for data in ([], iter([])):
        with pytest.raises(TracInFuncError):
            _kfac(fx).with_refinement(data)


def test_refinement_data_of_another_shape_is_a_clear_error(fx):
    """Another model's data (4 features for a 5-feature model): a library error naming the
    data, at with_refinement or at the query, never torch's raw RuntimeError."""
    x4, y4 = _data(40, 1, d=4)
    with pytest.raises(TracInFuncError):
        refined = _kfac(fx).with_refinement((x4, y4), steps=2)
        _queries(fx, refined)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_refinement_data_named(fx, bad):
    x = fx["x"].clone()
    x[7, 2] = bad
    with pytest.raises(TracInFuncError) as err:
        refined = _kfac(fx).with_refinement((x, fx["y"]), steps=2)
        _queries(fx, refined)
    assert "7" in str(err.value)


def test_projected_curvature_refinement_refused(fx):  # HELD
    proj = tif.Projection(dim=16, seed=0)
    c = tif.fit_curvature(fx["loss"], fx["ck"], (fx["x"], fx["y"]), projection=proj)
    with pytest.raises(InvalidArgumentError, match="projected"):
        c.with_refinement((fx["x"], fx["y"]))


@pytest.mark.parametrize("lam", [0.0, 1e-45, 1e30])
def test_refinement_refuses_zero_tiny_huge_damping(fx, lam):  # HELD
    with pytest.raises(IllConditionedError):
        _kfac(fx, damping=lam).with_refinement((fx["x"], fx["y"]), steps=2)


def test_non_convergence_reported(fx):  # HELD
    refined = _kfac(fx).with_refinement((fx["x"], fx["y"]), steps=1, tolerance=1e-12)
    with pytest.warns(RuntimeWarning, match="residual"):
        q = _queries(fx, refined)
    res = q.meta.extra["curvature"]["residuals"]
    assert len(res) == 2 and all(len(r) == 2 for r in res)


def test_refinement_is_reproducible(fx):  # HELD
    c = _kfac(fx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        a = _queries(fx, c.with_refinement((fx["x"], fx["y"]), steps=3))
        b = _queries(fx, c.with_refinement((fx["x"], fx["y"]), steps=3))
    np.testing.assert_array_equal(a.read_rows(1, 0, 6), b.read_rows(1, 0, 6))


# ---------------------------------------------------------------- refined curvature as a value


def test_refined_and_plain_queries_never_mix(fx):  # HELD
    c = _kfac(fx)
    refined = c.with_refinement((fx["x"], fx["y"]), steps=2, sampler=EXACT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rq = _queries(fx, refined)
    pq = _queries(fx, c)
    with pytest.raises(IncompatibleGradientsError):
        tif.score(fx["store"], pq, curvature=refined)
    with pytest.raises(IncompatibleGradientsError):
        tif.score(fx["store"], rq, curvature=c)
    assert refined.without_refinement().digest == c.digest


def test_with_damping_keeps_refinement(fx):
    """A re-damped refined curvature is still refined (same data, steps), or with_damping says
    it drops it: silently returning plain queries under a refined curvature's name is wrong."""
    refined = _kfac(fx).with_refinement((fx["x"], fx["y"]), steps=4, sampler=EXACT)
    redamped = refined.with_damping(0.08)
    assert redamped.refinement is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        q = _queries(fx, redamped)
    assert "residuals" in q.meta.extra["curvature"]


def test_save_refined_refused_and_nothing_written(fx, tmp_path):  # HELD
    refined = _kfac(fx).with_refinement((fx["x"], fx["y"]), steps=2)
    path = tmp_path / "c.zarr"
    with pytest.raises(TracInFuncError, match="without_refinement"):
        tif.save_curvature(refined, str(path))
    assert not path.exists()


def test_top_k_and_score_agree_with_refinement(fx):  # HELD
    refined = _kfac(fx).with_refinement((fx["x"], fx["y"]), steps=3, sampler=EXACT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        q = _queries(fx, refined)
    s = np.asarray(tif.score(fx["store"], q, curvature=refined))
    v, _ = tif.top_k(fx["store"], q, 5, curvature=refined)
    np.testing.assert_allclose(np.asarray(v), np.sort(s, 1)[:, ::-1][:, :5], rtol=1e-5)


def test_self_influence_with_refined_kfac_refused_clearly(fx):  # HELD
    refined = _kfac(fx).with_refinement((fx["x"], fx["y"]), steps=2)
    with pytest.raises(TracInFuncError, match="projected"):
        tif.self_influence(fx["store"], curvature=refined)


def test_refined_curvature_other_checkpoints_refused(fx):  # HELD
    refined = _kfac(fx).with_refinement((fx["x"], fx["y"]), steps=2)
    other = _mlp(seed=3)
    loss, ck = _setup(other)
    with pytest.raises(IncompatibleGradientsError):
        tif.preconditioned_test_grads(
            loss, ck, (fx["xt"], fx["yt"]), refined, projection=fx["proj"]
        )


# ---------------------------------------------------------------- damping values


def _fit(fx, damping, kind="kfac", sampler=EXACT):
    return tif.fit_curvature(
        fx["loss"], fx["ck"], (fx["x"], fx["y"]), kind=kind, sampler=sampler, damping=damping
    )


@pytest.mark.parametrize("lam", [float("nan"), float("inf"), -1.0, -0.0 - 1e-300])
def test_non_finite_or_negative_damping_refused_everywhere(fx, lam):  # HELD
    with pytest.raises(InvalidArgumentError):
        _fit(fx, lam)
    with pytest.raises(InvalidArgumentError):
        _fit(fx, 0.05).with_damping(lam)
    with pytest.raises(InvalidArgumentError):
        Damping(scale=lam)


@pytest.mark.parametrize("scale", [0.0])
def test_zero_scale_damping_refused(fx, scale):
    """Damping.scale: "a positive finite float"."""
    with pytest.raises(InvalidArgumentError):
        Damping(scale=scale)


@pytest.mark.parametrize("lam", [0.0, 1e-45])
def test_zero_or_denormal_damping_refused_at_first_use(fx, lam):  # HELD
    c = _fit(fx, lam, kind="dense")
    with pytest.raises(IllConditionedError):
        _queries(fx, c)


def test_huge_damping_scores_finite_near_zero(fx):  # HELD
    for damping in (1e30, 1e300):
        c = _fit(fx, damping, kind="dense")
        q = _queries(fx, c)
        s = np.asarray(tif.score(fx["store"], q, curvature=c))
        assert np.isfinite(s).all() and np.abs(s).max() < 1e-20


def test_damping_scale_overflow_refused_or_finite(fx):
    """ "a Damping whose lambda overflows is refused": scale 1e308 x mean eigenvalue."""
    try:
        c = _fit(fx, Damping(scale=1e308), kind="dense")
        q = _queries(fx, c)
    except InvalidArgumentError:
        return
    assert np.isfinite(np.asarray(tif.score(fx["store"], q, curvature=c))).all()


@pytest.mark.parametrize(
    "make",
    [
        np.float64,
        np.float32,
        lambda v: torch.tensor(v),
        lambda v: torch.tensor(v, dtype=torch.float64),
    ],
)
def test_framework_scalar_damping_equals_float(fx, make):
    want = np.asarray(_queries(fx, _fit(fx, 0.05, kind="dense")).read_rows(0, 0, 6))
    got = np.asarray(_queries(fx, _fit(fx, make(0.05), kind="dense")).read_rows(0, 0, 6))
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("bad", [True, "0.1", [0.1], torch.tensor([0.1, 0.2]), None.__class__])
def test_wrong_type_damping_refused(fx, bad):
    with pytest.raises(TracInFuncError) as err:
        _fit(fx, bad, kind="dense").with_damping(bad)
    assert "damping" in str(err.value).lower()


@pytest.mark.parametrize("over", ["bogus", "Rank", "", None])
def test_bad_over_refused(over):
    with pytest.raises(TracInFuncError):
        Damping(scale=1.0, over=over)


def test_numpy_scalar_damping_scale(fx):
    a = _fit(fx, Damping(scale=3.0), kind="dense")
    b = _fit(fx, Damping(scale=np.float32(3.0)), kind="dense")
    np.testing.assert_allclose(
        np.asarray(_queries(fx, a).read_rows(0, 0, 6)),
        np.asarray(_queries(fx, b).read_rows(0, 0, 6)),
        rtol=1e-5,
    )


# ---------------------------------------------------------------- one meaning of damping


@pytest.mark.parametrize("damping", [0.05, Damping(scale=3.0), Damping(scale=3.0, over="rank")])
def test_dense_damping_is_explicit_solve(fx, damping):  # HELD
    c = _fit(fx, damping, kind="dense")
    q = _queries(fx, c)
    for i in range(2):
        fm = _exact_fisher(fx["m"], fx["ck"][i].params, fx["x"])
        ev = torch.linalg.eigvalsh(fm)
        if isinstance(damping, float):
            lam = damping
        elif damping.over == "rank":
            lam = 3.0 * float(ev.sum()) / int((ev > 1e-10 * ev.max()).sum())
        else:
            lam = 3.0 * float(ev.sum()) / len(ev)
        assert _rel(q.read_rows(i, 0, 6), _explicit(fx, i, lam)) < 1e-5


@pytest.fixture(scope="module")
def one_example():
    """Logistic regression on ONE input with the exact sampler: its Fisher is exactly S (x) A
    (A = x x^T rank one), so "kfac", "ekfac" and "dense" all estimate the same H and every
    damping must give the same (H + lambda I)^-1 g."""
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(5, 3)).eval()
    loss, ck = _setup(m)
    x, y = _data(1, 5)
    xt, yt = _data(4, 6)
    proj = tif.Projection(kind="identity")
    return dict(m=m, loss=loss, ck=ck, x=x, y=y, xt=xt, yt=yt, proj=proj)


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
@pytest.mark.parametrize("damping", [0.05, Damping(scale=1.0), Damping(scale=1.0, over="rank")])
def test_kronecker_kinds_damping_meaning_matches_dense(one_example, kind, damping):
    fx = one_example
    ref = _queries(fx, _fit(fx, damping, kind="dense"))
    got = _queries(fx, _fit(fx, damping, kind=kind))
    for i in range(2):
        want = torch.as_tensor(np.asarray(ref.read_rows(i, 0, 4))).double()
        assert _rel(got.read_rows(i, 0, 4), want) < 1e-4


# ---------------------------------------------------------------- selection given once, BatchNorm


def _bn_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).eval()
    return m, tif.loss_from_module(m, F.cross_entropy)


def test_kfac_batchnorm_advice_closes_the_loop():  # HELD
    """Following the error's own select= advice, build + fit + refine + score all run."""
    m, loss = _bn_model()
    ck = [tif.Checkpoint.from_module(m, lr=0.1, name="c0")]
    x, y = _data(40, 0)
    xt, yt = _data(6, 100)
    with pytest.raises(InvalidArgumentError) as err:
        tif.fit_curvature(loss, ck, (x, y), kind="kfac")
    msg = str(err.value)
    assert "BatchNorm1d" in msg and "select=" in msg
    advised = eval(
        msg.split("options=")[1].split(" (")[0], {"GradientOptions": tif.GradientOptions}
    )
    proj = tif.Projection(kind="identity")
    store = tif.build_store(loss, ck, (x, y), projection=proj, options=advised)
    c = tif.fit_curvature(loss, ck, (x, y), kind="kfac", options=advised)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        r = c.with_refinement((x, y), steps=2)
        q = tif.preconditioned_test_grads(loss, ck, (xt, yt), r, projection=proj)
    assert tif.score(store, q, curvature=r).shape == (6, 40)


def test_kfac_advice_never_suggests_an_empty_selection():
    """A selection of only BatchNorm parameters: the advice must not be select=[] (itself
    refused: "selects no parameters"), a fix that loops back to another error."""
    m, loss = _bn_model()
    ck = [tif.Checkpoint.from_module(m, lr=0.1, name="c0")]
    x, y = _data(40, 0)
    with pytest.raises(InvalidArgumentError) as err:
        tif.fit_curvature(loss, ck, (x, y), kind="kfac", options=tif.GradientOptions(select=["1"]))
    assert "select=[]" not in str(err.value)


def test_kfac_error_names_every_unsupported_parameter():
    """ "refused by name": both of BatchNorm's parameters, not only the first."""
    m, loss = _bn_model()
    ck = [tif.Checkpoint.from_module(m, lr=0.1, name="c0")]
    x, y = _data(40, 0)
    with pytest.raises(InvalidArgumentError) as err:
        tif.fit_curvature(loss, ck, (x, y), kind="kfac")
    assert "'1.weight'" in str(err.value) and "'1.bias'" in str(err.value)


def test_selection_given_once_and_other_selection_refused(fx):  # HELD
    sel = tif.GradientOptions(select=["2"])
    store = tif.build_store(
        fx["loss"], fx["ck"], (fx["x"], fx["y"]), projection=fx["proj"], options=sel
    )
    c = tif.fit_curvature(fx["loss"], fx["ck"], (fx["x"], fx["y"]), kind="kfac", options=sel)
    q = _queries(fx, c)
    q_same = _queries(fx, c, options=tif.GradientOptions(select=["2.weight", "2.bias"]))
    np.testing.assert_array_equal(q.read_rows(0, 0, 6), q_same.read_rows(0, 0, 6))
    assert tif.score(store, q, curvature=c).shape == (6, 40)
    with pytest.raises(IncompatibleGradientsError):
        _queries(fx, c, options=tif.GradientOptions(select=["0"]))


# ---------------------------------------------------------------- other paths


def test_indexed_top_k_with_refinement_equals_top_k(fx):  # HELD
    pytest.importorskip("faiss")
    c = _kfac(fx)
    refined = c.with_refinement((fx["x"], fx["y"]), steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        q = _queries(fx, refined)
    index = tif.build_index(fx["store"], kind="ivf_flat", nlist=2)
    _, i = tif.indexed_top_k(fx["store"], q, 5, index=index, curvature=refined, nprobe=2)
    _, i2 = tif.top_k(fx["store"], q, 5, curvature=refined)
    np.testing.assert_array_equal(np.asarray(i), np.asarray(i2))
    with pytest.raises(IncompatibleGradientsError):
        tif.indexed_top_k(fx["store"], q, 5, index=index, curvature=c, nprobe=2)


def test_cli_score_curvature_reaches_refined_queries(fx, tmp_path):
    """Docs: "the CLI's `score --curvature` (through the marked test gradients)" gets the
    refinement. A refined curvature cannot be saved, so the CLI is given the saved plain one
    and the saved refined queries: it must score them (the refined scores), or refuse with a
    fix the user can follow; it refuses with "pass the curvature they were made with", which
    cannot be saved."""
    import subprocess
    import sys

    c = _kfac(fx, damping=Damping())
    refined = c.with_refinement((fx["x"], fx["y"]), steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        q = _queries(fx, refined)
    want = np.asarray(tif.score(fx["store"], q, curvature=refined))
    tif.save_store(fx["store"], str(tmp_path / "grads.zarr"))
    tif.save_store(q, str(tmp_path / "test.zarr"))
    tif.save_curvature(c, str(tmp_path / "c.zarr"))
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "tracinfunc",
            "score",
            "grads.zarr",
            "--test-store",
            "test.zarr",
            "--curvature",
            "c.zarr",
            "--output",
            "s.npy",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    if cli.returncode == 0:
        np.testing.assert_allclose(np.load(tmp_path / "s.npy"), want, rtol=1e-5)
    else:
        assert "refine" in cli.stderr, cli.stderr


def test_refined_digest_differs_after_plain_digest_was_read(fx):
    """The refined curvature "has its own digest, so refined and plain queries are never
    mixed". Reading ``c.digest`` first (save_curvature, load_curvature, any score does) must not
    make ``c.with_refinement(...)`` carry the plain digest: then plain queries are scored
    silently as refined ones and a refined test store passes as plain."""
    c = _kfac(fx)
    plain_digest = c.digest
    refined = c.with_refinement((fx["x"], fx["y"]), steps=3)
    assert refined.digest != plain_digest
    pq = _queries(fx, c)
    with pytest.raises(IncompatibleGradientsError):
        tif.score(fx["store"], pq, curvature=refined)


def test_loaded_curvature_refined_has_own_digest(fx, tmp_path):
    c = _kfac(fx)
    tif.save_curvature(c, str(tmp_path / "c.zarr"))
    loaded = tif.load_curvature(str(tmp_path / "c.zarr"))
    refined = loaded.with_refinement((fx["x"], fx["y"]), steps=3)
    assert refined.digest != loaded.digest


def test_zero_row_tensor_refinement_data_refused(fx):
    """A batch of 0 rows is "no examples in data" (EmptyDataError, as for [] or iter([])),
    at with_refinement, not torch's reshape RuntimeError at the query."""
    with pytest.raises(TracInFuncError):
        refined = _kfac(fx).with_refinement((fx["x"][:0], fx["y"][:0]), steps=2)
        _queries(fx, refined)


def test_jax_queries_refuse_refined_curvature():  # HELD
    pytest.importorskip("flax")
    import flax.linen as fnn
    import jax
    import jax.numpy as jnp
    import optax

    import tracinfunc.jax as tj

    class MLP(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            return fnn.Dense(3)(jnp.tanh(fnn.Dense(6)(x)))

    model = MLP()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype(np.float32)
    y = rng.integers(0, 3, 40)
    v0 = model.init(jax.random.PRNGKey(0), x[:1])

    def logits(v, xi):
        return model.apply(v, xi[None])[0]

    def loss(v, ex):
        return optax.softmax_cross_entropy_with_integer_labels(logits(v, ex[0]), ex[1])

    mapping = tj.ParamMapping.flax(v0)
    ck = [tj.Checkpoint(v0, lr=0.1, name="c0")]
    c = tj.fit_curvature(
        loss, ck, (x, y), kind="kfac", mapping=mapping, sampler=tj.classification_sampler(logits)
    )
    refined = c.with_refinement((torch.as_tensor(x), torch.as_tensor(y)), steps=2)
    with pytest.raises(InvalidArgumentError, match="without_refinement"):
        tj.preconditioned_test_grads(
            loss,
            ck,
            (x[:4], y[:4]),
            refined,
            projection=tif.Projection(dim=16, seed=0),
            mapping=mapping,
        )


def test_numpy_refinement_data_error_names_with_refinement(fx):
    """Refinement data as NumPy arrays: refused, and the error names with_refinement (not
    build_store, which the user never called)."""
    with pytest.raises(TracInFuncError) as err:
        _kfac(fx).with_refinement((fx["x"].numpy(), fx["y"].numpy()), steps=2)
    assert "with_refinement" in str(err.value)


def test_nan_test_example_blamed_on_the_test_data_not_the_refinement(fx):
    """A NaN in test example 3 with a refined curvature: named as test example 3 (as the plain
    path names it), not "the refinement data is not finite ... refine with other data"."""
    xt = fx["xt"].clone()
    xt[3, 1] = float("nan")
    refined = _kfac(fx).with_refinement((fx["x"], fx["y"]), steps=2)
    with pytest.raises(TracInFuncError) as err:
        tif.preconditioned_test_grads(
            fx["loss"], fx["ck"], (xt, fx["yt"]), refined, projection=fx["proj"]
        )
    msg = str(err.value)
    assert "3" in msg and "refine with other data" not in msg


def test_projected_rank_damping_is_explicit_solve(fx):  # k = 64 > p = 57: rank-deficient
    """Damping(over="rank") for "projected": lambda = scale * tr(F_P) / rank(F_P), score =
    sum_c lr_c (F_P + lambda I)^-1 P g_test . P g_train, against explicit float64 matrices."""
    proj = tif.Projection(dim=64, seed=0)
    store = tif.build_store(fx["loss"], fx["ck"], (fx["x"], fx["y"]), projection=proj)
    tests = tif.build_store(fx["loss"], fx["ck"], (fx["xt"], fx["yt"]), projection=proj)
    c = tif.fit_curvature(
        fx["loss"],
        fx["ck"],
        (fx["x"], fx["y"]),
        kind="projected",
        projection=proj,
        sampler=EXACT,
        damping=Damping(2.0, over="rank"),
    )
    got = np.asarray(tif.score(store, tests, curvature=c)).astype(np.float64)
    want = 0
    pg = tif.projected_grads(fx["loss"], proj)
    for i, ck in enumerate(fx["ck"]):
        params = dict(ck.params)
        with torch.no_grad():
            prob = torch.softmax(functional_call(fx["m"], params, (fx["x"],)), -1).double()
        fp = 0
        for cls in range(3):
            rows = pg(params, (fx["x"], torch.full((40,), cls))).double()
            fp = fp + (rows * prob[:, cls : cls + 1]).T @ rows
        fp = fp / 40
        ev = torch.linalg.eigvalsh(fp)
        lam = 2.0 * float(ev.sum()) / int((ev > 1e-10 * ev.max()).sum())
        t = torch.as_tensor(np.asarray(tests.read_rows(i, 0, 6))).double()
        tr = torch.as_tensor(np.asarray(store.read_rows(i, 0, 40))).double()
        want = (
            want
            + 0.1 * torch.linalg.solve(fp + lam * torch.eye(64, dtype=torch.float64), t.T).T @ tr.T
        )
    assert float(np.abs(got - want.numpy()).max() / np.abs(want.numpy()).max()) < 1e-4


@pytest.mark.parametrize("kw", [dict(seed=2.5), dict(seed="a"), dict(sampler="exact")])
def test_bad_seed_or_sampler_refused_at_with_refinement(fx, kw):
    """Wrong types are refused by with_refinement, naming the argument; today they pass and
    surface at the query as torch's "manual_seed expected a long" or "'str' object is not
    callable"."""
    with pytest.raises(TracInFuncError) as err:
        _kfac(fx).with_refinement((fx["x"], fx["y"]), steps=2, **kw)
    assert next(iter(kw)) in str(err.value)


def test_refined_queries_from_threads_equal_serial(fx):
    """Plain curvature queries from a thread pool equal the serial ones; refined ones raise
    torch's "Trying to access a forward AD level with an invalid index" (forward-mode AD
    levels are process-global: a lock around the jvp, or a clear error, is expected)."""
    from concurrent.futures import ThreadPoolExecutor

    refined = _kfac(fx, "ekfac").with_refinement((fx["x"], fx["y"]), steps=4)

    def make(_):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.asarray(_queries(fx, refined).read_rows(1, 0, 6))

    serial = make(0)
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(make, range(6)))
    for out in outs:
        np.testing.assert_array_equal(out, serial)


def test_refined_answer_independent_of_query_batching(fx):  # HELD
    """CG runs per query (its own step sizes), so splitting the test data changes nothing."""
    refined = _kfac(fx, "ekfac").with_refinement((fx["x"], fx["y"]), steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        one = np.asarray(_queries(fx, refined).read_rows(1, 0, 6))
        two = tif.preconditioned_test_grads(
            fx["loss"],
            fx["ck"],
            [(fx["xt"][:3], fx["yt"][:3]), (fx["xt"][3:], fx["yt"][3:])],
            refined,
            projection=fx["proj"],
        )
    np.testing.assert_allclose(np.asarray(two.read_rows(1, 0, 6)), one, rtol=1e-5, atol=1e-5)


def test_refinement_tiny_damping_advice_passes(fx):
    """with_refinement's advice "use with_damping(X) or more" must itself pass: today X is
    printed rounded to 2 digits (8.2e-08) and with_damping(X) is refused (needs 8.3e-08)."""
    import re

    c = _fit(fx, 1e-9)
    with pytest.raises(IllConditionedError) as err:
        c.with_refinement((fx["x"], fx["y"]), steps=2)
    advised = float(re.search(r"with_damping\(([^)]+)\) or more", str(err.value)).group(1))
    refined = c.with_damping(advised).with_refinement((fx["x"], fx["y"]), steps=2)
    # The query checks the sampled Fisher itself (atk40: its largest eigenvalue can be above
    # the fitted estimate's, which with_refinement judges); its advice, for every checkpoint,
    # must pass in turn.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            _queries(fx, refined)
        except IllConditionedError as error:
            assert "sampled Fisher" in str(error)
            again = float(re.search(r"with_damping\(([^)]+)\) or more", str(error)).group(1))
            _queries(fx, refined.with_damping(again))


def test_refinement_huge_damping_advice_passes(fx):
    """ "Lower the damping (at most X)": with_damping(X) must then refine; today X (5.8e+06)
    is refused with the same message naming X as the bound."""
    import re

    c = _fit(fx, 1e12)
    with pytest.raises(IllConditionedError) as err:
        c.with_refinement((fx["x"], fx["y"]), steps=2)
    advised = float(re.search(r"at most ([0-9.e+-]+)\)", str(err.value)).group(1))
    c.with_damping(advised).with_refinement((fx["x"], fx["y"]), steps=2)
