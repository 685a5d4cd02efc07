"""Small models, data and checkpoints shared by the tests (CPU, seconds)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif


def make_mlp(d_in=6, hidden=8, d_out=3, dtype=torch.float64, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out)).to(dtype)


def make_convnet(dtype=torch.float64, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)
    ).to(dtype)


def make_data(n, d_in=6, n_classes=3, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=dtype)
    y = torch.randint(0, n_classes, (n,), generator=g)
    return x, y


def make_checkpoints(model, n_ckpt=3, lrs=(0.3, 0.1, 0.05), seed=2):
    """Checkpoints that differ by random perturbations, with lr != 1."""
    g = torch.Generator().manual_seed(seed)
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    ckpts = []
    for c in range(n_ckpt):
        params = {
            k: v + 0.3 * c * torch.randn(v.shape, generator=g, dtype=v.dtype)
            for k, v in base.items()
        }
        ckpts.append(tif.Checkpoint(params=params, lr=lrs[c], name=f"epoch-{c}"))
    return ckpts


@pytest.fixture
def mlp_setup():
    """(loss, checkpoints, train_batch, test_batch) for a float64 MLP."""
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    return loss, make_checkpoints(model), make_data(11, seed=1), make_data(5, seed=3)


@pytest.fixture
def mlp_setup32():
    model = make_mlp(dtype=torch.float32).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    train = make_data(40, dtype=torch.float32, seed=1)
    test = make_data(7, dtype=torch.float32, seed=3)
    return loss, make_checkpoints(model), train, test


@pytest.fixture
def one_thread():
    """torch on one thread for the test: bit-for-bit comparisons across store kinds. A
    streamed Zarr store computes with one thread fewer than an in-memory one (a core for
    the reader), and MKL on AMD CPUs sums a GEMM differently with 1 and 2 threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
