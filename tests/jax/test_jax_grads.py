"""tracinfunc.jax gradients and ParamMapping against the torch path on the same weights."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.jax_helpers import as_numpy, flax_mlp_loss, flax_template, paired_mlp, to_jax_batch


def test_flax_mapping_names_and_shapes():
    mapping = tj.ParamMapping.flax(flax_template())
    assert mapping.names == {
        "params/layers_0/bias": "0.bias", "params/layers_0/kernel": "0.weight",
        "params/layers_2/bias": "2.bias", "params/layers_2/kernel": "2.weight",
    }
    assert mapping.layout == (("0.bias", (8,)), ("0.weight", (8, 6)),
                              ("2.bias", (3,)), ("2.weight", (3, 8)))


def test_flax_mapping_matches_the_torch_model_layout():
    _, ckpts, *_ = paired_mlp()
    mapping = tj.ParamMapping.flax(flax_template())
    assert mapping.layout == tif.projection.canonical_layout(ckpts[0].params)
    mapping.check(ckpts[0].params)  # does not raise


def test_to_torch_and_from_torch_are_inverse():
    _, ckpts, _, jax_ckpts, mapping, *_ = paired_mlp()
    as_torch = mapping.to_torch(jax_ckpts[1].params)
    for name, value in ckpts[1].params.items():
        np.testing.assert_array_equal(np.asarray(as_torch[name]), value.numpy())
    back = mapping.from_torch(as_torch)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, jax_ckpts[1].params)


def test_conv_kernels_move_channels_first():
    tree = {"params": {"Conv_0": {"kernel": jnp.zeros((3, 5, 2, 4)), "bias": jnp.zeros(4)},
                       "LayerNorm_0": {"scale": jnp.zeros(4)}}}
    mapping = tj.ParamMapping.flax(tree, rename={"LayerNorm_0.weight": "norm.weight"})
    assert dict(mapping.layout) == {"Conv_0.weight": (4, 2, 3, 5), "Conv_0.bias": (4,),
                                    "norm.weight": (4,)}
    kernel = jnp.arange(120.0).reshape(3, 5, 2, 4)
    torch_kernel = np.asarray(mapping.to_torch({"params": {**tree["params"], "Conv_0": {
        "kernel": kernel, "bias": jnp.zeros(4)}}})["Conv_0.weight"])
    assert torch_kernel[1, 0, 2, 3] == kernel[2, 3, 0, 1]  # [out, in, h, w] <- [h, w, in, out]


def test_identity_mapping_names_attribute_paths_like_equinox():
    @jax.tree_util.register_dataclass
    @dataclass
    class Linear:  # an Equinox Linear is a pytree of weight [out, in] and bias, like this
        weight: jax.Array
        bias: jax.Array

    tree = {"layers": [Linear(jnp.zeros((8, 6)), jnp.zeros(8)),
                       Linear(jnp.zeros((3, 8)), jnp.zeros(3))]}
    mapping = tj.ParamMapping.identity(tree)
    assert [name for name, _ in mapping.layout] == [
        "layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"]
    assert dict(mapping.layout)["layers.0.weight"] == (8, 6)
    renamed = tj.ParamMapping.identity(tree, rename=lambda n: n.removeprefix("layers."))
    assert renamed.layout == (("0.bias", (8,)), ("0.weight", (8, 6)),
                              ("1.bias", (3,)), ("1.weight", (3, 8)))


def test_mapping_errors_name_the_parameter():
    _, ckpts, *_ = paired_mlp()
    unmapped = tj.ParamMapping.identity(flax_template(), rename=lambda n: (
        n.removeprefix("params.").replace("layers_", "").replace("kernel", "weight")))
    with pytest.raises(tif.errors.IncompatibleGradientsError,
                       match=r"'0.weight' is \[6, 8\], expected \[8, 6\] \(transposed"):
        unmapped.check(ckpts[0].params)
    mapping = tj.ParamMapping.flax(flax_template())
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="structure differs"):
        mapping.to_torch({"params": {}})
    with pytest.raises(ValueError, match="several leaves map to the torch names"):
        tj.ParamMapping.identity({"a": jnp.zeros(1), "b": jnp.zeros(1)}, rename=lambda n: "x")
    with pytest.raises(TypeError, match="eqx.partition"):
        tj.ParamMapping.identity({"w": jnp.zeros(1), "act": jnp.tanh})


def test_per_example_grads_agree_with_torch():
    loss, ckpts, jax_loss, jax_ckpts, mapping, train, _ = paired_mlp(n_train=12)
    expected = tif.per_sample_grads(loss)(ckpts[1].params, train)
    grads = tj.per_sample_grads(jax_loss)(jax_ckpts[1].params, to_jax_batch(train))
    got = jax.vmap(mapping.to_torch)(grads)
    assert sorted(got) == sorted(expected)
    for name in expected:
        np.testing.assert_allclose(np.asarray(got[name]), expected[name].numpy(), rtol=1e-5,
                                   atol=1e-6)


def test_per_sample_grads_has_aux_and_chunking():
    _, _, jax_loss, jax_ckpts, _, train, _ = paired_mlp(n_train=10)
    batch = to_jax_batch(train)

    def loss_with_aux(params, example):
        value = jax_loss(params, example)
        return value, {"loss": value}

    whole = tj.per_sample_grads(jax_loss)(jax_ckpts[0].params, batch)
    grads, aux = tj.per_sample_grads(loss_with_aux, has_aux=True, chunk_size=3)(
        jax_ckpts[0].params, batch)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), grads,
                           whole)
    expected = jax.vmap(jax_loss, in_axes=(None, 0))(jax_ckpts[0].params, batch)
    np.testing.assert_allclose(np.asarray(aux["loss"]), np.asarray(expected), rtol=1e-6)


@pytest.mark.parametrize("projection", [
    tif.Projection(dim=24, seed=7),
    tif.Projection(dim=24, seed=7, kind="sjlt", nnz=3),
    tif.Projection(kind="identity"),
], ids=["rademacher", "sjlt", "identity"])
def test_projected_grads_agree_with_torch(projection):
    loss, ckpts, jax_loss, jax_ckpts, mapping, train, _ = paired_mlp(n_train=12)
    expected = tif.projected_grads(loss, projection)(ckpts[2].params, train).numpy()
    got = tj.projected_grads(jax_loss, projection, mapping=mapping, chunk_size=5)(
        jax_ckpts[2].params, to_jax_batch(train))
    assert got.shape == expected.shape
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)


def test_torch_has_aux_returns_batched_aux():
    loss, ckpts, *_, train, _ = paired_mlp(n_train=6)

    def loss_with_aux(params, example):
        value = loss(params, example)
        return value, value.detach() * 2

    grads, aux = tif.per_sample_grads(loss_with_aux, has_aux=True)(ckpts[0].params, train)
    expected = tif.per_sample_grads(loss)(ckpts[0].params, train)
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name])
    projection = tif.Projection(dim=8)
    rows, aux2 = tif.projected_grads(loss_with_aux, projection, has_aux=True)(
        ckpts[0].params, train)
    torch.testing.assert_close(rows, tif.projected_grads(loss, projection)(ckpts[0].params,
                                                                           train))
    assert aux.shape == aux2.shape == (6,)
    losses = torch.stack([loss(ckpts[0].params, (train[0][i], train[1][i])) for i in range(6)])
    torch.testing.assert_close(aux, 2 * losses)


def test_jax_grads_accept_torch_tensors():
    _, ckpts, jax_loss, jax_ckpts, mapping, train, _ = paired_mlp(n_train=4)
    from_torch = tj.per_sample_grads(jax_loss)(mapping.from_torch(ckpts[0].params), train)
    from_jax = tj.per_sample_grads(jax_loss)(jax_ckpts[0].params, to_jax_batch(train))
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(as_numpy(a),
                                                                      as_numpy(b)),
                           from_torch, from_jax)


def test_flax_loss_is_what_the_template_describes():
    value = flax_mlp_loss(flax_template(), (jnp.ones(6), 1))
    np.testing.assert_allclose(float(value), np.log(3.0), rtol=1e-6)
