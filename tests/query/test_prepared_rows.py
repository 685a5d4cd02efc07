"""A query reads a test store's rows once into its own tensor and scales that in place: the
test store, the caller's tensors and every other store's rows stay as they were."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_checkpoints, make_data, make_mlp
from tracinfunc.query.prepared import prepare_query

SPEC = tif.Projection(dim=8, seed=1)


def stores():
    model = make_mlp()
    checkpoints = make_checkpoints(model)
    loss = tif.loss_from_module(model, F.cross_entropy)
    train = tif.build_store(loss, checkpoints, make_data(12, seed=3), projection=SPEC)
    test = tif.build_store(loss, checkpoints, make_data(5, seed=4), projection=SPEC)
    return train, test


def all_rows(store):
    return torch.stack([store.read_rows(c, 0, store.meta.n_train)
                        for c in range(store.meta.n_ckpt)])


class OwnTensors:
    """A store that ignores ``out`` and returns a tensor of its own (a user's store)."""

    def __init__(self, store):
        self._store = store

    @property
    def meta(self):
        return self._store.meta

    def read_rows(self, ckpt, start, stop, *, out=None):
        return self._store.read_rows(ckpt, start, stop)

    def read_norms(self, ckpt, start, stop):
        return self._store.read_norms(ckpt, start, stop)


def test_store_rows_are_lr_weighted_and_the_store_is_unchanged():
    train, test = stores()
    before = all_rows(test)
    query = prepare_query(train, test, device="cpu")
    lrs = torch.tensor(train.meta.lrs, dtype=before.dtype)[:, None, None]
    assert torch.equal(query.rows, before * lrs)
    assert torch.equal(all_rows(test), before)
    assert torch.equal(tif.score(train, test, device="cpu"), tif.score(train, before))


def test_caller_tensor_is_never_scaled_in_place():
    train, test = stores()
    rows = all_rows(test)
    kept = rows.clone()
    first = tif.score(train, rows, device="cpu")
    assert torch.equal(rows, kept)
    assert torch.equal(tif.score(train, rows, device="cpu"), first)


def test_store_that_ignores_out_gives_the_same_query():
    train, test = stores()
    got = prepare_query(train, OwnTensors(test), device="cpu")
    expected = prepare_query(train, test, device="cpu")
    assert torch.equal(got.rows, expected.rows)
    assert torch.equal(got.norms, expected.norms)
