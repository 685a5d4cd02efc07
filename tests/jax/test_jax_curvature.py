"""Curvature-aware scores of JAX-written stores equal the torch path's (issue 26).

The curvature is fitted once, by torch code, at the checkpoints both frontends hold (the same
float32 weights); scores of JAX-written training stores with JAX-made (preconditioned) test
gradients must equal ``tif.score(torch_store, torch_test, curvature=c)``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.jax_helpers import as_numpy, paired_mlp, to_jax_batch
from tracinfunc.curvature import classification_sampler

PROJECTIONS = {"rademacher": tif.Projection(dim=24, seed=5),
               "kronecker": tif.Projection(dim=24, seed=5, kind="kronecker")}


def _rel_err(got, expected) -> float:
    got, expected = as_numpy(got).astype(np.float64), as_numpy(expected).astype(np.float64)
    return float(np.abs(got - expected).max() / np.abs(expected).max())


@pytest.fixture(scope="module")
def pair():
    return paired_mlp(n_train=30, n_test=5)


@pytest.fixture(scope="module")
def stores(pair):
    """``{projection name: (torch store, JAX store)}`` of the training rows, built once."""
    loss, ckpts, jax_loss, jax_ckpts, mapping, train, _ = pair
    return {name: (tif.build_store(loss, ckpts, train, projection=projection, progress=False),
                   tj.build_store(jax_loss, jax_ckpts, to_jax_batch(train),
                                  projection=projection, mapping=mapping, progress=False))
            for name, projection in PROJECTIONS.items()}


@pytest.mark.parametrize(("kind", "projection_name"), [
    ("projected", "rademacher"), ("dense", "rademacher"),
    ("kfac", "kronecker"), ("ekfac", "rademacher")])
def test_jax_curvature_scores_equal_torch(pair, stores, kind, projection_name):
    loss, ckpts, jax_loss, jax_ckpts, mapping, train, test = pair
    projection = PROJECTIONS[projection_name]
    curvature = tif.fit_curvature(loss, ckpts, train, kind=kind, projection=projection,
                                  sampler=classification_sampler(exact=True))
    torch_train, jax_train = stores[projection_name]
    if kind == "projected":
        torch_test = tif.build_store(loss, ckpts, test, projection=projection, progress=False)
    else:
        torch_test = tif.preconditioned_test_grads(loss, ckpts, test, curvature,
                                                   projection=projection)
    jax_test = tj.preconditioned_test_grads(jax_loss, jax_ckpts, to_jax_batch(test), curvature,
                                            projection=projection, mapping=mapping)
    expected = tif.score(torch_train, torch_test, curvature=curvature)
    plain = tif.score(torch_train, tif.build_store(loss, ckpts, test, projection=projection,
                                                   progress=False))
    assert _rel_err(plain, expected) > 1e-2  # the curvature changes the scores
    for train_store, test_grads in [(jax_train, jax_test), (torch_train, jax_test),
                                    (jax_train, torch_test)]:
        got = tif.score(train_store, test_grads, curvature=curvature, output="jax")
        assert _rel_err(got, expected) <= 1e-5
        _, top = tif.top_k(train_store, test_grads, 5, curvature=curvature)
        _, expected_top = tif.top_k(torch_train, torch_test, 5, curvature=curvature)
        assert torch.equal(top, expected_top)
    if kind == "projected":  # plain JAX test stores are preconditioned by score itself
        plain_jax = tj.build_store(jax_loss, jax_ckpts, to_jax_batch(test),
                                   projection=projection, mapping=mapping, progress=False)
        assert _rel_err(tif.score(jax_train, plain_jax, curvature=curvature), expected) <= 1e-5
        assert _rel_err(tif.self_influence(jax_train, curvature=curvature),
                        tif.self_influence(torch_train, curvature=curvature)) <= 1e-5


def test_jax_preconditioned_grads_refuse_a_curvature_of_other_weights(pair):
    loss, ckpts, jax_loss, jax_ckpts, mapping, train, test = pair
    projection = PROJECTIONS["rademacher"]
    curvature = tif.fit_curvature(loss, ckpts[:1], train, kind="kfac")
    with pytest.raises(tif.errors.IncompatibleGradientsError,
                       match=r"tracinfunc.jax.preconditioned_test_grads: the curvature was "
                             r"fitted at 1 checkpoints"):
        tj.preconditioned_test_grads(jax_loss, jax_ckpts, to_jax_batch(test), curvature,
                                     projection=projection, mapping=mapping)
    wrong = tj.ParamMapping.identity(jax_ckpts[0].params)  # Flax names and [in, out] kernels
    whole = tif.fit_curvature(loss, ckpts, train, kind="kfac")
    with pytest.raises(tif.errors.IncompatibleGradientsError,
                       match="checkpoint 0 differs.*fingerprint"):
        tj.preconditioned_test_grads(jax_loss, jax_ckpts, to_jax_batch(test), whole,
                                     projection=projection, mapping=wrong)
