"""atk45: attacks on in-memory builds of data of known size (docs/concepts/memory.md,
"In-memory builds of known size"). The reference for every sized build is the same batches
given as a generator (unknown size): same calls, so rows and norms must be torch.equal."""

from __future__ import annotations

import contextlib
import io
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import (
    DataLoader,
    Dataset,
    RandomSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import tracinfunc as tif

N = 50
torch.manual_seed(0)
X = torch.randn(N, 6)
Y = torch.randint(0, 3, (N,))


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).eval()


LOSS = tif.loss_from_module(_model(0), F.cross_entropy)
CK = [
    tif.Checkpoint.from_module(_model(0), lr=0.1, name="a"),
    tif.Checkpoint.from_module(_model(1), lr=0.05, name="b"),
    tif.Checkpoint.from_module(_model(2), lr=0.01, name="c"),
]
P = tif.Projection(dim=16, seed=0)


def _batches(b=10, x=X, y=Y):
    return [(x[i : i + b], y[i : i + b]) for i in range(0, len(x), b)]


def _all(store):
    rows = torch.stack([store.read_rows(c, 0, store.shape[1]) for c in range(store.shape[0])])
    norms = torch.stack([store.read_norms(c, 0, store.shape[1]) for c in range(store.shape[0])])
    return rows, norms


def _build(data, loss=LOSS, ckpts=CK, **kw):
    kw.setdefault("projection", P)
    kw.setdefault("progress", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # pinned without CUDA
        return tif.build_store(loss, ckpts, data, **kw)


def _assert_same(sized, reference_batches, **kw):
    a = _build(sized, **kw)
    kw.pop("projection", None)
    b = _build(iter(list(reference_batches)), projection=a.projection, **kw)
    assert type(a) is type(b)
    assert a.shape == b.shape
    ra, na = _all(a)
    rb, nb = _all(b)
    assert torch.equal(ra, rb)
    assert torch.equal(na, nb)
    return a


class Claim(Dataset):
    """A map-style dataset over X, Y whose __len__ says `claim`."""

    def __init__(self, claim, bad=None):
        self.claim, self.bad = claim, bad

    def __len__(self):
        if isinstance(self.claim, Exception):
            raise self.claim
        return self.claim

    def __getitem__(self, i):
        if self.bad is not None and i == self.bad:
            return torch.randn(5), Y[0]  # wrong feature count: the loss fails on it
        return X[i], Y[i]


class Batches:
    """A batch sampler yielding batches of `b` over the first `n` rows, claiming `claim` batches."""

    def __init__(self, claim, b=10, n=N, extra=()):
        self.claim, self.b, self.n, self.extra = claim, b, n, extra

    def __len__(self):
        if isinstance(self.claim, Exception):
            raise self.claim
        return self.claim

    def __iter__(self):
        for i in range(0, self.n, self.b):
            yield list(range(i, min(i + self.b, self.n)))
        yield from self.extra


def _loader(ds_claim, bs_claim, b=10, n=N):
    return DataLoader(Claim(ds_claim), batch_sampler=Batches(bs_claim, b=b, n=n))


# ---------------------------------------------------------------- sizes that are right
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"dtype": torch.float16},
        {"dtype": torch.bfloat16},
        {"dtype": "int8"},
        {"dtype": "sign"},
        {"store": "pinned"},
        {"store": "memory"},
        {"batch_size": 13},
        {"options": tif.GradientOptions(chunk_size=4)},
        {"projection": tif.Projection(dim=16, seed=0, kind="kronecker")},
        {"projection": tif.Projection(dim=16, seed=0, kind="sjlt")},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default",
)
def test_sized_list_equals_generator(kw):
    _assert_same(_batches(), _batches(), **kw)


def test_sized_single_batch_equals_generator():
    _assert_same((X, Y), [(X, Y)])


@pytest.mark.parametrize("drop_last", [False, True])
def test_sized_dataloader_equals_generator(drop_last):
    dl = DataLoader(TensorDataset(X, Y), batch_size=7, drop_last=drop_last)
    s = _assert_same(dl, list(dl))
    assert s.shape[1] == (49 if drop_last else 50)


def test_sized_mixed_and_empty_batches_equal_generator():
    mixed = [(X[:0], Y[:0]), (X[0:3], Y[0:3]), (X[3:3], Y[3:3]), (X[3:20], Y[3:20]),
             (X[20:21], Y[20:21]), (X[21:50], Y[21:50]), (X[:0], Y[:0])]
    s = _assert_same(mixed, mixed)
    assert s.shape == (3, 50, 16)


def test_sized_dict_batches_and_strided_tensors():
    xs = torch.randn(N, 12)[:, ::2]
    _assert_same(_batches(x=xs), _batches(x=xs))

    def dloss(p, ex):
        return LOSS(p, (ex["x"], ex["y"]))

    dicts = [{"x": x, "y": y} for x, y in _batches()]
    _assert_same(dicts, dicts, loss=dloss)


def test_sized_float64_store_equals_generator():
    ck = [tif.Checkpoint.from_module(_model(i).double(), lr=lr, name=n)
          for i, lr, n in [(0, 0.1, "a"), (1, 0.05, "b")]]
    b64 = [(x.double(), y) for x, y in _batches()]
    s = _assert_same(b64, b64, ckpts=ck, dtype=torch.float64)
    assert s.read_rows(0, 0, 1).dtype == torch.float64


def test_sized_dataloader_over_a_dataset_of_batches_batch_size_none():
    bl = _batches()

    class OfBatches(Dataset):
        def __len__(self):  # 5 batches, 50 rows: the length counts batches
            return len(bl)

        def __getitem__(self, i):
            return bl[i]

    _assert_same(DataLoader(OfBatches(), batch_size=None), bl)


def test_sized_subset_sampler():
    dl = DataLoader(TensorDataset(X, Y), batch_size=4, sampler=list(range(5, 17)))
    assert _assert_same(dl, list(dl)).shape[1] == 12


# ---------------------------------------------------------------- sizes that lie
@pytest.mark.parametrize("claim", [0, 1, 23, 45, 70, 77, 10**6, 10**12, 2**62, sys.maxsize])
@pytest.mark.parametrize("where", ["dataset", "batch_sampler"])
def test_lying_length_gives_the_rows_yielded(claim, where):
    dl = _loader(claim, 5) if where == "dataset" else _loader(N, claim)
    s = _assert_same(dl, _batches())
    assert s.shape == (3, N, 16)
    with pytest.raises(tif.TracInFuncError):
        s.read_rows(0, N, N + 1)


@pytest.mark.parametrize("claim", [0, 23, 45, 77])
@pytest.mark.parametrize(
    "kw",
    [
        {"batch_size": 13},
        {"options": tif.GradientOptions(chunk_size=4)},
        {"dtype": torch.float16},
        {"dtype": "int8"},
        {"store": "pinned"},
        {"dtype": torch.bfloat16, "batch_size": 3},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_lying_length_straddling_a_batch_with_options(claim, kw):
    dl = DataLoader(Claim(claim), batch_sampler=Batches(5, b=7))
    _assert_same(dl, list(DataLoader(Claim(claim), batch_sampler=Batches(5, b=7))), **kw)


def test_numpy_length_and_lengths_that_raise():
    _assert_same(_loader(np.int64(10**12), np.int64(10**12)), _batches())
    _assert_same(_loader(RuntimeError("no len"), 5), _batches())
    _assert_same(_loader(N, TypeError("no len")), _batches())
    _assert_same(_loader(RuntimeError("no len"), TypeError("no len")), _batches())


def test_claimed_length_with_no_rows_is_empty_data():
    class Nothing:
        def __len__(self):
            return 5

        def __iter__(self):
            return iter([])

    with pytest.raises(tif.TracInFuncError, match="no examples"):
        _build(DataLoader(Claim(N), batch_sampler=Nothing()))
    for data in ([(X[:0], Y[:0]), (X[:0], Y[:0])], (X[:0], Y[:0]), []):
        with pytest.raises(tif.TracInFuncError, match="no examples"):
            _build(data)


# ---------------------------------------------------------------- producers
def test_refilled_buffer_dataloader_gives_every_batch_its_rows():
    bx, by = torch.empty(10, 6), torch.empty(10, dtype=torch.long)

    def collate(items):
        for j, (x, y) in enumerate(items):
            bx[j], by[j] = x, y
        return bx[: len(items)], by[: len(items)]

    for b in (10, 7):
        dl = DataLoader(TensorDataset(X, Y), batch_size=b, collate_fn=collate)
        _assert_same(dl, list(DataLoader(TensorDataset(X, Y), batch_size=b)))


def test_refilled_buffer_sized_iterable():
    bx, by = torch.empty(10, 6), torch.empty(10, dtype=torch.long)

    class Refill:
        def __len__(self):
            return 5

        def __iter__(self):
            for i in range(0, N, 10):
                bx.copy_(X[i : i + 10])
                by.copy_(Y[i : i + 10])
                yield bx, by

    _assert_same(Refill(), _batches())


@pytest.mark.parametrize("mutation", ["append", "pop", "inplace", "replace"])
@pytest.mark.parametrize(
    "kw", [{}, {"options": tif.GradientOptions(chunk_size=4)}, {"batch_size": 10}],
    ids=["merged", "chunk", "batch_size"],
)
def test_list_mutated_while_the_build_iterates(mutation, kw):
    def setup():
        lst = [(x.clone(), y.clone()) for x, y in _batches()]
        done = []
        ops = {
            "append": lambda: lst.append((X[:7], Y[:7])),
            "pop": lambda: lst.pop(),
            "inplace": lambda: lst[4][0].mul_(3),
            "replace": lambda: lst.__setitem__(4, (X[:3], Y[:3])),
        }

        def loss(p, ex):
            if not done:
                done.append(1)
                ops[mutation]()
            return LOSS(p, ex)

        return lst, loss

    lst, loss = setup()
    a = _build(lst, loss=loss, **kw)
    lst2, loss2 = setup()
    b = _build(iter(lst2), loss=loss2, **kw)
    assert a.shape == b.shape
    assert torch.equal(_all(a)[0], _all(b)[0]) and torch.equal(_all(a)[1], _all(b)[1])


# ---------------------------------------------------------------- failures
def test_loss_failing_mid_build_names_batch_and_retry_is_correct():
    bad = _batches()
    bad.insert(3, (torch.randn(10, 5), Y[:10]))
    for data in (bad, iter(bad)):
        with pytest.raises(tif.TracInFuncError, match=r"batch 3 of data \(rows 30-39\)"):
            _build(data)
    dl = DataLoader(Claim(300000, bad=999), batch_sampler=Batches(6, extra=[[999]]))
    with pytest.raises(tif.TracInFuncError, match=r"batch 5 of data \(rows 50-50\)"):
        _build(dl)
    _assert_same(_loader(300000, 6), _batches())


def test_nan_row_is_named_in_a_sized_build():
    xn = X.clone()
    xn[23, 2] = float("nan")
    class ClaimNaN(Claim):
        def __getitem__(self, i):
            return xn[i], Y[i]

    for data in (_batches(x=xn), DataLoader(TensorDataset(xn, Y), batch_size=7),
                 DataLoader(ClaimNaN(10**9), batch_sampler=Batches(5))):
        with pytest.raises(tif.TracInFuncError, match=r"\[23\]"):
            _build(data)


# ---------------------------------------------------------------- progress
@pytest.mark.parametrize("drop_last,total", [(False, 50), (True, 49)])
def test_progress_total_from_dataloader(drop_last, total):
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        _build(DataLoader(TensorDataset(X, Y), batch_size=7, drop_last=drop_last), progress=True)
    out = buf.getvalue()
    assert f"0/{total}" in out and f"{total}/{total}" in out


# ---------------------------------------------------------------- samplers and unbatched loaders
def test_batch_size_none_loader_of_single_examples_names_the_fix():
    """A DataLoader(batch_size=None) over a TensorDataset yields single examples; the error
    should say so (name batch_size), not only 'shapes [[6], []]'."""
    with pytest.raises(tif.TracInFuncError) as e:
        _build(DataLoader(TensorDataset(X, Y), batch_size=None))
    assert "batch_size" in str(e.value), str(e.value)


def test_random_sampler_refusal_names_the_sampler_not_shuffle():
    """sampler=RandomSampler(...) was passed, not shuffle=True: the message should name it."""
    g = torch.Generator().manual_seed(3)
    ds = TensorDataset(X, Y)
    dl = DataLoader(ds, batch_size=9, sampler=RandomSampler(ds, replacement=True,
                                                            num_samples=120, generator=g))
    with pytest.raises(tif.TracInFuncError) as e:
        _build(dl)
    assert "sampler" in str(e.value).lower(), str(e.value)


@pytest.mark.parametrize("kind", ["subset", "weighted"])
def test_other_random_samplers_are_refused_like_shuffle(kind):
    """shuffle=True is refused so that row i is example i; SubsetRandomSampler and
    WeightedRandomSampler reorder (and repeat) examples just the same."""
    g = torch.Generator().manual_seed(0)
    smp = (SubsetRandomSampler(list(range(10)), generator=g) if kind == "subset"
           else WeightedRandomSampler(torch.ones(N), 20, generator=g))
    with pytest.raises(tif.TracInFuncError):
        _build(DataLoader(TensorDataset(X, Y), batch_size=5, sampler=smp))


# ---------------------------------------------------------------- aliasing and mixed dtypes
def test_same_batch_object_listed_three_times():
    b = _batches()[0]
    s = _assert_same([b, b, b], [b, b, b])
    r = _all(s)[0]
    assert torch.equal(r[:, 0:10], r[:, 10:20]) and torch.equal(r[:, 0:10], r[:, 20:30])


def test_one_float64_batch_in_a_merged_sized_build_is_named():
    m = _batches()
    m[2] = (m[2][0].double(), m[2][1])
    for data in (m, iter(m)):
        with pytest.raises(tif.TracInFuncError, match=r"batch 2 of data \(rows 20-29\)"):
            _build(data)


def test_merged_sized_build_equals_per_batch_build():
    a = _all(_build(_batches()))[0]
    b = _all(_build(_batches(), options=tif.GradientOptions(chunk_size=4)))[0]
    torch.testing.assert_close(a, b)
