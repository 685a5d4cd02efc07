"""per_sample_grads / projected_grads against a per-example autograd loop."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tracinfunc as tif
from tests.conftest import make_convnet, make_data, make_mlp
from tests.reference import flat_loop_grads, loop_grads


def _mlp():
    model = make_mlp().eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    return tif.loss_from_module(model, F.cross_entropy), params, make_data(9)


def _convnet():
    model = make_convnet().eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1, 8, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=g)
    return tif.loss_from_module(model, F.cross_entropy), params, (x, y)


@pytest.mark.parametrize("setup", [_mlp, _convnet], ids=["mlp", "convnet"])
def test_per_sample_grads_equal_autograd_loop(setup):
    loss, params, batch = setup()
    got = tif.per_sample_grads(loss)(params, batch)
    expected = loop_grads(loss, params, batch)
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-12)


@settings(max_examples=10, deadline=None)
@given(chunk_size=st.integers(1, 10))
def test_chunk_size_does_not_change_per_sample_grads(chunk_size):
    loss, params, batch = _mlp()
    whole = tif.per_sample_grads(loss)(params, batch)
    chunked = tif.per_sample_grads(loss, options=tif.GradientOptions(chunk_size=chunk_size))(
        params, batch
    )
    for name in whole:
        torch.testing.assert_close(chunked[name], whole[name], rtol=0, atol=1e-12)


def test_identity_projected_grads_are_the_flat_gradients():
    loss, params, batch = _convnet()
    got = tif.projected_grads(loss, tif.Projection(kind="identity"))(params, batch)
    torch.testing.assert_close(got, flat_loop_grads(loss, params, batch), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["rademacher", "sjlt"])
def test_projected_grads_equal_projecting_the_loop_gradients(kind):
    loss, params, batch = _mlp()
    projection = tif.Projection(dim=12, seed=4, kind=kind)
    got = tif.projected_grads(loss, projection, options=tif.GradientOptions(chunk_size=4))(
        params, batch
    )
    projector = tif.projection.make_projector(
        projection, tif.projection.canonical_layout(params), dtype=torch.float64
    )
    grads = loop_grads(loss, params, batch)
    expected = torch.stack([projector({n: g[i] for n, g in grads.items()}) for i in range(9)])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_projected_grads_chunk_size_bounds_peak_memory():
    """Projection inside vmap: with chunk_size only that many full gradients exist at once.

    The model has 1M parameters (4 MB); 256 full per-example gradients are 1 GB. Peak RSS
    of a fresh process is compared with and without chunking.
    """
    script = textwrap.dedent(
        """
        import resource, sys, torch
        import tracinfunc as tif
        def peak():  # MiB, this process's own: ru_maxrss also holds pytest's RSS at fork
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) // 1024
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        torch.manual_seed(0)
        w = {"w": torch.randn(1000, 1000) * 0.01}
        def loss(params, x):
            return (params["w"] @ x).tanh().sum()
        chunk = None if sys.argv[1] == "none" else int(sys.argv[1])
        fn = tif.projected_grads(loss, tif.Projection(dim=4, seed=0),
                                 options=tif.GradientOptions(chunk_size=chunk))
        out = fn(w, torch.randn(256, 1000))
        assert out.shape == (256, 4)
        print(peak())
        """
    )

    def peak_mib(chunk):
        result = subprocess.run([sys.executable, "-c", script, chunk], capture_output=True,
                                text=True, check=True)
        return int(result.stdout.strip().splitlines()[-1])

    unchunked, chunked = peak_mib("none"), peak_mib("8")
    assert unchunked - chunked > 800, (unchunked, chunked)


def test_non_scalar_loss_is_reported():
    loss, params, batch = _mlp()

    def vector_loss(params, example):
        return loss(params, example).reshape(1).repeat(2)

    with pytest.raises(tif.errors.LossFunctionError, match="must return a scalar"):
        tif.per_sample_grads(vector_loss)(params, batch)


def test_batchnorm_in_train_mode_is_reported():
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4)).double().train()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss(params, example):
        x, y = example
        out = torch.func.functional_call(model, ({**params, **buffers},), (x[None],))
        return F.cross_entropy(out, y[None])

    with pytest.raises(tif.errors.TrainModeError, match=r"model\.eval\(\)"):
        tif.per_sample_grads(loss)(params, make_data(4))
    with pytest.raises(tif.errors.TrainModeError, match=r"model\.eval\(\)"):
        tif.loss_from_module(model, F.cross_entropy)


def test_invalid_chunk_size_is_reported():
    loss, _, _ = _mlp()
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        tif.projected_grads(loss, tif.Projection(dim=4), options=tif.GradientOptions(chunk_size=0))
    with pytest.raises(TypeError, match="must be a tracinfunc.Projection"):
        tif.projected_grads(loss, 512)
