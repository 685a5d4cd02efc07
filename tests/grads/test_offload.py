"""ActivationStash: CPU keeps activations in place; CUDA offloads to pinned memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tracinfunc.grads.offload import ActivationStash


def test_on_cpu_offloading_keeps_the_tensor_itself():
    stash = ActivationStash(torch.device("cpu"), offload=True)
    assert stash.mode == "keep"
    h = torch.randn(4, 3)
    stash.put(1, h)
    stash.prefetch(1)
    assert stash.pop(1) is h  # already in CPU memory: no copy
    assert len(stash) == 0
    with pytest.raises(KeyError):
        stash.pop(1)  # handed back once, then forgotten


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_activations_round_trip_through_pinned_memory():
    device = torch.device("cuda")
    stash = ActivationStash(device, offload=True)
    h = torch.randn(64, 128, device=device)
    expected = h.clone()
    stash.put(1, h)
    slot = stash._slots[1]
    assert slot.host.device.type == "cpu" and slot.host.is_pinned()
    del h
    stash.prefetch(1)
    back = stash.pop(1)
    assert back.device.type == "cuda"
    torch.testing.assert_close(back, expected, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_gradients_equal_kept_ones_on_cuda():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 5)).cuda().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    stages = tif.model_stages(model, F.cross_entropy)
    params = {k: v.detach() for k, v in model.named_parameters()}
    batch = (torch.randn(50, 32, device="cuda"), torch.randint(0, 5, (50,), device="cuda"))
    projection = tif.Projection(dim=32)
    kept = tif.projected_grads(loss, projection, options=tif.GradientOptions(stages=stages))(
        params, batch
    )
    offloaded = tif.projected_grads(
        loss, projection, options=tif.GradientOptions(stages=stages, offload=True)
    )(params, batch)
    plain = tif.projected_grads(loss, projection)(params, batch)
    torch.testing.assert_close(offloaded, kept, rtol=0, atol=0)
    torch.testing.assert_close(offloaded, plain, rtol=1e-4, atol=1e-5)
