"""atk44: outside attack on the float32 overflow warnings of the query functions.

Written from the docs only (CHANGELOG "Overflow and denormal rows (session 44)",
docs/concepts/faults.md, help()). Failing tests are findings; passing ones are attacks that held.
"""
from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np
import pytest
import torch

import tracinfunc as tif
import tracinfunc.testing as tt
from tracinfunc.store import MemoryStore


def _store(rows: torch.Tensor, lrs=None, dtype=torch.float32) -> MemoryStore:
    c, n, k = rows.shape
    meta = tt.reference_store(n, k, n_ckpt=c, dtype=dtype).meta
    if lrs is not None:
        meta = dataclasses.replace(meta, checkpoints=tuple(
            dataclasses.replace(ck, lr=lr) for ck, lr in zip(meta.checkpoints, lrs, strict=False)))
    r = rows.to(dtype)
    return MemoryStore(meta, r, r.double().norm(dim=-1).float())


def _ref(store, test: torch.Tensor) -> torch.Tensor:
    """float64 brute force: sum_c lr_c * test_c @ train_c.T"""
    out = 0
    for c in range(store.n_ckpt):
        lr = store.meta.checkpoints[c].lr
        out = out + lr * test[c].double() @ store.read_rows(c, 0, store.n_train).double().T
    return out


def _calls(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        result = fn()
    return result, [x for x in w if issubclass(x.category, RuntimeWarning)]


def _three_big_rows():
    """40 rows, 3 checkpoints; rows 5, 20 and 33 of norm ~1e30 (20 only at checkpoint 1);
    test row 1 of norm ~1e30: scores at rows 5, 20, 33 overflow to NaN."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 40, 4, generator=g)
    rows[:, 5] *= 1e30
    rows[:, 33] *= 1e30
    rows[1, 20] *= 1e30
    test = torch.randn(3, 3, 4, generator=g)
    test[:, 1] *= 1e30
    return _store(rows, lrs=[0.1, 0.2, 0.3]), test


def _aligned_big():
    """Rows 5 and 33 of norm ~1e30, test row 1 aligned with row 33: +inf at row 33 and NaN at
    row 5 (true value -2.2e59) for test row 1; everything else finite."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 40, 4, generator=g)
    rows[:, 5] *= 1e30
    rows[:, 33] *= 1e30
    test = torch.randn(2, 3, 4, generator=g)
    test[:, 1] = (rows[:, 33].double() / rows[:, 33].double().norm(dim=-1, keepdim=True) * 1e30).float()
    return _store(rows, lrs=[0.1, 0.2]), test


# --------------------------------------------------------------------------- held


def test_overflow_warning_names_rows_and_fix_and_user_line():
    """Held: score warns once, naming row 3, the norms and dtype='float64', at the caller's line;
    the other scores equal the float64 reference."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 6, 4, generator=g)
    rows[:, 3] *= 1e30
    test = torch.randn(2, 3, 4, generator=g)
    test[:, 1] *= 1e20
    st = _store(rows)
    s, w = _calls(lambda: tif.score(st, test))
    assert len(w) == 1
    msg = str(w[0].message)
    assert "training rows [3]" in msg and "float64" in msg and "1.69e+30" in msg
    assert os.path.basename(w[0].filename) == os.path.basename(__file__)
    ref = _ref(st, test)
    finite = torch.isfinite(s)
    assert (~finite).sum() == 1 and not finite[1, 3]
    torch.testing.assert_close(s[finite].double(), ref[finite], rtol=1e-5, atol=1e-6)


def test_overflow_only_in_the_sum_over_checkpoints_warns():
    """Held: each checkpoint's score (2.4e38) fits float32, their sum does not: warned, row 1."""
    rows = torch.ones(2, 3, 4)
    rows[:, 1] = 1e19
    test = torch.ones(2, 2, 4)
    test[:, 0] = 0.6e19
    st = _store(rows, lrs=[1.0, 1.0])
    s, w = _calls(lambda: tif.score(st, test))
    assert len(w) == 1 and "training rows [1]" in str(w[0].message)
    assert torch.isinf(s[0, 1])


def test_negative_lr_overflow_warns():
    """Held: lr=-1 gives -inf and a warning naming row 1."""
    rows = torch.ones(2, 3, 4) * 3
    rows[:, 1] = 3e19
    test = torch.ones(2, 2, 4)
    test[:, 0] = 0.6e19
    st = _store(rows, lrs=[-1.0, 1e-3])
    s, w = _calls(lambda: tif.score(st, test))
    assert len(w) == 1 and "training rows [1]" in str(w[0].message)
    assert s[0, 1] == -float("inf")


def test_cancelling_checkpoint_overflows_warn_and_top_k_error_names_overflow():
    """Held: +4e40 and -4e40 at two checkpoints (true 0) give NaN with a warning; top_k's NaN
    error mentions the overflow."""
    rows = torch.ones(2, 3, 4)
    rows[:, 1] = 1e20
    test = torch.ones(2, 2, 4)
    test[0, 0] = 1e20
    test[1, 0] = -1e20
    st = _store(rows, lrs=[1.0, 1.0])
    s, w = _calls(lambda: tif.score(st, test))
    assert len(w) == 1 and torch.isnan(s[0, 1])
    with pytest.raises(tif.errors.NonFiniteGradientError, match="overflow"):
        _calls(lambda: tif.top_k(st, test, 2))


def test_cauchy_schwarz_allows_overflow_but_scores_finite_no_warning():
    """Held: norms 1e20 x 1e20 allow an overflow, but the rows are orthogonal: no warning."""
    rows = torch.zeros(1, 3, 4)
    rows[0, 1, 0] = 1e20
    rows[0, 0] = 1
    rows[0, 2] = 1
    test = torch.zeros(1, 2, 4)
    test[0, 0, 1] = 1e20
    test[0, 1] = 1
    st = _store(rows, lrs=[1.0])
    _, w = _calls(lambda: tif.score(st, test))
    _, w2 = _calls(lambda: tif.top_k(st, test, 2))
    assert w == [] and w2 == []


def test_ordinary_queries_never_warn():
    """Held: ordinary rows, every query function, no RuntimeWarning."""
    st = tt.reference_store(30, 8, n_ckpt=2)
    test = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    _, w = _calls(lambda: (tif.score(st, test), tif.top_k(st, test, 3), tif.self_influence(st),
                           list(tif.score_chunks(st, test, chunk_rows=7)),
                           tif.score(st, test, candidates=torch.arange(5).repeat(3, 1)),
                           tif.score(st, test, normalize=True)))
    assert w == []


def test_float64_store_stays_silent_and_exact():
    """Held: a float64 store with 1e30 rows scores 2.4e59 exactly, without a warning."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    rows[:, 2] *= 1e30
    test = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    test[:, 1] *= 1e30
    st = _store(rows, lrs=[0.5, -0.25], dtype=torch.float64)
    (s, (v, _i), si), w = _calls(lambda: (tif.score(st, test), tif.top_k(st, test, 2),
                                         tif.self_influence(st)))
    assert w == []
    torch.testing.assert_close(s, _ref(st, test), rtol=1e-12, atol=0)
    assert torch.isfinite(si).all() and torch.isfinite(v).all()


def test_normalize_never_warns_on_huge_rows():
    """Held: cosine scores over 1e30 rows: no warning, values in [-0.3, 0.3]."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 5, 4, generator=g)
    rows[:, 2] *= 1e30
    test = torch.randn(2, 3, 4, generator=g)
    test[:, 1] *= 1e30
    st = _store(rows)
    (s, _), w = _calls(lambda: (tif.score(st, test, normalize=True),
                               tif.top_k(st, test, 2, normalize=True)))
    assert w == [] and s.abs().max() <= 0.3 + 1e-6


@pytest.mark.parametrize("q", ["int8", "sign"])
def test_quantised_store_overflow_warns(q):
    """Held: int8 and sign stores with a 2.4e30 row: score and self_influence warn, row 4."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 6, 4, generator=g)
    rows[:, 4] *= 1e30
    test = torch.randn(2, 3, 4, generator=g)
    test[:, 1] *= 1e30
    qs = tif.to_memory(_store(rows), dtype=q)
    _, w = _calls(lambda: tif.score(qs, test))
    _, w2 = _calls(lambda: tif.self_influence(qs))
    assert len(w) == 1 and "training rows [4]" in str(w[0].message)
    assert len(w2) == 1 and "rows [4]" in str(w2[0].message)


def test_int8_rounding_above_the_stored_norm_still_warns():
    """Held: int8 codes whose row norm is 8.5% above the stored (pre-quantisation) norm,
    aligned test row: stored-norm product 3.2e38 fits, the real score 3.47e38 does not: warned."""
    k = 4096
    x = torch.full((1, 2, k), 0.51)
    x[0, :, 0] = 127.0
    x[0, 1] = 1.0
    q = tif.to_memory(_store(x * 1e19, lrs=[1.0]), dtype="int8")
    r = q.read_rows(0, 0, 2).double()
    n = q.read_norms(0, 0, 2).double()[0]
    test = (r[0] / r[0].norm() * (3.2e38 / n)).float().reshape(1, 1, k)
    s, w = _calls(lambda: tif.score(q, test))
    assert torch.isinf(s[0, 0]) and len(w) == 1


def test_bfloat16_and_zarr_stores_warn(tmp_path):
    """Held: a bfloat16 store and a Zarr store reopened from disk warn, naming row 4 (also
    under rows=(3, 6) with chunk_rows=1)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 6, 4, generator=g)
    rows[:, 4] *= 1e30
    test = torch.randn(2, 3, 4, generator=g)
    test[:, 1] *= 1e30
    st = _store(rows)
    _, w = _calls(lambda: tif.score(_store(rows, dtype=torch.bfloat16), test))
    assert len(w) == 1 and "training rows [4]" in str(w[0].message)
    tif.save_store(st, tmp_path / "x.zarr")
    z = tif.GradientStore.open(tmp_path / "x.zarr")
    _, w = _calls(lambda: tif.score(z, test, rows=(3, 6), chunk_rows=1))
    assert len(w) == 1 and "training rows [4]" in str(w[0].message)
    _, w = _calls(lambda: tif.self_influence(z))
    assert len(w) == 1


def test_self_influence_sum_overflow_and_rows_range():
    """Held: squares 2e38 per checkpoint summing past float32 warn; rows=(1, 3) names row 2."""
    rows = torch.ones(2, 3, 4)
    rows[:, 1] = 1e19
    s, w = _calls(lambda: tif.self_influence(_store(rows, lrs=[1.0, 1.0])))
    assert torch.isinf(s[1]) and len(w) == 1 and "rows [1]" in str(w[0].message)
    rows = torch.ones(2, 3, 4)
    rows[:, 2] = 1e20
    s, w = _calls(lambda: tif.self_influence(_store(rows, lrs=[1.0, 1.0]), rows=(1, 3)))
    assert len(w) == 1 and "rows [2]" in str(w[0].message) and s.shape == (2,)


def test_contrast_subtraction_that_overflows_float32_is_scored_right():
    """Held: test 3e38 minus control -3e38 (6e38 in float32 is inf): scores equal the float64
    reference."""
    t2 = torch.ones(3, 2, 4)
    t2[:, 0] = 3e38
    c2 = torch.ones(3, 2, 4)
    c2[:, 0] = -3e38
    rows = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(3)) * 1e-10
    st = _store(rows, lrs=[0.1, 0.2, 0.3])
    s, _ = _calls(lambda: tif.score(st, tif.Contrast(t2, c2, paired=True)))
    torch.testing.assert_close(s.double(), _ref(st, t2.double() - c2.double()), rtol=1e-5, atol=0)


def test_output_numpy_and_contrast_warn_with_all_rows():
    """Held: output='numpy' and a Contrast query warn once, naming rows [5, 20, 33]."""
    st, test = _three_big_rows()
    ctrl = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(7))
    r, w = _calls(lambda: tif.score(st, test, output="numpy"))
    assert isinstance(r, np.ndarray) and len(w) == 1
    assert "training rows [5, 20, 33]" in str(w[0].message)
    _, w = _calls(lambda: tif.score(st, tif.Contrast(test, ctrl)))
    assert len(w) == 1 and "training rows [5, 20, 33]" in str(w[0].message)


def test_rerank_and_indexed_top_k_warn_at_the_user_line():
    """Held: indexed_top_k and rerank warn (row 33 / rows [5, 33]) at the caller's line."""
    pytest.importorskip("faiss")
    st, test = _aligned_big()
    idx = tif.build_index(st)
    _, w = _calls(lambda: tif.indexed_top_k(st, test, 3, index=idx, nprobe=idx.nlist))
    # one warning, before the search: the rows whose scores can overflow (session 44's fix of
    # this pass's finding 6), the overflowed row 33 among them
    assert len(w) == 1 and "[5, 33]" in str(w[0].message)
    assert os.path.basename(w[0].filename) == os.path.basename(__file__)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with pytest.raises(tif.errors.NonFiniteGradientError, match="overflow"):
            tif.rerank(tif.Retriever(st, test), st, test, 2, n_candidates=5)
    w = [x for x in w if issubclass(x.category, RuntimeWarning)]
    assert w and os.path.basename(w[0].filename) == os.path.basename(__file__)


# --------------------------------------------------------------------------- findings


def test_score_with_small_chunk_rows_names_every_overflowed_row():
    """Finding: with chunk_rows=2 the warning says '1 score(s) ... (training rows [5])' although
    rows 5, 20 and 33 are NaN (the default chunking names all three, '3 score(s)'): only the
    first chunk's overflow is reported."""
    st, test = _three_big_rows()
    s, w = _calls(lambda: tif.score(st, test, chunk_rows=2))
    assert torch.isnan(s[1, [5, 20, 33]]).all()
    assert len(w) == 1
    assert "training rows [5, 20, 33]" in str(w[0].message), str(w[0].message)


def test_score_rows_range_with_small_chunks_names_every_overflowed_row():
    """Finding: rows=(10, 40), chunk_rows=3: the warning names only store row [20]; row 33 is
    NaN too and is not named."""
    st, test = _three_big_rows()
    s, w = _calls(lambda: tif.score(st, test, rows=(10, 40), chunk_rows=3))
    assert torch.isnan(s[1, [10, 23]]).all()
    assert len(w) == 1
    assert "training rows [20, 33]" in str(w[0].message), str(w[0].message)


def test_score_chunks_names_every_overflowed_row():
    """Finding: iterating score_chunks(chunk_rows=4) to the end gives one warning naming only
    row [5]; the NaN blocks of rows 20 and 33 come later without a word."""
    st, test = _three_big_rows()

    def run():
        return torch.cat([b.clone() for _, b in tif.score_chunks(st, test, chunk_rows=4)], 1)

    s, w = _calls(run)
    assert torch.isnan(s[1, [5, 20, 33]]).all()
    named = " ".join(str(x.message) for x in w)
    for row in ("5", "20", "33"):
        assert row in named.replace("[", " ").replace("]", " ").replace(",", " ").split(), named


def test_top_k_candidates_does_not_rank_an_overflow_nan_first():
    """Finding: top_k(..., candidates=) returns a NaN (from an overflow, true value -2.2e59) as
    the best proponent of test row 1 (values [nan], index 5), where top_k over the whole store
    raises NonFiniteGradientError naming the overflow. Expected: the same error (or the finite
    candidate 0 ranked first), never NaN as a top value."""
    st, test = _aligned_big()
    cand = torch.tensor([[5, 0], [5, 0], [5, 0]])
    try:
        (v, i), _ = _calls(lambda: tif.top_k(st, test, 1, candidates=cand))
    except tif.errors.NonFiniteGradientError as e:
        assert "overflow" in str(e)
        return
    assert not torch.isnan(v).any(), (v, i)


def test_candidate_overflow_warning_names_the_largest_norms():
    """Finding: the candidates path's warning says only "those rows' and the test rows' norms
    are too large for their products to fit float32" - no norms - where score's names 'the
    largest learning-rate-weighted test row norm and training row norm' (the documented content:
    rows, largest norms, fix)."""
    st, test = _three_big_rows()
    cand = torch.tensor([[5, 1], [33, 2], [0, 20]])
    _, w = _calls(lambda: tif.score(st, test, candidates=cand))
    assert len(w) == 1
    assert "e+30" in str(w[0].message) and "e+29" in str(w[0].message), str(w[0].message)


def test_lr_weighting_overflow_does_not_turn_a_representable_score_into_inf():
    """Finding: test entries 1e36, lr=1e3, training entries 1e-5: every true score is 4e34
    (well inside float32, each checkpoint's too), but score returns inf everywhere and warns
    'the largest learning-rate-weighted test row norm ... are inf and 2e-05': lr * test
    overflows before the product."""
    st = _store(torch.full((1, 3, 4), 1e-5), lrs=[1e3])
    test = torch.full((1, 2, 4), 1e36)
    s, _ = _calls(lambda: tif.score(st, test))
    torch.testing.assert_close(s.double(), _ref(st, test), rtol=1e-5, atol=0)


def test_lr_weighting_underflow_does_not_silently_change_scores():
    """Finding: test entries 1e-25, lr=1e-20 (in float32's normal range), training entries
    1e25: every true score is 4e-20, score returns 5.6052e-20 (40% off) with no warning:
    lr * test underflows to the denormal 1.4e-45 before the product."""
    st = _store(torch.full((1, 3, 4), 1e25), lrs=[1e-20])
    test = torch.full((1, 2, 4), 1e-25)
    s, w = _calls(lambda: tif.score(st, test))
    if not w:
        torch.testing.assert_close(s.double(), _ref(st, test), rtol=1e-5, atol=0)


def _identity_curvature(st, scale, damping):
    e = torch.eye(st.k, dtype=torch.float64) * scale
    return tif.Curvature(kind="projected", checkpoints=st.meta.checkpoints, layout=st.meta.layout,
                         projection=st.meta.projection, damping=(damping,) * st.n_ckpt,
                         estimates=tuple({"matrix": e} for _ in range(st.n_ckpt)))


def test_curvature_amplified_overflow_warns():
    """Held: a "projected" curvature (F = 1e-7 I, damping 1e-6) multiplies 1e17 test rows by
    ~9e5: score (true -3.4e39) and self_influence (true 2.4e40) overflow and warn, row 5, though
    the raw norms' products (1e34) fit."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 20, 4, generator=g)
    rows[:, 5] *= 1e17
    st = _store(rows, lrs=[0.1, 0.2])
    cv = _identity_curvature(st, 1e-7, 1e-6)
    test = torch.randn(2, 3, 4, generator=g)
    test[:, 1] *= 1e17
    s, w = _calls(lambda: tif.score(st, test, curvature=cv))
    assert not torch.isfinite(s[1, 5]) and len(w) == 1 and "[5]" in str(w[0].message)
    si, w = _calls(lambda: tif.self_influence(st, curvature=cv))
    assert torch.isinf(si[5]) and len(w) == 1 and "[5]" in str(w[0].message)


def test_curvature_self_influence_warning_does_not_blame_the_norms_squares():
    """Finding (message): with a curvature, row 5's norm is 3.1e17 (square 1e35, fits float32);
    the overflow comes from (F + l I)^-1 (damping 1e-6). The warning says "those rows' norms are
    too large for their squares to fit float32", which is false; expected it to name the
    curvature (or damping) as the cause."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 20, 4, generator=g)
    rows[:, 5] *= 1e17
    st = _store(rows, lrs=[0.1, 0.2])
    _, w = _calls(lambda: tif.self_influence(st, curvature=_identity_curvature(st, 1e-7, 1e-6)))
    assert len(w) == 1
    msg = str(w[0].message)
    assert "too large for their squares" not in msg and ("curvature" in msg or "damping" in msg), msg


def test_huge_test_row_against_ordinary_rows_message_is_bounded():
    """Held: a 2e38 test row against 20,000 ordinary rows: one warning of 422 characters
    ('2502 score(s) ... training rows [1, 4, 5, 7, 11] and more'), finite scores right, every
    true overflow non-finite (477 of the 2502 have true values inside float32: partial sums)."""
    g = torch.Generator().manual_seed(0)
    st = _store(torch.randn(1, 20000, 4, generator=g), lrs=[1.0])
    test = torch.randn(1, 2, 4, generator=g)
    test[:, 0] *= 1e38
    s, w = _calls(lambda: tif.score(st, test))
    assert len(w) == 1 and len(str(w[0].message)) < 1000 and "and more" in str(w[0].message)
    ref = _ref(st, test)
    fin = torch.isfinite(s)
    # every true overflow is inf/NaN (2025 of them); 477 more whose true value fits float32
    # (a partial sum of the float32 product overflowed) are inf too: noted, not asserted
    assert not fin[ref.abs() > torch.finfo(torch.float32).max].any()
    # float32 rounding of sums of ~1e38 terms: error up to ~eps * |t| |r| (1e31 observed)
    torch.testing.assert_close(s[0][fin[0]].double(), ref[0][fin[0]], rtol=1e-5, atol=1e33)
    torch.testing.assert_close(s[1].double(), ref[1], rtol=1e-5, atol=1e-5)


def test_output_jax_warns():
    """Held: output='jax' warns once, naming rows [5, 20, 33]."""
    pytest.importorskip("jax")
    st, test = _three_big_rows()
    _, w = _calls(lambda: tif.score(st, test, output="jax"))
    assert len(w) == 1 and "training rows [5, 20, 33]" in str(w[0].message)


def _nan_best_row():
    """Row 5 = 1e20*e0; test row 0 is 2e20*e0 at checkpoint 0 and -1e20*e0 at checkpoint 1
    (lr 1, 1): the true score is +1e40 (the best of the store); in float32 +inf + -inf = NaN."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 40, 4, generator=g)
    rows[:, 5] = 0
    rows[:, 5, 0] = 1e20
    test = torch.randn(2, 2, 4, generator=g)
    test[0, 0] = 0
    test[0, 0, 0] = 2e20
    test[1, 0] = 0
    test[1, 0, 0] = -1e20
    return _store(rows, lrs=[1.0, 1.0]), test


def test_indexed_top_k_does_not_silently_drop_an_overflowed_best_row():
    """Finding: the true best row of test row 0 (row 5, score 1e40, NaN in float32 from
    +inf + -inf over two checkpoints) is silently left out by indexed_top_k - no warning, no
    error, result rows [29, 24, 6] - even with nprobe=nlist and n_candidates=n_train. top_k
    over the same store warns and raises NonFiniteGradientError naming the overflow."""
    pytest.importorskip("faiss")
    st, test = _nan_best_row()
    idx = tif.build_index(st)
    with pytest.raises(tif.errors.NonFiniteGradientError):
        _calls(lambda: tif.top_k(st, test, 3))
    try:
        (v, i), w = _calls(lambda: tif.indexed_top_k(st, test, 3, index=idx, nprobe=idx.nlist,
                                                    n_candidates=40))
    except tif.errors.NonFiniteGradientError as e:
        assert "overflow" in str(e)
        return
    assert w and "[5]" in str(w[0].message), (v, i)


def test_self_influence_that_fits_float32_is_not_inf():
    """Finding: norm 2.5e19 (stored exactly enough in float32), lr=0.5: the self-influence
    0.5 * 6.25e38 = 3.125e38 fits float32, but self_influence returns inf and warns that the
    row's self-influence 'overflowed float32' (the square is formed before the lr). Likewise
    lr 1 and -0.8 over two checkpoints of square 5e38 (true 1e38) give NaN."""
    rows = torch.ones(1, 3, 4)
    rows[0, 1] = 1.25e19
    st = _store(rows, lrs=[0.5])
    si, _ = _calls(lambda: tif.self_influence(st))
    assert torch.isfinite(si[1]) and si[1].item() == pytest.approx(3.125e38, rel=1e-5), si


def test_float64_store_overflow_warning_does_not_prescribe_float64():
    """Finding (message): a float64 store whose score overflows float64 (1e200 x 1e200) warns
    "overflowed float64 ... build the store and the test gradients with dtype='float64' to keep
    them finite" - the store already is float64, so the advice cannot help; it also reports the
    lr-weighted test row norm as 'inf' (its norm is 1e199)."""
    base = tt.reference_store(4, 8, n_ckpt=1, dtype=torch.float64)
    rows = torch.randn(1, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rows[0, 3] = 0
    rows[0, 3, 0] = 1e200
    norms = rows.norm(dim=-1)
    norms[0, 3] = 1e200
    st = MemoryStore(base.meta, rows, norms)
    test = torch.zeros(1, 1, 8, dtype=torch.float64)
    test[0, 0, 0] = 1e200
    _, w = _calls(lambda: tif.score(st, test))
    assert len(w) == 1
    assert "dtype='float64' to keep them finite" not in str(w[0].message), str(w[0].message)


def test_top_k_over_more_than_65536_test_rows_warns_once_with_the_total():
    """Finding: 70,000 test rows (top_k splits them into blocks of 65,536, one scan each), rows
    5 and 69,000 overflow with training row 3: top_k emits two identical warnings, each saying
    '1 score(s) overflowed' (under Python's default filter the second is hidden, so the user reads
    1 of 2). score and top_k(candidates=) on the same input warn once, '2 score(s)'."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(1, 10, 4, generator=g)
    rows[:, 3] = 1e20
    st = _store(rows, lrs=[1.0])
    test = torch.randn(1, 70000, 4, generator=g)
    test[0, 5] = 1e20
    test[0, 69000] = 1e20
    (v, _i), w = _calls(lambda: tif.top_k(st, test, 2))
    assert torch.isinf(v[[5, 69000], 0]).all()
    assert len(w) == 1 and "2 score(s)" in str(w[0].message), [str(x.message)[:60] for x in w]


def test_no_false_warning_when_the_overflowing_row_is_outside_the_query():
    """Held: row 5 overflows with test row 1, but rows=(10, 40), candidates without row 5, or
    an index search over rows (10, 40): finite results, no warning."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 40, 4, generator=g)
    rows[:, 5] *= 1e30
    st = _store(rows, lrs=[0.1, 0.2])
    test = torch.randn(2, 3, 4, generator=g)
    test[:, 1] *= 1e30
    calls = [lambda: tif.score(st, test, rows=(10, 40)),
             lambda: tif.top_k(st, test, 2, rows=(10, 40))[0],
             lambda: tif.self_influence(st, rows=(10, 40)),
             lambda: tif.score(st, test, candidates=torch.tensor([[1, 2]] * 3))]
    try:
        import faiss  # noqa: F401
        idx = tif.build_index(st)
        calls.append(lambda: tif.indexed_top_k(st, test, 2, index=idx, rows=(10, 40))[0])
    except ImportError:
        pass
    for fn in calls:
        r, w = _calls(fn)
        assert w == [] and torch.isfinite(r).all()
