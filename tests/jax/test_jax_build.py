"""Stores written from JAX are scored by torch code, and the other way round."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.jax_helpers import as_numpy, flax_template, paired_mlp, to_jax_batch

PROJECTIONS = [tif.Projection(dim=32, seed=11), tif.Projection(dim=32, seed=11, kind="sjlt",
                                                               nnz=2)]
KRONECKER = tif.Projection(dim=32, seed=11, kind="kronecker")


def _rel_err(got, expected) -> float:
    got, expected = as_numpy(got).astype(np.float64), as_numpy(expected).astype(np.float64)
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def _stores(projection):
    loss, ckpts, jax_loss, jax_ckpts, mapping, train, test = paired_mlp(n_train=40, n_test=7)
    torch_train = tif.build_store(loss, ckpts, train, projection=projection)
    torch_test = tif.build_store(loss, ckpts, test, projection=projection)
    # Batches from JAX and from torch (imported by DLPack), in two pieces.
    x, y = to_jax_batch(train)
    batches = [(x[:25], y[:25]), (train[0][25:], train[1][25:])]
    jax_train = tj.build_store(jax_loss, jax_ckpts, batches,
                               projection=projection, mapping=mapping, chunk_size=16)
    jax_test = tj.build_store(jax_loss, jax_ckpts, to_jax_batch(test), projection=projection,
                              mapping=mapping)
    return torch_train, torch_test, jax_train, jax_test


@pytest.mark.parametrize("projection", [*PROJECTIONS, KRONECKER],
                         ids=["rademacher", "sjlt", "kronecker"])
def test_jax_and_torch_stores_score_the_same(projection):
    torch_train, torch_test, jax_train, jax_test = _stores(projection)
    assert jax_train.meta.layout == torch_train.meta.layout
    assert [c.fingerprint for c in jax_train.meta.checkpoints] == [
        c.fingerprint for c in torch_train.meta.checkpoints]
    expected = tif.score(torch_train, torch_test)
    _, expected_top = tif.top_k(torch_train, torch_test, k=10)
    for train, test in [(jax_train, jax_test), (jax_train, torch_test), (torch_train, jax_test)]:
        assert _rel_err(tif.score(train, test), expected) <= 1e-5
        _, top = tif.top_k(train, test, k=10)
        assert torch.equal(top, expected_top)
        assert _rel_err(tif.self_influence(train), tif.self_influence(torch_train)) <= 1e-5


@pytest.mark.parametrize("projection", [PROJECTIONS[0], KRONECKER],
                         ids=["rademacher", "kronecker"])
def test_jax_store_rows_match_torch_rows(projection):
    torch_train, _, jax_train, _ = _stores(projection)
    for c in range(torch_train.n_ckpt):
        np.testing.assert_allclose(jax_train.read_rows(c, 0, 40).numpy(),
                                   torch_train.read_rows(c, 0, 40).numpy(), rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(jax_train.read_norms(c, 0, 40).numpy(),
                                   torch_train.read_norms(c, 0, 40).numpy(), rtol=1e-5)


def test_unmapped_flax_tree_is_refused_at_score_time():
    projection = PROJECTIONS[0]
    loss, ckpts, jax_loss, jax_ckpts, _, train, test = paired_mlp(n_train=6, n_test=3)
    wrong = tj.ParamMapping.identity(flax_template(), rename=lambda n: (
        n.removeprefix("params.").replace("layers_", "").replace("kernel", "weight")))
    jax_store = tj.build_store(jax_loss, jax_ckpts, to_jax_batch(train), projection=projection,
                               mapping=wrong)
    torch_test = tif.build_store(loss, ckpts, test, projection=projection)
    with pytest.raises(tif.errors.IncompatibleGradientsError,
                       match=r"score: .*'0.weight' is \[8, 6\], expected \[6, 8\] \(transposed"):
        tif.score(jax_store, torch_test)


def test_build_store_options_and_errors():
    _, _, jax_loss, jax_ckpts, mapping, train, _ = paired_mlp(n_train=5)
    batch = to_jax_batch(train)
    projection = PROJECTIONS[0]
    half = tj.build_store(jax_loss, jax_ckpts[:1], batch, projection=projection,
                          mapping=mapping, dtype=jnp.float16,
                          store=lambda meta: tif.store.MemoryWriter(meta))
    assert half.meta.dtype == "float16" and half.shape == (1, 5, 32)
    with pytest.raises(
        tif.errors.EmptyDataError, match="tracinfunc.jax.build_store: data holds no"
    ):
        tj.build_store(jax_loss, jax_ckpts, [], projection=projection, mapping=mapping)
    with pytest.raises(tif.errors.LossFunctionError, match="must return a scalar"):
        tj.build_store(lambda p, ex: jnp.ones(2), jax_ckpts, batch, projection=projection,
                       mapping=mapping)
    with pytest.raises(TypeError, match="projection must be a tracinfunc.Projection"):
        tj.build_store(jax_loss, jax_ckpts, batch, projection=32)
    with pytest.raises(
        tif.errors.IncompatibleGradientsError, match="differ in parameter structure"
    ):
        tj.build_store(jax_loss, [jax_ckpts[0], tj.Checkpoint({"w": jnp.zeros(2)})], batch,
                       projection=projection)
    bad = (batch[0].at[0, 0].set(jnp.nan), batch[1])
    with pytest.raises(tif.errors.NonFiniteGradientError, match=r"examples \[0\]"):
        tj.build_store(jax_loss, jax_ckpts, bad, projection=projection, mapping=mapping)


def test_checkpoint_to_torch_round_trips_weights():
    _, ckpts, _, jax_ckpts, mapping, *_ = paired_mlp()
    back = jax_ckpts[2].to_torch(mapping)
    assert back.fingerprint == ckpts[2].fingerprint
    assert back.lr == ckpts[2].lr and back.name == ckpts[2].name


@pytest.mark.parametrize("projection", PROJECTIONS, ids=["rademacher", "sjlt"])
def test_a_zarr_store_written_from_jax_is_opened_and_scored_by_torch(projection, tmp_path):
    loss, ckpts, jax_loss, jax_ckpts, mapping, train, test = paired_mlp(n_train=40, n_test=7)
    tj.build_store(jax_loss, jax_ckpts, to_jax_batch(train), projection=projection,
                   mapping=mapping, store=str(tmp_path / "jax.zarr"))
    tif.build_store(loss, ckpts, train, projection=projection, store=str(tmp_path / "pt.zarr"))
    from_jax = tif.open_store(str(tmp_path / "jax.zarr"))
    from_torch = tif.open_store(str(tmp_path / "pt.zarr"))
    assert (
        isinstance(from_jax, tif.store.ZarrStore) and from_jax.meta.layout == from_torch.meta.layout
    )
    torch_test = tif.build_store(loss, ckpts, test, projection=projection)
    jax_test = tj.build_store(jax_loss, jax_ckpts, to_jax_batch(test), projection=projection,
                              mapping=mapping)
    expected = tif.score(from_torch, torch_test)
    _, expected_top = tif.top_k(from_torch, torch_test, k=10)
    for train_store, test_store in [(from_jax, torch_test), (from_torch, jax_test)]:
        assert _rel_err(tif.score(train_store, test_store), expected) <= 1e-5
        assert torch.equal(tif.top_k(train_store, test_store, k=10)[1], expected_top)


def test_an_interrupted_jax_zarr_build_resumes_to_the_same_bits(tmp_path):
    _, _, jax_loss, jax_ckpts, mapping, train, _ = paired_mlp(n_train=40)
    x, y = to_jax_batch(train)
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 40, 8)]
    options = dict(projection=PROJECTIONS[0], mapping=mapping)
    whole = tj.build_store(jax_loss, jax_ckpts, batches, **options,
                           store=str(tmp_path / "whole.zarr"))

    def small_shards(meta):
        return tif.store.ZarrWriter(tmp_path / "cut.zarr", meta, chunk_rows=8, shard_rows=16)

    class Interrupted(Exception):
        pass

    def dies_after_three():
        for i, batch in enumerate(batches):
            if i == 3:
                raise Interrupted
            yield batch

    with pytest.raises(Interrupted):
        tj.build_store(jax_loss, jax_ckpts, dies_after_three(), **options, store=small_shards)
    with pytest.raises(tif.errors.IncompleteStoreError):
        tif.open_store(str(tmp_path / "cut.zarr"))
    resumed = tj.build_store(jax_loss, jax_ckpts, batches, **options, store=small_shards)
    for c in range(whole.n_ckpt):
        assert torch.equal(resumed.read_rows(c, 0, 40), whole.read_rows(c, 0, 40))


@pytest.mark.parametrize("kind", ["pinned", "zarr"])
def test_every_writer_takes_jax_and_numpy_blocks(kind, tmp_path):
    loss, ckpts, _, _, _, train, _ = paired_mlp(n_train=12)
    store = tif.build_store(loss, ckpts, train, projection=PROJECTIONS[0])
    meta = store.meta.replace(n_train=0, complete=False)
    rows = np.stack([store.read_rows(c, 0, 12).numpy() for c in range(store.n_ckpt)])
    norms = np.stack([store.read_norms(c, 0, 12).numpy() for c in range(store.n_ckpt)])
    writer = (tif.store.PinnedWriter(meta) if kind == "pinned"
              else tif.store.ZarrWriter(tmp_path / "w.zarr", meta))
    writer.append(jnp.asarray(rows[:, :5]), jnp.asarray(norms[:, :5]))
    writer.append(rows[:, 5:], norms[:, 5:])
    again = writer.finish()
    for c in range(store.n_ckpt):
        assert torch.equal(again.read_rows(c, 0, 12), store.read_rows(c, 0, 12))


@pytest.mark.parametrize("dtype", ["int8", jnp.int8, "sign"], ids=["int8", "jnp.int8", "sign"])
def test_the_jax_frontend_writes_quantised_stores_through_the_shared_writers(dtype, tmp_path):
    from tracinfunc.store.codes import quantize

    _, _, jax_loss, jax_ckpts, mapping, train, _ = paired_mlp(n_train=12)
    options = {"projection": PROJECTIONS[0], "mapping": mapping}
    batch = to_jax_batch(train)
    plain = tj.build_store(jax_loss, jax_ckpts, batch, **options)
    quantized = tj.build_store(jax_loss, jax_ckpts, batch, **options, dtype=dtype,
                               store=tmp_path / "q.zarr")
    name = "sign" if dtype == "sign" else "int8"
    assert quantized.meta.quantization == name and quantized.meta.dtype == "float32"
    for c in range(plain.n_ckpt):
        codes, scales = quantized.read_codes(c, 0, 12)
        expected_codes, expected_scales = quantize(plain.read_rows(c, 0, 12), name)
        assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)
        assert torch.equal(quantized.read_norms(c, 0, 12), plain.read_norms(c, 0, 12))
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match=r"jax.build_store: dtype must be a storage dtype.*'sign'.*got "
                             r"torch.int4. Pass e.g."):
        tj.build_store(jax_loss, jax_ckpts, batch, **options, dtype="int4")
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match="unsupported storage dtype 'int9'.*'int8' or 'sign'"):
        tj.build_store(jax_loss, jax_ckpts, batch, **options, dtype="int9")


def test_a_list_of_batches_writes_rows_in_place_and_equals_a_generator(monkeypatch):
    """A list's size is known: the in-memory store takes its rows in place (no blocks joined
    at the end) and its progress bar a total; the rows are those of the same batches as a
    generator, bit for bit."""
    from tracinfunc.jax.build import known_rows
    from tracinfunc.store.memory import dense

    _, _, jax_loss, jax_ckpts, mapping, train, _ = paired_mlp(n_train=40, n_test=7)
    x, y = to_jax_batch(train)
    batches = [(x[:25], y[:25]), (train[0][25:], train[1][25:])]
    assert known_rows(batches) == 40 and known_rows(iter(batches)) is None
    assert known_rows((x, y)) == 40 and known_rows({"x": np.zeros((3, 2))}) == 3
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*train), batch_size=8)
    assert known_rows(loader) == 40  # a DataLoader over a sized dataset: its bar's total
    joins = []
    monkeypatch.setattr(dense, "_joined", lambda blocks: joins.append(1) or torch.cat(blocks, 1))
    blockwise = tj.build_store(jax_loss, jax_ckpts, iter(batches), projection=KRONECKER,
                               mapping=mapping)
    assert joins == [1, 1]
    joins.clear()
    in_place = tj.build_store(jax_loss, jax_ckpts, batches, projection=KRONECKER,
                              mapping=mapping)
    assert joins == []
    for c in range(in_place.n_ckpt):
        assert torch.equal(in_place.read_rows(c, 0, 40), blockwise.read_rows(c, 0, 40))
        assert torch.equal(in_place.read_norms(c, 0, 40), blockwise.read_norms(c, 0, 40))
