"""Row norms neither under- nor overflow in float32 (issue 25 item 12): before, rows with
entries around 1e-24 were stored with norm 0 (cosine 0 against their own copy) and finite rows
around 1e20 were refused as NaN/inf."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_checkpoints, make_data, make_mlp
from tracinfunc._norms import row_norms


def _store(scale: float, **kwargs):
    """A float32 store whose gradients are ``scale`` times those of a small MLP."""
    model = make_mlp(dtype=torch.float32).eval()
    loss = tif.loss_from_module(model, lambda out, y: scale * F.cross_entropy(out, y))
    x, y = make_data(10, dtype=torch.float32, seed=1)
    return tif.build_store(loss, make_checkpoints(model), (x, y),
                           projection=tif.Projection(kind="identity"), **kwargs)


@pytest.mark.parametrize("scale", [1e-24, 1e20])
def test_stored_norms_are_the_exact_norms_of_tiny_and_huge_rows(scale):
    store = _store(scale)
    for c in range(store.meta.n_ckpt):
        rows = store.read_rows(c, 0, store.meta.n_train)
        assert rows.abs().amax() < 1e3 * scale  # the scale the gradients really have
        exact = rows.double().norm(dim=-1)
        assert (exact > 0).all()
        torch.testing.assert_close(store.read_norms(c, 0, store.meta.n_train).double(), exact,
                                   rtol=1e-6, atol=0)


@pytest.mark.parametrize("scale", [1e-24, 1e20])
def test_cosine_of_an_example_with_itself_is_one(scale):
    store = _store(scale)
    test = torch.stack([store.read_rows(c, 0, 3) for c in range(store.meta.n_ckpt)])
    cosine = tif.score(store, test, normalize=True)  # [3, n_train]
    total = sum(store.meta.lrs)
    torch.testing.assert_close(cosine.diagonal(), torch.full((3,), total), rtol=1e-5, atol=0)


def test_row_norms_are_bit_identical_to_norm_on_ordinary_rows():
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        rows = torch.randn(3, 50, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
        assert torch.equal(row_norms(rows), rows.norm(dim=-1))
    rows = torch.tensor([[0.0, 0.0], [3e38, 3e38], [float("nan"), 1.0], [float("inf"), 1.0]])
    got = row_norms(rows)
    assert got[0] == 0 and got[1] == float("inf") and got[2].isnan() and got[3] == float("inf")


def test_row_norms_redo_only_the_odd_rows_of_a_block_exactly():
    """The CPU path takes ``norm`` once and rescales only rows outside the ordinary range:
    a block mixing ordinary, tiny, huge, zero and NaN rows gets each row's exact norm."""
    rows = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    rows[1] *= 1e-24
    rows[2] *= 1e20
    rows[3] = 0.0
    rows[4, 5] = float("nan")
    got = row_norms(rows)
    exact = rows.double().norm(dim=-1)
    assert torch.equal(got[[0, 5]], rows[[0, 5]].norm(dim=-1))  # ordinary: norm itself
    torch.testing.assert_close(got[[1, 2]].double(), exact[[1, 2]], rtol=1e-6, atol=0)
    assert got[3] == 0 and got[4].isnan()
