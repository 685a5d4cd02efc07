"""Model state (BatchNorm statistics) is never differentiated, and each checkpoint brings its own.

References are brute force: a Python loop of ``jax.grad`` per example in float64
(``jax.enable_x64``), differentiating ``params`` only, each checkpoint with its own statistics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tracinfunc as tif
import tracinfunc.jax as tj

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

IDENTITY = tif.Projection(kind="identity")


class BNNet(nn.Module):
    """Dense -> BatchNorm (running statistics) -> tanh -> Dense, as the issue's model."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=True)(x)
        return nn.Dense(3)(jnp.tanh(x))


def _linen_snapshots(n_ckpt=3, dtype=jnp.float32):
    """``n_ckpt`` variables with different params AND different batch statistics."""
    variables = BNNet().init(jax.random.key(0), jnp.zeros((1, 5)))
    snapshots = []
    for c in range(n_ckpt):
        keys = iter(jax.random.split(jax.random.key(10 + c), 64))

        def perturb(leaf, scale, keys=keys):
            return (leaf + scale * jax.random.normal(next(keys), leaf.shape)).astype(dtype)

        params = jax.tree_util.tree_map(lambda leaf: perturb(leaf, 0.3), variables["params"])
        stats = variables["batch_stats"]["BatchNorm_0"]
        stats = {"mean": perturb(stats["mean"], 1.0),
                 "var": jnp.abs(perturb(stats["var"], 1.0)) + 0.5}
        snapshots.append({"params": params, "batch_stats": {"BatchNorm_0": stats}})
    return snapshots


def linen_loss(params, state, example):
    x, y = example
    logits = BNNet().apply({"params": params, **state}, x[None])[0]
    return -jax.nn.log_softmax(logits)[y]


def _data(n=11, d=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32), rng.integers(0, 3, n).astype(np.int32)


def _brute_force_rows(loss, ckpt, mapping, data):
    """``[n, p]`` float64: one ``jax.grad`` per example, mapped and flattened by name."""
    with jax.enable_x64(True):
        cast = lambda tree: jax.tree_util.tree_map(  # noqa: E731
            lambda leaf: jnp.asarray(np.asarray(leaf), jnp.float64), tree)
        params, state = cast(ckpt.params), cast(ckpt.state)
        rows = []
        for x, y in zip(*data, strict=True):
            grads = jax.grad(loss)(params, state, (jnp.asarray(x, jnp.float64), y))
            named = mapping.to_torch(grads)
            rows.append(np.concatenate([np.asarray(named[name]).ravel()
                                        for name, _ in mapping.layout]))
        return np.stack(rows)


def test_batchnorm_state_is_not_differentiated_and_is_per_checkpoint():
    snapshots = _linen_snapshots()
    mapping = tj.ParamMapping.flax(snapshots[0])
    ckpts = [tj.Checkpoint.flax(v, lr=0.1, name=f"c{i}") for i, v in enumerate(snapshots)]
    assert all(c.state is not None and "batch_stats" in c.state for c in ckpts)
    assert not any("mean" in name or "var" in name for name, _ in mapping.layout)
    p = sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(ckpts[0].params))
    data = _data()
    store = tj.build_store(linen_loss, ckpts, data, projection=IDENTITY, mapping=mapping)
    assert store.k == p
    for c, ckpt in enumerate(ckpts):
        expected = _brute_force_rows(linen_loss, ckpt, mapping, data)
        got = store.read_rows(c, 0, len(data[0])).numpy().astype(np.float64)
        assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_scores_with_state_equal_brute_force():
    snapshots = _linen_snapshots()
    mapping = tj.ParamMapping.flax(snapshots[0])
    ckpts = [tj.Checkpoint.flax(v, lr=0.5 + i, name=f"c{i}") for i, v in enumerate(snapshots)]
    train, test = _data(9, seed=1), _data(4, seed=2)
    projection = tif.Projection(dim=16, seed=3)
    store = tj.build_store(linen_loss, ckpts, train, projection=projection, mapping=mapping)
    test_store = tj.build_store(linen_loss, ckpts, test, projection=projection, mapping=mapping)
    identity_scores = sum(
        ckpt.lr * _brute_force_rows(linen_loss, ckpt, mapping, test)
        @ _brute_force_rows(linen_loss, ckpt, mapping, train).T for ckpt in ckpts)
    exact = tif.score(tj.build_store(linen_loss, ckpts, train, projection=IDENTITY,
                                     mapping=mapping),
                      tj.build_store(linen_loss, ckpts, test, projection=IDENTITY,
                                     mapping=mapping)).numpy()
    assert np.abs(exact - identity_scores).max() <= 1e-5 * np.abs(identity_scores).max()
    assert tif.score(store, test_store).shape == (4, 9)


def test_state_from_another_checkpoint_changes_the_fingerprint():
    a, b = _linen_snapshots(2)
    mapping = tj.ParamMapping.flax(a)
    own = tj.Checkpoint.flax(a)
    swapped = tj.Checkpoint(a["params"], state={"batch_stats": b["batch_stats"]})
    assert own.to_torch(mapping).fingerprint != swapped.to_torch(mapping).fingerprint


def test_state_passed_as_params_is_refused_with_the_fix():
    (variables,) = _linen_snapshots(1)
    with pytest.raises(tif.errors.InvalidArgumentError, match=r"batch_stats.*Checkpoint.flax"):
        tj.Checkpoint(variables, lr=0.1)
    ckpts = [tj.Checkpoint.flax(variables, name="a"),
             tj.Checkpoint(variables["params"], name="b")]
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="1 of 2 checkpoints carry"):
        tj.build_store(linen_loss, ckpts, _data(), projection=IDENTITY)


def test_a_loss_that_does_not_take_state_is_told_so():
    (variables,) = _linen_snapshots(1)

    def stateless(params, example):
        return linen_loss(params, {}, example)

    with pytest.raises(tif.errors.LossFunctionError, match=r"loss\(params, state, example\)"):
        tj.build_store(stateless, tj.Checkpoint.flax(variables), _data(),
                       projection=IDENTITY)


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.linear1 = nnx.Linear(5, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, use_running_average=True, rngs=rngs)
        self.linear2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.linear2(jnp.tanh(self.bn(self.linear1(x))))


def _nnx_model(seed=0):
    model = NNXNet(nnx.Rngs(seed))
    model.bn.mean[...] = jnp.linspace(-1.0, 1.0, 8)
    model.bn.var[...] = jnp.linspace(0.5, 2.0, 8)
    return model


def test_nnx_module_state_and_pure_dict_map_the_same():
    model = _nnx_model()
    _, params, _ = nnx.split(model, nnx.Param, ...)
    pure = params.to_pure_dict()
    layouts = {tj.ParamMapping.flax(tree).layout
               for tree in (model, nnx.state(model), params, pure)}
    assert len(layouts) == 1
    (layout,) = layouts
    assert dict(layout)["linear1.weight"] == (8, 5)  # [in, out] kernel -> torch [out, in]
    assert not any(name.endswith("value") or "mean" in name for name, _ in layout)


def _variable_dict(state):
    """A plain nested dict of nnx.Variable leaves: what Flax says will replace nnx.State."""
    return {key: _variable_dict(value) if isinstance(value, (dict, nnx.State)) else value
            for key, value in state.items()}


def test_a_dict_of_nnx_variables_is_detected_as_nnx_state():
    model = _nnx_model()
    plain = _variable_dict(nnx.state(model))
    assert type(plain) is dict
    # Before: detected by the State type only, so batch statistics mapped as parameters
    # ("bn.mean.value") and kernels were left untransposed.
    assert tj.ParamMapping.flax(plain).layout == tj.ParamMapping.flax(model).layout
    with pytest.raises(tif.errors.InvalidArgumentError, match=r"BatchStat.*Checkpoint.flax"):
        tj.Checkpoint(plain)
    ckpt = tj.Checkpoint.flax(plain)
    assert ckpt.state is not None
    assert tj.Checkpoint.flax(model).to_torch(tj.ParamMapping.flax(model)).fingerprint == \
        ckpt.to_torch(tj.ParamMapping.flax(plain)).fingerprint


def test_nnx_rows_equal_the_pure_dict_path_and_brute_force():
    models = [_nnx_model(seed) for seed in range(2)]
    graphdef = nnx.split(models[0], nnx.Param, ...)[0]

    def loss(params, state, example):
        x, y = example
        logits = nnx.merge(graphdef, params, state)(x[None])[0]
        return -jax.nn.log_softmax(logits)[y]

    ckpts = [tj.Checkpoint.flax(m, lr=0.1, name=f"c{i}") for i, m in enumerate(models)]
    mapping = tj.ParamMapping.flax(models[0])
    data = _data()
    store = tj.build_store(loss, ckpts, data, projection=IDENTITY, mapping=mapping)
    for c, ckpt in enumerate(ckpts):
        expected = _brute_force_rows(loss, ckpt, mapping, data)
        got = store.read_rows(c, 0, len(data[0])).numpy().astype(np.float64)
        assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()

    # The same weights as pure dicts, differentiated through a linen-style function.
    def pure_loss(params, state, example):
        return loss(nnx.State(params), state, example)

    pure_ckpts = [tj.Checkpoint(c.params.to_pure_dict(), lr=0.1, name=c.name, state=c.state)
                  for c in ckpts]
    pure_store = tj.build_store(pure_loss, pure_ckpts, data, projection=IDENTITY,
                                mapping=tj.ParamMapping.flax(pure_ckpts[0].params))
    np.testing.assert_allclose(pure_store.read_rows(0, 0, 11).numpy(),
                               store.read_rows(0, 0, 11).numpy(), rtol=1e-6, atol=1e-7)


def test_nnx_state_with_batch_stats_passed_as_params_is_refused():
    model = _nnx_model()
    with pytest.raises(tif.errors.InvalidArgumentError, match=r"BatchStat.*Checkpoint.flax"):
        tj.Checkpoint(nnx.state(model))
    with pytest.raises(tif.errors.InvalidTypeError, match="nnx.Module"):
        tj.Checkpoint(model)


def test_identity_mapping_of_variables_with_state_maps_params_only():
    (variables,) = _linen_snapshots(1)
    names = [name for name, _ in tj.ParamMapping.identity(variables).layout]
    assert names and not any("batch_stats" in name or "mean" in name for name in names)


def test_a_mapping_of_another_model_is_refused():
    (variables,) = _linen_snapshots(1)
    other = tj.ParamMapping.flax({"params": {"Dense_0": {"kernel": jnp.zeros((5, 4))}}})
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="structure differs"):
        tj.build_store(linen_loss, tj.Checkpoint.flax(variables), _data(),
                       projection=IDENTITY, mapping=other)


def test_integer_parameter_leaf_points_to_state():
    params = {"w": jnp.ones((3, 2)), "step": jnp.array(3)}
    with pytest.raises(tif.errors.InvalidTypeError, match=r"\['step \(int32\)'\].*state="):
        tj.Checkpoint(params, lr=0.1)
    ckpt = tj.Checkpoint({"w": params["w"]}, lr=0.1, state={"step": params["step"]})
    assert ckpt.args[1]["step"] == 3
