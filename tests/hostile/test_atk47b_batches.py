"""atk47b: the structure of training batches given to build_store (docs-only outside pass)."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

import tracinfunc as tif

torch.manual_seed(0)
X = torch.randn(24, 6)
Y = torch.randint(0, 3, (24,))
M = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).eval()
LOSS = tif.loss_from_module(M, F.cross_entropy)
CK = [tif.Checkpoint.from_module(M, lr=0.1, name="a")]
P = tif.Projection(dim=8, seed=0)
NT = collections.namedtuple("NT", "x y")


def dict_loss(params, ex):
    return F.cross_entropy(functional_call(M, params, (ex["x"][None],)), ex["y"][None])


def rows(data, loss=LOSS, **kw):
    kw.setdefault("projection", P)
    s = tif.build_store(loss, CK, data, progress=False, **kw)
    return s.read_rows(0, 0, s.shape[1])


def chunks(b, make=lambda x, y: (x, y)):
    return [make(X[i : i + b], Y[i : i + b]) for i in range(0, 24, b)]


REF4 = rows(chunks(4), batch_size=4)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(lambda: chunks(4), id="tuples"),
        pytest.param(lambda: chunks(4, lambda x, y: [x, y]), id="lists"),
        pytest.param(lambda: chunks(4, NT), id="namedtuples"),
        pytest.param(lambda: (X, Y), id="one-tuple"),
        pytest.param(lambda: NT(X, Y), id="one-namedtuple"),
        pytest.param(lambda: iter(chunks(4)), id="generator"),
        pytest.param(
            lambda: [c if i % 2 else list(c) for i, c in enumerate(chunks(4))], id="tuple-list-mix"
        ),
        pytest.param(lambda: DataLoader(TensorDataset(X, Y), batch_size=4), id="dataloader"),
        pytest.param(
            lambda: DataLoader(
                TensorDataset(X, Y),
                batch_size=4,
                collate_fn=lambda b: NT(torch.stack([e[0] for e in b]), torch.stack([e[1] for e in b])),
            ),
            id="dl-namedtuple",
        ),
    ],
)
def test_held_structures_give_the_same_rows(data):
    assert torch.equal(rows(data()), REF4)


def test_held_dict_key_order_and_nesting():
    b = [
        {"x": X[i : i + 4], "y": Y[i : i + 4]} if i % 8 else {"y": Y[i : i + 4], "x": X[i : i + 4]}
        for i in range(0, 24, 4)
    ]
    assert torch.equal(rows(b, loss=dict_loss), REF4)
    assert torch.equal(rows(b, loss=dict_loss, batch_size=4), REF4)
    nested = chunks(4, lambda x, y: (x, {"y": y}))
    got = rows(nested, loss=lambda p, e: dict_loss(p, {"x": e[0], "y": e[1]["y"]}))
    assert torch.equal(got, REF4)


def _reuse(n, ring=1):
    bufs = [(torch.empty(n, 6), torch.empty(n, dtype=torch.long)) for _ in range(ring)]
    for j, i in enumerate(range(0, 24, n)):
        bx, by = bufs[j % ring]
        bx.copy_(X[i : i + n])
        by.copy_(Y[i : i + n])
        yield (bx, by)


def test_held_loader_reusing_buffers():
    assert torch.equal(rows(_reuse(4)), REF4)
    assert torch.equal(rows(_reuse(4, ring=2)), REF4)
    assert torch.equal(rows(_reuse(6), batch_size=4), REF4)
    assert torch.equal(rows(_reuse(6), batch_size=8), rows(chunks(8), batch_size=8))


def test_held_same_tensor_twice_and_odd_leaves():
    r = rows([(X[:4], Y[:4]), (X[:4], Y[:4])])
    assert torch.equal(r[:4], r[4:]) and torch.equal(r[:4], REF4[:4])
    xg = X.clone().requires_grad_()
    assert torch.equal(rows(chunks(4, lambda x, y: (xg[: len(x)] * 0 + x, y))), REF4)
    xn = X.t().contiguous().t()
    assert torch.equal(rows([(xn[i : i + 4], Y[i : i + 4]) for i in range(0, 24, 4)]), REF4)
    assert torch.equal(rows([(nn.Parameter(X[:4].clone()), Y[:4])]), REF4[:4])


@pytest.mark.parametrize(
    "bad, cls, words",
    [
        ((X[4:8], Y[4:8], "s"), tif.errors.InvalidTypeError, ["str", "batch 1"]),
        ((X[4:8], Y[4:8], None), tif.errors.InvalidTypeError, ["NoneType", "batch 1"]),
        ((X[4:8], Y[4:8], 3), tif.errors.InvalidTypeError, ["int", "batch 1"]),
        ((X[4:8].numpy(), Y[4:8].numpy()), tif.errors.InvalidTypeError, ["ndarray", "batch 1"]),
        ((X[4:8], Y[4:7]), tif.errors.InvalidArgumentError, ["[4, 6], [3]", "batch 1"]),
        ((X[4:8], torch.tensor(1)), tif.errors.InvalidArgumentError, ["batch 1"]),
        ((X[4:8].double(), Y[4:8]), tif.errors.LossFunctionError, ["float64", "batch 1"]),
        ((X[4:8], Y[4:8, None]), tif.errors.LossFunctionError, ["[4, 1]", "batch 1"]),
    ],
)
def test_held_bad_later_batch_is_refused_naming_it(bad, cls, words):
    with pytest.raises(cls) as e:
        rows([(X[:4], Y[:4]), bad, (X[8:12], Y[8:12])])
    for w in words:
        assert w in str(e.value)


def test_held_empty_inputs():
    with pytest.raises(tif.errors.EmptyDataError):
        rows([])
    with pytest.raises(tif.errors.InvalidTypeError):
        rows([()])
    assert rows([(X[:4], Y[:4]), (X[4:4], Y[4:4]), (X[4:8], Y[4:8])]).shape == (8, 8)


@pytest.mark.parametrize("b", [1, 3, 5])
def test_finding_default_merge_changes_rows_for_odd_loader_batches(b):
    """FINDING (fixed in the docs): ``build_store``'s docstring said merging consecutive
    batches "never splits a batch; rows do not change". A default in-memory build of a
    DataLoader(batch_size=b) equalled ONE call over all 24 examples and differed from the
    batch_size=b build (the rows of each batch built alone) by up to ~2.4e-7 for b in 1, 3,
    5: BLAS rounds a row differently by call size and memory alignment. Now documented:
    equal to float32 rounding; ``batch_size=`` gives the same calls, hence the same bits."""
    dl = DataLoader(TensorDataset(X, Y), batch_size=b)
    alone = torch.cat([rows((X[i : i + b], Y[i : i + b])) for i in range(0, 24, b)])
    assert torch.equal(rows(dl, batch_size=b), alone)
    assert torch.equal(rows(dl, batch_size=b), rows(dl, batch_size=b))  # same calls, same bits
    torch.testing.assert_close(rows(dl), alone, rtol=1e-5, atol=1e-6)
    import tracinfunc.build.torch as build_module

    doc = " ".join(build_module.build_store.__doc__.split())
    assert "rows do not change" not in doc and "to float32 rounding" in doc


def test_finding_list_with_batch_size_is_not_honoured_like_a_dataloader():
    """FINDING (fixed in the docs, as above): the same five batches of 5 (4 last) with
    batch_size=5, given as a list of views of one tensor and as a DataLoader (fresh tensors),
    gave rows ~2.4e-7 apart: the calls are of 5 either way, but BLAS rounds views at other
    memory offsets differently. Equal to float32 rounding; each container reproduces its
    own bits."""
    dl = rows(DataLoader(TensorDataset(X, Y), batch_size=5), batch_size=5)
    alone = torch.cat([rows((X[i : i + 5], Y[i : i + 5])) for i in range(0, 24, 5)])
    assert torch.equal(dl, alone)
    for data in (chunks(5), iter(chunks(5))):
        torch.testing.assert_close(rows(data, batch_size=5), dl, rtol=1e-5, atol=1e-6)
    assert torch.equal(rows(chunks(5), batch_size=5), rows(chunks(5), batch_size=5))


@pytest.mark.parametrize("kind", ["rademacher", "sjlt", "kronecker"])
def test_held_kinds_merge_equal_batch_size_even(kind):
    p = tif.Projection(dim=8, seed=0, kind=kind)
    assert torch.equal(rows(chunks(4), projection=p), rows(chunks(4), projection=p, batch_size=4))
    test = tif.build_store(LOSS, CK, (X[:3], Y[:3]), projection=p, progress=False)
    s1 = tif.build_store(LOSS, CK, chunks(4), projection=p, progress=False)
    s2 = tif.build_store(LOSS, CK, chunks(4, NT), projection=p, progress=False)
    assert torch.equal(tif.score(s1, test), tif.score(s2, test))
