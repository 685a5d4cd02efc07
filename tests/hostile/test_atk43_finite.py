"""Outside pass atk43 (black box, docs only): score / top_k refusing non-finite test gradients.

Tests marked FINDING fail on the commit they were written against (dc6a83b); the others held
and guard regressions (marked HELD).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tracinfunc as tif
from tracinfunc.errors import NonFiniteGradientError

from ._tiny import build, query_grads

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def store():
    return build()


@pytest.fixture(scope="module")
def tests():
    t = query_grads()
    return torch.stack([t.read_rows(c, 0, 5) for c in range(2)])


# ---- FINDINGS ----

def test_cosine_of_a_huge_finite_test_row_is_its_direction(store, tests):
    """FINDING: a finite test row of +-3e38 entries (float32 max range) scored with
    normalize=True gives cosine 0 with every training row, silently: its norm overflows to inf.
    Its cosines are those of its direction (the same row scaled down), or it is refused."""
    huge = tests.clone()
    huge[:, 0] = torch.sign(tests[:, 0]) * 3e38
    unit = tests.clone()
    unit[:, 0] = torch.sign(tests[:, 0])
    try:
        got = tif.score(store, huge, normalize=True)
    except NonFiniteGradientError:
        return
    want = tif.score(store, unit, normalize=True)
    assert torch.allclose(got, want, atol=1e-5), got[0, :4]


def test_non_finite_error_names_the_test_example_and_checkpoint(store, tests):
    """FINDING (wording): "score: test gradients contain NaN or inf; check the loss on those
    examples" names no example and no checkpoint (build_store's names both)."""
    bad = tests.clone()
    bad[1, 3, 2] = float("nan")
    with pytest.raises(NonFiniteGradientError) as err:
        tif.score(store, bad)
    assert "3" in str(err.value) and ("1" in str(err.value) or "'b'" in str(err.value)), str(err.value)


def test_cosine_of_a_denormal_test_row_is_finite(store, tests):
    """FINDING: a finite test row scaled into float32 denormals (x 1e-44) scored with
    normalize=True gives NaN cosines, silently (score returns them). Expected: the cosines of
    its direction (as for x 1e-30, which held), or a refusal naming the test row; never NaN."""
    tiny = tests.clone()
    tiny[:, 0] = tests[:, 0] * 1e-44
    try:
        got = tif.score(store, tiny, normalize=True)
    except NonFiniteGradientError as err:
        assert "test" in str(err)
        return
    assert torch.isfinite(got).all(), got[0, :4]


def test_top_k_denormal_test_row_not_blamed_on_the_store(store, tests):
    """FINDING: top_k(normalize=True) with that denormal test row refuses with "the store
    holds inf or NaN rows (... float16) Rebuild it with dtype=torch.float32": the store is
    finite float32; the cause is the test row. Expected: the direction's top-k, or an error
    naming the test gradients."""
    tiny = tests.clone()
    tiny[:, 0] = tests[:, 0] * 1e-44
    try:
        values, _ = tif.top_k(store, tiny, 3, normalize=True)
    except NonFiniteGradientError as err:
        assert "store holds" not in str(err), str(err)
        return
    assert torch.isfinite(values).all()


def test_held_cosine_of_a_1e_30_scaled_row(store, tests):
    """HELD: x 1e-30 and x 1e20 rows give their direction's cosines."""
    want = tif.score(store, tests, normalize=True)
    for scale in (1e-30, 1e20):
        scaled = tests.clone()
        scaled[:, 0] = tests[:, 0] * scale
        assert torch.allclose(tif.score(store, scaled, normalize=True)[0], want[0], atol=1e-5)


# ---- HELD (regression guards) ----

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_held_non_finite_refused(store, tests, dtype, value):
    bad = tests.clone().to(dtype)
    bad[1, 2, 3] = value
    with pytest.raises(NonFiniteGradientError, match="NaN or inf"):
        tif.score(store, bad)
    with pytest.raises(NonFiniteGradientError, match="NaN or inf"):
        tif.top_k(store, bad, 3)


def test_held_inf_and_minus_inf_together_and_other_paths(store, tests):
    bad = tests.clone()
    bad[0, 1, 0] = float("inf")
    bad[0, 1, 1] = float("-inf")
    with pytest.raises(NonFiniteGradientError):
        tif.score(store, bad, normalize=True)
    with pytest.raises(NonFiniteGradientError):
        tif.score(store, bad, candidates=torch.arange(2).repeat(5, 1))
    with pytest.raises(NonFiniteGradientError):
        tif.score(store, bad, rows=(0, 10))
    with pytest.raises(NonFiniteGradientError):
        tif.score(store, bad.numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_held_finite_accepted(store, tests, dtype):
    s = tif.score(store, tests.to(dtype))
    assert s.shape == (5, 40) and torch.isfinite(s).all()


def test_held_extreme_finite_and_empty_accepted(store, tests):
    big = tests.clone()
    big[0, 0, 0] = torch.finfo(torch.float32).max
    assert torch.isfinite(tif.score(store, big)).all()
    assert torch.isfinite(tif.top_k(store, big, 3)[0]).all()
    assert tif.score(store, tests[:, :0]).shape == (0, 40)
    assert tif.top_k(store, tests[:, :0], 3)[0].shape == (0, 3)
    assert np.isfinite(tif.score(store, tests.numpy(), output="numpy")).all()
