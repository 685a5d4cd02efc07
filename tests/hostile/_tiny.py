"""Tiny model, data and stores shared by the hostile tests (an MLP on 40 random rows)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import tracinfunc as tif

torch.manual_seed(0)
X = torch.randn(40, 6)
Y = torch.randint(0, 3, (40,))
XT = torch.randn(5, 6)
YT = torch.randint(0, 3, (5,))
PROJ = tif.Projection(dim=8, seed=0)


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).eval()


M = model()
LOSS = tif.loss_from_module(M, F.cross_entropy)
CKPTS = [
    tif.Checkpoint.from_module(M, lr=0.1, name="a"),
    tif.Checkpoint.from_module(model(1), lr=0.05, name="b"),
]


def data():
    return [(X[i : i + 10], Y[i : i + 10]) for i in range(0, 40, 10)]


def build(store=None, loss=LOSS, ckpts=None, **kw):
    kw.setdefault("projection", PROJ)
    ckpts = CKPTS if ckpts is None else ckpts
    if store is None:
        return tif.build_store(loss, ckpts, data(), **kw)
    return tif.build_store(loss, ckpts, data(), store=store, **kw)


def query_grads(**kw):
    kw.setdefault("projection", PROJ)
    return tif.build_store(LOSS, CKPTS, (XT, YT), **kw)


def big_loss(params, example):
    """Gradients around 1e7: beyond float16's range (65504)."""
    return LOSS(params, example) * 1e7


def train(directory, *, m=None, steps=4, every=2, **kw):
    """A plain training loop recorded by CheckpointRecorder; returns the model."""
    m = model(0).train() if m is None else m
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=0.1)
    rec = tif.training.CheckpointRecorder(directory, m, opt, every=every, **kw)
    for _ in range(steps):
        F.cross_entropy(m(X), Y).backward()
        opt.step()
        opt.zero_grad()
        rec.step()
    rec.save()
    rec.close()
    return m


def frozen_base(seed: int = 0) -> nn.Module:
    """A LoRA-like model: the first layer is a frozen base."""
    m = model(seed).train()
    m[0].weight.requires_grad_(False)
    m[0].bias.requires_grad_(False)
    return m


def files(root) -> dict:
    """Every file under root with its bytes (to check nothing was changed)."""
    import os

    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out
