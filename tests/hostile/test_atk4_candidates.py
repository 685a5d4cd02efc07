"""atk4 outside pass, surfaces 1-3: candidates=, tif.Contrast, tif.rerank (docs/rerank.md).

Failing tests (found by the pass) first; tests marked HELD guard attacks that held.
Black box: written from docs/rerank.md, docs/api.md and HOSTILE.md only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tracinfunc as tif
from tracinfunc.errors import (
    IncompatibleGradientsError,
    InvalidArgumentError,
    InvalidTypeError,
    NonFiniteGradientError,
    TracInFuncError,
)

from . import _tiny as T


@pytest.fixture(scope="module")
def setup():
    store = T.build()
    q = T.query_grads()
    ctrl = tif.build_store(T.LOSS, T.CKPTS, (T.X[:8], T.Y[:8]), projection=T.PROJ)
    rng = np.random.default_rng(0)
    cand = np.stack([rng.permutation(40)[:7] for _ in range(5)])
    return store, q, ctrl, cand


@pytest.fixture(scope="module")
def stores():
    cheap = tif.build_store(T.LOSS, T.CKPTS, T.data(), projection=tif.Projection(dim=4, seed=3))
    cq = tif.build_store(T.LOSS, T.CKPTS, (T.XT, T.YT), projection=cheap.projection)
    strong = tif.build_store(T.LOSS, T.CKPTS, T.data(), projection=tif.Projection(kind="identity"))
    sq = tif.build_store(T.LOSS, T.CKPTS, (T.XT, T.YT), projection=strong.projection)
    return cheap, cq, strong, sq


def _arr(x):
    return np.asarray(x)


def _accepts_or_explains(call, want):
    """A NumPy integer where a Python int is expected: accept it (the right answer), or
    refuse with a message that names the type problem and the fix (int(...))."""
    try:
        got = call()
    except TracInFuncError as e:
        msg = str(e)
        assert "int(" in msg or "numpy" in msg.lower() or "python int" in msg.lower(), msg
        return
    for g, w in zip(got, want, strict=False):
        np.testing.assert_array_equal(_arr(g), _arr(w))


# ----------------------------------------------------------------------------- failing


def test_rerank_takes_a_numpy_integer_n_candidates(stores):
    """HOSTILE 4: NumPy scalars where a Python number is expected. rerank(...,
    n_candidates=np.int64(10)) with 10 inside [k, n_train] is refused with
    'n_candidates must be an int in [3, n_train=40], got np.int64(10)': in range, yet
    refused, and the message gives no fix (Contrast's weight takes NumPy scalars)."""
    cheap, cq, strong, sq = stores
    want = tif.rerank(tif.Retriever(cheap, cq), strong, sq, 3, n_candidates=10)
    _accepts_or_explains(
        lambda: tif.rerank(tif.Retriever(cheap, cq), strong, sq, 3, n_candidates=np.int64(10)),
        want,
    )


def test_top_k_with_candidates_takes_a_numpy_integer_k(setup):
    """HOSTILE 4: top_k(..., np.int64(3), candidates=c) is refused with 'k must be an int
    in [1, M=7], got np.int64(3)' (3 is in [1, 7]); accept it or say int(k)."""
    store, q, _, cand = setup
    want = tif.top_k(store, q, 3, candidates=cand)
    _accepts_or_explains(lambda: tif.top_k(store, q, np.int64(3), candidates=cand), want)


def test_a_contrast_passed_as_the_store_is_a_clear_error(setup):
    """rerank.md: a Contrast goes where *test gradients* go. Passed as the store (a slip of
    argument order, or self_influence(contrast)) it raises a raw AttributeError
    ('Contrast' object has no attribute 'meta') instead of a TracInFuncError naming the
    store argument."""
    _store, q, ctrl, _ = setup
    with pytest.raises(TracInFuncError):
        tif.score(tif.Contrast(q, ctrl), q)
    with pytest.raises(TracInFuncError):
        tif.self_influence(tif.Contrast(q, ctrl))


def test_a_huge_unsigned_candidate_names_its_position(setup):
    """rerank.md: an index >= n_train is an InvalidArgumentError *with its position*. A
    uint64 2**63 says only 'candidates hold 9223372036854775808, beyond any store row',
    without the [test, j] position (a signed 2**40 names '[0, 0]')."""
    store, q, _, cand = setup
    bad = cand.astype(np.uint64)
    bad[1, 2] = 2**63
    with pytest.raises(InvalidArgumentError, match=r"\[1, 2\]"):
        tif.score(store, q, candidates=bad)


# ----------------------------------------------------------------------------- HELD


@pytest.mark.parametrize("kind", ["numpy", "torch", "jax", "list", "list_of_arrays"])
def test_held_candidates_equal_the_full_matrix_in_every_form(setup, kind):
    """HELD: score(..., candidates=c)[i, j] == score(...)[i, c[i, j]] for every form."""
    store, q, _, cand = setup
    full = _arr(tif.score(store, q))
    forms = {
        "numpy": lambda: cand,
        "torch": lambda: torch.from_numpy(cand),
        "jax": lambda: __import__("jax.numpy").numpy.asarray(cand),
        "list": lambda: [list(map(int, r)) for r in cand],
        "list_of_arrays": lambda: list(cand),
    }
    got = _arr(tif.score(store, q, candidates=forms[kind]()))
    np.testing.assert_allclose(got, np.take_along_axis(full, cand, 1), atol=1e-6)


@pytest.mark.parametrize(
    "kw", [{}, {"normalize": True}, {"curvature": True}, {"curvature": True, "normalize": True}]
)
def test_held_top_k_over_candidates_is_top_k_restricted(setup, kw):
    """HELD: top_k(..., candidates=c) equals a brute-force top-k over the candidates'
    full-matrix scores, ties by row, with normalize= and curvature=."""
    store, q, _, cand = setup
    kw = dict(kw)
    if kw.get("curvature"):
        kw["curvature"] = tif.fit_curvature(
            T.LOSS, T.CKPTS, T.data(), kind="projected", projection=store.projection
        )
    full = _arr(tif.score(store, q, **kw))
    v, i = tif.top_k(store, q, 3, candidates=cand, **kw)
    for r in range(5):
        sub = full[r, cand[r]]
        order = sorted(range(7), key=lambda j: (-sub[j], cand[r][j]))[:3]
        assert list(_arr(i[r])) == [cand[r][j] for j in order]
        np.testing.assert_allclose(_arr(v[r]), sub[order], atol=1e-5)


@pytest.mark.parametrize(
    "bad,err",
    [
        ("float", InvalidTypeError),
        ("bool", InvalidTypeError),
        ("oor", InvalidArgumentError),
        ("neg", InvalidArgumentError),
        ("dup", InvalidArgumentError),
        ("empty", InvalidArgumentError),
        ("1d", InvalidArgumentError),
        ("ragged", InvalidArgumentError),
        ("n_test", InvalidArgumentError),
        ("swapped_pair", InvalidTypeError),
    ],
)
def test_held_bad_candidates_are_refused(setup, bad, err):
    """HELD: every row of rerank.md's refusal table."""
    store, q, _, c = setup
    d = c.copy()
    d[2, 3] = d[2, 1]
    tk = tif.top_k(store, q, 4)
    forms = {
        "float": c.astype(float),
        "bool": np.ones((5, 40), bool),
        "oor": np.where(c == c[0, 0], 40, c),
        "neg": np.where(c == c[0, 0], -1, c),
        "dup": d,
        "empty": np.zeros((5, 0), int),
        "1d": c[0],
        "ragged": [c[0], c[1][:3], c[2], c[3], c[4]],
        "n_test": c[:4],
        "swapped_pair": (tk[1], tk[0]),
    }
    with pytest.raises(err):
        tif.score(store, q, candidates=forms[bad])


def test_held_k_above_m_is_refused(setup):
    store, q, _, cand = setup
    with pytest.raises(InvalidArgumentError, match="M=7"):
        tif.top_k(store, q, 8, candidates=cand)


@pytest.mark.parametrize("w", [1.0, 0.5, -1.0, np.float32(2.0), np.array(0.3)])
def test_held_contrast_is_the_difference_of_two_scores(setup, w):
    """HELD: score(store, Contrast(test, control, weight=w)) == score(test) - w * mean
    score(control), NumPy and 0-d weights included."""
    store, q, ctrl, _ = setup
    full = _arr(tif.score(store, q))
    fc = _arr(tif.score(store, ctrl))
    got = _arr(tif.score(store, tif.Contrast(q, ctrl, weight=w)))
    np.testing.assert_allclose(got, full - float(w) * fc.mean(0), atol=1e-6)


def test_held_contrast_paired_normalize_curvature_and_candidates(setup):
    store, q, ctrl, cand = setup
    c5 = tif.build_store(T.LOSS, T.CKPTS, (T.X[:5], T.Y[:5]), projection=T.PROJ)
    got = _arr(tif.score(store, tif.Contrast(q, c5, paired=True, weight=0.7)))
    np.testing.assert_allclose(got, _arr(tif.score(store, q)) - 0.7 * _arr(tif.score(store, c5)), atol=1e-6)
    got = _arr(tif.score(store, tif.Contrast(q, ctrl), normalize=True))
    want = _arr(tif.score(store, q, normalize=True)) - _arr(tif.score(store, ctrl, normalize=True)).mean(0)
    np.testing.assert_allclose(got, want, atol=1e-6)
    curv = tif.fit_curvature(T.LOSS, T.CKPTS, T.data(), kind="projected", projection=store.projection)
    got = _arr(tif.score(store, tif.Contrast(q, ctrl), curvature=curv))
    want = _arr(tif.score(store, q, curvature=curv)) - _arr(tif.score(store, ctrl, curvature=curv)).mean(0)
    np.testing.assert_allclose(got, want, atol=1e-6)
    got = _arr(tif.score(store, tif.Contrast(q, ctrl, weight=0.5), candidates=cand))
    want = _arr(tif.score(store, q)) - 0.5 * _arr(tif.score(store, ctrl)).mean(0)
    np.testing.assert_allclose(got, np.take_along_axis(want, cand, 1), atol=1e-6)


def test_held_contrast_refusals(setup):
    """HELD: empty / NaN / +-inf controls, another projection, k, checkpoints, paired of
    another length, nested contrasts, bool/NaN weights."""
    store, q, ctrl, _ = setup
    qa = torch.stack([torch.as_tensor(_arr(q.read_rows(c, 0, 5))) for c in range(2)])
    ca = torch.stack([torch.as_tensor(_arr(ctrl.read_rows(c, 0, 8))) for c in range(2)])
    with pytest.raises(InvalidArgumentError, match="control"):
        tif.score(store, tif.Contrast(qa, ca[:, :0]))
    bad = ca.clone()
    bad[0, 0, 0], bad[0, 1, 0] = float("inf"), -float("inf")
    with pytest.raises(NonFiniteGradientError, match="control"):
        tif.top_k(store, tif.Contrast(qa, bad), 3)
    other = tif.build_store(T.LOSS, T.CKPTS, (T.X[:8], T.Y[:8]), projection=tif.Projection(dim=8, seed=1))
    with pytest.raises(IncompatibleGradientsError, match="control"):
        tif.score(store, tif.Contrast(q, other))
    rev = tif.build_store(T.LOSS, T.CKPTS[::-1], (T.X[:8], T.Y[:8]), projection=T.PROJ)
    with pytest.raises(IncompatibleGradientsError, match="control"):
        tif.score(store, tif.Contrast(q, rev))
    with pytest.raises(InvalidArgumentError, match="paired"):
        tif.score(store, tif.Contrast(q, ctrl, paired=True))
    with pytest.raises(InvalidTypeError):
        tif.Contrast(tif.Contrast(q, ctrl), ctrl)
    for w in (True, np.bool_(True), float("nan"), float("inf")):
        with pytest.raises(InvalidArgumentError):
            tif.Contrast(q, ctrl, weight=w)


def test_held_rerank_result_records_what_the_docs_say(stores):
    """HELD: rerank = top_k of the strong store over the retriever's top-M, candidates
    sorted by row, retrieved_by/reranked_by/contrast recorded, re-usable as candidates."""
    cheap, cq, strong, sq = stores
    r = tif.rerank(tif.Retriever(cheap, cq), strong, sq, 3, n_candidates=10)
    _, ci = tif.top_k(cheap, cq, 10)
    np.testing.assert_array_equal(np.sort(_arr(ci), 1), _arr(r.candidates))
    fs = _arr(tif.score(strong, sq))
    for t in range(5):
        cc = _arr(r.candidates[t])
        sub = fs[t, cc]
        assert list(_arr(r.indices[t])) == list(cc[sorted(range(10), key=lambda j: (-sub[j], cc[j]))[:3]])
    assert r.n_candidates == 10 and "top_k" in r.retrieved_by and "identity" in r.reranked_by
    # to rounding: the candidate products' shapes differ, and BLAS sums by shape
    np.testing.assert_allclose(_arr(tif.score(strong, sq, candidates=r)), _arr(r.values),
                               rtol=1e-6, atol=1e-7)
    ctrl = tif.build_store(T.LOSS, T.CKPTS, (T.X[:8], T.Y[:8]), projection=strong.projection)
    rc = tif.rerank(tif.Retriever(cheap, cq), strong, tif.Contrast(sq, ctrl, name="gen"), 3, n_candidates=10)
    assert "gen" in rc.contrast
    with pytest.raises(InvalidArgumentError):
        tif.rerank(tif.Retriever(cheap, cq), strong, sq, 3, n_candidates=41)
    with pytest.raises(InvalidArgumentError):
        tif.rerank(tif.Retriever(cheap, cq), strong, sq, 11, n_candidates=10)
    small = tif.build_store(T.LOSS, T.CKPTS, T.data()[:3], projection=cheap.projection)
    with pytest.raises(IncompatibleGradientsError):
        tif.rerank(tif.Retriever(small, cq), strong, sq, 3, n_candidates=10)
