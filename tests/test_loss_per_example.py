"""ModuleLoss.per_example: one vmapped criterion call, or row by row where it cannot vmap."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_data, make_mlp


def _loop(model, criterion, params, x, y):
    """The reference: the loss of each example on its own, through the module."""
    return torch.stack([criterion(torch.func.functional_call(model, params, (x[i:i + 1],)),
                                  y[i:i + 1]) for i in range(len(y))])


def test_per_example_equals_the_loss_of_each_example():
    model = make_mlp().eval()  # float64
    params = dict(model.named_parameters())
    x, y = make_data(9, seed=1)
    loss = tif.loss_from_module(model, F.cross_entropy)
    got = loss.per_example(params, (x, y))
    assert got.shape == (9,)
    torch.testing.assert_close(got, _loop(model, F.cross_entropy, params, x, y))


def test_a_criterion_without_a_batching_rule_goes_row_by_row():
    def criterion(outputs, target):  # .item() has no vmap rule
        return F.cross_entropy(outputs, target) * (1.0 if target.sum().item() >= 0 else 2.0)

    model = make_mlp().eval()
    params = dict(model.named_parameters())
    x, y = make_data(5, seed=2)
    loss = tif.loss_from_module(model, criterion)
    torch.testing.assert_close(loss.per_example(params, (x, y)),
                               _loop(model, criterion, params, x, y))
