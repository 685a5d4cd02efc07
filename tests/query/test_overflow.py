"""Scores and self-influences that overflow float32 from finite rows are named, not silent.

A store accepts rows whose norm fits float32; two rows of norm 1e30 have a product float32
cannot hold. Before: ``inf`` returned without a word (and ``top_k`` blamed the store for the
NaN of ``+inf - inf``). The reference is the same query in float64 (explicit matmul).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import tracinfunc as tif
from tracinfunc.store import MemoryStore
from tracinfunc.testing import reference_store


def _store_with_huge_row(row: int = 2, norm: float = 1e30, dtype=torch.float32,
                         flip_second: bool = False) -> tuple[MemoryStore, torch.Tensor]:
    base = reference_store(6, 8, n_ckpt=2)
    rows = torch.stack([base.read_rows(c, 0, 6) for c in range(2)]).double()
    rows[:, row] *= norm / rows[:, row].norm(dim=-1, keepdim=True)
    if flip_second:  # +inf at one checkpoint, -inf at the other: NaN summed
        rows[1, row] = -rows[0, row]
    meta = base.meta.replace(dtype=str(dtype).removeprefix("torch."))
    return MemoryStore(meta, rows.to(dtype), rows.norm(dim=-1).to(dtype)), rows


def _reference(rows: torch.Tensor, test: torch.Tensor, lrs) -> torch.Tensor:
    return sum(lr * test[c].double() @ rows[c].T for c, lr in enumerate(lrs))


def test_score_warns_naming_the_training_row_whose_scores_overflow():
    store, rows = _store_with_huge_row()
    test = rows[:, :3].float()
    with pytest.warns(RuntimeWarning, match=r"overflowed float32.*training rows \[2\]") as seen:
        scores = tif.score(store, test)
    assert len([w for w in seen if "overflowed" in str(w.message)]) == 1  # once per call
    assert seen[0].filename == __file__  # points at the user's call, not the library
    assert "dtype='float64'" in str(seen[0].message)
    expected = _reference(rows, test, store.meta.lrs)
    finite = torch.isfinite(scores)
    assert not finite[2, 2]  # 1e60 has no float32
    torch.testing.assert_close(scores[finite].double(), expected[finite], rtol=1e-5, atol=1e-5)


def test_top_k_and_score_chunks_warn_too_with_the_rows_offset():
    store, rows = _store_with_huge_row(row=4)
    test = rows[:, [0, 1, 4]].float()
    with pytest.warns(RuntimeWarning, match=r"training rows \[4\]"):
        tif.top_k(store, test, k=2)
    with pytest.warns(RuntimeWarning, match=r"training rows \[4\]"):
        list(tif.score_chunks(store, test, rows=(3, 6)))
    with pytest.warns(RuntimeWarning, match=r"training rows \[4\]"):
        tif.score(store, test, rows=(3, 6))


def test_plus_and_minus_inf_summed_to_nan_make_top_k_say_overflow():
    store, rows = _store_with_huge_row(flip_second=True)
    test = rows[:, 2:3].float()
    test[1] = rows[0, 2].float()  # checkpoint 1 sees a score of -1e60
    with pytest.warns(RuntimeWarning, match="overflowed"), \
            pytest.raises(tif.errors.NonFiniteGradientError, match="overflowed"):
        tif.top_k(store, test, k=2)


def test_self_influence_warns_naming_the_row_and_keeps_the_others_exact():
    store, rows = _store_with_huge_row(row=3)
    with pytest.warns(RuntimeWarning, match=r"self-influence of 1 training row\(s\) \(rows \[3\]"):
        values = tif.self_influence(store)
    expected = sum(lr * rows[c].norm(dim=-1) ** 2 for c, lr in enumerate(store.meta.lrs))
    assert torch.isinf(values[3])
    keep = torch.arange(6) != 3
    torch.testing.assert_close(values[keep].double(), expected[keep], rtol=1e-6, atol=0)
    with pytest.warns(RuntimeWarning, match=r"rows \[3\]"):
        tif.self_influence(store, rows=(2, 5))  # named as the store's row, not the range's


def test_a_float64_store_keeps_them_finite_and_silent():
    store, rows = _store_with_huge_row(dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = tif.score(store, rows[:, :3])
        values = tif.self_influence(store)
    torch.testing.assert_close(scores, _reference(rows, rows[:, :3], store.meta.lrs),
                               rtol=1e-12, atol=0)
    assert torch.isfinite(values).all()


@pytest.mark.parametrize("norm", [1.0, 1e15])
def test_ordinary_and_large_but_fitting_rows_stay_silent(norm):
    """1e15 squared is 1e30: large, fits float32; no warning, scores as the reference."""
    store, rows = _store_with_huge_row(norm=norm)
    test = rows[:, :3].float()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = tif.score(store, test)
        tif.top_k(store, test, k=2)
        tif.self_influence(store)
        tif.score(store, test * 1e20, normalize=True)  # cosines are bounded: never checked
    torch.testing.assert_close(scores.double(), _reference(rows, test, store.meta.lrs),
                               rtol=1e-5, atol=1e-5 * norm)


def test_candidates_and_the_index_rescoring_warn_too():
    pytest.importorskip("faiss", reason="the search extra: pip install 'tracinfunc[search]'")
    store, rows = _store_with_huge_row(row=4)
    test = rows[:, [0, 1, 4]].float()
    with pytest.warns(RuntimeWarning, match=r"training rows \[4\]"):
        tif.score(store, test, candidates=torch.tensor([[4, 0], [1, 4], [4, 3]]))
    index = tif.search.build_index(store, nlist=1, target_recall=None)
    with pytest.warns(RuntimeWarning, match=r"training rows \[4\]"):
        tif.search.indexed_top_k(store, test, 2, index=index, n_candidates=6)


def test_a_float64_learning_rate_below_its_normal_range_never_scales_the_callers_tensor():
    """lr = 1e-310 (a float64 denormal) folded into float64 test rows of 1e300 is applied in
    float64 on a copy: ``.to(float64)`` of a float64 tensor is the tensor itself, and the
    first version scaled the caller's rows in place."""
    base = reference_store(6, 4, n_ckpt=1, dtype=torch.float64)
    meta = base.meta.replace(checkpoints=(
        dataclasses.replace(base.meta.checkpoints[0], lr=1e-310),))
    rows = base.read_rows(0, 0, 6)[None]
    store = MemoryStore(meta, rows, rows.norm(dim=-1))
    test = torch.randn(1, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    test *= 1e300
    kept = test.clone()
    scores = tif.score(store, test)
    assert torch.equal(test, kept)
    torch.testing.assert_close(scores, 1e-310 * (test[0] @ rows[0].T), rtol=1e-9, atol=0)
