"""GradientStore conformance: every store kind passes the same suite.

The generic suite ships as ``tracinfunc.testing.StoreConformance`` (so users' stores can run
it); every kind runs it below, then the built-in stores' own promises (messages, immutability,
conversions, writers) are tested on stores built from a model.

Zarr stores use tiny chunks and shards (4 and 16 rows) so 40 rows span several shards and
end in a partial one; "zarr-zstd" exercises zarr's own read path (the fallback codec path).
"""

from __future__ import annotations

import functools
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_checkpoints, make_data, make_mlp
from tracinfunc._validate import entry_point
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import check_out_buffer, check_row_range
from tracinfunc.testing import StoreConformance

PROJ = tif.Projection(dim=16, seed=0)
KINDS = ["memory", "pinned", "zarr", "zarr-zstd"]


def store_target(kind, tmp_path):
    if kind in ("memory", "pinned"):
        return kind
    compression = "zstd" if kind == "zarr-zstd" else None
    return functools.partial(tif.store.ZarrWriter, tmp_path / f"{kind}.zarr", chunk_rows=4,
                             shard_rows=16, compression=compression)


def all_rows(store):
    return torch.stack([store.read_rows(c, 0, store.n_train) for c in range(store.n_ckpt)])


def all_norms(store):
    return torch.stack([store.read_norms(c, 0, store.n_train) for c in range(store.n_ckpt)])


@pytest.fixture(scope="module")
def setup():
    model = make_mlp(dtype=torch.float32).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    train = make_data(40, dtype=torch.float32, seed=1)
    test = make_data(7, dtype=torch.float32, seed=3)
    return loss, make_checkpoints(model), train, test


@pytest.fixture(scope="module")
def reference(setup):
    loss, ckpts, train, _ = setup
    return tif.build_store(loss, ckpts, train, projection=PROJ)


# Stores are immutable, so one per kind serves the whole module.
@pytest.fixture(scope="module", params=KINDS)
def store(request, setup, tmp_path_factory):
    loss, ckpts, train, _ = setup
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "no CUDA, not pinned"
        return tif.build_store(loss, ckpts, train, projection=PROJ,
                               store=store_target(request.param, tmp_path_factory.mktemp("s")))


def test_store_satisfies_protocol(store):
    assert isinstance(store, tif.GradientStore)
    assert store.shape == (3, 40, 16) and len(store) == 40 and store.dtype == torch.float32
    assert "n_train=40" in repr(store) and "epoch-2" in repr(store)
    assert store.meta.complete


def test_rows_and_norms_equal_the_memory_store_bit_for_bit(store, reference):
    assert torch.equal(all_rows(store), all_rows(reference))
    assert torch.equal(all_norms(store), all_norms(reference))
    assert store.meta == reference.meta


@pytest.mark.parametrize(("start", "stop"), [(0, 40), (3, 29), (16, 40), (5, 6), (39, 40),
                                             (7, 7)])
def test_any_row_range_reads_the_same(store, reference, start, stop):
    assert torch.equal(store.read_rows(2, start, stop), reference.read_rows(2, start, stop))
    assert torch.equal(store.read_norms(1, start, stop), reference.read_norms(1, start, stop))


def test_read_rows_hands_out_copies(store):
    before = store.read_rows(1, 3, 9)
    before.fill_(123.0)
    after = store.read_rows(1, 3, 9)
    assert not torch.equal(before, after)
    norms = store.read_norms(1, 3, 9)
    norms.zero_()
    assert (store.read_norms(1, 3, 9) > 0).all()


def test_read_rows_into_out_buffer(store):
    buffer = torch.empty(10, 16)
    view = store.read_rows(2, 30, 37, out=buffer)
    assert view.data_ptr() == buffer.data_ptr() and view.shape == (7, 16)
    assert torch.equal(view, store.read_rows(2, 30, 37))
    with pytest.raises(ValueError, match="out has 10 rows, 12 are needed"):
        store.read_rows(0, 0, 12, out=buffer)
    with pytest.raises(ValueError, match="out must be"):
        store.read_rows(0, 0, 2, out=torch.empty(2, 16, dtype=torch.float64))


def test_norms_match_rows(store):
    rows = store.read_rows(0, 0, 40)
    torch.testing.assert_close(store.read_norms(0, 0, 40), rows.norm(dim=-1))


def test_out_of_range_reads_are_refused(store):
    with pytest.raises(IndexError, match="checkpoint index 3 out of range"):
        store.read_rows(3, 0, 1)
    with pytest.raises(IndexError, match=r"row range \[5, 41\)"):
        store.read_rows(0, 5, 41)
    with pytest.raises(IndexError, match=r"row range \[-1, 2\)"):
        store.read_norms(0, -1, 2)


def test_store_is_immutable(store):
    with pytest.raises(tif.errors.ReadOnlyStoreError, match="read-only"):
        store._rows = torch.zeros(1)
    with pytest.raises(tif.errors.ReadOnlyStoreError, match="cannot set 'meta'"):
        store.meta = None
    with pytest.raises(AttributeError):
        store.meta.n_train = 3


def test_meta_roundtrips_through_json(store):
    data = json.loads(json.dumps(store.meta.to_dict()))
    assert StoreMeta.from_dict(data) == store.meta


@pytest.mark.parametrize("target", ["memory", "pinned", "zarr"])
def test_conversions_are_bit_exact(store, target, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        converted = {
            "memory": lambda: tif.to_memory(store),
            "pinned": lambda: tif.to_pinned(store),
            "zarr": lambda: tif.save_store(store, tmp_path / "copy.zarr", chunk_rows=8),
        }[target]()
    expected_type = {"memory": tif.store.MemoryStore, "pinned": tif.store.PinnedStore,
                     "zarr": tif.store.ZarrStore}[target]
    assert type(converted) is expected_type
    assert converted.meta == store.meta
    assert torch.equal(all_rows(converted), all_rows(store))
    assert torch.equal(all_norms(converted), all_norms(store))


@pytest.mark.parametrize("normalize", [False, True])
def test_scores_equal_across_stores(store, reference, setup, normalize):
    loss, ckpts, _, test = setup
    test_store = tif.build_store(loss, ckpts, test, projection=PROJ)
    expected = tif.score(reference, test_store, normalize=normalize)
    for chunk_rows in (None, 7):
        got = tif.score(store, test_store, normalize=normalize, chunk_rows=chunk_rows)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    values, indices = tif.top_k(store, test_store, k=5, chunk_rows=6, normalize=normalize)
    expected_values, expected_indices = tif.top_k(reference, test_store, k=5,
                                                  normalize=normalize)
    assert torch.equal(indices, expected_indices)
    torch.testing.assert_close(values, expected_values, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tif.self_influence(store), tif.self_influence(reference))


class TestMemoryStore(StoreConformance):
    def make_store(self, reference, tmp_path):
        return tif.to_memory(reference)


class TestPinnedStore(StoreConformance):
    def make_store(self, reference, tmp_path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "no CUDA, not pinned"
            return tif.to_pinned(reference)


@pytest.mark.parametrize("compression", [None, "zstd"])
class TestZarrStore(StoreConformance):
    @pytest.fixture
    def store(self, reference, tmp_path, compression):
        return tif.save_store(reference, tmp_path / "s.zarr", chunk_rows=4, shard_rows=16,
                              compression=compression)


class TestUserStore(StoreConformance):
    """The suite as a user runs it on their own store (below: three members, no base class)."""

    def make_store(self, reference, tmp_path):
        return ListStore(reference.meta, all_rows(reference), all_norms(reference))


class ListStore:
    """A user's own store: three members, no subclassing."""

    def __init__(self, meta, rows, norms=None):
        self.rows = rows
        self.norms = rows.norm(dim=-1) if norms is None else norms
        self._meta = meta

    @property
    def meta(self):
        return self._meta

    @entry_point("ListStore.read_rows")
    def read_rows(self, ckpt, start, stop, *, out=None):
        check_row_range(self._meta, ckpt, start, stop)
        rows = self.rows[ckpt, start:stop].clone()
        if out is None:
            return rows
        return check_out_buffer(out, stop - start, self._meta).copy_(rows)

    @entry_point("ListStore.read_norms")
    def read_norms(self, ckpt, start, stop):
        check_row_range(self._meta, ckpt, start, stop)
        return self.norms[ckpt, start:stop].clone()


def test_a_user_store_with_three_members_is_a_gradient_store(reference, tmp_path):
    mine = ListStore(reference.meta, all_rows(reference))
    assert isinstance(mine, tif.GradientStore)
    # One opener, the class's (on the protocol's metaclass): stores themselves have no open.
    assert not hasattr(mine, "open") and callable(tif.GradientStore.open)
    torch.testing.assert_close(tif.score(mine, reference), tif.score(reference, reference))
    saved = tif.save_store(mine, tmp_path / "mine.zarr")
    assert torch.equal(all_rows(tif.GradientStore.open(tmp_path / "mine.zarr")), mine.rows)
    assert saved.raw_reads


def test_writer_refuses_appends_after_finish(reference, tmp_path):
    meta = reference.meta.replace(n_train=0, complete=False)
    for writer in (tif.store.MemoryWriter(meta), tif.store.ZarrWriter(tmp_path / "w.zarr", meta)):
        writer.append(torch.zeros(3, 2, 16), torch.zeros(3, 2))
        finished = writer.finish()
        assert finished.n_train == 2 and finished.meta.complete
        with pytest.raises(tif.errors.ReadOnlyStoreError, match="already finished"):
            writer.append(torch.zeros(3, 2, 16), torch.zeros(3, 2))
    for writer in (tif.store.MemoryWriter(meta), tif.store.PinnedWriter(meta),
                   tif.store.ZarrWriter(tmp_path / "bad.zarr", meta)):
        with pytest.raises(tif.errors.IncompatibleGradientsError,
                           match=r"rows must be \[n_ckpt=3, b, k=16\], got \[2, 2, 16\]"):
            writer.append(torch.zeros(2, 2, 16), torch.zeros(2, 2))


def test_writers_copy_blocks_and_finish_once(reference, tmp_path):
    meta = reference.meta.replace(n_train=0, complete=False)
    for writer in (tif.store.MemoryWriter(meta), tif.store.PinnedWriter(meta),
                   tif.store.ZarrWriter(tmp_path / "f.zarr", meta)):
        rows = torch.ones(3, 2, 16)
        writer.append(rows, rows.norm(dim=-1))
        rows.zero_()  # the caller reuses its buffer before finish: the store must not change
        finished = writer.finish()
        assert torch.equal(all_rows(finished), torch.ones(3, 2, 16)), type(writer).__name__
        with pytest.raises(
            tif.errors.ReadOnlyStoreError, match="finish: the store is already finished"
        ):
            writer.finish()


def test_memory_store_copies_on_ingest(reference):
    rows = all_rows(reference)
    copy = tif.store.MemoryStore(reference.meta, rows, rows.norm(dim=-1))
    rows.zero_()
    assert torch.equal(copy.read_rows(0, 0, 40), reference.read_rows(0, 0, 40))
    with pytest.raises(ValueError, match="rows must be"):
        tif.store.MemoryStore(reference.meta, rows[:, :3], rows.norm(dim=-1))


def test_pinned_store_says_once_that_it_is_not_pinned_without_cuda(reference):
    if torch.cuda.is_available():
        assert tif.to_pinned(reference).pinned
        return
    from tracinfunc.store.memory import pinned

    pinned._warn_not_pinned.cache_clear()
    with pytest.warns(RuntimeWarning, match="CUDA is not available") as record:
        first, second = tif.to_pinned(reference), tif.to_pinned(reference)
    assert len(record) == 1 and not first.pinned and not second.pinned


def test_score_chunks_writes_into_out(store, setup):
    loss, ckpts, _, test = setup
    test_store = tif.build_store(loss, ckpts, test, projection=PROJ)
    out = torch.full((7, 40), float("nan"))
    starts = [start for start, block in tif.score_chunks(store, test_store, out=out,
                                                         chunk_rows=16)]
    assert starts == [0, 16, 32]
    torch.testing.assert_close(out, tif.score(store, test_store), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"out must be \[7, 40\] torch.float32"):
        next(tif.score_chunks(store, test_store, out=torch.empty(7, 39)))
