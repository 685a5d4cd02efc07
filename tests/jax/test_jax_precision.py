"""Every program the JAX frontend compiles traces the user's loss with float32 matmuls in IEEE
float32, whatever default the caller set, and leaves the caller's setting as it was.

On a GPU, JAX's default float32 matmul is TF32: a Flax NNX walkthrough on an H100 scored
2.2e-4 off its float64 brute force (the CPU: ~1e-7), and JAX-written stores scored unlike
torch-written ones. On the CPU every precision computes the same float32 products, so these
tests read the precision the loss was traced under (a spy), as ``tests/test_devices.py`` does
for torch; the numbers were checked on a lent H100 (``tests/jax/test_jax_docs_nnx.py`` within
1e-5 of float64 there after the change).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.jax_helpers import paired_mlp, to_jax_batch
from tracinfunc.jax.precision import float32_jit

nn = pytest.importorskip("flax.linen")
MODEL = nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(3)])  # paired_mlp's torch twin


def _spying_loss(seen: list):
    """Cross-entropy through Flax layers (K-FAC needs them) that records the default matmul
    precision it is traced under."""
    def loss(variables, example):
        seen.append(jax.config.jax_default_matmul_precision)
        x, y = example
        return -jax.nn.log_softmax(MODEL.apply(variables, x))[y]
    return loss


def _spying_logits(seen: list):
    def logits(variables, x):
        seen.append(jax.config.jax_default_matmul_precision)
        return MODEL.apply(variables, x)
    return logits


def _calls(seen: list):
    """Each public entry point that traces a loss, as ``name -> call()``."""
    _, _, _, ckpts, mapping, train, _ = paired_mlp(n_train=8)
    batch = to_jax_batch(train)
    projection = tif.Projection(dim=8, seed=1)
    kronecker = tif.Projection(dim=8, seed=1, kind="kronecker")
    params = ckpts[0].params

    def fit(kind):
        return lambda: tj.fit_curvature(
            _spying_loss(seen), ckpts, batch, kind=kind, mapping=mapping,
            projection=projection if kind == "projected" else None,
            sampler=tj.classification_sampler(_spying_logits(seen)))

    def preconditioned():
        curvature = tj.fit_curvature(_spying_loss([]), ckpts, batch, kind="dense",
                                     mapping=mapping,
                                     sampler=tj.classification_sampler(_spying_logits([])))
        seen.clear()
        return tj.preconditioned_test_grads(_spying_loss(seen), ckpts, batch, curvature,
                                            projection=projection, mapping=mapping)

    return {
        "per_sample_grads": lambda: tj.per_sample_grads(_spying_loss(seen))(params, batch),
        "per_sample_grads chunked": lambda: tj.per_sample_grads(
            _spying_loss(seen), chunk_size=3)(params, batch),
        "projected_grads": lambda: tj.projected_grads(
            _spying_loss(seen), projection, mapping=mapping)(params, batch),
        "build_store rademacher": lambda: tj.build_store(
            _spying_loss(seen), ckpts, batch, projection=projection, mapping=mapping),
        "build_store kronecker": lambda: tj.build_store(
            _spying_loss(seen), ckpts, batch, projection=kronecker, mapping=mapping),
        "fit_curvature projected": fit("projected"),
        "fit_curvature dense": fit("dense"),
        "fit_curvature kfac": fit("kfac"),
        "fit_curvature ekfac": fit("ekfac"),
        "preconditioned_test_grads": preconditioned,
    }


NAMES = list(_calls([]))


@pytest.mark.parametrize("outer", [None, "bfloat16", "tensorfloat32"])
@pytest.mark.parametrize("name", NAMES)
def test_every_entry_point_traces_the_loss_in_ieee_float32(name, outer):
    seen: list = []
    call = _calls(seen)[name]
    if outer is None:
        call()
        after = jax.config.jax_default_matmul_precision
    else:
        with jax.default_matmul_precision(outer):
            call()
            after = jax.config.jax_default_matmul_precision
    assert seen, f"{name} never traced the loss"
    assert set(seen) == {"float32"}, (name, seen)
    assert after == outer  # the caller's setting, untouched


def test_a_loss_that_sets_its_own_precision_keeps_it():
    seen: list = []

    def loss(w, x):
        with jax.default_matmul_precision("bfloat16"):
            seen.append(jax.config.jax_default_matmul_precision)
            return jnp.sum(jnp.tanh(x @ w))

    w, x = jnp.ones((4, 3)), jnp.ones((5, 4))
    tj.per_sample_grads(loss)(w, x)
    assert seen == ["bfloat16"]


def test_float32_jit_compiles_once_and_restores_the_setting():
    seen: list = []

    def fn(a, b):
        seen.append(jax.config.jax_default_matmul_precision)
        return a @ b

    program = float32_jit(fn)
    a = jnp.ones((3, 3))
    with jax.default_matmul_precision("bfloat16"):
        program(a, a)
        assert jax.config.jax_default_matmul_precision == "bfloat16"
    program(a, a)
    program(a, a)
    assert seen == ["float32"] and program._cache_size() == 1
    with pytest.raises(TypeError):  # errors from inside pass through, the setting restored
        program(a, jnp.ones((2, 2, 2, 2)), 3)
    assert jax.config.jax_default_matmul_precision is None
