"""candidates= on score and top_k (issue 35): exact against the brute-force reference and the
full scan restricted to the candidates, only candidate rows read, hostile candidates refused."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tests.reference import exact_tracin
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError

PROJECTION = tif.Projection(kind="identity")


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(46, 5, dtype=torch.float64, generator=g), torch.randint(0, 3, (46,))
    ckpts = [tif.Checkpoint.from_module(model, lr=0.3, name="a")]
    with torch.no_grad():
        model[0].weight.add_(0.5)
    ckpts.append(tif.Checkpoint.from_module(model, lr=0.2, name="b"))
    build = dict(projection=PROJECTION, dtype=torch.float64, progress=False)
    store = tif.build_store(loss, ckpts, (x[:40], y[:40]), **build)
    tests = tif.build_store(loss, ckpts, (x[40:], y[40:]), **build)
    truth = exact_tracin(loss, ckpts, (x[:40], y[:40]), (x[40:], y[40:]))  # [6, 40] float64
    return store, tests, truth, (loss, ckpts, x, y)


def _candidates(n_test=6, m=7, n_train=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n_train, generator=g)[:m] for _ in range(n_test)])


def test_score_with_candidates_equals_the_reference_at_those_rows(setup):
    store, tests, truth, _ = setup
    chosen = _candidates()
    got = tif.score(store, tests, candidates=chosen)
    assert got.shape == (6, 7)
    torch.testing.assert_close(got, truth.gather(1, chosen), rtol=1e-10, atol=1e-12)
    full = tif.score(store, tests)
    torch.testing.assert_close(got, full.gather(1, chosen), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("m", [1, 3, 40])  # dense (union small) and gathered paths
def test_both_paths_agree_with_the_full_scan(setup, monkeypatch, m):
    import tracinfunc.query.candidates as module

    store, tests, _, _ = setup
    chosen = _candidates(m=m, seed=m)
    full = tif.score(store, tests)
    real = module._plan
    monkeypatch.setattr(module, "_QUERY_BLOCK", 4)  # blocks of 4 and 2 queries
    for how in ("all", "union", "each"):
        monkeypatch.setattr(module, "_plan", functools.partial(real, how=how))
        for normalize in (False, True):
            expected = tif.score(store, tests, normalize=normalize).gather(1, chosen)
            got = tif.score(store, tests, candidates=chosen, normalize=normalize)
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert full.shape == (6, 40)


@pytest.mark.parametrize("largest", [True, False])
def test_top_k_with_candidates_is_the_full_top_k_restricted_to_them(setup, largest):
    store, tests, truth, _ = setup
    chosen = _candidates(m=12, seed=3)
    values, indices = tif.top_k(store, tests, 5, candidates=chosen, largest=largest)
    masked = torch.full_like(truth, -torch.inf if largest else torch.inf)
    masked.scatter_(1, chosen, truth.gather(1, chosen))
    expected_values, expected_indices = masked.topk(5, dim=1, largest=largest)
    assert torch.equal(indices, expected_indices)
    torch.testing.assert_close(values, expected_values, rtol=1e-10, atol=1e-12)
    # all rows as candidates: exactly top_k's answer
    every = torch.arange(40).repeat(6, 1)
    full = tif.top_k(store, tests, 5, largest=largest)
    got = tif.top_k(store, tests, 5, largest=largest, candidates=every.flip(1))
    assert torch.equal(got[1], full[1])


def test_a_top_k_result_numpy_jax_and_lists_are_candidates(setup):
    store, tests, _, _ = setup
    first = tif.top_k(store, tests, 9)
    expected = tif.score(store, tests, candidates=first[1])
    torch.testing.assert_close(tif.score(store, tests, candidates=first), expected)
    torch.testing.assert_close(tif.score(store, tests, candidates=first[1].numpy()), expected)
    torch.testing.assert_close(tif.score(store, tests, candidates=list(first[1])), expected)
    torch.testing.assert_close(
        tif.score(store, tests, candidates=[r.tolist() for r in first[1]]), expected)
    ranked = torch.topk(tif.score(store, tests), 9)  # torch's (values, indices) result
    torch.testing.assert_close(tif.score(store, tests, candidates=ranked),
                               tif.score(store, tests, candidates=ranked.indices))
    numpy_result = tif.top_k(store, tests, 9, output="numpy")
    torch.testing.assert_close(tif.score(store, tests, candidates=numpy_result), expected)
    jnp = pytest.importorskip("jax.numpy")
    torch.testing.assert_close(
        tif.score(store, tests, candidates=jnp.asarray(first[1].numpy())), expected)


def test_only_candidate_rows_are_read(setup):
    store, tests, _, _ = setup

    class Counting:
        def __init__(self, inner):
            self.inner, self.read = inner, set()

        @property
        def meta(self):
            return self.inner.meta

        def read_rows(self, ckpt, start, stop, *, out=None):
            self.read.update(range(start, stop))
            return self.inner.read_rows(ckpt, start, stop, out=out)

        def read_norms(self, ckpt, start, stop):
            self.read.update(range(start, stop))
            return self.inner.read_norms(ckpt, start, stop)

    counting = Counting(store)
    chosen = torch.tensor([[3, 17, 30]] * 3 + [[4, 17, 39]] * 3)
    tif.top_k(counting, tests, 2, candidates=chosen, normalize=True)
    assert counting.read == {3, 4, 17, 30, 39}


BAD = [
    (torch.tensor([[0, 1, 40]] * 6), InvalidArgumentError, r"in \[0, n_train=40\), got 40"),
    (torch.tensor([[0, -1, 2]] * 6), InvalidArgumentError, r"got -1 at \[0, 1\]"),
    (torch.tensor([[0.0, 1.0, 2.0]] * 6), InvalidTypeError, "must hold integers, got torch.float"),
    (np.array([[0.5, 1, 2]] * 6), InvalidTypeError, "never cast"),
    (torch.tensor([[True, False]] * 6), InvalidTypeError, "must hold integers, got torch.bool"),
    (torch.tensor([[0, 1, 1]] * 6), InvalidArgumentError, "name row 1 twice"),
    (torch.tensor([[0, 1, 2]] * 5), InvalidArgumentError, "have 5 rows but there are 6 test"),
    (torch.zeros(6, 0, dtype=torch.long), InvalidArgumentError, r"hold no rows \(M=0\)"),
    (torch.tensor([0, 1, 2]), InvalidArgumentError, r"must be \[n_test, M\], got shape \[3\]"),
    ([torch.tensor([0, 1]), torch.tensor([2])] * 3, InvalidArgumentError, "of one length M"),
    ("0,1,2", InvalidTypeError, "must be an integer array"),
    ([], InvalidArgumentError, "candidates are empty"),  # was: "got torch.float64"
    (np.array([[1, "a"]] * 6, dtype=object), InvalidTypeError, "must be an integer array"),
    (np.array([[2**63 + 5]] * 6, dtype=np.uint64), InvalidArgumentError,
     "hold 9223372036854775813, beyond any store row"),  # was: wrapped to a negative int64
    ((torch.rand(6, 3).long(), torch.rand(6, 3)), InvalidTypeError, r"read as \(values, ind"),
]


@pytest.mark.parametrize("name", ["score", "top_k"])
@pytest.mark.parametrize(("bad", "error", "message"), BAD)
def test_hostile_candidates_are_refused(setup, name, bad, error, message):
    store, tests, _, _ = setup
    call = {"score": lambda **kw: tif.score(store, tests, **kw),
            "top_k": lambda **kw: tif.top_k(store, tests, 1, **kw)}[name]
    with pytest.raises(error, match=rf"^{name}: .*{message}"):
        call(candidates=bad)


def test_k_above_m_and_rows_are_refused(setup):
    store, tests, _, _ = setup
    with pytest.raises(InvalidArgumentError, match=r"^top_k: k must be an int in \[1, M=3\]"):
        tif.top_k(store, tests, 4, candidates=_candidates(m=3))
    with pytest.raises(InvalidArgumentError, match="candidates= and rows= are exclusive"):
        tif.score(store, tests, candidates=_candidates(m=3), rows=(0, 20))


def test_candidates_take_the_curvature_path(setup):
    store, tests, _, (loss, ckpts, x, y) = setup
    from tracinfunc.curvature import classification_sampler

    curvature = tif.fit_curvature(loss, ckpts, (x[:40], y[:40]), kind="projected",
                                  projection=PROJECTION,
                                  sampler=classification_sampler(exact=True))
    chosen = _candidates(m=10, seed=5)
    full = tif.score(store, tests, curvature=curvature)
    got = tif.score(store, tests, curvature=curvature, candidates=chosen)
    torch.testing.assert_close(got, full.gather(1, chosen), rtol=1e-10, atol=1e-12)
    values, indices = tif.top_k(store, tests, 3, curvature=curvature, candidates=chosen)
    torch.testing.assert_close(values, full.gather(1, indices), rtol=1e-10, atol=1e-12)
