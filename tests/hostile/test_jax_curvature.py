"""Hostile pass atk3 (JAX frontend, curvature; HOSTILE.md classes 4, 5). Black box, from
docs/jax.md and docs/curvature.md only.

FAILING now (findings):
- test_fit_curvature_nan_example_named_by_index: tj.fit_curvature on data with a NaN input
  raises torch's raw "probability tensor contains either inf, nan or element < 0"; the torch
  twin (and docs/curvature.md) refuse it by example index and checkpoint.
- test_fit_curvature_empty_data_refused[projected|dense]: empty data gives a NaN curvature
  ("projected", refused only at first use) or a raw reshape RuntimeError ("dense"); build_store
  refuses empty data with EmptyDataError.
- test_preconditioned_test_grads_inf_example_refused: an inf test input gives NaN rows and a
  NaN row of scores, silently (tj.build_store refuses the same example by index).
HELD (guards): "projected" and "dense" equal the torch twin's fit, kfac/ekfac refused from JAX
with the fix, a torch K-FAC used from JAX equals torch's test gradients, a curvature fitted
with another mapping or projection is refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

import tracinfunc as tif  # noqa: E402
import tracinfunc.jax as tj  # noqa: E402
from tracinfunc.curvature.samplers import classification_sampler as torch_sampler  # noqa: E402
from tracinfunc.errors import EmptyDataError, NonFiniteGradientError, TracInFuncError  # noqa: E402


def _data(n=40, seed=0):
    r = np.random.default_rng(seed)
    return r.normal(size=(n, 4)).astype(np.float32), r.integers(0, 3, n).astype(np.int32)


def _params(scale=1.0):
    r = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(r.normal(size=s).astype(np.float32) * 0.5 * scale)  # noqa: E731
    return {"params": {"layers_0": {"kernel": w(4, 5), "bias": w(5)},
                       "layers_2": {"kernel": w(5, 3), "bias": w(3)}}}


def _logits(v, x):
    p = v["params"]
    h = jax.nn.relu(x @ p["layers_0"]["kernel"] + p["layers_0"]["bias"])
    return h @ p["layers_2"]["kernel"] + p["layers_2"]["bias"]


def _loss(v, example):
    x, y = example
    return optax.softmax_cross_entropy_with_integer_labels(_logits(v, x), y)


@pytest.fixture(scope="module")
def setup():
    ckpts = [tj.Checkpoint(_params(), lr=0.1, name="a"), tj.Checkpoint(_params(0.7), lr=0.2, name="b")]
    mapping = tj.ParamMapping.flax(ckpts[0].params)
    twin = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).eval()
    return ckpts, mapping, tif.loss_from_module(twin, F.cross_entropy), [c.to_torch(mapping) for c in ckpts]


def _t(x, y):
    return torch.from_numpy(x), torch.from_numpy(y).long()


P = tif.Projection(dim=8, seed=0)


def test_fit_curvature_nan_example_named_by_index(setup):
    ckpts, mapping, _, _ = setup
    x, y = _data()
    x[7, 0] = np.nan
    with pytest.raises(NonFiniteGradientError, match="7"):
        tj.fit_curvature(_loss, ckpts, (x, y), kind="projected", projection=P, mapping=mapping,
                         sampler=tj.classification_sampler(_logits))


@pytest.mark.parametrize("kind", ["projected", "dense"])
def test_fit_curvature_empty_data_refused(setup, kind):
    ckpts, mapping, _, _ = setup
    x, y = _data()
    with pytest.raises(EmptyDataError):
        tj.fit_curvature(_loss, ckpts, (x[:0], y[:0]), kind=kind, projection=P, mapping=mapping,
                         sampler=tj.classification_sampler(_logits))


def test_preconditioned_test_grads_inf_example_refused(setup):
    """FAILS now: row 2 is NaN and so is row 2 of the scores."""
    ckpts, mapping, tl, tck = setup
    x, y = _data()
    curvature = tif.fit_curvature(tl, tck, _t(x, y), kind="kfac")
    xt, yt = _data(6, seed=3)
    xt[2, 1] = np.inf
    try:
        q = tj.preconditioned_test_grads(_loss, ckpts, (xt, yt), curvature, projection=P,
                                         mapping=mapping)
    except NonFiniteGradientError as err:
        assert "2" in str(err)
        return
    rows = torch.stack([q.read_rows(c, 0, 6) for c in range(2)])
    assert torch.isfinite(rows).all(), "an inf test example gave NaN preconditioned rows silently"


# ---- HELD (regression guards) ----

@pytest.mark.parametrize("kind", ["projected", "dense"])
def test_held_jax_fit_equals_torch_twin(setup, kind):
    ckpts, mapping, tl, tck = setup
    x, y = _data()
    xt, yt = _data(6, seed=3)
    store = tj.build_store(_loss, ckpts, (x, y), projection=P, mapping=mapping)
    jc = tj.fit_curvature(_loss, ckpts, (x, y), kind=kind, projection=P, mapping=mapping,
                          sampler=tj.classification_sampler(_logits, exact=True))
    tc = tif.fit_curvature(tl, tck, _t(x, y), kind=kind, projection=P,
                           sampler=torch_sampler(exact=True))
    if kind == "projected":
        got = tif.score(store, tj.build_store(_loss, ckpts, (xt, yt), projection=P, mapping=mapping),
                        curvature=jc)
        want = tif.score(store, tif.build_store(tl, tck, _t(xt, yt), projection=P), curvature=tc)
    else:
        got = tif.score(store, tj.preconditioned_test_grads(_loss, ckpts, (xt, yt), jc, projection=P,
                                                            mapping=mapping), curvature=jc)
        want = tif.score(store, tif.preconditioned_test_grads(tl, tck, _t(xt, yt), tc, projection=P),
                         curvature=tc)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_held_kfac_from_a_loss_without_flax_layers_is_refused_with_fix(setup, kind):
    """K-FAC and EK-FAC now fit from JAX for Flax Dense/Embed layers (tests/jax/
    test_jax_kfac.py checks them against the torch twin); this loss is hand-written matrix
    products, which K-FAC cannot see as layers: refused naming the parameters and the fixes."""
    ckpts, mapping, _, _ = setup
    x, y = _data()
    with pytest.raises(TracInFuncError, match=r"not the kernel or bias of a Flax layer.*torch "
                                              r"twin"):
        tj.fit_curvature(_loss, ckpts, (x, y), kind=kind, projection=P, mapping=mapping,
                         sampler=tj.classification_sampler(_logits))


def test_held_curvature_with_other_mapping_or_projection_refused(setup):
    ckpts, mapping, _, _ = setup
    x, y = _data()
    p = ckpts[0].params
    wrong = tj.ParamMapping.identity(p, rename=lambda n: n.replace("params.", "")
                                     .replace("layers_", "").replace("kernel", "weight"))
    store = tj.build_store(_loss, ckpts, (x, y), projection=P, mapping=mapping)
    test = tj.build_store(_loss, ckpts, (x[:4], y[:4]), projection=P, mapping=mapping)
    sampler = tj.classification_sampler(_logits)
    with pytest.raises(TracInFuncError, match="fingerprint"):
        tif.score(store, test, curvature=tj.fit_curvature(
            _loss, ckpts, (x, y), kind="projected", projection=P, mapping=wrong, sampler=sampler))
    with pytest.raises(TracInFuncError, match="seed=1"):
        tif.score(store, test, curvature=tj.fit_curvature(
            _loss, ckpts, (x, y), kind="projected", projection=tif.Projection(dim=8, seed=1),
            mapping=mapping, sampler=sampler))
