"""tracinfunc.jax projections: the torch path's matrices bit for bit, and the same outputs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.jax_helpers import paired_mlp, to_jax_batch
from tracinfunc import projection as torch_projection
from tracinfunc.jax.projection import _mulhi32
from tracinfunc.projection import _kernels as _hashing

NAMES = st.sampled_from(["fc.weight", "0.bias", "layers.3.conv.weight", "x"])


@settings(max_examples=5, deadline=None)
@given(name=NAMES, shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       dim=st.integers(1, 70), seed=st.integers(0, 2**63 - 1), data=st.data())
def test_rademacher_blocks_are_bit_identical_to_torch(name, shape, dim, seed, data):
    numel = int(np.prod(shape))
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    projection = tif.Projection(dim=dim, seed=seed)
    got = np.asarray(tj.rademacher_block(projection, name, shape, start, stop))
    expected = torch_projection.rademacher_block(projection, name, shape, start, stop).numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


@settings(max_examples=5, deadline=None)
@given(name=NAMES, shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       dim=st.integers(1, 2**31 - 1), seed=st.integers(0, 2**63 - 1), data=st.data())
def test_sjlt_blocks_are_bit_identical_to_torch(name, shape, dim, seed, data):
    nnz = data.draw(st.integers(1, min(dim, 6)))
    numel = int(np.prod(shape))
    projection = tif.Projection(dim=dim, seed=seed, kind="sjlt", nnz=nnz)
    cols, signs = tj.sjlt_block(projection, name, shape, 0, numel)
    cols_t, signs_t = torch_projection.sjlt_block(projection, name, shape, 0, numel)
    np.testing.assert_array_equal(np.asarray(cols), cols_t.numpy())
    np.testing.assert_array_equal(np.asarray(signs), signs_t.numpy())


@settings(max_examples=5, deadline=None)
@given(name=NAMES, shape=st.lists(st.integers(1, 9), min_size=2, max_size=4),
       dim=st.integers(1, 70), seed=st.integers(0, 2**63 - 1))
def test_kronecker_factors_are_bit_identical_to_torch(name, shape, dim, seed):
    projection = tif.Projection(dim=dim, seed=seed, kind="kronecker")
    got = tj.kronecker_factors(projection, name, shape)
    expected = torch_projection.kronecker_factors(projection, name, shape)
    for side, side_t in zip(got, expected, strict=True):
        assert side.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(side), side_t.numpy())


def test_kronecker_factors_refuse_vectors_and_other_kinds():
    kron = tif.Projection(dim=16, kind="kronecker")
    with pytest.raises(tif.errors.InvalidProjectionError,
                       match=r"tracinfunc.jax.kronecker_factors: 'b' needs at least two dim"):
        tj.kronecker_factors(kron, "b", (5,))
    with pytest.raises(tif.errors.InvalidProjectionError, match="expected a Projection with kind="):
        tj.kronecker_factors(tif.Projection(dim=16), "w", (5, 3))


def test_mulhi32_is_the_exact_high_word():
    rng = np.random.default_rng(0)
    edges = np.array([0, 1, 2**16 - 1, 2**16, 2**31 - 1, 2**31, 2**32 - 1], dtype=np.uint64)
    a = np.concatenate([edges, rng.integers(0, 2**32, 20_000, dtype=np.uint64)])
    for b in [1, 3, 2**16 - 1, 2**16 + 1, 123_456_789, 2**31 - 1, 2**32 - 1]:
        got = np.asarray(_mulhi32(jnp.asarray(a.astype(np.uint32)), b))
        np.testing.assert_array_equal(got.astype(np.uint64), (a * np.uint64(b)) >> np.uint64(32))


def _grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"b.weight": torch.randn(5, 7, generator=g), "a.bias": torch.randn(5, generator=g),
            "c": torch.randn(3, 2, 2, generator=g)}


@pytest.mark.parametrize("projection", [
    tif.Projection(dim=33, seed=3),
    tif.Projection(dim=33, seed=3, kind="sjlt", nnz=4),
    tif.Projection(kind="identity"),
    tif.Projection(dim=33, seed=3, kind="kronecker"),
], ids=["rademacher", "sjlt", "identity", "kronecker"])
@pytest.mark.parametrize("cache_bytes", [2**30, 0], ids=["cached", "streamed"])
def test_projector_equals_the_torch_projector(projection, cache_bytes):
    grads = _grads()
    layout = tif.projection.canonical_layout(grads)
    expected = tif.projection.make_projector(projection, layout)(grads).numpy()
    project = tj.make_projector(projection, layout, cache_bytes=cache_bytes)
    jax_grads = {name: jnp.asarray(g.numpy()) for name, g in grads.items()}
    got = np.asarray(project(jax_grads))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    # Under jit and vmap (blocks passed as an argument) the answer is the same.
    batch = {name: jnp.stack([g, 2 * g]) for name, g in jax_grads.items()}
    both = jax.jit(jax.vmap(project.apply, in_axes=(None, 0)))(project.blocks, batch)
    np.testing.assert_allclose(np.asarray(both), np.stack([got, 2 * got]), rtol=1e-6, atol=1e-5)


def test_streamed_slices_cover_every_row(monkeypatch):
    """Several fori_loop slices plus zero padding give the cached block's answer."""
    monkeypatch.setattr("tracinfunc.jax.projection._SLICE_ELEMENTS", 7 * 33)
    grads = {name: jnp.asarray(g.numpy()) for name, g in _grads().items()}
    for projection in (tif.Projection(dim=33, seed=1), tif.Projection(dim=33, kind="sjlt",
                                                                      nnz=2)):
        layout = tif.projection.canonical_layout({n: g.shape for n, g in grads.items()})
        cached = tj.make_projector(projection, layout)(grads)
        streamed = tj.make_projector(projection, layout, cache_bytes=0)(grads)
        np.testing.assert_allclose(np.asarray(streamed), np.asarray(cached), rtol=1e-6,
                                   atol=1e-6)


def test_projection_does_not_depend_on_dict_order():
    grads = {name: jnp.asarray(g.numpy()) for name, g in _grads().items()}
    layout = tif.projection.canonical_layout({n: g.shape for n, g in grads.items()})
    project = tj.make_projector(tif.Projection(dim=16, seed=2), layout)
    reordered = dict(reversed(list(grads.items())))
    np.testing.assert_array_equal(np.asarray(project(grads)), np.asarray(project(reordered)))


def test_projector_names_missing_extra_and_misshaped_parameters():
    project = tj.make_projector(tif.Projection(dim=8), {"w": (2, 3), "b": (2,)})
    with pytest.raises(
        tif.errors.InvalidProjectionError, match=r"missing 'b'.*extra 'z'.*'w' has shape"
    ):
        project({"w": jnp.zeros((3, 2)), "z": jnp.zeros(1)})


def test_make_projector_rejects_bad_specs():
    with pytest.raises(TypeError, match="tracinfunc.jax.make_projector: projection must be"):
        tj.make_projector({"dim": 8}, {"w": (2,)})
    with pytest.raises(tif.errors.InvalidProjectionError, match="identity"):
        tj.make_projector(tif.Projection(kind="identity", dim=5), {"w": (2,)})


def test_kronecker_projects_matrices_side_by_side_not_as_rademacher():
    """The matrix block is P_out.T @ G @ P_in / sqrt(k), never the dense Rademacher block."""
    projection, name, shape = tif.Projection(dim=12, seed=5, kind="kronecker"), "w", (5, 7)
    g = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    got = np.asarray(tj.make_projector(projection, {name: shape})({name: jnp.asarray(g)}))
    p_out, p_in = (side.numpy().astype(np.float64)
                   for side in torch_projection.kronecker_factors(projection, name, shape))
    side_by_side = (p_out.T @ g @ p_in).reshape(-1) / np.sqrt(12)  # [3, 4] -> [12]
    dense = _hashing.rademacher_rows(torch_projection.block_seed(projection, name, shape), 12,
                                     0, 35, "cpu", torch.float64).numpy()
    np.testing.assert_allclose(got, side_by_side, rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, g.reshape(-1) @ dense / np.sqrt(12), atol=1e-3)
    torch_rows = tif.projection.make_projector(projection, {name: shape})(
        {name: torch.from_numpy(g)}
    )
    np.testing.assert_allclose(got, torch_rows.numpy(), rtol=1e-5, atol=1e-6)


def test_kronecker_splits_the_torch_layout_of_flax_kernels():
    """A Flax conv kernel [h, w, in, out] is split as torch's [out, in * h * w], after mapping."""
    rng = np.random.default_rng(1)
    tree = {"params": {"Conv_0": {"kernel": rng.standard_normal((3, 2, 4, 5)),
                                  "bias": rng.standard_normal(5)},
                       "Dense_0": {"kernel": rng.standard_normal((6, 9))}}}
    tree = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), tree)
    mapping = tj.ParamMapping.flax(tree)
    projection = tif.Projection(dim=20, seed=4, kind="kronecker")
    got = tj.make_projector(projection, mapping.layout)(mapping.to_torch(tree))
    as_torch = {name: torch.from_numpy(np.array(value))
                for name, value in mapping.to_torch(tree).items()}
    assert as_torch["Conv_0.weight"].shape == (5, 4, 3, 2)
    expected = tif.projection.make_projector(projection, mapping.layout)(as_torch)
    np.testing.assert_allclose(np.asarray(got), expected.numpy(), rtol=1e-5, atol=1e-6)


def test_kronecker_mlp_factors_and_projected_grads_equal_torch():
    loss, ckpts, jax_loss, jax_ckpts, mapping, train, _ = paired_mlp(n_train=16)
    projection = tif.Projection(dim=32, seed=11, kind="kronecker")
    project = tj.make_projector(projection, mapping.layout)
    torch_project = tif.projection.make_projector(projection, mapping.layout)
    for name, shape in mapping.layout:
        if len(shape) >= 2:
            p_out, p_in = torch_project.kronecker_factors(name, torch.float32,
                                                          torch.device("cpu"))
            np.testing.assert_array_equal(np.asarray(project.blocks[name][0]), p_out.numpy())
            np.testing.assert_array_equal(np.asarray(project.blocks[name][1]), p_in.numpy())
    for ckpt, jax_ckpt in zip(ckpts, jax_ckpts, strict=True):
        expected = tif.projected_grads(loss, projection)(ckpt.params, train).numpy()
        got = np.asarray(tj.projected_grads(jax_loss, projection, mapping=mapping)(
            jax_ckpt.params, to_jax_batch(train)))
        assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize(("projection", "cache_bytes", "stacked"), [
    (tif.Projection(dim=33, seed=3), 2**30, True),
    (tif.Projection(dim=33, seed=3), 0, False),  # streamed: no [p, k] matrix held
    (tif.Projection(dim=33, seed=3, kind="sjlt", nnz=4), 2**30, False),
    (tif.Projection(dim=33, seed=3, kind="kronecker"), 2**30, False),
], ids=["rademacher", "rademacher-streamed", "sjlt", "kronecker"])
def test_one_stacked_rademacher_matrix_holds_the_torch_blocks_bit_for_bit(projection,
                                                                         cache_bytes, stacked):
    grads = _grads()
    layout = tif.projection.canonical_layout(grads)
    project = tj.make_projector(projection, layout, cache_bytes=cache_bytes)
    assert project.concatenated is stacked
    if not stacked:
        return
    (matrix,) = project.blocks.values()
    # The stacked matrix is the torch blocks, in layout order, bit for bit (scale applied after).
    expected = torch.cat([torch_projection.rademacher_block(projection, name, shape, 0,
                                                          math.prod(shape))
                          for name, shape in layout])
    np.testing.assert_array_equal(np.asarray(matrix), expected.numpy())
    jax_grads = {name: jnp.asarray(g.numpy()) for name, g in grads.items()}
    per_weight = tj.make_projector(projection, layout, cache_bytes=cache_bytes)
    object.__setattr__(per_weight, "concatenated", False)
    per_weight.blocks = {name: tj.rademacher_block(projection, name, shape, 0, math.prod(shape))
                         for name, shape in layout}
    np.testing.assert_allclose(np.asarray(project(jax_grads)),
                               np.asarray(per_weight.apply(per_weight.blocks, jax_grads)),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("split", ["square", "shape"])
def test_kronecker_vectors_are_bit_identical_to_torch_and_project_alike(split):
    projection = tif.Projection(dim=48, seed=7, kind="kronecker", vectors="kronecker",
                                split=split)
    for shape in [(), (1,), (5,), (16,), (130,)]:
        got = tj.kronecker_factors(projection, "norm.bias", shape)
        expected = torch_projection.kronecker_factors(projection, "norm.bias", shape)
        for side, side_t in zip(got, expected, strict=True):
            np.testing.assert_array_equal(np.asarray(side), side_t.numpy())
    g = np.random.default_rng(0)
    grads = {"a.weight": g.standard_normal((6, 5)), "a.bias": g.standard_normal(6),
             "norm.weight": g.standard_normal(130), "scalar": g.standard_normal(())}
    grads = {k: np.asarray(v, dtype=np.float32) for k, v in grads.items()}
    layout = tif.projection.canonical_layout(grads)
    got = np.asarray(tj.make_projector(projection, layout)(
        {k: jnp.asarray(v) for k, v in grads.items()}))
    expected = torch_projection.make_projector(projection, layout)(
        {k: torch.from_numpy(v) for k, v in grads.items()}).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
