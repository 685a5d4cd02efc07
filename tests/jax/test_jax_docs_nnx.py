"""docs/jax.md's Flax NNX + optax walkthrough, run as written on a real NNX model with BatchNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tracinfunc as tif
import tracinfunc.jax as tj

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.linear1 = nnx.Linear(6, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.linear2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.linear2(jnp.tanh(self.bn(self.linear1(x))))


def test_the_nnx_optax_walkthrough_runs_and_scores_like_brute_force():
    rng = np.random.default_rng(0)
    x_train, y_train = rng.normal(size=(24, 6)).astype(np.float32), rng.integers(0, 3, 24)
    x_test, y_test = rng.normal(size=(5, 6)).astype(np.float32), rng.integers(0, 3, 5)
    model = MLP(rngs=nnx.Rngs(0))
    graphdef = nnx.split(model, nnx.Param, ...)[0]
    schedule = optax.cosine_decay_schedule(0.1, decay_steps=300)
    optimizer = nnx.Optimizer(model, optax.sgd(schedule), wrt=nnx.Param)

    def train_one_epoch(model):  # batch statistics update the running averages
        def batch_loss(m):
            logits = m(jnp.asarray(x_train))
            return optax.softmax_cross_entropy_with_integer_labels(logits, y_train).mean()
        model.train()
        optimizer.update(model, nnx.grad(batch_loss)(model))

    ckpts = []
    for epoch in range(3):
        train_one_epoch(model)
        ckpts.append(tj.Checkpoint.flax(model, lr=schedule(100 * epoch), name=f"epoch-{epoch}"))

    def loss(params, state, example):
        x, y = example
        m = nnx.merge(graphdef, params, state)
        m.eval()
        return optax.softmax_cross_entropy_with_integer_labels(m(x[None])[0], y)

    mapping = tj.ParamMapping.flax(model)
    projection = tif.Projection(kind="identity")
    store = tj.build_store(loss, ckpts, (x_train, y_train), projection=projection,
                           mapping=mapping)
    test = tj.build_store(loss, ckpts, (x_test, y_test), projection=projection, mapping=mapping)
    scores = np.asarray(tif.score(store, test, output="jax"), np.float64)

    # Brute force: float64 grads of params only, each checkpoint with its own statistics.
    with jax.enable_x64(True):
        expected = 0.0
        for ckpt in ckpts:
            f64 = lambda tree: jax.tree_util.tree_map(  # noqa: E731
                lambda a: jnp.asarray(np.asarray(a), jnp.float64)
                if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)
            params, state = f64(ckpt.params), f64(ckpt.state)

            def rows(xs, ys, params=params, state=state):
                out = []
                for x, y in zip(xs, ys, strict=True):
                    example = (jnp.asarray(x, jnp.float64), y)
                    g = mapping.to_torch(jax.grad(loss)(params, state, example))
                    out.append(np.concatenate([np.asarray(g[n]).ravel()
                                               for n, _ in mapping.layout]))
                return np.stack(out)

            expected = expected + ckpt.lr * rows(x_test, y_test) @ rows(x_train, y_train).T
    assert len({c.lr for c in ckpts}) == 3
    assert np.abs(scores - expected).max() <= 1e-5 * np.abs(expected).max()
