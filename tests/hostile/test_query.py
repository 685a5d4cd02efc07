"""Hostile pass on the five query functions and merge_top_k (0.2.0). Tests marked HELD guard
behaviour that held; the others fail now and assert what a demanding user expects."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tracinfunc as tif
from tracinfunc.errors import TracInFuncError

from ._tiny import CKPTS, PROJ, big_loss, build, data, query_grads


@pytest.fixture(scope="module")
def s():
    return build()


@pytest.fixture(scope="module")
def t():
    return query_grads()


# ---------------------------------------------------------------- failures (fail now)


def test_float16_build_that_overflows_is_refused():
    """Gradients ~1e7 stored as float16 (max 65504). Observed: the store holds inf, and
    score/top_k/cosine return all-NaN with top_k indices [0, 1, 2] -- silently. Expected: the
    build refuses (like its other finite checks), naming float16's range and bfloat16/float32."""
    with pytest.raises(TracInFuncError, match="float16"):
        tif.build_store(big_loss, CKPTS[:1], data(), projection=PROJ, dtype=torch.float16)


@pytest.mark.parametrize("convert", ["to_memory", "save_store"])
def test_float16_conversion_that_overflows_is_refused(tmp_path, convert):
    """The same through the conversions' dtype= (observed: rows become inf, no error)."""
    s32 = tif.build_store(big_loss, CKPTS[:1], data(), projection=PROJ)
    with pytest.raises(TracInFuncError, match="float16"):
        if convert == "to_memory":
            tif.to_memory(s32, dtype=torch.float16)
        else:
            tif.save_store(s32, str(tmp_path / "h.zarr"), dtype=torch.float16)


def test_top_k_never_returns_nan_scores_as_results():
    """Whatever got into a store, top_k must not hand back NaN 'proponents' (class 4: NaN
    sorts first). Observed: values all NaN, indices [0, 1, 2]."""
    try:
        s16 = tif.build_store(big_loss, CKPTS[:1], data(), projection=PROJ, dtype=torch.float16)
    except TracInFuncError:
        return  # refused at build: fine
    t = tif.build_store(big_loss, CKPTS[:1], (data()[0][0][:3], data()[0][1][:3]), projection=PROJ)
    try:
        vals, _ = tif.top_k(s16, t, k=3)
    except TracInFuncError:
        return
    assert torch.isfinite(vals).all()


def test_rows_as_numpy_integers(s, t):
    """rows=(np.int64(0), np.int64(20)) (e.g. from np.array_split). Observed: RowRangeError
    'rows must be (start, stop) with 0 <= start < stop <= n_train=40, got (0, 20)' -- a range
    that satisfies the rule it states. Expected: accepted (operator.index), same as ints."""
    got = tif.top_k(s, t, k=3, rows=(np.int64(0), np.int64(20)))
    ref = tif.top_k(s, t, k=3, rows=(0, 20))
    assert torch.equal(got[1], ref[1])


def test_merge_refuses_overlapping_parts(s, t):
    """The same partial result merged twice (a worker's output gathered twice, or two workers
    given overlapping rows). Observed: every row appears twice in the top-k ([10, 10, 13, 13,
    ...]). Expected: refused, naming the duplicated row."""
    p = tif.top_k(s, t, k=4, rows=(0, 20))
    with pytest.raises(TracInFuncError, match="row|overlap|duplicat"):
        tif.query.merge_top_k([p, p], k=6)


def test_merge_takes_numpy_parts(s, t):
    """Parts made with output='numpy' (the documented output of top_k). Observed: raw TypeError
    'expected Tensor as element 0'. Expected: merged (returned as NumPy) or a clear error."""
    a = tif.top_k(s, t, k=4, rows=(0, 20), output="numpy")
    b = tif.top_k(s, t, k=4, rows=(20, 40), output="numpy")
    _vals, idx = tif.query.merge_top_k([a, b], k=4)
    assert np.array_equal(np.asarray(idx), tif.top_k(s, t, k=4)[1].numpy())


def test_merge_refuses_swapped_values_and_indices(s, t):
    """(indices, values) instead of (values, indices). Observed: accepted; returns the int
    indices as 'values' and zeros as indices."""
    a = tif.top_k(s, t, k=4, rows=(0, 20))
    b = tif.top_k(s, t, k=4, rows=(20, 40))
    with pytest.raises(TracInFuncError):
        tif.query.merge_top_k([(a[1], a[0]), (b[1], b[0])], k=4)


def test_merge_refuses_parts_of_other_test_sets(s, t):
    """Parts with 5 and 3 test rows. Observed: raw torch RuntimeError about cat sizes."""
    a = tif.top_k(s, t, k=4, rows=(0, 20))
    b = tif.top_k(s, t, k=4, rows=(20, 40))
    with pytest.raises(TracInFuncError, match="merge_top_k"):
        tif.query.merge_top_k([a, (b[0][:3], b[1][:3])], k=4)


@pytest.mark.parametrize("device", ["tpu", "cuda:7"])
def test_an_unusable_device_is_the_librarys_error(s, t, device):
    """Observed: raw RuntimeError ('Expected one of cpu, cuda, ...') for 'tpu', raw
    AssertionError ('Torch not compiled with CUDA enabled') or a CUDA error for a missing GPU."""
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that GPU")
    with pytest.raises(TracInFuncError, match="device"):
        tif.score(s, t, device=device)


# ---------------------------------------------------------------- HELD (regression guards)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, "int8"])
def test_held_five_queries_agree(dtype, t):
    pytest.importorskip("faiss")
    s = build(dtype=dtype)
    S = tif.score(s, t)
    _v, i = tif.top_k(s, t, k=6)
    assert torch.equal(i, torch.argsort(S, dim=1, descending=True, stable=True)[:, :6])
    blocks = torch.cat([b.clone() for _, b in tif.score_chunks(s, t, chunk_rows=7)], dim=1)
    # The same pieces give the same bits; other pieces agree to rounding (BLAS picks its
    # kernel, and so its summation order, by shape: 1 ulp apart on AMD's MKL path).
    assert torch.equal(blocks, tif.score(s, t, chunk_rows=7))
    torch.testing.assert_close(blocks, S, rtol=1e-6, atol=1e-7)
    idx = tif.build_index(s, nlist=1, target_recall=None)
    assert torch.equal(tif.indexed_top_k(s, t, 6, index=idx, n_candidates=40)[1], i)
    assert torch.equal(
        tif.indexed_top_k(s, t, 6, index=idx, n_candidates=40, largest=False)[1],
        tif.top_k(s, t, k=6, largest=False)[1],
    )
    for largest in (True, False):
        parts = [
            tif.top_k(s, t, k=6, rows=r, largest=largest) for r in [(0, 13), (13, 27), (27, 40)]
        ]
        _mv, mi = tif.query.merge_top_k(parts, k=6, largest=largest)
        assert torch.equal(mi, tif.top_k(s, t, k=6, largest=largest)[1])
    assert torch.equal(tif.self_influence(s, rows=(10, 30)), tif.self_influence(s)[10:30])
    assert torch.equal(tif.score(s, t, rows=(10, 30)), S[:, 10:30])


@pytest.mark.parametrize("out", ["numpy", "jax"])
def test_held_outputs(s, t, out):
    if out == "jax":
        pytest.importorskip("jax")
    S = tif.score(s, t)
    got = tif.score(s, t, output=out)
    assert np.array_equal(np.asarray(got), S.numpy())
    _vals, idx = tif.top_k(s, t, k=3, output=out)
    assert np.array_equal(np.asarray(idx), tif.top_k(s, t, k=3)[1].numpy())


# np.int64(3) is an integer and accepted (atk4); whole floats and out-of-range NumPy ints are not
@pytest.mark.parametrize("k", [0, -1, 41, 3.0, True, np.float64(3.0), np.int64(41)])
def test_held_bad_k_is_refused_clearly(s, t, k):
    with pytest.raises(tif.errors.InvalidArgumentError, match="k must be"):
        tif.top_k(s, t, k=k)


@pytest.mark.parametrize("rows", [(30, 50), (30, 10), (-5, 40), (10, 10), (0.5, 20.7)])
def test_held_bad_rows_are_refused(s, t, rows):
    with pytest.raises(tif.errors.RowRangeError):
        tif.top_k(s, t, k=3, rows=rows)


def test_held_non_finite_test_gradients_are_refused(s, t):
    T = torch.stack([t.read_rows(c, 0, 5) for c in range(2)])
    T[0, 1, 0] = float("inf")
    T[1, 1, 0] = float("-inf")
    for fn in (tif.score, tif.top_k):
        with pytest.raises(tif.errors.NonFiniteGradientError):
            fn(s, T)
