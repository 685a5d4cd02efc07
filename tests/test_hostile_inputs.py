"""Hostile inputs found by issue 16's probe: each ends in a TracInFuncError that says the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_checkpoints, make_data, make_mlp


@pytest.fixture(scope="module")
def setup():
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = make_checkpoints(model)
    store = tif.build_store(loss, ckpts, make_data(8), projection=tif.Projection(dim=8))
    return loss, ckpts, store


@pytest.mark.parametrize("data", [torch.tensor(1.0), (torch.tensor(1.0), torch.tensor(2))])
def test_a_batch_without_a_batch_dimension(setup, data):
    loss, ckpts, _ = setup
    with pytest.raises(tif.errors.InvalidArgumentError, match="same leading .batch. dimension"):
        tif.build_store(loss, ckpts, data, projection=tif.Projection(dim=8))


def test_per_example_gradients_of_a_0d_batch(setup):
    loss, ckpts, _ = setup
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match=r"per_sample_grads: every tensor of a batch needs a leading batch "
                             r"dimension, got shapes \[\[\]\]; pass x\[None\]"):
        tif.per_sample_grads(loss)(dict(ckpts[0].params), torch.tensor(1.0))


def test_meta_tensors_are_refused_where_values_are_needed(setup):
    _, _, store = setup
    with pytest.raises(tif.errors.InvalidArgumentError, match="'w' is on the meta device"):
        tif.Checkpoint({"w": torch.empty(3, device="meta")}, lr=0.1)
    with pytest.raises(
        tif.errors.InvalidArgumentError, match="score: test gradients are on the meta"
    ):
        tif.score(store, torch.empty(3, 2, 8, device="meta"))
