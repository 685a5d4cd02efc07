"""atk44b: denormal cosines, MemoryStore's norm checks and how NaN rows are named."""

from __future__ import annotations

import warnings

import pytest
import torch

import tracinfunc as tif
import tracinfunc.testing as tt
from tests.hostile._atk44b import make, ref
from tracinfunc.errors import NonFiniteGradientError
from tracinfunc.store import MemoryStore

D = 1.401298464324817e-45  # the smallest float32 denormal


def _denormal_store():
    torch.manual_seed(0)
    rows = torch.randn(2, 4, 4, dtype=torch.float64)
    rows[:, 1] = torch.tensor([D, D, 0.0, 0.0], dtype=torch.float64)
    rows[:, 2] = torch.tensor([3 * D, 4 * D, 0.0, 0.0], dtype=torch.float64)
    test = torch.zeros(2, 1, 4, dtype=torch.float64)
    test[:, 0, :2] = 1.0
    return rows, test, make(rows, [0.5, 0.5])


def test_cosine_of_a_smallest_denormal_row_is_not_above_one():
    """normalize=True over a float32 row [d, d, 0, 0] (d = 1.4e-45; its float32 norm 1.4e-45 is
    sqrt(2) off): score gave cosine 1.4142 (the reference 1.0); the docs say such rows' cosines
    are computed from their directions."""
    rows, test, store = _denormal_store()
    got = tif.score(store, test.float(), normalize=True)
    expected = ref(rows, test, [0.5, 0.5], normalize=True)
    assert got.abs().max() <= 1.0 + 1e-5, got
    assert torch.allclose(got.double(), expected, atol=1e-5), (got, expected)


def test_top_k_and_indexed_top_k_cosine_of_smallest_denormal_row():
    """top_k / indexed_top_k(normalize=True) returned 1.4142 as the best cosine (row [d, d])."""
    pytest.importorskip("faiss")
    _, test, store = _denormal_store()
    values, _ = tif.top_k(store, test.float(), 2, normalize=True)
    index = tif.build_index(store, nlist=1, target_recall=None, normalize=True)
    ivalues, _ = tif.indexed_top_k(store, test.float(), 2, index=index, nprobe=1, normalize=True)
    assert values.max() <= 1.0 + 1e-5, values
    assert ivalues.max() <= 1.0 + 1e-5, ivalues


def _meta(n, k, c=2, dtype=torch.float32):
    return tt.reference_store(n, k, n_ckpt=c, dtype=dtype).meta


def test_memory_store_nan_norm_message_does_not_blame_float32_range():
    """A finite row of ordinary entries (randn) given a NaN norm: refused (good) but the message
    says 'a torch.float32 norm cannot hold it (entries near the largest torch.float32). Give
    float64 rows...' - the entries are ~1, a float64 store would not help."""
    torch.manual_seed(0)
    rows = torch.randn(2, 4, 4)
    norms = rows.norm(dim=-1)
    norms[1, 3] = float("nan")
    with pytest.raises(Exception) as info:
        MemoryStore(_meta(4, 4), rows, norms)
    msg = str(info.value)
    assert "row 3" in msg
    assert "largest" not in msg and "float64" not in msg, msg


def test_memory_store_float64_inf_norm_does_not_advise_float64():
    """float64 rows given an inf norm: the message advises 'Give float64 rows and norms (a float64
    store)' - they already are float64."""
    torch.manual_seed(0)
    rows = torch.randn(2, 4, 4, dtype=torch.float64)
    norms = rows.norm(dim=-1)
    norms[1, 3] = float("inf")
    with pytest.raises(Exception) as info:
        MemoryStore(_meta(4, 4, dtype=torch.float64), rows, norms)
    assert "Give float64" not in str(info.value), str(info.value)


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_memory_store_refuses_a_zero_or_negative_norm_for_a_nonzero_row(bad):
    """A nonzero finite row given norm 0 or -1 was accepted; its cosine at that checkpoint was
    then silently dropped (0.0674 instead of 0.1674) - the same silent 0 atk44 fixed for inf."""
    torch.manual_seed(0)
    rows = torch.randn(2, 4, 4)
    norms = rows.norm(dim=-1)
    norms[1, 3] = bad
    try:
        store = MemoryStore(_meta(4, 4), rows, norms)
    except Exception:
        return
    test = torch.randn(2, 2, 4)
    got = tif.score(store, test, normalize=True)
    expected = ref(rows.double(), test.double(), [0.1, 0.2], normalize=True)
    assert torch.allclose(got.double(), expected, atol=1e-5), (got, expected)


def test_memory_store_nan_row_with_finite_norm_is_refused_or_named():
    """A NaN row given a finite norm was accepted; score returned NaN for it with no warning and
    self_influence returned a finite 1.87 for it (computed from the norm)."""
    torch.manual_seed(0)
    rows = torch.randn(2, 4, 4)
    norms = rows.norm(dim=-1)
    rows[1, 2] = float("nan")
    try:
        store = MemoryStore(_meta(4, 4), rows, norms)
    except Exception:
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scores = tif.score(store, torch.randn(2, 2, 4))
        si = tif.self_influence(store)
    named = [str(w.message) for w in caught if "[2]" in str(w.message)]
    assert not torch.isfinite(si[2]), si
    assert len(named) >= 2, ([str(w.message) for w in caught], scores)


def _nan_store():
    torch.manual_seed(0)
    rows = torch.randn(2, 4, 4)
    norms = rows.norm(dim=-1)
    rows[1, 2] = float("nan")
    norms[1, 2] = float("nan")
    return MemoryStore(_meta(4, 4), rows, norms)


def test_score_of_a_nan_row_does_not_call_it_an_overflow():
    """A NaN row (NaN norm) of ordinary scale: score warns 'overflowed float32 ... training row
    norm ... nan, whose products float32 cannot hold ... build the store ... with dtype=float64'
    - the row is NaN in the store; float64 would not help."""
    store = _nan_store()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tif.score(store, torch.randn(2, 2, 4))
    msgs = [str(w.message) for w in caught]
    assert msgs and "[2]" in msgs[0]
    assert "overflow" not in msgs[0] and "float64" not in msgs[0], msgs[0]


def test_self_influence_of_a_nan_row_does_not_call_it_an_overflow():
    """self_influence of a NaN row: 'overflowed float32 ... those rows' norms are too large for lr
    times their squares to fit float32' - the norm is NaN, not large."""
    store = _nan_store()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tif.self_influence(store)
    msgs = [str(w.message) for w in caught]
    assert msgs and "too large" not in msgs[0] and "overflow" not in msgs[0], msgs


def test_cosine_score_names_a_nan_row_like_the_inner_product():
    """score(normalize=True) over a NaN row returned NaN with no warning at all, while
    score(normalize=False) warns naming row 2 (the docs: queries name such rows)."""
    store = _nan_store()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = tif.score(store, torch.randn(2, 2, 4), normalize=True)
    assert torch.isnan(got[:, 2]).all()
    assert any("[2]" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_top_k_normalize_refuses_a_nan_row():
    """Held: top_k(normalize=True) refuses NaN scores from a NaN row."""
    store = _nan_store()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NonFiniteGradientError):
            tif.top_k(store, torch.randn(2, 2, 4), 2, normalize=True)


def test_memory_store_accepts_nan_inf_zero_and_float64_rows():
    """Held: NaN/inf rows with NaN/inf norms, zero rows and float64 rows are accepted."""
    torch.manual_seed(0)
    rows = torch.randn(2, 4, 4)
    rows[0, 1, 0] = float("inf")
    rows[1, 2] = float("nan")
    rows[1, 3] = 0.0
    norms = rows.norm(dim=-1)
    MemoryStore(_meta(4, 4), rows, norms)
    r64 = torch.randn(2, 4, 4, dtype=torch.float64)
    MemoryStore(_meta(4, 4, dtype=torch.float64), r64, r64.norm(dim=-1))


def test_zarr_store_cosine_of_float32_denormal_rows_keeps_precision(tmp_path):
    """Rows of randn * 1e-42 (float32 denormals, ~11 significant bits) saved to Zarr: the cosine of
    the stored row came back 1.1e-4 off (memory and Zarr, score and indexed_top_k) - divided by
    its denormal float32 norm rather than computed from its direction."""
    torch.manual_seed(0)
    rows = torch.randn(2, 10, 4, dtype=torch.float64)
    rows[:, 3] *= 1e-42
    store = make(rows, [1e-20, 1e-20])
    tif.save_store(store, str(tmp_path / "s.zarr"))
    zarr = tif.GradientStore.open(str(tmp_path / "s.zarr"))
    stored = rows.float().double()
    test = torch.randn(2, 3, 4, dtype=torch.float64)
    expected = ref(stored, test, [1e-20, 1e-20], normalize=True)
    got = tif.score(zarr, test.float(), normalize=True)
    err = ((got.double() - expected).abs().max() / expected.abs().max()).item()
    assert err < 1e-5, err


def test_rows_and_chunks_and_candidates_cosines_of_denormals_held():
    """Held: float16 (3e-8), bfloat16 (1e-39), float32 1e-19/1e-20 and float64 1e-310 rows: cosine
    score, rows=, candidates= and score_chunks match the float64 reference to 2e-7."""
    torch.manual_seed(0)
    base = torch.randn(2, 10, 4, dtype=torch.float64)
    test = torch.randn(2, 3, 4, dtype=torch.float64)
    for dtype, scale in [(torch.float16, 3e-8), (torch.bfloat16, 1e-39), (torch.float32, 1e-19),
                         (torch.float32, 1e-20), (torch.float64, 1e-310)]:
        rows = base.clone()
        rows[:, 3] *= scale
        store = make(rows, [0.1, 0.2], dtype=dtype)
        expected = ref(rows.to(dtype).double(), test, [0.1, 0.2], normalize=True)
        outs = [
            tif.score(store, test.float(), normalize=True),
            torch.cat([tif.score(store, test.float(), normalize=True, rows=(0, 5)),
                       tif.score(store, test.float(), normalize=True, rows=(5, 10))], 1),
            tif.score(store, test.float(), normalize=True, candidates=torch.arange(10).repeat(3, 1)),
            torch.cat([b.clone() for _, b in tif.score_chunks(store, test.float(), normalize=True, chunk_rows=3)], 1),
        ]
        for out in outs:
            assert torch.allclose(out.double(), expected, atol=3e-7), (dtype, scale)
