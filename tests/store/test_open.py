"""``GradientStore.open`` is the documented door, and protocol membership stays as it was.

The opener lives on the protocol's metaclass: ``isinstance(x, GradientStore)`` still asks for
``meta``, ``read_rows`` and ``read_norms`` only, so every store, including one a user writes
without subclassing, keeps passing it (``score`` refuses anything else).
"""

from __future__ import annotations

import typing

import pytest
import torch

import tracinfunc as tif
from tracinfunc.query.rows import row_range

PROJ = tif.Projection(dim=8, seed=0)


class UserStore:
    """A store written by a user: the three protocol members, no subclassing, no ``open``."""

    def __init__(self, store):
        self._store = store

    @property
    def meta(self):
        return self._store.meta

    def read_rows(self, ckpt, start, stop, *, out=None):
        return self._store.read_rows(ckpt, start, stop, out=out)

    def read_norms(self, ckpt, start, stop):
        return self._store.read_norms(ckpt, start, stop)


@pytest.fixture
def built(mlp_setup32):
    loss, ckpts, train, test = mlp_setup32
    store = tif.build_store(loss, ckpts, train, projection=PROJ)
    return loss, ckpts, train, store, tif.build_store(loss, ckpts, test, projection=PROJ)


def _in_memory_kinds(built):
    loss, ckpts, train, store, _ = built
    quantized = tif.build_store(loss, ckpts, train, projection=PROJ, dtype="int8")
    return {
        "memory": store,
        "pinned": tif.to_pinned(store),
        "quantized-memory": quantized,
        "quantized-pinned": tif.to_pinned(quantized),
        "row-range": row_range(store, (3, 17)),
        "user": UserStore(store),
    }


def test_open_is_no_protocol_member_and_every_store_kind_stays_a_gradient_store(built):
    assert typing._get_protocol_attrs(tif.GradientStore) == {"meta", "read_rows", "read_norms"}
    test = built[4]
    for name, store in _in_memory_kinds(built).items():
        assert isinstance(store, tif.GradientStore), name
        assert not hasattr(store, "open"), name  # the opener is the class's, not the stores'
        assert tif.score(store, test).shape == (7, store.meta.n_train), name


def test_something_with_an_open_but_not_the_protocol_is_no_store(built):
    class OnlyOpen:
        meta = built[3].meta

        def open(self, path):
            return self

        def read_rows(self, ckpt, start, stop, *, out=None):
            raise NotImplementedError

    assert not isinstance(OnlyOpen(), tif.GradientStore)  # no read_norms
    with pytest.raises(tif.errors.InvalidTypeError, match="test_grads must be a GradientStore"):
        tif.score(built[3], OnlyOpen())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, "int8", "sign"])
def test_every_disk_store_kind_opens_both_ways_with_the_same_rows(built, tmp_path, dtype):
    loss, ckpts, train, _, test = built
    path = tmp_path / "grads.zarr"
    written = tif.build_store(loss, ckpts, train, projection=PROJ, dtype=dtype, store=path)
    by_class, by_function = tif.GradientStore.open(path), tif.open_store(str(path))
    assert type(by_class) is type(by_function) is type(written)
    assert by_class.meta == by_function.meta == written.meta
    for c in range(written.meta.n_ckpt):
        n = written.meta.n_train
        assert torch.equal(by_class.read_rows(c, 0, n), by_function.read_rows(c, 0, n))
        assert torch.equal(by_class.read_norms(c, 0, n), written.read_norms(c, 0, n))
    assert isinstance(by_class, tif.GradientStore)
    assert torch.equal(tif.score(by_class, test), tif.score(written, test))


def test_a_sharded_committed_store_opens_both_ways(built, tmp_path):
    loss, ckpts, train, store, _ = built
    path = tmp_path / "grads.zarr"
    for index in range(2):
        tif.build_store(loss, ckpts, train, projection=PROJ, store=path, shard=(index, 2))
    tif.store.commit_store(path)
    n = store.meta.n_train
    assert torch.equal(tif.GradientStore.open(path).read_rows(1, 0, n),
                       tif.open_store(path).read_rows(1, 0, n))
    assert torch.equal(tif.GradientStore.open(path).read_rows(1, 0, n), store.read_rows(1, 0, n))


def test_open_refuses_what_open_store_refuses(built, tmp_path):
    with pytest.raises(tif.errors.StoreNotFoundError, match="^GradientStore.open: no zarr store"):
        tif.GradientStore.open(tmp_path / "missing.zarr")
    with pytest.raises(tif.errors.StoreNotFoundError, match="^open_store: no zarr store"):
        tif.open_store(tmp_path / "missing.zarr")
    loss, ckpts, train, _, _ = built
    path = tmp_path / "half.zarr"

    def dying():
        yield train[0][:8], train[1][:8]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tif.build_store(loss, ckpts, dying(), projection=PROJ, store=path)
    with pytest.raises(tif.errors.IncompleteStoreError):
        tif.GradientStore.open(path)
    with pytest.raises(TypeError):
        tif.GradientStore.open(path, True)  # options are keywords, as for open_store
