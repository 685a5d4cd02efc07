"""build_index / load_index / indexed_top_k against the exact scan and explicit matrices."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tracinfunc as tif
from tracinfunc.search.rows import read_rows_at, row_groups, weighted_rows
from tracinfunc.store.meta import CheckpointMeta, StoreMeta

LRS = (0.5, -0.2)  # a negative lr: the index must carry its sign to the query side


def _meta(n_train: int, k: int, lrs=LRS, dtype="float64") -> StoreMeta:
    checkpoints = tuple(CheckpointMeta(f"c{i}", lr, f"fp{i}") for i, lr in enumerate(lrs))
    return StoreMeta(projection=tif.Projection(dim=k, seed=0), checkpoints=checkpoints,
                     layout=(("w", (4, k)),), n_train=n_train, k=k, dtype=dtype)


def _clustered(n: int, k: int, n_ckpt: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    """``[n_ckpt, n, k]`` rows around 8 centres, so clusters mean something."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(n_ckpt, 8, k, generator=g, dtype=dtype)
    assign = torch.randint(8, (n,), generator=g)
    return centres[:, assign] + 0.3 * torch.randn(n_ckpt, n, k, generator=g, dtype=dtype)


def _store(n=300, k=16, seed=0, lrs=LRS) -> tif.store.MemoryStore:
    rows = _clustered(n, k, len(lrs), seed)
    return tif.store.MemoryStore(_meta(n, k, lrs), rows, rows.norm(dim=-1))


def _test_grads(k=16, n_test=6, seed=1) -> torch.Tensor:
    return _clustered(n_test, k, len(LRS), seed)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("largest", [True, False])
def test_searching_every_list_equals_exact_top_k(normalize, largest):
    store, test = _store(), _test_grads()
    index = tif.build_index(store, nlist=12, normalize=normalize)
    values, indices = tif.indexed_top_k(store, test, 7, index=index, nprobe=12, normalize=normalize,
                                largest=largest)
    exact_values, exact_indices = tif.top_k(store, test, 7, normalize=normalize,
                                            largest=largest)
    assert torch.equal(indices, exact_indices)
    torch.testing.assert_close(values, exact_values, rtol=1e-12, atol=1e-12)


def test_weighted_rows_inner_product_is_the_tracin_score():
    store, test = _store(n=20), _test_grads()
    rows = torch.stack([store.read_rows(c, 0, 20) for c in range(2)])
    train = weighted_rows(rows, None, LRS, normalize=False, query=False, dtype=torch.float64)
    query = weighted_rows(test, None, LRS, normalize=False, query=True, dtype=torch.float64)
    explicit = sum(lr * test[c] @ rows[c].T for c, lr in enumerate(LRS))  # [n_test, n_train]
    torch.testing.assert_close(query @ train.T, explicit, rtol=1e-12, atol=1e-12)


def test_ivf_pq_values_are_exact_scores_of_the_rows_returned():
    store, test = _store(n=600, k=16), _test_grads()
    index = tif.build_index(store, kind="ivf_pq", nlist=8, m=4)
    values, indices = tif.indexed_top_k(store, test, 5, index=index, nprobe=8, n_candidates=200)
    full = tif.score(store, test)
    torch.testing.assert_close(values, full.gather(1, indices), rtol=1e-12, atol=1e-12)
    exact = tif.top_k(store, test, 5)[1]
    found = (indices[:, :, None] == exact[:, None, :]).any(2).double().mean()
    assert found >= 0.9  # PQ codes rank the candidates; the re-rank is exact


def test_zarr_index_is_saved_beside_the_store_and_reloaded(tmp_path):
    # Stores on disk hold positive lrs only (the negative one above lives in memory metadata).
    store = tif.save_store(_store(lrs=(0.5, 0.2)), tmp_path / "grads.zarr", chunk_rows=16)
    test = _test_grads()
    index = tif.build_index(store, nlist=6)
    assert index.path == tmp_path / "grads.zarr.faiss"
    loaded = tif.load_index(index.path, store)
    assert loaded.fingerprint == index.fingerprint == tif.search.store_fingerprint(store)
    first = tif.indexed_top_k(store, test, 5, index=index, nprobe=3)
    again = tif.indexed_top_k(store, test, 5, index=loaded, nprobe=3)
    assert torch.equal(first[1], again[1]) and torch.equal(first[0], again[0])
    with pytest.raises(tif.errors.StoreExistsError, match="overwrite=True"):
        tif.build_index(store, nlist=6)


def test_load_index_refuses_another_store_naming_the_rows_that_differ(tmp_path):
    store = tif.save_store(_store(seed=0, lrs=(0.5, 0.2)), tmp_path / "a.zarr")
    other = tif.save_store(_store(seed=5, lrs=(0.5, 0.2)), tmp_path / "b.zarr")  # other rows
    index = tif.build_index(store, nlist=6)
    assert tif.search.store_fingerprint(other) != index.fingerprint
    with pytest.raises(tif.errors.IncompatibleGradientsError,
                       match=r"load_index: .*other rows.* row norms differ .*first: row \d+ "
                             r"at checkpoint \d.*rebuild"):
        tif.load_index(index.path, other)


def test_top_k_refuses_an_index_of_a_store_with_other_metadata():
    index = tif.build_index(_store(lrs=LRS), nlist=6)
    store = _store(lrs=(0.5, 0.2))
    with pytest.raises(
        tif.errors.IncompatibleGradientsError, match="indexed_top_k: the index was built for"
    ):
        tif.indexed_top_k(store, _test_grads(), 3, index=index)


def test_top_k_index_argument_errors():
    store = _store()
    index = tif.build_index(store, nlist=6)
    test = _test_grads()
    with pytest.raises(tif.errors.InvalidArgumentError, match="normalize=True but the index"):
        tif.indexed_top_k(store, test, 3, index=index, normalize=True)
    with pytest.raises(TypeError, match="nprobe"):  # search settings are indexed_top_k's
        tif.top_k(store, test, 3, nprobe=2)
    with pytest.raises(tif.errors.InvalidArgumentError, match=r"nprobe must be an int in \[1, 6\]"):
        tif.indexed_top_k(store, test, 3, index=index, nprobe=7)
    with pytest.raises(tif.errors.InvalidArgumentError, match="n_candidates must be an int in"):
        tif.indexed_top_k(store, test, 3, index=index, n_candidates=2)
    with pytest.raises(tif.errors.InvalidTypeError, match="index must be a SearchIndex"):
        tif.indexed_top_k(store, test, 3, index="grads.zarr.faiss")


def test_top_k_has_no_index_mode_approximate_search_is_indexed_top_k():
    store = _store()
    index = tif.build_index(store, nlist=6)
    with pytest.raises(TypeError, match="index"):
        tif.top_k(store, _test_grads(), 3, index=index)


def test_too_few_rows_in_the_searched_lists_says_raise_nprobe():
    store = _store(n=300)
    index = tif.build_index(store, nlist=150)  # ~2 rows per list
    with pytest.raises(tif.errors.InvalidArgumentError, match="fewer than k=50; raise nprobe"):
        tif.indexed_top_k(store, _test_grads(), 50, index=index, nprobe=1, n_candidates=60)


def test_build_index_argument_errors():
    store = _store(n=100, k=16)
    with pytest.raises(tif.errors.InvalidArgumentError, match="kind must be one of 'ivf_flat'"):
        tif.build_index(store, kind="hnsw")
    with pytest.raises(
        tif.errors.InvalidArgumentError, match=r"nlist must be an int in \[1, 100\]"
    ):
        tif.build_index(store, nlist=101)
    with pytest.raises(tif.errors.InvalidArgumentError, match="needs at least 256 rows"):
        tif.build_index(store, kind="ivf_pq", m=4)
    with pytest.raises(tif.errors.InvalidArgumentError, match="m must divide n_ckpt \\* k = 32"):
        tif.build_index(_store(n=300), kind="ivf_pq", nlist=4, m=5)


def test_load_index_without_an_index_is_store_not_found(tmp_path):
    with pytest.raises(tif.errors.StoreNotFoundError, match="load_index: no index at"):
        tif.load_index(tmp_path / "missing.faiss", _store())


def test_missing_faiss_gives_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # `import faiss` now raises ImportError
    with pytest.raises(
        tif.errors.MissingDependencyError, match=r"pip install 'tracinfunc\[search\]'"
    ):
        tif.build_index(_store())


@settings(max_examples=40, deadline=None)
@given(st.sets(st.integers(0, 199), min_size=1, max_size=60), st.integers(1, 40))
def test_row_groups_cover_indices_in_runs_within_a_chunk(rows, chunk_rows):
    indices = torch.tensor(sorted(rows))
    groups = row_groups(indices, chunk_rows)
    assert [i for b, e in groups for i in range(b, e)] == list(range(len(indices)))
    def together(a: int, b: int) -> bool:
        return b == a + 1 or a // chunk_rows == b // chunk_rows

    within = {(b, e) for b, e in groups}
    for position in range(len(indices) - 1):
        a, b = int(indices[position]), int(indices[position + 1])
        same_group = any(begin <= position < end - 1 for begin, end in within)
        assert same_group == together(a, b)


def test_read_rows_at_equals_fancy_indexing(tmp_path):
    memory = _store(n=200, lrs=(0.5, 0.2))  # on disk: positive lrs only
    store = tif.save_store(memory, tmp_path / "g.zarr", chunk_rows=8)
    indices = torch.tensor([0, 1, 2, 5, 7, 8, 40, 41, 42, 43, 99, 150, 199])
    for ckpt in range(2):
        expected = memory.read_rows(ckpt, 0, 200)[indices]
        assert torch.equal(read_rows_at(store, ckpt, indices), expected)
        assert torch.equal(read_rows_at(memory, ckpt, indices), expected)


@pytest.mark.parametrize("quantization", ["int8", "sign"])
def test_a_quantised_store_is_searched_and_re_ranked_over_its_dequantised_rows(quantization):
    float_store = tif.to_memory(_store(lrs=(0.5, 0.2)), dtype=torch.float32)
    store = tif.to_memory(float_store, dtype=quantization)
    test = _test_grads()
    index = tif.build_index(store, nlist=12)
    values, indices = tif.indexed_top_k(store, test, 7, index=index, nprobe=12)
    exact_values, exact_indices = tif.top_k(store, test, 7)
    assert torch.equal(indices, exact_indices)
    torch.testing.assert_close(values, exact_values)
    # Same rows and norms before quantisation, but another storage: another fingerprint.
    assert tif.search.store_fingerprint(store) != tif.search.store_fingerprint(float_store)
    with pytest.raises(
        tif.errors.IncompatibleGradientsError, match="top_k: the index was built for"
    ):
        tif.indexed_top_k(float_store, test, 3, index=index)
