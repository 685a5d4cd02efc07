"""A user's global module forward hook that replaces a layer's output (atk49): the factorised
kronecker rows stay those of the exact per-example gradients projected, because the capture's
own hook runs before every global hook the user registered."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import vmap
from torch.nn.modules.module import register_module_forward_hook

import tracinfunc as tif
from tests.conftest import make_data, make_mlp
from tracinfunc.projection import canonical_layout, make_projector


def _double_first_layer(module, inputs, output):
    if isinstance(module, torch.nn.Linear) and module.out_features == 8:
        return output * 2
    return None


def test_kronecker_rows_under_a_global_hook_replacing_an_output():
    model = make_mlp().eval()  # Linear(6, 8), Tanh, Linear(8, 3)
    loss = tif.loss_from_module(model, F.cross_entropy)
    params = {name: value.detach() for name, value in model.named_parameters()}
    batch = make_data(5)
    projection = tif.Projection(dim=16, kind="kronecker", seed=3)
    handle = register_module_forward_hook(_double_first_layer)
    try:
        rows = tif.projected_grads(loss, projection)(params, batch)  # [5, 16]
        exact = tif.per_sample_grads(loss)(params, batch)  # plain autograd, hook included
    finally:
        handle.remove()
    project = make_projector(projection, canonical_layout(params), dtype=torch.float64)
    torch.testing.assert_close(rows, vmap(project)(exact))
