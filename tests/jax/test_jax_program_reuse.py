"""Compiled JAX programs are reused across calls (builds and fits), never keep their loss
alive, and the shortcuts that make warm calls cheap never change a result (issue 32 item 4).

References are the plain-JAX computations (``jax.vmap(jax.grad)``, explicit index maps) and
the uncached paths, in float32 with tolerances at its rounding.
"""

from __future__ import annotations

import gc
import math

import jax
import numpy as np
import pytest
import torch

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.jax_helpers import flax_mlp_loss, flax_template, paired_mlp, to_jax_batch
from tracinfunc import projection as torch_projection
from tracinfunc.jax import build as jax_build
from tracinfunc.jax import capture as jax_capture
from tracinfunc.jax import fit as jax_fit
from tracinfunc.jax import grads as jax_grads

nn = pytest.importorskip("flax.linen")
MODEL = nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(3)])  # paired_mlp's torch twin


def _new_loss():
    """A new function (nothing cached for it) computing flax_mlp_loss through Flax layers."""
    def loss(variables, example):
        x, y = example
        return -jax.nn.log_softmax(MODEL.apply(variables, x))[y]
    return loss


def _new_logits():
    def logits(variables, x):
        return MODEL.apply(variables, x)
    return logits


def _cache_sizes() -> tuple[int, ...]:
    gc.collect()
    return (len(jax_grads._PROGRAMS), len(jax_capture._IO), len(jax_fit._LOGITS),
            len(jax_build._CHECKED_LOSSES))


def test_a_dropped_loss_frees_every_program_it_compiled():
    _, _, _, jax_ckpts, mapping, train, _ = paired_mlp(n_train=12)
    batch = to_jax_batch(train)
    projection = tif.Projection(dim=8, seed=1)
    before = _cache_sizes()
    for _ in range(3):
        loss, logits = _new_loss(), _new_logits()
        tj.build_store(loss, jax_ckpts, batch, projection=projection, mapping=mapping)
        tj.per_sample_grads(loss)(jax_ckpts[0].params, batch)
        for kind in ("projected", "dense", "kfac"):
            tj.fit_curvature(loss, jax_ckpts, batch, kind=kind, mapping=mapping,
                             projection=projection,
                             sampler=tj.classification_sampler(logits))
        assert _cache_sizes() > before  # held while the loss lives
        del loss, logits
    assert _cache_sizes() == before  # every loss (and logits) dropped: nothing kept


def test_a_held_function_keeps_its_loss_and_traces_new_shapes():
    _, _, _, jax_ckpts, _, train, _ = paired_mlp(n_train=12)
    x, y = to_jax_batch(train)
    params = jax_ckpts[1].params
    fn = tj.per_sample_grads(_new_loss())  # the only reference to that loss
    gc.collect()
    for size in (12, 5):  # a new batch shape traces the loss again
        got = fn(params, (x[:size], y[:size]))
        want = jax.vmap(jax.grad(flax_mlp_loss), in_axes=(None, 0))(params, (x[:size], y[:size]))
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6,
                                                                       atol=1e-7), got, want)


@pytest.mark.parametrize("kind", ["dense", "kfac", "ekfac"])
def test_a_second_fit_compiles_nothing_and_fits_the_same(kind):
    _, _, _, jax_ckpts, mapping, train, _ = paired_mlp(n_train=20)
    x, y = to_jax_batch(train)
    batches = [(x[:10], y[:10]), (x[10:], y[10:])]
    loss, logits = _new_loss(), _new_logits()
    sampler = tj.classification_sampler(logits)
    first = tj.fit_curvature(loss, jax_ckpts, batches, kind=kind, mapping=mapping,
                             sampler=sampler)
    programs = {key: value for key, value in jax_grads._PROGRAMS.get(loss, {}).items()}
    io = dict(jax_capture._IO.get(loss, {}))
    again = tj.fit_curvature(loss, jax_ckpts, batches, kind=kind, mapping=mapping,
                             sampler=sampler)
    assert dict(jax_grads._PROGRAMS.get(loss, {})) == programs  # the same objects, no new
    assert dict(jax_capture._IO.get(loss, {})) == io
    for program in programs.values():
        assert program._cache_size() == 1  # 3 checkpoints x 2 batches x 2 fits
    assert jax_fit._LOGITS[logits]["program"]._cache_size() == 1
    fresh = tj.fit_curvature(_new_loss(), jax_ckpts, batches, kind=kind, mapping=mapping,
                             sampler=tj.classification_sampler(_new_logits()))
    for c in range(len(jax_ckpts)):
        for key, value in first.estimates[c].items():
            np.testing.assert_array_equal(again.estimates[c][key].numpy(), value.numpy())
            np.testing.assert_array_equal(fresh.estimates[c][key].numpy(), value.numpy())


def test_reordered_matrix_is_the_stacked_matrix_with_rows_permuted():
    """Rows in the mapping's leaf order and JAX layouts: row i of the reordered matrix is the
    torch-layout row of the same parameter entry, bit for bit."""
    mapping = tj.ParamMapping.flax(flax_template(d_in=5, hidden=4, d_out=3))
    projection = tif.Projection(dim=7, seed=4)
    project = tj.make_projector(projection, mapping.layout)
    stacked = np.asarray(next(iter(project.blocks.values())))
    reordered = np.asarray(project._reordered([(leaf.name, leaf.axes)
                                              for leaf in mapping.leaves]))
    offsets, start = {}, 0
    for name, shape in mapping.layout:
        offsets[name] = start
        start += math.prod(shape)
    row = 0
    for leaf in mapping.leaves:  # walk every JAX-layout entry by hand
        jax_shape = tuple(leaf.shape[i] for i in np.argsort(leaf.axes)) if leaf.axes else \
            leaf.shape
        for index in np.ndindex(*jax_shape):
            torch_index = tuple(index[a] for a in leaf.axes) if leaf.axes else index
            flat = offsets[leaf.name] + np.ravel_multi_index(torch_index, leaf.shape)
            np.testing.assert_array_equal(reordered[row], stacked[flat])
            row += 1
    assert row == stacked.shape[0]
    with pytest.raises(tif.errors.InvalidProjectionError, match="projector's parameters"):
        project._reordered([(mapping.leaves[0].name, None)])
    sparse = tj.make_projector(tif.Projection(dim=7, seed=4, kind="sjlt", nnz=2),
                               mapping.layout)
    assert sparse._reordered([(leaf.name, leaf.axes) for leaf in mapping.leaves]) is None


def test_projected_rows_through_the_reordered_matrix_equal_torch_rows():
    loss, ckpts, jax_loss, jax_ckpts, mapping, train, _ = paired_mlp(n_train=9)
    projection = tif.Projection(dim=16, seed=6)
    expected = tif.projected_grads(loss, projection)(ckpts[0].params, train).numpy()
    got = tj.projected_grads(jax_loss, projection, mapping=mapping)(
        jax_ckpts[0].params, to_jax_batch(train))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)
    # the cached projector keeps one [p, k] matrix, in mapping order (no second copy)
    held = [p for key, p in jax_grads._PROJECTORS.items() if key[:2] == (projection, mapping)]
    assert len(held) == 1 and list(held[0].blocks) == [jax_grads._IN_MAPPING_ORDER]
    expected_block = torch.cat([torch_projection.rademacher_block(projection, name, shape, 0,
                                                                  math.prod(shape))
                                for name, shape in mapping.layout])
    assert tuple(held[0].blocks[jax_grads._IN_MAPPING_ORDER].shape) == tuple(
        expected_block.shape)


def test_fingerprints_follow_torch_tensors_changed_in_place():
    """A checkpoint made of torch tensors shares their memory: training on changes the
    weights, so its fingerprint is computed anew; JAX arrays are immutable, so theirs is
    kept, and equals a fresh computation."""
    _, ckpts, jax_loss, jax_ckpts, mapping, train, _ = paired_mlp(n_train=6)
    batch = to_jax_batch(train)
    projection = tif.Projection(dim=8, seed=0)
    tensors = {path: torch.tensor(np.asarray(leaf)) for path, leaf in
               jax.tree_util.tree_flatten_with_path(jax_ckpts[0].params)[0]}
    params = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(jax_ckpts[0].params), list(tensors.values()))
    shared = tj.Checkpoint(params, lr=0.1, name="live")
    first = tj.build_store(jax_loss, [shared], batch, projection=projection, mapping=mapping)
    with torch.no_grad():
        next(iter(tensors.values())).add_(1.0)  # the user trains on
    second = tj.build_store(jax_loss, [shared], batch, projection=projection, mapping=mapping)
    assert first.meta.checkpoints[0].fingerprint != second.meta.checkpoints[0].fingerprint
    own = jax_ckpts[1]
    once = tj.build_store(jax_loss, [own], batch, projection=projection, mapping=mapping)
    twice = tj.build_store(jax_loss, [own], batch, projection=projection, mapping=mapping)
    fresh = own.to_torch(mapping).fingerprint
    assert once.meta.checkpoints[0].fingerprint == twice.meta.checkpoints[0].fingerprint == fresh
    assert fresh == ckpts[1].fingerprint  # the torch twin's


def test_the_loss_check_is_skipped_only_for_a_signature_that_passed():
    _, _, _, jax_ckpts, mapping, train, _ = paired_mlp(n_train=6)
    x, y = to_jax_batch(train)
    projection = tif.Projection(dim=8, seed=0)

    def picky(variables, example):  # traces only for 6 input features
        if example[0].shape[-1] != 6:
            raise ValueError("six features expected")
        return flax_mlp_loss(variables, example)

    tj.build_store(picky, jax_ckpts, (x, y), projection=projection, mapping=mapping)
    tj.build_store(picky, jax_ckpts, (x, y), projection=projection, mapping=mapping)
    for _ in range(2):  # another example shape is traced again, and refused every time
        with pytest.raises(tif.errors.LossFunctionError, match="six features expected"):
            tj.build_store(picky, jax_ckpts, (x[:, :5], y), projection=projection,
                           mapping=mapping)
