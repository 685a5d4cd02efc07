"""score / top_k / self_influence against brute-force TracIn (tests/reference.py)."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tracinfunc as tif
from tests.reference import exact_self_influence, exact_tracin

IDENTITY = tif.Projection(kind="identity")


def _stores(setup, projection=IDENTITY, dtype=torch.float64):
    loss, ckpts, train, test = setup
    store = tif.build_store(loss, ckpts, train, projection=projection, dtype=dtype)
    test_store = tif.build_store(loss, ckpts, test, projection=store.projection, dtype=dtype)
    return store, test_store


def test_identity_scores_equal_exact_tracin_float64(mlp_setup):
    loss, ckpts, train, test = mlp_setup
    store, test_store = _stores(mlp_setup)
    expected = exact_tracin(loss, ckpts, train, test)
    got = tif.score(store, test_store)
    assert got.dtype == torch.float64 and got.shape == (5, 11)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_identity_scores_float32_close_to_exact(mlp_setup32):
    loss, ckpts, train, test = mlp_setup32
    store, test_store = _stores(mlp_setup32, dtype=torch.float32)
    expected = exact_tracin(loss, ckpts, train, test)
    got = tif.score(store, test_store)
    assert got.dtype == torch.float32
    rel = (got.double() - expected).norm() / expected.norm()
    assert rel < 1e-5


def test_self_influence_equals_exact_and_score_diagonal(mlp_setup):
    loss, ckpts, train, _ = mlp_setup
    store, _ = _stores(mlp_setup)
    si = tif.self_influence(store)
    torch.testing.assert_close(si, exact_self_influence(loss, ckpts, train), rtol=1e-10, atol=0)
    torch.testing.assert_close(si, tif.score(store, store).diagonal(), rtol=1e-10, atol=0)


def test_normalize_equals_cosine(mlp_setup):
    loss, ckpts, train, test = mlp_setup
    store, test_store = _stores(mlp_setup)
    expected = exact_tracin(loss, ckpts, train, test, normalize=True)
    torch.testing.assert_close(tif.score(store, test_store, normalize=True), expected,
                               rtol=0, atol=1e-10)


@pytest.mark.parametrize("largest", [True, False])
def test_top_k_equals_argsort_of_full_matrix(mlp_setup32, largest):
    store, test_store = _stores(mlp_setup32, projection=tif.Projection(dim=32, seed=3),
                                dtype=torch.float32)
    full = tif.score(store, test_store)
    values, indices = tif.top_k(store, test_store, k=6, largest=largest, chunk_rows=7)
    order = full.argsort(dim=1, descending=largest)[:, :6]
    assert torch.equal(indices, order)
    torch.testing.assert_close(values, full.gather(1, order))


@pytest.mark.parametrize("as_tensor", [False, True])
def test_large_query_sets_are_split_into_blocks_with_the_same_result(mlp_setup32, monkeypatch,
                                                                     as_tensor):
    """Above _MAX_QUERY_BLOCK test rows top_k scans once per block of queries (the score block
    [n_test, chunk] stays bounded); the result is the one-block result."""
    store, test_store = _stores(mlp_setup32, projection=tif.Projection(dim=32, seed=3),
                                dtype=torch.float32)
    n_test = test_store.meta.n_train
    test = torch.stack([test_store.read_rows(c, 0, n_test) for c in range(
        test_store.meta.n_ckpt)]) if as_tensor else test_store
    whole = tif.top_k(store, test, k=4, normalize=True, rows=(3, store.meta.n_train))
    scans = []

    def counting(store, query, **kwargs):
        scans.append(query.n_test)
        return real(store, query, **kwargs)

    module = sys.modules["tracinfunc.query.top_k"]  # tif.top_k is the function
    real = module.stream_scores
    monkeypatch.setattr(module, "_MAX_QUERY_BLOCK", 2)
    monkeypatch.setattr(module, "stream_scores", counting)
    blocked = tif.top_k(store, test, k=4, normalize=True, rows=(3, store.meta.n_train))
    assert scans == [2] * (n_test // 2) + [n_test % 2] * (n_test % 2)
    assert torch.equal(blocked[1], whole[1])
    # The matmul's float32 rounding may depend on how many test rows share it.
    torch.testing.assert_close(blocked[0], whole[0], rtol=1e-6, atol=1e-7)


def test_top_k_rejects_k_out_of_range(mlp_setup):
    store, test_store = _stores(mlp_setup)
    with pytest.raises(ValueError, match=r"k must be an int in \[1, n_train=11\]"):
        tif.top_k(store, test_store, k=12)


@settings(max_examples=15, deadline=None)
@given(chunk_rows=st.integers(1, 45), normalize=st.booleans())
def test_chunking_never_changes_scores(chunk_rows, normalize):
    from tests.conftest import make_checkpoints, make_data, make_mlp

    model = make_mlp(dtype=torch.float32).eval()
    loss = tif.loss_from_module(model, torch.nn.functional.cross_entropy)
    ckpts = make_checkpoints(model)
    store = tif.build_store(loss, ckpts, make_data(40, dtype=torch.float32),
                            projection=tif.Projection(dim=16, seed=1))
    test = torch.randn(3, 4, 16)
    whole = tif.score(store, test, normalize=normalize, chunk_rows=40)
    chunked = tif.score(store, test, normalize=normalize, chunk_rows=chunk_rows)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


def test_tensor_test_grads_equal_store_test_grads(mlp_setup):
    store, test_store = _stores(mlp_setup)
    as_tensor = torch.stack([test_store.read_rows(c, 0, 5) for c in range(3)])
    torch.testing.assert_close(tif.score(store, as_tensor), tif.score(store, test_store))


def test_score_chunks_streams_row_blocks(mlp_setup):
    store, test_store = _stores(mlp_setup)
    starts = [(start, block.shape) for start, block in
              tif.score_chunks(store, test_store, chunk_rows=4)]
    assert starts == [(0, (5, 4)), (4, (5, 4)), (8, (5, 3))]


# --- errors ------------------------------------------------------------------------------


def test_mismatched_k_is_refused(mlp_setup32):
    loss, ckpts, train, test = mlp_setup32
    store = tif.build_store(loss, ckpts, train, projection=tif.Projection(dim=16, seed=0))
    other = tif.build_store(loss, ckpts, test, projection=tif.Projection(dim=8, seed=0))
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="projection=store.projection"):
        tif.score(store, other)
    with pytest.raises(tif.errors.IncompatibleGradientsError, match=r"k=16\]"):
        tif.score(store, torch.zeros(3, 2, 8))


def test_other_projection_seed_is_refused(mlp_setup32):
    loss, ckpts, train, test = mlp_setup32
    store = tif.build_store(loss, ckpts, train, projection=tif.Projection(dim=16, seed=0))
    other = tif.build_store(loss, ckpts, test, projection=tif.Projection(dim=16, seed=1))
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="seed=1"):
        tif.top_k(store, other, k=2)


def test_checkpoint_count_mismatch_is_refused(mlp_setup32):
    loss, ckpts, train, test = mlp_setup32
    store = tif.build_store(loss, ckpts, train, projection=tif.Projection(dim=16))
    fewer = tif.build_store(loss, ckpts[:2], test, projection=store.projection)
    with pytest.raises(
        tif.errors.IncompatibleGradientsError, match="2 checkpoints but the store has 3"
    ):
        tif.score(store, fewer)
    with pytest.raises(tif.errors.IncompatibleGradientsError, match=r"n_ckpt=3"):
        tif.score(store, torch.zeros(2, 4, 16))


def test_other_checkpoint_weights_are_refused(mlp_setup32):
    loss, ckpts, train, test = mlp_setup32
    store = tif.build_store(loss, ckpts, train, projection=tif.Projection(dim=16))
    swapped = tif.build_store(loss, ckpts[::-1], test, projection=store.projection)
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="checkpoint 0 differs"):
        tif.score(store, swapped)


def test_non_finite_test_tensor_is_refused(mlp_setup32):
    loss, ckpts, train, _ = mlp_setup32
    store = tif.build_store(loss, ckpts, train, projection=tif.Projection(dim=16))
    bad = torch.zeros(3, 2, 16)
    bad[1, 0, 3] = float("nan")
    with pytest.raises(tif.errors.NonFiniteGradientError, match="NaN or inf"):
        tif.score(store, bad)


def test_test_grads_of_wrong_type_are_refused(mlp_setup32):
    loss, ckpts, train, _ = mlp_setup32
    store = tif.build_store(loss, ckpts, train, projection=tif.Projection(dim=16))
    with pytest.raises(TypeError, match="GradientStore or a tensor"):
        tif.score(store, [[1.0]])
