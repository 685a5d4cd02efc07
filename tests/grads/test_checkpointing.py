"""Stage-by-stage gradients (checkpointing, offloading, frozen prefixes) equal the plain path."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_convnet, make_data, make_mlp
from tests.reference import flat_loop_grads, loop_grads


def _mlp(dtype=torch.float64):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
        torch.nn.Linear(8, 3)).to(dtype).eval()
    return model, make_data(9, dtype=dtype)


def _convnet():
    model = make_convnet().eval()
    g = torch.Generator().manual_seed(0)
    return model, (torch.randn(6, 1, 8, 8, generator=g, dtype=torch.float64),
                   torch.randint(0, 3, (6,), generator=g))


def _pieces(model):
    params = {k: v.detach() for k, v in model.named_parameters()}
    return (tif.loss_from_module(model, F.cross_entropy), params,
            tif.model_stages(model, F.cross_entropy))


@pytest.mark.parametrize("setup", [_mlp, _convnet], ids=["mlp", "convnet"])
@pytest.mark.parametrize("chunk_size", [None, 1, 4])
@pytest.mark.parametrize("offload", [False, True])
def test_staged_per_sample_grads_equal_the_reference(setup, chunk_size, offload):
    model, batch = setup()
    loss, params, stages = _pieces(model)
    got = tif.per_sample_grads(
        loss, options=tif.GradientOptions(stages=stages, chunk_size=chunk_size, offload=offload)
    )(params, batch)
    expected = loop_grads(loss, params, batch)
    assert list(got) == list(params)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["identity", "rademacher", "sjlt"])
def test_staged_projection_equals_projecting_the_whole_gradient(kind):
    model, batch = _convnet()
    loss, params, stages = _pieces(model)
    projection = tif.Projection(dim=None if kind == "identity" else 12, seed=3, kind=kind)
    got = tif.projected_grads(
        loss, projection, options=tif.GradientOptions(stages=stages, offload=True)
    )(params, batch)
    if kind == "identity":
        torch.testing.assert_close(got, flat_loop_grads(loss, params, batch), rtol=0, atol=1e-12)
    else:  # per-stage shares of P @ g add up in another order: rounding only
        expected = tif.projected_grads(loss, projection)(params, batch)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("select", [tif.last_layers(1), ["2.*"], ["0.bias", "4.weight"]])
def test_frozen_prefix_and_selection_equal_the_reference(select):
    model, batch = _mlp()
    loss, params, stages = _pieces(model)
    got = tif.per_sample_grads(loss, options=tif.GradientOptions(stages=stages, select=select))(
        params, batch
    )
    expected = loop_grads(loss, params, batch)
    assert list(got) == list(tif.select_params(params, select))
    for name, g in got.items():
        torch.testing.assert_close(g, expected[name], rtol=0, atol=1e-12)


def test_frozen_prefix_is_never_differentiated():
    """With the last layer selected, earlier stages run once, batched, without autograd."""
    model, batch = _mlp()
    loss, params, stages = _pieces(model)
    seen = []

    def spy(stage):
        def fn(p, h):
            seen.append((stage.name, tuple(h.shape), torch.is_grad_enabled()))
            return stage.fn(p, h)
        return tif.grads.Stage(fn=fn, param_names=stage.param_names, name=stage.name)

    spied = tif.grads.Stages(tuple(map(spy, stages.stages)), F.cross_entropy, stages.forward)
    fn = tif.per_sample_grads(
        loss, options=tif.GradientOptions(stages=spied, select=tif.last_layers(1))
    )
    fn(params, batch)  # the first call also checks the stages against the model
    seen.clear()
    fn(params, batch)
    prefix = [entry for entry in seen if entry[0] != "4"]
    assert prefix == [("0+1", (9, 6), False), ("2+3", (9, 8), False)]


def test_all_options_compose():
    """Checkpointing + offloading + mixed precision + projection + automatic chunking."""
    model, batch = _mlp(torch.float32)
    loss, params, stages = _pieces(model)
    projection = tif.Projection(dim=16, seed=0)
    plain_amp = tif.projected_grads(
        loss, projection, options=tif.GradientOptions(mixed_precision=torch.float16)
    )
    composed = tif.projected_grads(
        loss,
        projection,
        options=tif.GradientOptions(
            stages=stages,
            offload=True,
            mixed_precision=torch.float16,
            memory_budget=3 * 4 * 100 * 3,
            select=["2", "4"],
        ),
    )  # 3 examples of <=100 params a chunk
    full = tif.projected_grads(loss, projection, options=tif.GradientOptions(select=["2", "4"]))(
        params, batch
    )
    got = composed(params, batch)
    assert got.dtype == torch.float32 and got.shape == (9, 16)
    assert float((got - full).norm() / full.norm()) < 0.01
    reference_amp = tif.projected_grads(
        loss,
        projection,
        options=tif.GradientOptions(mixed_precision=torch.float16, select=["2", "4"]),
    )(params, batch)
    torch.testing.assert_close(got, reference_amp, rtol=0, atol=5e-3)
    assert plain_amp(params, batch).shape == (9, 16)


def test_no_reference_to_any_activation_survives_the_call():
    """Memory cleanup is unnecessary: activations die by refcount, with the collector off."""
    model, batch = _mlp()
    loss, params, stages = _pieces(model)
    refs = []

    def track(stage):
        def fn(p, h):
            out = stage.fn(p, h)
            refs.append(weakref.ref(out))
            return out
        return tif.grads.Stage(fn=fn, param_names=stage.param_names, name=stage.name)

    tracked = tif.grads.Stages(tuple(map(track, stages.stages)), F.cross_entropy, stages.forward)
    fn = tif.projected_grads(
        loss, tif.Projection(dim=8), options=tif.GradientOptions(stages=tracked, offload=True)
    )
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            out = fn(params, batch)
            del out
        assert len(refs) > 9
        alive = [ref for ref in refs if ref() is not None]
    finally:
        gc.enable()
    assert alive == []


def test_offload_needs_stages():
    loss, _, _ = _pieces(make_mlp().eval())
    with pytest.raises(ValueError, match="offload=True .* needs stages="):
        tif.projected_grads(loss, tif.Projection(dim=4), options=tif.GradientOptions(offload=True))
    with pytest.raises(TypeError, match="stages must be a tracinfunc.grads.Stages"):
        tif.per_sample_grads(loss, options=tif.GradientOptions(stages=[torch.nn.Linear(2, 2)]))


def test_build_store_passes_the_options_through(mlp_setup32):
    loss, ckpts, train, _ = mlp_setup32
    model = make_mlp(dtype=torch.float32).eval()
    stages = tif.model_stages(model, F.cross_entropy)
    projection = tif.Projection(dim=8)
    plain = tif.build_store(loss, ckpts, train, projection=projection)
    staged = tif.build_store(
        loss,
        ckpts,
        [train],
        projection=projection,
        options=tif.GradientOptions(stages=stages, offload=True, memory_budget=2**16),
    )
    assert staged.meta == plain.meta
    for c in range(3):
        torch.testing.assert_close(staged.read_rows(c, 0, 40), plain.read_rows(c, 0, 40),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("staged", [False, True], ids=["plain", "staged"])
def test_calls_leave_no_tensor_for_the_cyclic_collector(staged):
    """Everything a call allocates is freed by refcount as it returns: no gc.collect() needed."""
    model, batch = _mlp()
    loss, params, stages = _pieces(model)
    options = tif.GradientOptions(stages=stages, offload=True) if staged else None
    fn = tif.projected_grads(loss, tif.Projection(dim=8), options=options)
    fn(params, batch)  # first call: projectors are made and kept by fn (not garbage)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(2):
            fn(params, batch)
        gc.collect()
        cyclic_tensors = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert cyclic_tensors == []


@pytest.mark.parametrize("kind", ["rademacher", "sjlt"])
def test_a_whole_build_leaves_nothing_for_the_cyclic_collector(kind):
    """build_store makes fresh projectors each call; they and their cached blocks must be
    freed by refcount when it returns (a bound method stored on the projector once made a
    cycle that kept every block alive until gc.collect())."""
    model, batch = _mlp()
    loss, _, stages = _pieces(model)
    ckpt = [tif.Checkpoint.from_module(model)]
    projection = tif.Projection(dim=8, kind=kind)
    tif.build_store(
        loss, ckpt, batch, projection=projection, options=tif.GradientOptions(stages=stages)
    )  # warm-up
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        tif.build_store(
            loss, ckpt, batch, projection=projection, options=tif.GradientOptions(stages=stages)
        )
        gc.collect()
        leftovers = [type(o).__name__ for o in gc.garbage
                     if isinstance(o, torch.Tensor) or type(o).__module__.startswith("tracinfunc")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert leftovers == []
