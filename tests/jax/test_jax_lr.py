"""Learning rates are real scalars of any framework (optax schedules return JAX scalars)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import tracinfunc as tif
import tracinfunc.jax as tj

PARAMS = {"w": jnp.ones(3)}


@pytest.mark.parametrize("lr", [0.1, np.float32(0.1), np.float64(0.1), jnp.asarray(0.1),
                                np.asarray(0.1), torch.tensor(0.1), jnp.asarray(0.1, jnp.bfloat16),
                                np.int64(2)],
                         ids=["float", "np32", "np64", "jax0d", "np0d", "torch0d", "bf16", "int"])
def test_real_scalars_are_accepted_as_floats(lr):
    ckpt = tj.Checkpoint(PARAMS, lr=lr)
    assert type(ckpt.lr) is float and ckpt.lr == float(lr)
    assert type(tif.Checkpoint({"w": torch.ones(3)}, lr=lr).lr) is float


def test_an_optax_schedule_value_is_accepted():
    optax = pytest.importorskip("optax")
    schedule = optax.cosine_decay_schedule(0.1, decay_steps=100)
    lrs = [schedule(step) for step in (0, 50)]
    ckpts = [tj.Checkpoint(PARAMS, lr=lr, name=str(i)) for i, lr in enumerate(lrs)]
    assert [c.lr for c in ckpts] == [float(lr) for lr in lrs]


@pytest.mark.parametrize(("lr", "error", "match"), [
    (float("nan"), tif.errors.InvalidArgumentError, "finite"),
    (jnp.asarray(jnp.nan), tif.errors.InvalidArgumentError, "finite"),
    (np.float32(np.inf), tif.errors.InvalidArgumentError, "finite"),
    (np.float32(-0.1), tif.errors.InvalidArgumentError, "positive"),
    (0.0, tif.errors.InvalidArgumentError, "positive"),
    (True, tif.errors.InvalidTypeError, "real scalar"),
    (np.bool_(True), tif.errors.InvalidTypeError, "real scalar"),
    (jnp.asarray([0.1]), tif.errors.InvalidTypeError, r"shape \[1\]"),
    (np.complex64(0.1), tif.errors.InvalidTypeError, "real scalar"),
    ("0.1", tif.errors.InvalidTypeError, "real scalar"),
])
def test_other_values_are_refused(lr, error, match):
    with pytest.raises(error, match=match):
        tj.Checkpoint(PARAMS, lr=lr)


def test_a_traced_lr_is_refused_not_traced_through():
    @jax.jit
    def make(lr):
        tj.Checkpoint(PARAMS, lr=lr)
        return lr

    with pytest.raises(tif.errors.InvalidTypeError, match="outside jax.jit"):
        make(0.1)
