"""atk44: outside attack on cosine indexes (and cosine scores) over denormal and extreme rows.

Written from the docs only (docs/search.md, CHANGELOG session 44, help()). Failing tests are
findings; passing ones are attacks that held.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import tracinfunc as tif
import tracinfunc.testing as tt
from tracinfunc.store import MemoryStore

pytest.importorskip("faiss")

SMALLEST = 1.401298464324817e-45  # float32's smallest denormal


def _store(rows: torch.Tensor, lrs=None, dtype=torch.float32) -> MemoryStore:
    c, n, k = rows.shape
    meta = tt.reference_store(n, k, n_ckpt=c, dtype=dtype).meta
    if lrs is not None:
        meta = dataclasses.replace(meta, checkpoints=tuple(
            dataclasses.replace(ck, lr=lr) for ck, lr in zip(meta.checkpoints, lrs, strict=False)))
    r = rows.to(dtype)
    return MemoryStore(meta, r, r.double().norm(dim=-1).float())


def _rows_with(row3: torch.Tensor, extra: dict | None = None, n=30, k=8, c=2):
    rows = torch.randn(c, n, k, generator=torch.Generator().manual_seed(0))
    rows[:, 3] = row3
    for j, v in (extra or {}).items():
        rows[:, j] = v
    return rows


def _e0(k=8):
    v = torch.zeros(k)
    v[0] = 1
    return v


def _query(c=2, k=8):
    """Test row 0 is e0 at every checkpoint (cosine 1 with a row along e0)."""
    t = torch.randn(c, 3, k, generator=torch.Generator().manual_seed(5))
    t[:, 0] = _e0(k)
    return t


# --------------------------------------------------------------------------- held

ROWS = {
    "denormal_1e-42": torch.tensor([1e-42, -2e-42, 0, 0, 3e-42, 0, 0, 0]),
    "zero": torch.zeros(8),
    "near_3e38": torch.tensor([3e38, 0, 0, 0, 0, 0, 0, 0]),
    "all_1e38": torch.full((8,), 1e38),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_cosine_index_over_extreme_row_matches_exact(name):
    """Held: build_index(normalize=True) builds over the row; indexed_top_k (every cluster)
    equals exact top_k(normalize=True), proponents and opponents."""
    st = _store(_rows_with(ROWS[name], {5: torch.zeros(8), 6: torch.full((8,), 1e-40)}))
    test = _query()
    idx = tif.build_index(st, normalize=True)
    for largest in (True, False):
        ev, ei = tif.top_k(st, test, 5, normalize=True, largest=largest)
        v, i = tif.indexed_top_k(st, test, 5, index=idx, normalize=True, largest=largest,
                                 nprobe=idx.nlist, n_candidates=30)
        assert torch.equal(ei, i)
        torch.testing.assert_close(v, ev, rtol=1e-5, atol=1e-6)


def test_saved_cosine_index_over_denormal_row_loads_and_refuses_a_swap(tmp_path):
    """Held (lr=1): a saved index over a 1e-20/denormal row loads for its own store; a store
    whose row 3 is turned (same norm, orthogonal direction) is refused by the query naming row 3."""
    for v in (1e-42, 1e-20):
        row = torch.zeros(8)
        row[0] = v
        st = _store(_rows_with(row), lrs=[1.0, 1.0])
        z = tif.save_store(st, tmp_path / f"a{v}.zarr")
        tif.build_index(z, normalize=True)
        idx = tif.load_index(tmp_path / f"a{v}.zarr.faiss", tif.GradientStore.open(tmp_path / f"a{v}.zarr"))
        val, ind = tif.indexed_top_k(z, _query(), 2, index=idx, normalize=True)
        assert ind[0, 0] == 3 and abs(val[0, 0].item() - 2.0) < 1e-5
        turned = torch.zeros(8)
        turned[1] = v
        st2 = _store(_rows_with(turned), lrs=[1.0, 1.0])
        with pytest.raises(tif.errors.IncompatibleGradientsError, match=r"rows \[3\]"):
            tif.indexed_top_k(st2, _query(), 2, index=idx, normalize=True)


# --------------------------------------------------------------------------- findings


@pytest.mark.parametrize("v, lr", [(SMALLEST, 0.5), (SMALLEST, 0.7), (1e-43, 0.3), (1e-42, 0.1)])
def test_cosine_score_of_a_denormal_row_is_its_cosine(v, lr):
    """Finding: a training row v*e0 (v a float32 denormal) against the test row e0 has cosine 1,
    so score(normalize=True) is lr. Observed (score/lr): 0.0 (smallest denormal, lr=0.5: also
    0.3, 0.1), 1.4286 (smallest, lr=0.7: a cosine above 1), 0.9859 (1e-43, lr=0.3), 0.9944
    (1e-42, lr=0.1); the candidates= path gives exactly lr, and lr=1 or 2 is right."""
    rows = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0))
    rows[0, 3] = 0
    rows[0, 3, 0] = v
    st = _store(rows, lrs=[lr])
    test = _e0().reshape(1, 1, 8)
    cand = tif.score(st, test, normalize=True, candidates=[[3]])[0, 0].item()
    exact = tif.score(st, test, normalize=True)[0, 3].item()
    assert cand == pytest.approx(lr, rel=1e-5)
    assert exact == pytest.approx(lr, rel=1e-3), exact / lr


def test_exact_cosine_top_k_finds_the_smallest_denormal_row():
    """Finding: store row 3 = 1.4e-45 * e0 at both checkpoints (lr 0.1, 0.2), test row e0:
    its cosine score is 0.3, the best in the store; top_k(normalize=True) returns rows
    [24, 21, 13] (0.1143, ...) and scores row 3 as 0; top_k(candidates=all rows) returns row 3
    with 0.3000."""
    st = _store(_rows_with(SMALLEST * _e0()))
    v, i = tif.top_k(st, _query(), 3, normalize=True)
    assert i[0, 0] == 3 and v[0, 0].item() == pytest.approx(0.3, rel=1e-5), (v[0], i[0])


def test_cosine_indexed_top_k_finds_the_smallest_denormal_row():
    """Finding: the same store through build_index(normalize=True) + indexed_top_k: row 3
    (cosine 1 at both checkpoints, score 0.3, the best) is not returned; the result is
    [24, 21, 13] (0.1143, ...), as the exact top_k's, though the index ranks it first."""
    st = _store(_rows_with(SMALLEST * _e0()))
    idx = tif.build_index(st, normalize=True)
    v, i = tif.indexed_top_k(st, _query(), 3, index=idx, normalize=True)
    assert i[0, 0] == 3 and v[0, 0].item() == pytest.approx(0.3, rel=1e-5), (v[0], i[0])


def test_cosine_index_refuses_a_turned_smallest_denormal_row_at_lr_below_one():
    """Finding: index built over row 3 = 1.4e-45*e0 (lr 0.1, 0.2); the store's row 3 replaced by
    1.4e-45*e1 (equal norm, orthogonal: cosine with the query 1 -> 0). indexed_top_k answers
    without a word ([24, 21]); with lr=1, or a 1e-42 row, the same swap is refused
    ('rows [3] differ from the rows the index was built from'). Not in the "not detected" list."""
    st = _store(_rows_with(SMALLEST * _e0()))
    idx = tif.build_index(st, normalize=True)
    turned = torch.zeros(8)
    turned[1] = SMALLEST
    st2 = _store(_rows_with(turned))
    with pytest.raises(tif.errors.IncompatibleGradientsError, match=r"rows \[3\]"):
        tif.indexed_top_k(st2, _query(), 2, index=idx, normalize=True)


@pytest.mark.parametrize("normalize", [False, True])
def test_indexed_top_k_over_every_cluster_orders_ties_like_top_k(normalize):
    """Finding: docs/search.md: with nprobe=nlist an "ivf_flat" result "equals exact top_k
    (tested)", and top_k orders equal scores by row. Rows 3, 7 and 11 are one example stored
    three times (bit-equal scores): top_k gives [3, 7, 11]; indexed_top_k gives [11, 3, 7]
    (plain) and [7, 11, 3] (cosine)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(1, 300, 8, generator=g)
    v = torch.randn(8, generator=g)
    for j in (3, 7, 11):
        rows[:, j] = v
    st = _store(rows, lrs=[1.0])
    test = v.reshape(1, 1, 8).clone()
    idx = tif.build_index(st, normalize=normalize)
    _ev, ei = tif.top_k(st, test, 4, normalize=normalize)
    _iv, ii = tif.indexed_top_k(st, test, 4, index=idx, normalize=normalize, nprobe=idx.nlist)
    assert ei.tolist() == ii.tolist(), (ei.tolist(), ii.tolist())


def test_cosine_of_a_finite_row_whose_norm_overflows_float32():
    """Finding: row 3 = [3e38, 3e38, 0, ...] is finite but its norm (4.2e38) is inf in float32;
    a MemoryStore takes it (norm inf) and the test row e0+e1 has cosine 1 with it at both
    checkpoints (score 0.3, the best). score(normalize=True) gives 0 for it, silently (as do
    candidates= and a cosine index): expected 0.3, or the store refused (save_store refuses it:
    'the block holds NaN/inf values')."""
    rows = _rows_with(torch.tensor([3e38, 3e38, 0, 0, 0, 0, 0, 0]))
    try:
        st = _store(rows)
    except tif.TracInFuncError:
        return
    test = torch.zeros(2, 1, 8)
    test[:, 0, :2] = 1
    try:
        s = tif.score(st, test, normalize=True)
    except tif.TracInFuncError:
        return
    assert s[0, 3].item() == pytest.approx(0.3, rel=1e-5)


def test_float64_cosine_score_of_the_smallest_denormal_row():
    """Finding: the float64 analogue: a float64 row 5e-324*e0 (norm 5e-324 given exactly) and
    the test row e0, lr=0.5: cosine 1, score 0.5; score(normalize=True) gives 0.0 (lr=0.1:
    0.0; 1e-320 at lr=0.1: 0.998*lr); candidates= gives 0.5. lr=1 is right."""
    base = tt.reference_store(4, 8, n_ckpt=1, dtype=torch.float64)
    meta = dataclasses.replace(base.meta, checkpoints=(
        dataclasses.replace(base.meta.checkpoints[0], lr=0.5),))
    rows = torch.randn(1, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rows[0, 3] = 0
    rows[0, 3, 0] = 5e-324
    norms = rows.norm(dim=-1)
    norms[0, 3] = 5e-324
    st = MemoryStore(meta, rows, norms)
    test = torch.zeros(1, 1, 8, dtype=torch.float64)
    test[0, 0, 0] = 1
    assert tif.score(st, test, normalize=True, candidates=[[3]])[0, 0].item() == pytest.approx(0.5)
    assert tif.score(st, test, normalize=True)[0, 3].item() == pytest.approx(0.5)


def _perm_pair(tmp_path, v, lrs):
    rows = torch.randn(2, 30, 8, generator=torch.Generator().manual_seed(0))
    rows[:, 3] = 0
    rows[:, 3, 0] = v
    rows[:, 7] = 0
    rows[:, 7, 1] = v
    z = tif.save_store(_store(rows, lrs=lrs), tmp_path / "a.zarr")
    tif.build_index(z, normalize=True)
    perm = rows.clone()
    perm[:, 3] = rows[:, 7]
    perm[:, 7] = rows[:, 3]
    z2 = tif.save_store(_store(perm, lrs=lrs), tmp_path / "b.zarr")
    return tmp_path / "a.zarr.faiss", z2


def test_load_index_refuses_two_denormal_rows_swapped_at_lr_one(tmp_path):
    """Held: rows 3 and 7 (1.4e-45*e0 and 1.4e-45*e1, equal norms) swapped, lr 1 and 1:
    load_index refuses naming rows [3, 7]."""
    path, z2 = _perm_pair(tmp_path, SMALLEST, [1.0, 1.0])
    with pytest.raises(tif.errors.IncompatibleGradientsError, match=r"rows \[3, 7\]"):
        tif.load_index(path, z2)


def test_load_index_refuses_two_denormal_rows_swapped_at_lr_below_one(tmp_path):
    """Finding: the same swap with lr 0.1 and 0.2 (the usual case) loads without a word, and
    indexed_top_k then answers [24, 21] for the query e0 (whose best is the moved row, cosine
    1). With 1e-42 rows, or lr 1, the swap is refused ('rows [3, 7] differ ...')."""
    path, z2 = _perm_pair(tmp_path, SMALLEST, [0.1, 0.2])
    with pytest.raises(tif.errors.IncompatibleGradientsError, match=r"rows \[3, 7\]"):
        tif.load_index(path, z2)


def test_ivf_pq_cosine_index_over_denormal_zero_and_huge_rows():
    """Held (lr 1): a 300-row store with rows 1e-42*e0, 1.4e-45*e1, 0 and 3e38*e2 builds an
    ivf_pq cosine index; searching every cluster with every row as candidate gives exact top_k."""
    rows = torch.randn(1, 300, 8, generator=torch.Generator().manual_seed(0))
    for j, (axis, v) in {3: (0, 1e-42), 7: (1, SMALLEST), 9: (0, 0.0), 11: (2, 3e38)}.items():
        rows[:, j] = 0
        rows[:, j, axis] = v
    st = _store(rows, lrs=[1.0])
    test = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(2))
    test[0, 0] = _e0()
    test[0, 1] = 0
    test[0, 1, 1] = 1
    test[0, 2] = 0
    test[0, 2, 2] = 1
    idx = tif.build_index(st, normalize=True, kind="ivf_pq", m=2)
    ev, ei = tif.top_k(st, test, 3, normalize=True)
    v, i = tif.indexed_top_k(st, test, 3, index=idx, normalize=True, nprobe=idx.nlist,
                             n_candidates=300)
    assert torch.equal(ei, i) and ei[0, 0] == 3 and ei[1, 0] == 7 and ei[2, 0] == 11
    torch.testing.assert_close(v, ev)
