"""build_store compiles once per (loss, shapes, projection), and the reuse never mixes results."""

from __future__ import annotations

import numpy as np

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.jax_helpers import flax_mlp_loss, paired_mlp, to_jax_batch
from tracinfunc.jax import grads as jax_grads


def _copy_of_loss():
    def loss(variables, example):
        return flax_mlp_loss(variables, example)
    return loss


def test_one_program_for_every_checkpoint_batch_and_call():
    _, _, _, jax_ckpts, mapping, train, _ = paired_mlp(n_train=40)
    x, y = to_jax_batch(train)
    batches = [(x[:16], y[:16]), (x[16:32], y[16:32]), (x[32:], y[32:])]  # last one smaller
    loss = _copy_of_loss()
    projection = tif.Projection(dim=16, seed=2)
    first = tj.build_store(loss, jax_ckpts, batches, projection=projection, mapping=mapping)
    again = tj.build_store(loss, jax_ckpts, batches, projection=projection, mapping=mapping)
    (program,) = jax_grads._PROGRAMS[loss].values()
    assert program._cache_size() == 1  # 3 checkpoints x 3 batches x 2 calls: one compile
    whole = tj.build_store(_copy_of_loss(), jax_ckpts, (x, y), projection=projection,
                           mapping=mapping)
    for c in range(len(jax_ckpts)):
        np.testing.assert_array_equal(first.read_rows(c, 0, 40).numpy(),
                                      again.read_rows(c, 0, 40).numpy())
        np.testing.assert_allclose(first.read_rows(c, 0, 40).numpy(),
                                   whole.read_rows(c, 0, 40).numpy(), rtol=1e-6, atol=1e-6)


def test_reuse_never_mixes_projections():
    _, _, _, jax_ckpts, mapping, train, _ = paired_mlp(n_train=10)
    batch = to_jax_batch(train)
    loss = _copy_of_loss()
    for projection in (tif.Projection(dim=16, seed=2), tif.Projection(dim=16, seed=3),
                       tif.Projection(dim=16, seed=2, kind="sjlt", nnz=2),
                       tif.Projection(dim=16, seed=2, per_checkpoint=True)):
        shared = tj.build_store(loss, jax_ckpts, batch, projection=projection, mapping=mapping)
        fresh = tj.build_store(_copy_of_loss(), jax_ckpts, batch, projection=projection,
                               mapping=mapping)
        for c in range(len(jax_ckpts)):
            np.testing.assert_array_equal(shared.read_rows(c, 0, 10).numpy(),
                                          fresh.read_rows(c, 0, 10).numpy())
