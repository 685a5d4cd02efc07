"""The batched path's vmap-free rows for ``nn.Linear`` layers: bit for bit the rows of the
``vmap(combine)`` they replace (same operations, written batched)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tests.conftest import make_convnet, make_data, make_mlp
from tracinfunc.grads import factorized_batched
from tracinfunc.grads.factorized import factorized_projected_grads

SPEC = tif.Projection(dim=24, seed=5, kind="kronecker")


class Twice(nn.Module):
    """One Linear applied twice per example: its second call adds to the first's block."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


def rows_both_ways(model, x, y, monkeypatch, *, spec=SPEC):
    """``(rows, rows with the vmap-free path switched off, calls that took it)``."""
    loss = tif.loss_from_module(model, F.cross_entropy)
    params = {k: v.detach() for k, v in model.named_parameters()}
    taken = []
    original = factorized_batched._linear_rows

    def spy(*args):
        rows = original(*args)
        taken.append(rows is not None)
        return rows

    monkeypatch.setattr(factorized_batched, "_linear_rows", spy)
    fast = factorized_projected_grads(loss, spec)(params, (x, y))
    monkeypatch.setattr(factorized_batched, "_linear_rows", lambda *args: None)
    slow = factorized_projected_grads(loss, spec)(params, (x, y))
    return fast, slow, taken


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("model", ["mlp", "twice"])
def test_linear_rows_equal_the_vmapped_combine_bit_for_bit(model, dtype, monkeypatch):
    torch.manual_seed(0)
    module = (make_mlp(dtype=dtype) if model == "mlp" else Twice().to(dtype)).eval()
    x, y = make_data(40, dtype=dtype)
    fast, slow, taken = rows_both_ways(module, x, y, monkeypatch)
    assert taken and all(taken)  # the vmap-free path ran
    assert fast.shape == (40, SPEC.dim)
    assert torch.equal(fast, slow)


def test_a_layer_seen_per_position_keeps_vmap(monkeypatch):
    """A Linear over a sequence (T rows per example) is not the vmap-free case: vmap runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Flatten(), nn.Linear(15, 3)).double().eval()
    x = torch.randn(10, 3, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (10,))
    fast, slow, taken = rows_both_ways(model, x, y, monkeypatch)
    assert taken and not any(taken)
    assert torch.equal(fast, slow)


def test_convolutions_keep_vmap(monkeypatch):
    x = torch.randn(6, 1, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    _, _, taken = rows_both_ways(make_convnet().eval(), x, y, monkeypatch)
    assert taken and not any(taken)
