"""Shared tiny fixtures for the atk2 outside pass (black box, docs only)."""

from __future__ import annotations

import hashlib
import os

import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif


def model_ckpts(seed=0, n=2):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).eval()
    ck = []
    for e in range(n):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.1 * torch.randn_like(p))
        ck.append(tif.Checkpoint.from_module(m, lr=0.1, name=f"e{e}"))
    return m, tif.loss_from_module(m, F.cross_entropy), ck


def data(seed=1, n=40):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def tree_hash(p) -> str:
    h = hashlib.sha256()
    for root, ds, fs in sorted(os.walk(p)):
        ds.sort()
        h.update(root.encode())
        for f in sorted(fs):
            fp = os.path.join(root, f)
            h.update(fp.encode())
            if os.path.islink(fp):
                h.update(os.readlink(fp).encode())
            else:
                with open(fp, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()
