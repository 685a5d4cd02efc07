"""Helpers for the atk44b hostile tests: crafted MemoryStores and a float64 brute force."""

from __future__ import annotations

import dataclasses

import torch

import tracinfunc.testing as tt
from tracinfunc.store import MemoryStore


def make(rows64: torch.Tensor, lrs, dtype=torch.float32) -> MemoryStore:
    """A MemoryStore holding ``rows64`` (cast to ``dtype``) with per-checkpoint ``lrs``."""
    c, n, k = rows64.shape
    base = tt.reference_store(n, k, n_ckpt=c, dtype=dtype)
    cps = tuple(dataclasses.replace(cp, lr=float(lr))
                for cp, lr in zip(base.meta.checkpoints, lrs, strict=False))
    meta = dataclasses.replace(base.meta, checkpoints=cps)
    rows = rows64.to(dtype)
    wide = torch.float32 if dtype != torch.float64 else torch.float64
    norms = rows.double().norm(dim=-1).to(wide)
    return MemoryStore(meta, rows, norms)


def ref(store_rows64, test64, lrs, normalize=False):
    """float64 brute force ``sum_c lr_c test_c @ train_c.T`` (cosine per checkpoint)."""
    out = 0
    for c, lr in enumerate(lrs):
        a = test64[c].double()
        b = store_rows64[c].double()
        if normalize:
            an = a.norm(dim=-1, keepdim=True)
            bn = b.norm(dim=-1, keepdim=True)
            a = torch.where(an > 0, a / an.clamp_min(1e-300), torch.zeros_like(a))
            b = torch.where(bn > 0, b / bn.clamp_min(1e-300), torch.zeros_like(b))
        out = out + lr * (a @ b.T)
    return out
