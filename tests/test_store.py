"""GradientStore conformance (MemoryStore today; every store implementation joins here)."""

from __future__ import annotations

import json

import pytest
import torch

import tracinfunc as tif
from tracinfunc.store.meta import StoreMeta

PROJ = tif.Projection(dim=16, seed=0)


@pytest.fixture
def store(mlp_setup32):
    loss, ckpts, train, _ = mlp_setup32
    return tif.build_store(loss, ckpts, train, projection=PROJ)


def test_store_satisfies_protocol(store):
    assert isinstance(store, tif.GradientStore)
    assert store.shape == (3, 40, 16) and len(store) == 40 and store.dtype == torch.float32
    assert "n_train=40" in repr(store) and "epoch-2" in repr(store)


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
    with pytest.raises(tif.ReadOnlyStoreError, match="read-only"):
        store._rows = torch.zeros(1)
    with pytest.raises(tif.ReadOnlyStoreError, match="cannot set 'meta'"):
        store.meta = None
    with pytest.raises(AttributeError):
        store.meta.n_train = 3


def test_memory_store_copies_on_ingest(store):
    rows = torch.stack([store.read_rows(c, 0, 40) for c in range(3)])
    norms = rows.norm(dim=-1)
    copy = tif.MemoryStore(store.meta, rows, norms)
    rows.zero_()
    assert torch.equal(copy.read_rows(0, 0, 40), store.read_rows(0, 0, 40))
    with pytest.raises(ValueError, match="rows must be"):
        tif.MemoryStore(store.meta, rows[:, :3], norms)


def test_meta_roundtrips_through_json(store):
    data = json.loads(json.dumps(store.meta.to_dict()))
    assert StoreMeta.from_dict(data) == store.meta


def test_writer_refuses_appends_after_finish(store):
    writer = tif.MemoryWriter(store.meta.replace(n_train=0, complete=False))
    writer.append(torch.zeros(3, 2, 16), torch.zeros(3, 2))
    finished = writer.finish()
    assert finished.n_train == 2 and finished.meta.complete
    with pytest.raises(tif.ReadOnlyStoreError, match="already finished"):
        writer.append(torch.zeros(3, 2, 16), torch.zeros(3, 2))
