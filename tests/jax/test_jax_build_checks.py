"""The JAX build computes row norms and finiteness inside its compiled program (issue 32,
item 4): the same norms as the torch path's row_norms, the same refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.jax_helpers import paired_mlp, to_jax_batch
from tracinfunc._norms import row_norms as torch_row_norms
from tracinfunc.jax.grads import row_norms


def _hostile_rows(dtype):
    """Rows whose squares underflow or overflow, zeros, NaN, +-inf (no subnormals: XLA on
    the CPU flushes them to zero, so rows made in JAX never hold them)."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((10, 33)).astype(dtype)
    rows[1] *= dtype(1e-24) if dtype == np.float32 else dtype(1e-200)  # squares underflow
    rows[2] *= dtype(1e20) if dtype == np.float32 else dtype(1e200)  # squares overflow
    rows[3] = 0
    rows[4] = np.finfo(dtype).tiny * np.arange(33)  # the smallest normal numbers
    rows[5, 7] = np.nan
    rows[6, 0] = np.inf
    rows[7, 1] = -np.inf
    rows[8, :2] = (np.inf, -np.inf)  # +inf and -inf together
    rows[9] = np.finfo(dtype).max  # finite entries, norm over the range: inf
    return rows


@pytest.mark.parametrize(("dtype", "rtol"), [(np.float32, 1e-6), (np.float64, 1e-14)])
def test_jax_row_norms_equal_the_torch_row_norms(dtype, rtol):
    rows = _hostile_rows(dtype)
    with jax.enable_x64(dtype == np.float64):
        got = np.asarray(row_norms(jnp.asarray(rows)))
    assert got.dtype == dtype
    expected = torch_row_norms(torch.from_numpy(rows)).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=rtol, atol=0)
    assert got[1] > 0 and got[4] > 0  # no underflow to 0


def test_stored_norms_are_the_norms_of_the_stored_rows():
    _, _, jax_loss, jax_ckpts, mapping, train, _ = paired_mlp(n_train=23)
    batch = to_jax_batch(train)
    store = tj.build_store(jax_loss, jax_ckpts, [tuple(a[:10] for a in batch),
                                                 tuple(a[10:] for a in batch)],
                           projection=tif.Projection(dim=16, seed=1), mapping=mapping)
    for c in range(store.n_ckpt):
        rows = store.read_rows(c, 0, store.n_train)
        np.testing.assert_allclose(store.read_norms(c, 0, store.n_train).numpy(),
                                   torch_row_norms(rows).numpy(), rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_row_in_a_later_padded_batch_is_named(bad):
    _, _, jax_loss, jax_ckpts, mapping, train, _ = paired_mlp(n_train=23)
    x, y = to_jax_batch(train)
    x = x.at[21, 2].set(bad)  # in the last (padded) batch
    with pytest.raises(tif.errors.NonFiniteGradientError, match=r"examples \[21\]"):
        tj.build_store(jax_loss, jax_ckpts, [(x[:10], y[:10]), (x[10:20], y[10:20]),
                                             (x[20:], y[20:])],
                       projection=tif.Projection(dim=16, seed=1), mapping=mapping)
