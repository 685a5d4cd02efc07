"""atk44b: the one-warning-per-call overflow reports, NaN refusals and the index's pre-search warning."""

from __future__ import annotations

import contextlib
import gc
import warnings

import pytest
import torch

import tracinfunc as tif
from tests.hostile._atk44b import make, ref
from tracinfunc.errors import NonFiniteGradientError


def _overflow_store():
    torch.manual_seed(0)
    rows = torch.randn(2, 12, 4, dtype=torch.float64)
    rows[:, [1, 3, 5, 7, 9, 11]] *= 1e30
    test = (torch.randn(2, 3, 4, dtype=torch.float64) * 1e10).float()
    return make(rows, [1.0, 1.0]), test


def _record(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.suppress(NonFiniteGradientError):
            fn()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_indexed_top_k_overflowing_every_row_does_not_blame_nprobe():
    """Test entries 1e35 at lr=1e5 over ordinary rows (every score ~1e41 overflows float32): after
    its overflow warning indexed_top_k raised 'the 1 of 1 clusters searched for test example 0 hold
    only 0 rows, fewer than k=5; raise nprobe' - the single cluster holds all 40 rows; raising
    nprobe cannot help. Expected: an error naming the overflow (as top_k's NonFiniteGradientError)."""
    pytest.importorskip("faiss")
    torch.manual_seed(0)
    rows = torch.randn(2, 40, 8, dtype=torch.float64)
    test = (torch.randn(2, 3, 8, dtype=torch.float64) * 1e35).float()
    store = make(rows, [1e5, 1e5])
    index = tif.build_index(store, nlist=1, target_recall=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception) as info:
            tif.indexed_top_k(store, test, 5, index=index, nprobe=1)
    assert "raise nprobe" not in str(info.value), str(info.value)


def test_abandoned_score_chunks_warning_names_score_chunks():
    """A score_chunks generator broken out of after one chunk warns (on collection) with the prefix
    'tracinfunc:' where every other path says 'score_chunks:'; an exception raised mid-stream in
    the consumer's loop also gives 'tracinfunc: 9 score(s) ...'."""
    store, test = _overflow_store()

    def abandon():
        gen = tif.score_chunks(store, test, chunk_rows=2)
        for _ in gen:
            break
        del gen
        gc.collect()

    msgs = _record(abandon)
    assert len(msgs) == 1
    assert msgs[0].startswith("score_chunks"), msgs[0]


def test_score_chunks_error_filter_leaves_later_queries_intact():
    """Held: with simplefilter('error') the warning is raised once; later queries warn normally."""
    store, test = _overflow_store()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning):
            for _ in tif.score_chunks(store, test, chunk_rows=2):
                pass
        with pytest.raises(RuntimeWarning):
            tif.score(store, test, chunk_rows=2)
    msgs = _record(lambda: tif.score(store, test))
    assert len(msgs) == 1 and "[1, 3, 5, 7, 9] and more" in msgs[0] and "18 score" in msgs[0]


def test_one_warning_per_call_on_every_path():
    """Held: score (chunk_rows=1, rows=), candidates, top_k (largest both), NumPy output, nested
    score inside score_chunks and a never-iterated generator each warn once (or not at all)."""
    store, test = _overflow_store()
    cand = torch.tensor([[0, 2, 3], [3, 4, 5], [6, 8, 10]])
    for fn in [
        lambda: tif.score(store, test, chunk_rows=1),
        lambda: tif.score(store, test, rows=(2, 8)),
        lambda: tif.score(store, test, candidates=cand),
        lambda: tif.top_k(store, test, 2, candidates=cand, largest=False),
        lambda: tif.top_k(store, test, 2, largest=False),
        lambda: tif.score(store, test.numpy(), output="numpy"),
    ]:
        assert len(_record(fn)) == 1
    assert "[3, 5]" in _record(lambda: tif.score(store, test, candidates=cand))[0]

    def never():
        gen = tif.score_chunks(store, test, chunk_rows=2)
        del gen
        gc.collect()

    assert _record(never) == []


def test_top_k_over_65537_test_rows_warns_once():
    """Held: top_k over 65,537 test rows, one of them huge, warns once with 6 scores."""
    store, _ = _overflow_store()
    torch.manual_seed(0)
    test = torch.randn(2, 65537, 4)
    test[:, -1] *= 1e10
    msgs = _record(lambda: tif.top_k(store, test, 2))
    assert len(msgs) == 1 and msgs[0].startswith("top_k: 6 score(s)"), msgs


def test_indexed_top_k_prewarning_names_right_rows_and_stays_quiet_otherwise():
    """Held: rows 5 and 17 (norm 3e19) warned before the search (rows= narrows to [5]); no
    warning on ordinary stores, lr=1e3/test 1e36 over rows 1e-5, or normalize=True."""
    pytest.importorskip("faiss")
    torch.manual_seed(0)
    base = torch.randn(2, 40, 8, dtype=torch.float64)
    test = torch.randn(2, 3, 8, dtype=torch.float64)
    rows = base.clone()
    rows[:, [5, 17]] *= 1e19
    store = make(rows, [1.0, 1.0])
    index = tif.build_index(store, nlist=1, target_recall=None)
    msgs = _record(lambda: tif.indexed_top_k(store, (test * 1e19).float(), 5, index=index, nprobe=1))
    assert len(msgs) == 1 and "[5, 17]" in msgs[0]
    msgs = _record(lambda: tif.indexed_top_k(store, (test * 1e19).float(), 5, index=index, nprobe=1, rows=(0, 10)))
    assert len(msgs) == 1 and "[5]" in msgs[0]
    assert _record(lambda: tif.indexed_top_k(store, test.float(), 5, index=index, nprobe=1)) == []
    nindex = tif.build_index(store, nlist=1, target_recall=None, normalize=True)
    assert _record(lambda: tif.indexed_top_k(store, (test * 1e19).float(), 5, index=nindex, nprobe=1, normalize=True)) == []
    small = make(base * 1e-5, [1e3, 1e3])
    sindex = tif.build_index(small, nlist=1, target_recall=None)
    t36 = test * 1e36
    msgs = _record(lambda: tif.indexed_top_k(small, t36.float(), 5, index=sindex, nprobe=1))
    _values, indices = tif.indexed_top_k(small, t36.float(), 5, index=sindex, nprobe=1)
    assert msgs == []
    assert torch.equal(indices, ref(base * 1e-5, t36, [1e3, 1e3]).topk(5, dim=1).indices)
