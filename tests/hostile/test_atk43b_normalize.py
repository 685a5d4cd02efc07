"""Outside pass atk43b (black box, docs only): cosine TracIn (``normalize=True``) on every query path.

Reference: an explicit float64 loop, ``sum_c lr_c <t_c / |t_c|, x_c / n_c>`` with ``n_c`` the
store's exact norms (docs/concepts/stores.md) and "a zero gradient has cosine 0 with everything"
(``score``'s docstring). FINDING tests fail on the commit they were written against; HELD tests
held and guard regressions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tracinfunc as tif
from tests.hostile import _tiny as T

STORE = T.build()
C, N, K = STORE.shape
LRS = [c.lr for c in STORE.meta.checkpoints]


def reference(store, t):
    """Cosine TracIn in float64 by an explicit loop: ``[n_test, n_train]``."""
    t = torch.as_tensor(np.asarray(t.float() if t.dtype == torch.bfloat16 else t)).double()
    out = torch.zeros(t.shape[1], store.n_train, dtype=torch.float64)
    for c in range(C):
        rows = store.read_rows(c, 0, store.n_train).double()
        norms = store.read_norms(c, 0, store.n_train).double()
        for i in range(t.shape[1]):
            a = t[c, i]
            m = a.abs().max()
            if m == 0:
                continue
            unit = (a / m) / torch.linalg.norm(a / m)
            for j in range(store.n_train):
                if norms[j] != 0:
                    out[i, j] += LRS[c] * float(unit @ rows[j]) / float(norms[j])
    return out


def crafted(big=3e38, tiny=1e-42, dtype=torch.float32):
    g = torch.Generator().manual_seed(5)
    t = torch.randn(C, 6, K, generator=g, dtype=torch.float64)
    t[0, 0] = 0                                   # zero in checkpoint 0 only
    t[:, 1] = 0
    t[:, 1, 3] = big                              # one huge entry
    t[:, 2] = tiny * torch.sign(torch.randn(C, K, generator=g, dtype=torch.float64))
    t[:, 3, 0] = big                              # huge and denormal in one row
    t[:, 3, 1:] = tiny
    t[:, 4] = big * 0.9                           # the norm overflows in float32
    return t.to(dtype)


def close(got, want, tol=1e-5):
    got = torch.as_tensor(np.asarray(got)).double()
    assert torch.isfinite(got).all(), got
    assert (got - want).abs().max().item() < tol, (got, want)


# ---- FINDING: float64 test rows of denormal size ----

@pytest.mark.parametrize("row", ["all-denormal", "one-smallest-denormal"])
def test_float64_denormal_rows_have_their_cosine(row):
    """FINDING: float64 test rows whose entries are float64 denormals (1e-310; one 5e-324 entry)
    gave NaN cosines from score (the float32 fix of atk43 does not cover float64 rows: the
    reciprocal of a denormal float64 norm overflows). The direction is well defined."""
    t = torch.zeros(C, 1, K, dtype=torch.float64)
    if row == "all-denormal":
        t[:] = 1e-310 * torch.sign(torch.randn(C, 1, K, generator=torch.Generator().manual_seed(1),
                                               dtype=torch.float64))
    else:
        t[:, 0, 0] = 5e-324
    close(tif.score(STORE, t, normalize=True), reference(STORE, t))


def test_float64_denormal_rows_top_k():
    """FINDING: top_k on the same rows raised NonFiniteGradientError blaming the *store*
    ("the store holds inf or NaN rows ... rebuild it"), a misdiagnosis: the store is finite."""
    t = torch.zeros(C, 1, K, dtype=torch.float64)
    t[:, 0, 0] = 5e-324
    values, _ = tif.top_k(STORE, t, 3, normalize=True)
    close(values, reference(STORE, t).topk(3, dim=1).values)


def test_float64_crafted_rows_score():
    """FINDING: mixed 1e300 / 1e-310 float64 rows in one query: the denormal row came back NaN."""
    t = crafted(1e300, 1e-310, torch.float64)
    close(tif.score(STORE, t, normalize=True), reference(STORE, t))


# ---- HELD (regression guards) ----

def test_held_float32_crafted_rows_every_path_and_no_mutation():
    """HELD: zero, one-huge, all-denormal, mixed and overflowing float32 rows: score, top_k
    (both ends), score_chunks, NumPy rows, candidates; the caller's rows are unchanged."""
    t = crafted()
    keep = t.clone()
    want = reference(STORE, t)
    close(tif.score(STORE, t, normalize=True), want)
    close(tif.score(STORE, t.numpy(), normalize=True), want)
    for largest in (True, False):
        v, _ = tif.top_k(STORE, t, 5, normalize=True, largest=largest)
        close(v, want.topk(5, dim=1, largest=largest).values)
    blocks = torch.cat([b for _, b in tif.score_chunks(STORE, t, normalize=True, chunk_rows=7)], 1)
    close(blocks, want)
    cand = torch.tensor([[0, 5, 9]] * 6)
    close(tif.score(STORE, t, normalize=True, candidates=cand), want[:, [0, 5, 9]])
    assert torch.equal(t, keep)


def test_held_half_precision_rows():
    """HELD: float16 (6e4 / 1e-7) and bfloat16 (3e38 / 1e-40) crafted rows."""
    t = crafted(6e4, 1e-7, torch.float16)
    close(tif.score(STORE, t, normalize=True), reference(STORE, t.float()))
    t = crafted(3e38, 1e-40, torch.bfloat16)
    close(tif.score(STORE, t, normalize=True), reference(STORE, t.float()))


def test_held_contrast_and_index():
    """HELD: Contrast (shared and paired) and indexed_top_k with crafted float32 rows."""
    t = crafted()
    want = reference(STORE, t)
    ctrl = crafted()[:, :3]
    keep = ctrl.clone()
    got = tif.score(STORE, tif.Contrast(t, ctrl, weight=0.5), normalize=True)
    close(got, want - 0.5 * reference(STORE, ctrl).mean(0))
    assert torch.equal(ctrl, keep)
    got = tif.score(STORE, tif.Contrast(t, crafted(), weight=2.0, paired=True), normalize=True)
    close(got, want - 2.0 * reference(STORE, crafted()))
    index = tif.search.build_index(STORE, normalize=True, kind="ivf_flat", nlist=1)
    v, _ = tif.search.indexed_top_k(STORE, t, 5, index=index, normalize=True, nprobe=1, n_candidates=40)
    close(v, want.topk(5, dim=1).values)


@pytest.mark.parametrize("dtype", ["int8", "sign", torch.float16])
def test_held_quantised_and_half_stores(dtype):
    """HELD: quantised / float16 stores divide by their exact norms."""
    store = T.build(dtype=dtype)
    t = crafted()
    close(tif.score(store, t, normalize=True), reference(store, t))


def _f64_denormal_query():
    t = torch.zeros(C, 2, K, dtype=torch.float64)
    t[:, 0, 0] = 5e-324                                        # a denormal row
    t[:, 1] = torch.randn(C, K, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return t


@pytest.mark.parametrize("path", ["rerank", "score_chunks", "contrast", "indexed_top_k", "candidates"])
def test_float64_denormal_rows_every_path(path):
    """FINDING: the float64 denormal row through the other query paths: rerank returned NaN
    values silently (no error), score_chunks / Contrast / candidates NaN, and indexed_top_k
    (an ivf_flat index, nlist=1, nprobe=1: every row in the one cluster) refused with a false
    diagnosis: "the 1 of 1 clusters searched ... hold only 0 rows, fewer than k=5; raise
    nprobe". Every path must give the float64 reference."""
    t = _f64_denormal_query()
    want = reference(STORE, t)
    if path == "rerank":
        v, _ = tif.rerank(tif.Retriever(STORE, t), STORE, t, 5, n_candidates=40, normalize=True)
        close(v, want.topk(5, dim=1).values)
    elif path == "score_chunks":
        close(torch.cat([b for _, b in tif.score_chunks(STORE, t, normalize=True, chunk_rows=16)], 1), want)
    elif path == "contrast":
        ctrl = torch.randn(C, 3, K, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        got = tif.score(STORE, tif.Contrast(t, ctrl), normalize=True)
        close(got, want - reference(STORE, ctrl).mean(0))
    elif path == "indexed_top_k":
        index = tif.search.build_index(STORE, normalize=True, kind="ivf_flat", nlist=1)
        v, _ = tif.search.indexed_top_k(STORE, t, 5, index=index, normalize=True, nprobe=1, n_candidates=40)
        close(v, want.topk(5, dim=1).values)
    else:
        cand = torch.tensor([[0, 5, 9]] * 2)
        close(tif.score(STORE, t, normalize=True, candidates=cand), want[:, [0, 5, 9]])


def test_held_rerank_float32_crafted_rows():
    """HELD: rerank (normalize on both sides, every row a candidate) equals the top 5 of the
    float32 crafted rows' reference."""
    t = crafted()
    v, _ = tif.rerank(tif.Retriever(STORE, t, normalize=True), STORE, t, 5, n_candidates=40, normalize=True)
    close(v, reference(STORE, t).topk(5, dim=1).values)


def _store_with(row):
    """STORE with training row 0 replaced (every checkpoint), norms exact: a MemoryStore."""
    from tracinfunc.store import MemoryStore

    rows = torch.stack([STORE.read_rows(c, 0, N) for c in range(C)]).clone()
    g = torch.Generator().manual_seed(6)
    if row == "denormal":
        rows[:, 0] = 1e-42 * torch.sign(torch.randn(C, K, generator=g))
    elif row == "zero":
        rows[:, 0] = 0
    elif row == "one-huge":
        rows[:, 0] = 0
        rows[:, 0, 0] = 1e30
    else:  # "tiny": normal entries whose squares underflow
        rows[:, 0] = 1e-20
    norms = torch.linalg.vector_norm(rows.double(), dim=2).float()
    return MemoryStore(STORE.meta, rows, norms)


@pytest.mark.parametrize("row", ["denormal", "zero", "one-huge", "tiny"])
def test_training_rows_of_extreme_size(row):
    """FINDING (denormal): a training row of float32 denormals (norm 2.8e-42, exact and finite)
    gives NaN cosines from score (silently) and top_k refuses with "the store holds inf or NaN
    rows ... rebuild it", which is false: the store is finite. The atk43 fix covers test rows
    only. HELD: zero rows (cosine 0), one 1e30 entry, entries of 1e-20."""
    store = _store_with(row)
    t = torch.randn(C, 3, K, generator=torch.Generator().manual_seed(7))
    want = reference(store, t)
    # A float32 denormal near 1e-42 keeps ~10 significant bits, and so does its dot product
    # with a test row in a float32 matmul: its cosine is right to ~1e-3, not 1e-5 (the fix:
    # finite and right to that precision, where it was NaN or refused).
    tol = 1e-2 if row == "denormal" else 1e-5
    close(tif.score(store, t, normalize=True), want, tol)
    values, _ = tif.top_k(store, t, N, normalize=True)
    close(values, want.topk(N, dim=1).values, tol)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
@pytest.mark.parametrize("path", ["score", "top_k", "contrast-control"])
def test_held_non_finite_rows_named(value, dtype, path):
    """HELD: a NaN/inf entry at example 3, checkpoint 1 is named (control named as the control)."""
    t = torch.randn(C, 5, K, generator=torch.Generator().manual_seed(8)).to(dtype)
    t[1, 3, 2] = value
    with pytest.raises(tif.errors.NonFiniteGradientError, match=r"example 3 at checkpoint 1") as info:
        if path == "score":
            tif.score(STORE, t, normalize=True)
        elif path == "top_k":
            tif.top_k(STORE, t, 3, normalize=True)
        else:
            tif.score(STORE, tif.Contrast(torch.randn(C, 2, K).to(dtype), t), normalize=True)
    assert path != "contrast-control" or "control" in str(info.value)


def _projected_curvature():
    return tif.fit_curvature(T.LOSS, T.CKPTS, T.data(), kind="projected", projection=T.PROJ, damping=0.1)


def curvature_reference(cur, t):
    """Cosine between the float64-preconditioned test row and the training row (docs/curvature.md)."""
    t = t.double()
    out = torch.zeros(t.shape[1], N, dtype=torch.float64)
    for c in range(C):
        pre = cur.precondition_rows(c, t[c]).double()
        rows, norms = STORE.read_rows(c, 0, N).double(), STORE.read_norms(c, 0, N).double()
        for i in range(t.shape[1]):
            m = pre[i].abs().max()
            if m != 0:
                out[i] += LRS[c] * (rows @ ((pre[i] / m) / torch.linalg.norm(pre[i] / m))) / norms
    return out


def test_curvature_cosine_of_huge_float32_rows():
    """FINDING: normalize=True with a "projected" curvature and finite float32 test rows near
    3e38 (one huge entry; huge and denormal; all 2.7e38) is refused with "test gradients
    contain NaN or inf (example 1 at checkpoint 0, ...) check the loss on those examples": the
    rows are finite, the float32 preconditioning overflowed. The cosine is scale-free and well
    defined (atk43 fixed exactly this for plain cosine scores); expected its value."""
    cur = _projected_curvature()
    t = crafted()
    close(tif.score(STORE, t, normalize=True, curvature=cur), curvature_reference(cur, t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_held_curvature_cosine_of_ordinary_rows(dtype):
    """HELD: score and top_k with normalize=True and a projected curvature equal the reference."""
    cur = _projected_curvature()
    t = torch.randn(C, 4, K, generator=torch.Generator().manual_seed(9), dtype=dtype)
    want = curvature_reference(cur, t)
    close(tif.score(STORE, t, normalize=True, curvature=cur), want)
    close(tif.top_k(STORE, t, 5, normalize=True, curvature=cur)[0], want.topk(5, dim=1).values)


@pytest.mark.parametrize("dtype", ["sign", "int8", torch.float16, torch.bfloat16])
def test_held_quantised_test_store_uses_its_exact_norms(dtype):
    """HELD: a quantised / half test *store* is divided by its exact norms (docs/concepts/stores.md)."""
    q = T.query_grads(dtype=dtype)
    want = torch.zeros(q.n_train, N, dtype=torch.float64)
    for c in range(C):
        t = q.read_rows(c, 0, q.n_train).double() / q.read_norms(c, 0, q.n_train).double()[:, None]
        x = STORE.read_rows(c, 0, N).double() / STORE.read_norms(c, 0, N).double()[:, None]
        want += LRS[c] * t @ x.T
    close(tif.score(STORE, q, normalize=True), want)
