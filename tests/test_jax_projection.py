"""tracinfunc.jax projections: the torch path's matrices bit for bit, and the same outputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tracinfunc as tif
import tracinfunc.jax as tj
from tracinfunc import projection as torch_projection
from tracinfunc.jax.projection import _mulhi32

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
], ids=["rademacher", "sjlt", "identity"])
@pytest.mark.parametrize("cache_bytes", [2**30, 0], ids=["cached", "streamed"])
def test_projector_equals_the_torch_projector(projection, cache_bytes):
    grads = _grads()
    layout = tif.canonical_layout(grads)
    expected = tif.make_projector(projection, layout)(grads).numpy()
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
        layout = tif.canonical_layout({n: g.shape for n, g in grads.items()})
        cached = tj.make_projector(projection, layout)(grads)
        streamed = tj.make_projector(projection, layout, cache_bytes=0)(grads)
        np.testing.assert_allclose(np.asarray(streamed), np.asarray(cached), rtol=1e-6,
                                   atol=1e-6)


def test_projection_does_not_depend_on_dict_order():
    grads = {name: jnp.asarray(g.numpy()) for name, g in _grads().items()}
    layout = tif.canonical_layout({n: g.shape for n, g in grads.items()})
    project = tj.make_projector(tif.Projection(dim=16, seed=2), layout)
    reordered = dict(reversed(list(grads.items())))
    np.testing.assert_array_equal(np.asarray(project(grads)), np.asarray(project(reordered)))


def test_projector_names_missing_extra_and_misshaped_parameters():
    project = tj.make_projector(tif.Projection(dim=8), {"w": (2, 3), "b": (2,)})
    with pytest.raises(tif.InvalidProjectionError, match=r"missing 'b'.*extra 'z'.*'w' has shape"):
        project({"w": jnp.zeros((3, 2)), "z": jnp.zeros(1)})


def test_make_projector_rejects_bad_specs():
    with pytest.raises(TypeError, match="tracinfunc.jax.make_projector: projection must be"):
        tj.make_projector({"dim": 8}, {"w": (2,)})
    with pytest.raises(tif.InvalidProjectionError, match="identity"):
        tj.make_projector(tif.Projection(kind="identity", dim=5), {"w": (2,)})
