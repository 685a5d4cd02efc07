"""Small models, data and checkpoints shared by the tests (CPU, seconds).

Every test not marked ``cuda`` runs on the CPU, also on a machine with a GPU: ``score`` and
the JAX frontend compute on an accelerator when one is there (their documented default), and
the tests compare against CPU references. The ``cuda``-marked tests (``pytest -m cuda``;
``tests/test_cuda.py`` and others) are the ones that use the GPU.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif

REPO = Path(__file__).resolve().parents[1]
# JAX takes 75% of a GPU's memory when its backend starts unless told not to: torch's CUDA
# tests in the same process would then run out of memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
_TORCH_HAS_CUDA = torch.cuda.is_available()  # read once, before any test hides it


def _jax_has_gpu() -> bool:
    """Whether JAX has a GPU, read from its installed plugins (no backend is started on a
    machine without one: a test may configure JAX's backends itself). Where a plugin is
    installed, JAX's backends start here, before any test hides the GPU from the process."""
    plugins = [d for d in importlib.metadata.distributions()
               if re.match(r"jax[-_]?(cuda|rocm)", d.metadata.get("Name") or "")]
    if not plugins:
        return False
    try:
        import jax
    except ImportError:
        return False
    return any(device.platform != "cpu" for device in jax.devices())


_JAX_HAS_GPU = _jax_has_gpu()


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python process: this checkout first on ``PYTHONPATH``,
    the caller's entries kept (packages installed there by path must stay importable)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


@contextlib.contextmanager
def cpu_only(monkeypatch, *, torch_cuda: bool, jax_accelerated: bool) -> Iterator[None]:
    """Inside: torch reports no CUDA, child processes see no GPU, JAX places new arrays on
    its CPU device. ``torch_cuda``/``jax_accelerated``: what the machine has (nothing to
    hide when neither)."""
    if not (torch_cuda or jax_accelerated):
        yield
        return
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    if not jax_accelerated:
        yield
        return
    import jax

    with jax.default_device("cpu"):  # a platform name: starts no backend
        yield


@pytest.fixture(autouse=True)
def _cpu_unless_marked_cuda(request, monkeypatch):
    """A test not marked ``cuda`` runs in :func:`cpu_only`: a no-op on machines without a
    GPU, so the CPU suite runs exactly as on CI."""
    if request.node.get_closest_marker("cuda") is not None:
        yield
        return
    with cpu_only(monkeypatch, torch_cuda=_TORCH_HAS_CUDA, jax_accelerated=_JAX_HAS_GPU):
        yield


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
