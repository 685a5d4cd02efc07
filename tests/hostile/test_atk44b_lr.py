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
    values, indices = tif.indexed_top_k(store, test.float(), 5, index=index, nprobe=1)
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
