"""The same MLP in torch (``tests.conftest.make_mlp``) and in JAX with Flax's parameter layout.

Torch ``nn.Sequential(Linear(6, 8), Tanh(), Linear(8, 3))`` has ``0.weight [8, 6]``; the
Flax equivalent ``nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(3)])`` has
``params/layers_0/kernel [6, 8]``. The JAX model below is written out by hand in that layout
(Flax is not a dependency) so the mapping is tested against what Flax really produces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.conftest import make_checkpoints, make_data, make_mlp


def flax_template(d_in=6, hidden=8, d_out=3, dtype=jnp.float32):
    """A Flax-shaped ``variables`` tree of zeros (only its structure and shapes are used)."""
    return {"params": {
        "layers_0": {"kernel": jnp.zeros((d_in, hidden), dtype), "bias": jnp.zeros(hidden, dtype)},
        "layers_2": {"kernel": jnp.zeros((hidden, d_out), dtype), "bias": jnp.zeros(d_out, dtype)},
    }}


def flax_mlp_loss(variables, example):
    """Cross-entropy of one example, as Flax's Dense computes it (``x @ kernel + bias``)."""
    x, y = example
    p = variables["params"]
    h = jnp.tanh(x @ p["layers_0"]["kernel"] + p["layers_0"]["bias"])
    logits = h @ p["layers_2"]["kernel"] + p["layers_2"]["bias"]
    return -jax.nn.log_softmax(logits)[y]


def paired_mlp(n_train=40, n_test=7):
    """Torch loss/checkpoints and JAX loss/checkpoints holding the very same float32 weights."""
    model = make_mlp(dtype=torch.float32).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = make_checkpoints(model)
    mapping = tj.ParamMapping.flax(flax_template())
    jax_ckpts = [tj.Checkpoint(mapping.from_torch(c.params), lr=c.lr, name=c.name)
                 for c in ckpts]
    train = make_data(n_train, dtype=torch.float32, seed=1)
    test = make_data(n_test, dtype=torch.float32, seed=3)
    return loss, ckpts, flax_mlp_loss, jax_ckpts, mapping, train, test


def to_jax_batch(batch):
    return tuple(jnp.asarray(leaf.numpy()) for leaf in batch)


def as_numpy(array) -> np.ndarray:
    """A torch tensor (any device: score() answers on the accelerator when there is one), a
    JAX array or an ndarray, as an ndarray."""
    return np.asarray(array.detach().cpu() if isinstance(array, torch.Tensor) else array)
