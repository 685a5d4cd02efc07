"""fit_curvature from a JAX loss equals the torch fit on the torch twin (issue 32 item 3)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.jax_helpers import paired_mlp, to_jax_batch
from tracinfunc.curvature import classification_sampler

PROJECTION = tif.Projection(dim=24, seed=5)


def flax_logits(variables, x):
    p = variables["params"]
    h = jax.numpy.tanh(x @ p["layers_0"]["kernel"] + p["layers_0"]["bias"])
    return h @ p["layers_2"]["kernel"] + p["layers_2"]["bias"]


@pytest.fixture(scope="module")
def pair():
    return paired_mlp(n_train=30, n_test=5)


@pytest.mark.parametrize("kind", ["projected", "dense"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "sampled"])
def test_jax_fit_equals_the_torch_fit_on_the_twin(pair, kind, exact):
    loss, ckpts, jax_loss, jax_ckpts, mapping, train, test = pair
    expected = tif.fit_curvature(loss, ckpts, train, kind=kind, projection=PROJECTION,
                                 sampler=classification_sampler(exact=exact))
    got = tj.fit_curvature(jax_loss, jax_ckpts, to_jax_batch(train), kind=kind,
                           projection=PROJECTION, mapping=mapping,
                           sampler=tj.classification_sampler(flax_logits, exact=exact))
    assert got.layout == expected.layout
    assert [c.fingerprint for c in got.checkpoints] == [c.fingerprint
                                                          for c in expected.checkpoints]
    for c in range(len(ckpts)):
        for key, value in expected.estimates[c].items():
            np.testing.assert_allclose(got.estimates[c][key].numpy(), value.numpy(),
                                       rtol=1e-5, atol=1e-6 * float(value.abs().max()))
        assert got.damping[c] == pytest.approx(expected.damping[c], rel=1e-5)
    # JAX-written store and JAX test gradients, preconditioned by the JAX-fitted curvature.
    store = tif.build_store(loss, ckpts, train, projection=PROJECTION, progress=False)
    torch_test = (tif.build_store(loss, ckpts, test, projection=PROJECTION, progress=False)
                  if kind == "projected" else
                  tif.preconditioned_test_grads(loss, ckpts, test, expected,
                                                projection=PROJECTION))
    jax_test = tj.preconditioned_test_grads(jax_loss, jax_ckpts, to_jax_batch(test), got,
                                            projection=PROJECTION, mapping=mapping)
    want = tif.score(store, torch_test, curvature=expected).double()
    have = tif.score(store, jax_test, curvature=got).double()
    assert float((have - want).abs().max() / want.abs().max()) <= 1e-5


def test_empty_data_and_bad_sampler_are_refused(pair):
    _, _, jax_loss, jax_ckpts, mapping, _, _ = pair
    with pytest.raises(tif.errors.EmptyDataError):
        tj.fit_curvature(jax_loss, jax_ckpts, [], kind="dense", mapping=mapping,
                         sampler=tj.classification_sampler(flax_logits))
    with pytest.raises(TypeError, match="logits must be a function"):
        tj.classification_sampler(None)
    with pytest.raises(tif.errors.InvalidArgumentError, match="positive int"):
        tj.classification_sampler(flax_logits, samples=0)
