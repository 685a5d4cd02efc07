"""Hostile pass atk3 (JAX frontend: ParamMapping, lr; HOSTILE.md classes 3, 4, 5). Black box,
from docs/jax.md only.

FAILING now (findings):
- test_rename_key_matching_no_leaf_is_refused: a typo in rename={...} is silently ignored.
- test_rename_to_empty_name_is_refused: rename to '' gives a store with a parameter named ''.
- test_rename_to_non_str_names_the_type: a rename returning an int is refused as "several
  leaves map to the torch names [3]" (a collision that did not happen).
- test_flax_mapping_of_an_absent_collection_is_refused: ParamMapping.flax(tree,
  collection='batch_stats') on a tree without it maps the whole tree ('params.0.weight').
- test_lr_beyond_float32_is_refused: lr=1e39 (finite as a Python float, inf in the float32
  scores) is accepted, score() is NaN/inf and top_k ranks NaN values; lr=1e-320 (0 in float32)
  gives all-zero scores; lr=10**400 raises a raw OverflowError.
HELD (guards): mapping from another model, untransposed square kernels caught by the
fingerprint, Equinox via eqx.partition, lr spellings.
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
from tracinfunc.errors import TracInFuncError  # noqa: E402


def _data(n=16, d=4, c=4, seed=0):
    r = np.random.default_rng(seed)
    return r.normal(size=(n, d)).astype(np.float32), r.integers(0, c, n).astype(np.int32)


def _params(seed=0, shapes=((4, 4), (4, 4))):
    r = np.random.default_rng(seed)
    w = lambda *s: jnp.asarray(r.normal(size=s).astype(np.float32) * 0.5)  # noqa: E731
    (a, b), (c, d) = shapes
    return {"params": {"layers_0": {"kernel": w(a, b), "bias": w(b)},
                       "layers_2": {"kernel": w(c, d), "bias": w(d)}}}


def _loss(v, example):
    x, y = example
    p = v["params"]
    h = jax.nn.relu(x @ p["layers_0"]["kernel"] + p["layers_0"]["bias"])
    return optax.softmax_cross_entropy_with_integer_labels(
        h @ p["layers_2"]["kernel"] + p["layers_2"]["bias"], y)


def test_rename_key_matching_no_leaf_is_refused():
    """FAILS now: the typo 'fc1.wieght' is ignored and '0.weight' stays."""
    with pytest.raises(TracInFuncError, match="fc1.wieght|0.weight"):
        tj.ParamMapping.flax(_params(), rename={"0.wieght": "fc1.weight"})


def test_rename_to_empty_name_is_refused():
    with pytest.raises(TracInFuncError, match="(?i)empty|name"):
        tj.ParamMapping.flax(_params(), rename={"0.weight": ""})


def test_rename_to_non_str_names_the_type():
    with pytest.raises(TracInFuncError, match="(?i)str"):
        tj.ParamMapping.flax(_params(), rename=lambda name: 3)


def test_flax_mapping_of_an_absent_collection_is_refused():
    with pytest.raises(TracInFuncError, match="batch_stats"):
        tj.ParamMapping.flax(_params(), collection="batch_stats")


@pytest.mark.parametrize("lr", [1e39, 1e-320, 10**400], ids=["1e39", "1e-320", "10**400"])
def test_lr_beyond_float32_is_refused(lr):
    """FAILS now: 1e39 gives NaN/inf scores, 1e-320 (0 in float32) all-zero scores, both with
    no error; 10**400 raises a raw OverflowError instead of the library's lr message."""
    x, y = _data()
    p = _params()
    proj = tif.Projection(dim=8)
    try:
        ckpt = tj.Checkpoint(p, lr=lr, name="a")
        store = tj.build_store(_loss, [ckpt], (x, y), projection=proj)
        test = tj.build_store(_loss, [ckpt], (x[:3], y[:3]), projection=proj)
        scores = tif.score(store, test)
    except TracInFuncError as err:
        assert "lr" in str(err)
        return
    assert torch.isfinite(scores).all() and bool((scores != 0).any()), (
        f"lr={lr!r} accepted: scores are NaN/inf or all 0 in float32")


# ---- HELD (regression guards) ----

def test_held_mapping_of_another_model_refused():
    x, y = _data()
    ckpt = tj.Checkpoint(_params(), lr=0.1, name="a")
    other = {"params": {"Dense_0": _params()["params"]["layers_0"],
                        "Dense_1": _params()["params"]["layers_2"]}}
    with pytest.raises(TracInFuncError, match="structure"):
        tj.build_store(_loss, [ckpt], (x, y), projection=tif.Projection(dim=8),
                       mapping=tj.ParamMapping.flax(other))
    with pytest.raises(TracInFuncError, match="shape"):
        tj.build_store(_loss, [ckpt], (x, y), projection=tif.Projection(dim=8),
                       mapping=tj.ParamMapping.flax(_params(shapes=((4, 5), (5, 4)))))


def test_held_untransposed_square_kernels_refused_against_torch_twin():
    x, y = _data()
    p = _params()
    good = tj.ParamMapping.flax(p)
    wrong = tj.ParamMapping.identity(p, rename=lambda n: n.replace("params.", "")
                                     .replace("layers_", "").replace("kernel", "weight"))
    ckpt = tj.Checkpoint(p, lr=0.1, name="a")
    proj = tif.Projection(dim=8)
    twin = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)).eval()
    test = tif.build_store(tif.loss_from_module(twin, F.cross_entropy), [ckpt.to_torch(good)],
                           (torch.from_numpy(x[:4]), torch.from_numpy(y[:4]).long()),
                           projection=proj)
    bad_store = tj.build_store(_loss, [ckpt], (x, y), projection=proj, mapping=wrong)
    with pytest.raises(TracInFuncError, match="fingerprint"):
        tif.score(bad_store, test)
    good_store = tj.build_store(_loss, [ckpt], (x, y), projection=proj, mapping=good)
    assert tif.score(good_store, test).shape == (4, 16)


def test_held_equinox_partition_equals_torch_twin():
    eqx = pytest.importorskip("equinox")
    x, y = _data(d=4, c=3)
    model = eqx.nn.MLP(4, 3, 5, depth=1, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)

    def loss(p, example):
        xx, yy = example
        return optax.softmax_cross_entropy_with_integer_labels(eqx.combine(p, static)(xx), yy)

    class Twin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 5), torch.nn.Linear(5, 3)])

        def forward(self, xx):
            return self.layers[1](torch.relu(self.layers[0](xx)))

    mapping = tj.ParamMapping.identity(params)
    twin = Twin().eval()
    mapping.check(dict(twin.named_parameters()))
    ckpts = [tj.Checkpoint(params, lr=0.1, name="a")]
    proj = tif.Projection(dim=8)
    tl = tif.loss_from_module(twin, F.cross_entropy)
    tck = [c.to_torch(mapping) for c in ckpts]
    data_t = (torch.from_numpy(x), torch.from_numpy(y).long())
    test = tif.build_store(tl, tck, (data_t[0][:4], data_t[1][:4]), projection=proj)
    got = tif.score(tj.build_store(loss, ckpts, (x, y), projection=proj, mapping=mapping), test)
    want = tif.score(tif.build_store(tl, tck, data_t, projection=proj), test)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("lr,expected", [
    (np.float32(0.1), float(np.float32(0.1))), (np.array(0.1), 0.1),
    (jnp.array(0.1), float(jnp.float32(0.1))), (jnp.array(0.1, jnp.bfloat16), 0.10009765625),
    (torch.tensor(0.1), float(np.float32(0.1))), (1, 1.0)])
def test_held_lr_spellings_read_as_float(lr, expected):
    assert tj.Checkpoint(_params(), lr=lr, name="a").lr == expected


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -0.1, 0.0, True, np.bool_(True),
                                np.array([0.1]), 0.1 + 0j, "0.1", None])
def test_held_bad_lr_refused(lr):
    with pytest.raises(TracInFuncError, match="lr"):
        tj.Checkpoint(_params(), lr=lr, name="a")


def test_held_traced_lr_refused_inside_jit():
    @jax.jit
    def make(lr):
        return tj.Checkpoint(_params(), lr=lr, name="a").lr

    with pytest.raises(TracInFuncError, match="lr"):
        make(0.1)
