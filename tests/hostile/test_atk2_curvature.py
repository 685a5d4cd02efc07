"""atk2 outside pass, surface 5: curvature (classes 3, 4, 5).

Failing tests (found by the pass) first; tests marked HELD guard attacks that held."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tracinfunc.errors import (
    IllConditionedError,
    IncompatibleGradientsError,
    InvalidArgumentError,
    TracInFuncError,
)

from ._atk2 import data, model_ckpts

P = tif.Projection(dim=16, seed=0)


def test_fit_curvature_on_empty_data_is_a_clear_error():
    """fit_curvature on a batch of 0 examples: a raw torch RuntimeError ('cannot reshape
    tensor of 0 elements into shape [0, -1]'). Expected: the library's error (e.g.
    EmptyDataError) naming fit_curvature and the empty data."""
    _m, loss, ck = model_ckpts()
    X, Y = data()
    with pytest.raises(TracInFuncError, match="fit_curvature"):
        tif.fit_curvature(loss, ck, (X[:0], Y[:0]), projection=P)


# ---------------------------------------------------------------- HELD (regression guards)


@pytest.fixture(scope="module")
def fitted():
    m, loss, ck = model_ckpts()
    X, Y = data()
    s = tif.to_memory(tif.build_store(loss, ck, (X, Y), projection=P))
    t = tif.build_store(loss, ck, (X[:3], Y[:3]), projection=P)
    c = tif.fit_curvature(loss, ck, (X, Y), projection=P)
    return m, loss, ck, X, Y, s, t, c


@pytest.mark.parametrize("d", [-1.0, float("nan"), float("inf")])
def test_held_bad_damping_is_refused(fitted, d):
    c = fitted[-1]
    with pytest.raises(InvalidArgumentError):
        c.with_damping(d)


@pytest.mark.parametrize("d", [1e30, 1e300])
def test_held_huge_damping_gives_finite_scores(fitted, d):
    *_, s, t, c = fitted
    assert torch.isfinite(tif.score(s, t, curvature=c.with_damping(d))).all()


def test_held_damping_zero_on_rank_deficient_fit_is_kept_and_refused_at_use(fitted, tmp_path):
    _m, loss, ck, X, Y, *_ = fitted
    p2 = tif.Projection(dim=64, seed=0)
    s64 = tif.to_memory(tif.build_store(loss, ck, (X, Y), projection=p2))
    t64 = tif.build_store(loss, ck, (X[:3], Y[:3]), projection=p2)
    tif.save_curvature(tif.fit_curvature(loss, ck, (X[:3], Y[:3]), projection=p2, damping=0.0),
                       tmp_path / "z.zarr")
    c = tif.load_curvature(tmp_path / "z.zarr")
    with pytest.raises(IllConditionedError):
        tif.score(s64, t64, curvature=c)
    assert torch.isfinite(
        tif.score(s64, t64, curvature=c.with_damping(tif.curvature.Damping(scale=1.0)))).all()


def test_held_raw_curvature_with_an_adam_store_is_refused(fitted):
    m, loss, ck, X, Y, _s, t, c = fitted
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(m(X), Y).backward()
        opt.step()
    pre = tif.Preconditioner.from_optimizer(opt, m)
    sa = tif.build_store(loss, ck, (X, Y), projection=P, preconditioners=[pre, pre])
    with pytest.raises(IncompatibleGradientsError, match="adam"):
        tif.score(sa, t, curvature=c)


@pytest.mark.parametrize("other", ["seed", "kind", "select"])
def test_held_curvature_of_another_space_is_refused(fitted, other):
    _m, loss, ck, X, Y, s, t, _c = fitted
    kw = {"seed": dict(projection=tif.Projection(dim=16, seed=1)),
          "kind": dict(projection=tif.Projection(dim=16, seed=0, kind="sjlt")),
          "select": dict(projection=P, options=tif.GradientOptions(select=["2.*"]))}[other]
    with pytest.raises(IncompatibleGradientsError):
        tif.score(s, t, curvature=tif.fit_curvature(loss, ck, (X, Y), **kw))


def test_held_float16_store_and_tests_with_curvature_are_finite(fitted):
    *_, s, t, c = fitted
    s16, t16 = tif.to_memory(s, dtype=torch.float16), tif.to_memory(t, dtype=torch.float16)
    assert torch.isfinite(tif.score(s16, t16, curvature=c)).all()
