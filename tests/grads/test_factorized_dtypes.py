"""The factorised kronecker path computes in the parameters' dtype, whatever the module's own
tensors are: a float32 module called with float64 checkpoint tensors gives float64-exact rows
(the layer sides meet the factors in the factors' dtype, never the module weight's)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

import tracinfunc as tif
from tests import numpy_projection as ref


def test_float32_module_with_float64_params_gives_float64_rows():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))  # float32 module
    params = {k: v.detach().double() for k, v in model.named_parameters()}

    def loss(p, example):
        return functional_call(model, p, (example[None],)).square().sum()

    x = torch.randn(6, 4, dtype=torch.float64)
    spec = tif.Projection(dim=16, kind="kronecker", vectors="kronecker")
    rows = tif.projected_grads(loss, spec)(params, x)
    grads = tif.per_sample_grads(loss)(params, x)
    reference = torch.tensor(np.stack([
        ref.project({k: v[i].numpy() for k, v in grads.items()}, spec.seed, "kronecker",
                    spec.dim, vectors="kronecker") for i in range(x.shape[0])]))
    assert rows.dtype == torch.float64
    torch.testing.assert_close(rows, reference, rtol=1e-12, atol=1e-14)


def test_a_forward_dtype_mismatch_is_not_blamed_on_autocast_around_a_norm():
    """Review, session 51: the message for torch's batched norm backward (a loss's own
    autocast) is for errors raised in the backward only; a forward's own mismatch keeps
    torch's words."""
    import pytest
    import torch.nn.functional as F

    def loss(p, example):
        x, y = example
        return F.cross_entropy((x.bfloat16() @ p["w"].T)[None], y[None])

    with pytest.raises(RuntimeError) as raised:
        tif.per_sample_grads(loss)({"w": torch.randn(3, 4)},
                                   (torch.randn(2, 4), torch.tensor([0, 1])))
    assert "autocast" not in str(raised.value)
