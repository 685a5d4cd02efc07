"""Hostile pass atk3 (JAX frontend, model state; HOSTILE.md class 4): Flax linen batch_stats,
NNX BatchNorm, tj.Checkpoint(state=...). Black box: written from docs/jax.md only.

FAILING now (findings):
- test_state_holding_the_params_collection_is_refused: Checkpoint(params, state=variables)
  (the whole linen variables, 'params' included, as state) is accepted; the documented loss
  `{"params": params, **state}` then lets state's copy override the differentiated params and
  every row is silently 0.
- test_nnx_pure_dict_with_batch_stats_as_params_is_refused: an orbax-restored
  `nnx.state(model).to_pure_dict()` (Param + BatchStat) passed as parameters differentiates the
  BatchNorm running mean/var (stored as 'bn.mean', 'bn.var'), the 6.7-7.5% error docs/jax.md
  describes, with no error; the nnx.State form of the same tree is refused.
HELD (regression guards): the rest.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
linen = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
jnp = jax.numpy

import tracinfunc as tif  # noqa: E402
import tracinfunc.jax as tj  # noqa: E402
from tracinfunc.errors import TracInFuncError  # noqa: E402


def _data(n=24, d=5, c=3, seed=0):
    r = np.random.default_rng(seed)
    return r.normal(size=(n, d)).astype(np.float32), r.integers(0, c, n).astype(np.int32)


class LinBN(linen.Module):
    @linen.compact
    def __call__(self, x, train=False):
        x = linen.Dense(6)(x)
        x = linen.BatchNorm(use_running_average=not train)(x)
        return linen.Dense(3)(linen.relu(x))


MODEL = LinBN()


def _linen_loss(params, state, example):
    x, y = example
    logits = MODEL.apply({"params": params, **state}, x[None], train=False)[0]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _variables(shift=0.0):
    v = MODEL.init(jax.random.key(0), _data()[0][:2])
    return {"params": jax.tree_util.tree_map(lambda a: a * (1 + shift), v["params"]),
            "batch_stats": jax.tree_util.tree_map(lambda a: a + shift, v["batch_stats"])}


def _flat(g):
    return np.concatenate([np.asarray(leaf, np.float64).reshape(leaf.shape[0], -1)
                           for leaf in jax.tree_util.tree_leaves(g)], 1)


def _brute(loss, snaps, train, test):
    """sum_c lr_c <g_test, g_train>, params differentiated only, each with its own state."""
    grad = jax.vmap(jax.grad(loss), in_axes=(None, None, 0))
    return sum(lr * _flat(grad(p, s, test)) @ _flat(grad(p, s, train)).T for p, s, lr in snaps)


def test_state_holding_the_params_collection_is_refused():
    """FAILS now: state=variables (with 'params') is accepted and every row is 0."""
    v = _variables()
    x, y = _data()
    try:
        ckpt = tj.Checkpoint(v["params"], lr=0.1, name="a", state=v)
        store = tj.build_store(_linen_loss, [ckpt], (x, y), projection=tif.Projection(dim=8),
                               mapping=tj.ParamMapping.flax(v))
    except TracInFuncError as err:
        assert "params" in str(err) and "state" in str(err)
        return
    rows = store.read_rows(0, 0, len(x))
    assert float(rows.abs().max()) > 0, (
        "state holding the 'params' collection was accepted and overrode the differentiated "
        "parameters: every gradient row is 0")


class NnxBN(nnx.Module):
    def __init__(self, rngs):
        self.linear1 = nnx.Linear(5, 6, rngs=rngs)
        self.bn = nnx.BatchNorm(6, rngs=rngs)
        self.linear2 = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.bn(self.linear1(x))))


def test_nnx_pure_dict_with_batch_stats_as_params_is_refused():
    """FAILS now: the orbax-restored pure dict of the whole NNX state is differentiated whole."""
    model = NnxBN(nnx.Rngs(0))
    model.eval()
    graphdef, params, state = nnx.split(model, nnx.Param, ...)
    restored = nnx.state(model).to_pure_dict()     # what orbax restores for the whole state

    def loss(tree, example):
        x, y = example
        s = nnx.state(nnx.merge(graphdef, params, state))
        nnx.replace_by_pure_dict(s, tree)
        m = nnx.merge(graphdef, s)
        m.eval()
        return optax.softmax_cross_entropy_with_integer_labels(m(x[None])[0], y)

    x, y = _data()
    with pytest.raises(TracInFuncError, match="(?i)mean|var|batch|state"):
        ckpt = tj.Checkpoint(restored, lr=0.1, name="a")
        mapping = tj.ParamMapping.flax(restored)
        tj.build_store(loss, [ckpt], (x, y), projection=tif.Projection(dim=8), mapping=mapping)


# ---- HELD (regression guards) ----

def test_held_linen_batch_stats_rows_equal_brute_force_per_checkpoint_stats():
    vs = [_variables(0.0), _variables(0.5)]
    x, y = _data()
    xt, yt = _data(8, seed=1)
    ckpts = [tj.Checkpoint.flax(v, lr=0.1 * (i + 1), name=f"c{i}") for i, v in enumerate(vs)]
    mapping = tj.ParamMapping.flax(vs[0])
    proj = tif.Projection(kind="identity")
    store = tj.build_store(_linen_loss, ckpts, (x, y), projection=proj, mapping=mapping)
    test = tj.build_store(_linen_loss, ckpts, (xt, yt), projection=proj, mapping=mapping)
    got = np.asarray(tif.score(store, test, output="numpy"), np.float64)
    want = _brute(_linen_loss, [(v["params"], {"batch_stats": v["batch_stats"]}, 0.1 * (i + 1))
                                for i, v in enumerate(vs)], (x, y), (xt, yt))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_held_state_from_another_checkpoint_is_refused_at_scoring():
    v0, v1 = _variables(0.0), _variables(0.3)
    x, y = _data()
    proj, mapping = tif.Projection(dim=8), tj.ParamMapping.flax(v0)
    a = tj.Checkpoint(v0["params"], lr=0.1, name="a", state={"batch_stats": v0["batch_stats"]})
    b = tj.Checkpoint(v0["params"], lr=0.1, name="a", state={"batch_stats": v1["batch_stats"]})
    store = tj.build_store(_linen_loss, [a], (x, y), projection=proj, mapping=mapping)
    test = tj.build_store(_linen_loss, [b], (x[:4], y[:4]), projection=proj, mapping=mapping)
    with pytest.raises(TracInFuncError, match="fingerprint"):
        tif.score(store, test)


def test_held_only_some_checkpoints_with_state_refused():
    v = _variables()
    x, y = _data()
    a = tj.Checkpoint(v["params"], lr=0.1, name="a", state={"batch_stats": v["batch_stats"]})
    b = tj.Checkpoint(v["params"], lr=0.1, name="b")
    with pytest.raises(TracInFuncError, match="state"):
        tj.build_store(_linen_loss, [a, b], (x, y), projection=tif.Projection(dim=8),
                       mapping=tj.ParamMapping.flax(v))


def test_held_nnx_batchnorm_rows_equal_brute_force():
    model = NnxBN(nnx.Rngs(0))
    model.bn.mean.value = model.bn.mean.value + 0.5
    model.bn.var.value = model.bn.var.value * 2.0
    model.eval()
    graphdef, params, state = nnx.split(model, nnx.Param, ...)

    def loss(p, s, example):
        x, y = example
        m = nnx.merge(graphdef, p, s)
        m.eval()
        return optax.softmax_cross_entropy_with_integer_labels(m(x[None])[0], y)

    x, y = _data()
    xt, yt = _data(8, seed=1)
    ckpt = tj.Checkpoint.flax(model, lr=0.1, name="e0")
    proj, mapping = tif.Projection(kind="identity"), tj.ParamMapping.flax(model)
    got = tif.score(tj.build_store(loss, [ckpt], (x, y), projection=proj, mapping=mapping),
                    tj.build_store(loss, [ckpt], (xt, yt), projection=proj, mapping=mapping),
                    output="numpy")
    want = _brute(loss, [(params, state, 0.1)], (x, y), (xt, yt))
    assert np.abs(np.asarray(got, np.float64) - want).max() <= 1e-5 * np.abs(want).max()


def test_held_nnx_state_and_module_as_params_refused():
    model = NnxBN(nnx.Rngs(0))
    with pytest.raises(TracInFuncError, match="BatchStat"):
        tj.Checkpoint(nnx.state(model), lr=0.1, name="x")
    with pytest.raises(TracInFuncError, match="nnx.Module"):
        tj.Checkpoint(model, lr=0.1, name="x")
    with pytest.raises(TracInFuncError, match="batch_stats"):
        tj.Checkpoint(_variables(), lr=0.1, name="x")
