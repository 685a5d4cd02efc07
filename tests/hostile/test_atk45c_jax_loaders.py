"""atk45c: ``tracinfunc.jax.build_store`` over torch ``DataLoader``s whose size is claimed.

docs/concepts/memory.md "In-memory builds of known size": a ``DataLoader``'s size is a hint,
never trusted; a store of exactly the rows yielded, the same as the same batches given as a
generator. Each case is compared bit for bit with ``iter(list_of_batches)``.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

pytest.importorskip("jax")

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.jax_helpers import paired_mlp

N = 40
BATCH = 8


@pytest.fixture(scope="module")
def setup():
    _, _, jax_loss, jax_ckpts, mapping, train, _ = paired_mlp(n_train=N, n_test=7)
    return jax_loss, jax_ckpts, mapping, train


def _build(setup, data, **kw):
    jax_loss, jax_ckpts, mapping, _ = setup
    return tj.build_store(jax_loss, jax_ckpts, data, projection=tif.Projection(dim=16, seed=0),
                          mapping=mapping, **kw)


def _batches(train, n, batch):
    x, y = train[0][:n], train[1][:n]
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]


def _rows(store):
    return torch.stack([torch.as_tensor(store.read_rows(c, 0, store.n_train)) for c in range(store.n_ckpt)])


def _norms(store):
    return torch.stack([torch.as_tensor(store.read_norms(c, 0, store.n_train)) for c in range(store.n_ckpt)])


def _assert_same(setup, store, batches):
    ref = _build(setup, iter(batches))
    n = sum(len(b[1]) for b in batches)
    assert ref.n_train == n
    assert store.n_train == n, f"n_train {store.n_train}, expected {n}"
    assert tuple(store.shape) == tuple(ref.shape)
    assert torch.equal(_rows(store), _rows(ref)), "rows differ from the generator build"
    assert torch.equal(_norms(store), _norms(ref)), "norms differ from the generator build"


class _Claimed(IterableDataset):
    """Yields the first ``n`` examples; ``__len__`` says ``claim`` (or raises)."""

    def __init__(self, train, n, claim):
        self.x, self.y, self.n, self.claim = train[0], train[1], n, claim

    def __iter__(self):
        for i in range(self.n):
            yield self.x[i], self.y[i]

    def __len__(self):
        if isinstance(self.claim, BaseException):
            raise self.claim
        return self.claim


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n", [40, 37])
def test_tensor_dataset_loader(setup, n, drop_last):
    train = setup[3]
    ds = TensorDataset(train[0][:n], train[1][:n])
    loader = DataLoader(ds, batch_size=BATCH, shuffle=False, drop_last=drop_last)
    batches = _batches(train, n, BATCH)
    if drop_last:
        batches = [b for b in batches if len(b[1]) == BATCH]
    _assert_same(setup, _build(setup, loader), batches)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("claim", [10, 39, 41, 80, 10**12])
def test_iterable_dataset_wrong_len(setup, claim, drop_last):
    train = setup[3]
    n = 37
    loader = DataLoader(_Claimed(train, n, claim), batch_size=BATCH, drop_last=drop_last)
    batches = _batches(train, n, BATCH)
    if drop_last:
        batches = [b for b in batches if len(b[1]) == BATCH]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "Length of IterableDataset ... was reported"
        store = _build(setup, loader)
    _assert_same(setup, store, batches)


@pytest.mark.parametrize("exc", [TypeError("no len"), RuntimeError("boom"), ValueError("x")])
def test_iterable_dataset_len_raises(setup, exc):
    train = setup[3]
    loader = DataLoader(_Claimed(train, N, exc), batch_size=BATCH)
    _assert_same(setup, _build(setup, loader), _batches(train, N, BATCH))


def test_sampler_list(setup):
    train = setup[3]
    loader = DataLoader(TensorDataset(*train), batch_size=BATCH, sampler=list(range(N)))
    _assert_same(setup, _build(setup, loader), _batches(train, N, BATCH))


def test_sampler_shorter_than_dataset(setup):
    train = setup[3]
    loader = DataLoader(TensorDataset(*train), batch_size=BATCH, sampler=list(range(20)))
    _assert_same(setup, _build(setup, loader), _batches(train, 20, BATCH))


class _Ready(Dataset):
    def __init__(self, batches):
        self.b = batches

    def __len__(self):
        return len(self.b)

    def __getitem__(self, i):
        return self.b[i]


@pytest.mark.parametrize("batch", [8, 13])
def test_batch_size_none_ready_batches(setup, batch):
    """``len(loader)`` counts batches (5 / 4), not rows (40)."""
    train = setup[3]
    batches = _batches(train, N, batch)
    loader = DataLoader(_Ready(batches), batch_size=None)
    _assert_same(setup, _build(setup, loader), batches)


def _progress_totals(text):
    return [int(t) for t in re.findall(r"/\s*(\d+)", text)]


@pytest.mark.parametrize("claim", [None, "sampler", "ready", 10, 80, 10**12])
def test_progress_total_sane(setup, claim, capfd):
    train = setup[3]
    if claim is None:
        loader = DataLoader(TensorDataset(*train), batch_size=BATCH)
    elif claim == "sampler":
        loader = DataLoader(TensorDataset(*train), batch_size=BATCH, sampler=list(range(N)))
    elif claim == "ready":  # len(loader) is 5 batches: a total of 5 examples would be wrong
        loader = DataLoader(_Ready(_batches(train, N, BATCH)), batch_size=None)
    else:
        loader = DataLoader(_Claimed(train, N, claim), batch_size=BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store = _build(setup, loader, progress=True)
    err = capfd.readouterr().err
    assert store.n_train == N
    totals = _progress_totals(err)
    if claim in (None, "sampler"):  # the docs: the DataLoader's size gives the bar its total
        assert totals, f"no progress total in stderr: {err[-500:]!r}"
    # A sane total counts examples (40, or 40 per checkpoint), or is absent where the size
    # is only claimed: never a claimed 10, 80, 10**12, nor 5 batches counted as examples.
    if claim in (None, "sampler"):
        assert max(totals) == N, f"progress totals {sorted(set(totals))}: {err[-500:]!r}"
    assert all(t in (N, 3 * N) for t in totals), (
        f"progress totals {sorted(set(totals))}: {err[-500:]!r}")
