"""atk44b: learning rates and tiny rows against the atk44 fixes (score, index, self-influence)."""

from __future__ import annotations

import warnings

import pytest
import torch

import tracinfunc as tif
from tests.hostile._atk44b import make, ref

pytest.importorskip("faiss")


def _rel(a, b):
    a = torch.as_tensor(a).double()
    b = b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


def test_indexed_top_k_accepts_its_own_index_over_rows_of_norm_1e_29():
    """indexed_top_k on a store whose (normal float32) rows have entries ~1e-30 refused the
    store's own index: 'candidate rows [0, 1, ...] differ from the rows the index was built from
    (27 of the 27 rows checked; their norms agree ...)'. Expected: the exact top-k."""
    torch.manual_seed(0)
    rows = torch.randn(2, 40, 8, dtype=torch.float64) * 1e-30
    test = torch.randn(2, 3, 8, dtype=torch.float64)
    store = make(rows, [1.0, 1.0])
    index = tif.build_index(store, nlist=1, target_recall=None)
    values, indices = tif.indexed_top_k(store, test.float(), 5, index=index, nprobe=1)
    expected = ref(rows, test, [1.0, 1.0]).topk(5, dim=1)
    assert torch.equal(indices, expected.indices)
    assert _rel(values, expected.values) < 1e-5


def test_indexed_top_k_lr_1e3_test_1e36_rows_1e_30_own_index():
    """The atk44 fix's own lr case (lr=1e3, test entries 1e36) over rows of entries 1e-30
    (scores ~1e9, all finite): indexed_top_k refused the store's own index as 'rows differ'."""
    torch.manual_seed(1)
    rows = torch.randn(2, 40, 8, dtype=torch.float64) * 1e-30
    test = torch.randn(2, 3, 8, dtype=torch.float64) * 1e36
    lrs = [1e3, 1e3]
    store = make(rows, lrs)
    index = tif.build_index(store, nlist=1, target_recall=None)
    _values, indices = tif.indexed_top_k(store, test.float(), 5, index=index, nprobe=1)
    expected = ref(rows, test, lrs).topk(5, dim=1)
    assert torch.equal(indices, expected.indices)


def test_learning_rate_below_float32_range_does_not_silently_zero_scores():
    """lr=1e-46 (a float64 learning rate that underflows float32) with test entries 1e10 and
    rows 1e30: true scores ~5e-6 fit float32; score returned exact zeros with no warning."""
    torch.manual_seed(0)
    rows = torch.randn(2, 6, 4, dtype=torch.float64) * 1e30
    test = torch.randn(2, 3, 4, dtype=torch.float64) * 1e10
    lrs = [1e-46, 1e-46]
    store = make(rows, lrs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = tif.score(store, test.float())
    expected = ref(rows, test, lrs)
    assert expected.abs().max() > 1e-6
    assert caught or _rel(got, expected) < 1e-4, f"silently {got[0, :3]} vs {expected[0, :3]}"


def test_learning_rate_denormal_in_float32_keeps_float32_precision():
    """lr=1e-40 (a float32 denormal, exact in float64) over test entries 1 and rows 1e30: scores
    ~1e-9 are normal float32 numbers, but came back 5.4e-6 off (50x float32's epsilon)."""
    torch.manual_seed(0)
    rows = torch.randn(2, 6, 4, dtype=torch.float64) * 1e30
    test = torch.randn(2, 3, 4, dtype=torch.float64)
    lrs = [1e-40, 1e-40]
    store = make(rows, lrs)
    got = tif.score(store, test.float())
    expected = ref(rows, test, lrs)
    assert _rel(got, expected) < 1e-6


def test_learning_rate_above_float32_range_with_tiny_rows_gives_the_finite_score():
    """lr=1e40 (beyond float32, fine in float64) with test and row entries 1e-20: true scores ~10
    fit float32; score returned NaN and warned that 18 scores overflowed."""
    torch.manual_seed(0)
    rows = torch.randn(2, 6, 4, dtype=torch.float64) * 1e-20
    test = torch.randn(2, 3, 4, dtype=torch.float64) * 1e-20
    lrs = [1e40, 1e40]
    store = make(rows, lrs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tif.score(store, test.float())
    expected = ref(rows, test, lrs)
    assert torch.isfinite(got).all(), got
    assert _rel(got, expected) < 1e-5


CASES = {
    "lr1e3_test1e36": ([1e3, 1e3], 1e36, 1e-30),
    "lr1e-20_test1e-25": ([1e-20, 1e-20], 1e-25, 1e30),
    "mixed_safe_unsafe": ([1.0, 1e3], 1e36, 1e-30),
    "mixed_underflow": ([1e-20, 1.0], 1e-25, 1e30),
    "negative": ([-1e3, 1e3], 1e36, 1e-30),
    "negative_underflow": ([-1e-20, 2e-20], 1e-25, 1e30),
    "zero": ([0.0, 1e3], 1e36, 1e-30),
    "zero_underflow": ([0.0, 1e-20], 1e-25, 1e30),
    "lr1e30_test1e10": ([1e30, 1e30], 1e10, 1e-30),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_lr_applied_to_products_every_path_held(name):
    """Held: score (chunk_rows=1, rows=, candidates=), top_k, score_chunks, Contrast (shared and
    paired) and normalize=True match the float64 reference within 2e-6 for extreme lrs."""
    lrs, tscale, rscale = CASES[name]
    torch.manual_seed(0)
    rows = torch.randn(2, 6, 4, dtype=torch.float64) * rscale
    test = torch.randn(2, 3, 4, dtype=torch.float64) * tscale
    store = make(rows, lrs)
    expected = ref(rows, test, lrs)
    t = test.float()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = [
            tif.score(store, t),
            tif.score(store, t, chunk_rows=1),
            torch.cat([tif.score(store, t, rows=(0, 3)), tif.score(store, t, rows=(3, 6))], 1),
            tif.score(store, t, candidates=torch.arange(6).repeat(3, 1)),
            torch.cat([b.clone() for _, b in tif.score_chunks(store, t, chunk_rows=2)], 1),
        ]
        values, indices = tif.top_k(store, t, 6)
        outs.append(torch.empty(3, 6).scatter_(1, indices, values))
        for out in outs:
            assert _rel(out, expected) < 2e-6
        ctrl = test[:, :1] * 0.5
        got = tif.score(store, tif.Contrast(t, ctrl.float(), weight=1.0))
        assert _rel(got, ref(rows, test - ctrl, lrs)) < 2e-6
        got = tif.score(store, tif.Contrast(t, (test * 0.5).float(), weight=1.0, paired=True))
        assert _rel(got, ref(rows, test * 0.5, lrs)) < 2e-6
        got = tif.score(store, t, normalize=True)
        assert _rel(got, ref(rows, test, lrs, normalize=True)) < 2e-6


def test_self_influence_held():
    """Held: self_influence summed in float64 (lr=1e-20 with rows 1e20, |row|^2 beyond float32),
    negative lr, rows=; inf only where the true value exceeds float32 (warned)."""
    torch.manual_seed(0)
    rows = torch.randn(2, 40, 8, dtype=torch.float64)
    for lrs, scale in [([1e-20, 1e-20], 1e20), ([-1.0, 1.0], 1e18), ([1e30, 1e30], 1e-30)]:
        r = rows * scale
        store = make(r, lrs)
        stored = r.float().double()
        expected = sum(lrs[c] * (stored[c] ** 2).sum(-1) for c in range(2))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = tif.self_influence(store)
            part = tif.self_influence(store, rows=(3, 9))
        assert _rel(got, expected) < 1e-5
        assert _rel(part, expected[3:9]) < 1e-5
    store = make(rows * 1e19, [-1.0, 1.0])
    with pytest.warns(RuntimeWarning):
        got = tif.self_influence(store)
    stored = (rows * 1e19).float().double()
    expected = -(stored[0] ** 2).sum(-1) + (stored[1] ** 2).sum(-1)
    big = expected.abs() > 3.4028e38
    assert torch.isinf(got[big]).all() and torch.isfinite(got[~big]).all()


def test_indexed_and_rerank_with_extreme_lrs_held():
    """Held: indexed_top_k and rerank (index and scan retrievers) give the exact top-5 for lr=1e3 over
    test entries 1e36 (rows 1e-5), lr=1e-20 over 1e-25 (rows 1e20) and mixed lrs; JAX output too."""
    torch.manual_seed(0)
    rows = torch.randn(2, 40, 8, dtype=torch.float64)
    test = torch.randn(2, 3, 8, dtype=torch.float64)
    for rs, ts, lrs in [(1e-5, 1e36, [1e3, 1e3]), (1e20, 1e-25, [1e-20, 1e-20]), (1e-5, 1e36, [1.0, 1e3])]:
        r, t = rows * rs, test * ts
        store = make(r, lrs)
        exact = ref(r, t, lrs).topk(5, dim=1).indices
        index = tif.build_index(store, nlist=1, target_recall=None)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            assert torch.equal(tif.indexed_top_k(store, t.float(), 5, index=index, nprobe=1)[1], exact)
            out = tif.rerank(tif.Retriever(store, t.float(), index=index), store, t.float(), 5, n_candidates=10)
            assert torch.equal(out.indices, exact)
            out = tif.rerank(tif.Retriever(store, t.float()), store, t.float(), 5, n_candidates=10)
            assert torch.equal(out.indices, exact)
    jnp = pytest.importorskip("jax.numpy")
    import numpy as np

    r, t = rows * 1e20, test * 1e-25
    store = make(r, [1e-20, 1e-20])
    got = tif.score(store, jnp.asarray(t.float().numpy()), output="jax")
    assert _rel(torch.from_numpy(np.array(got)), ref(r, t, [1e-20, 1e-20])) < 2e-6
