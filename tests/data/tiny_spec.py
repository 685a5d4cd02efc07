"""A tiny experiment spec for the command-line tests: a 2-layer MLP on random data."""

import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).eval()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(30, 5, generator=g), torch.randint(0, 3, (30,), generator=g)
    checkpoints = [tif.Checkpoint.from_module(model, lr=0.1, name="start")]
    with torch.no_grad():
        model[0].weight.mul_(1.5)
    checkpoints.append(tif.Checkpoint.from_module(model, lr=0.05, name="later"))
    return tif.cli.Spec(
        loss=tif.loss_from_module(model, F.cross_entropy),
        train=(x[:24], y[:24]),
        test={"test": (x[24:], y[24:]), "control": (x[20:24], y[20:24])},
        checkpoints=checkpoints,
        model=model,
    )


def not_a_spec():
    return 42
