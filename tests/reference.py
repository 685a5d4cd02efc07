"""Brute-force TracIn, the yardstick for exactness tests.

Deliberately naive: a Python loop over examples with ``torch.autograd.grad``, explicit
flattening, explicit sums over checkpoints, float64 throughout. Nothing here shares code with
the library.
"""

from __future__ import annotations

import torch
from torch import Tensor


def example_at(batch, i):
    """The i-th example of a tuple batch (no batch dimension)."""
    return tuple(leaf[i] for leaf in batch)


def as_float64(batch):
    return tuple(leaf.double() if leaf.is_floating_point() else leaf for leaf in batch)


def n_examples(batch) -> int:
    return batch[0].shape[0]


def loop_grads(loss, params: dict[str, Tensor], batch) -> dict[str, Tensor]:
    """Per-example gradients by a Python loop: ``{name: [n, *shape]}``."""
    names = sorted(params)
    out: dict[str, list[Tensor]] = {name: [] for name in names}
    for i in range(n_examples(batch)):
        leaves = {name: params[name].detach().clone().requires_grad_(True) for name in names}
        value = loss(leaves, example_at(batch, i))
        grads = torch.autograd.grad(value, [leaves[name] for name in names])
        for name, g in zip(names, grads, strict=True):
            out[name].append(g)
    return {name: torch.stack(out[name]) for name in names}


def flat_loop_grads(loss, params, batch) -> Tensor:
    """``[n, p]``: per-example gradients flattened, parameters in sorted-name order."""
    grads = loop_grads(loss, params, batch)
    return torch.cat([grads[name].reshape(grads[name].shape[0], -1) for name in sorted(grads)], 1)


def exact_tracin(loss, checkpoints, train_batch, test_batch, *, normalize=False) -> Tensor:
    """``[n_test, n_train]`` = sum_c lr_c * <g_test, g_train> (or cosine), all explicit."""
    n_test, n_train = n_examples(test_batch), n_examples(train_batch)
    train_batch, test_batch = as_float64(train_batch), as_float64(test_batch)
    scores = torch.zeros(n_test, n_train, dtype=torch.float64)
    for ckpt in checkpoints:
        params = {k: v.double() for k, v in ckpt.params.items()}
        train = flat_loop_grads(loss, params, train_batch).double()
        test = flat_loop_grads(loss, params, test_batch).double()
        for i in range(n_test):
            for j in range(n_train):
                dot = torch.dot(test[i], train[j])
                if normalize:
                    dot = dot / (test[i].norm() * train[j].norm())
                scores[i, j] += ckpt.lr * dot
    return scores


def exact_self_influence(loss, checkpoints, train_batch) -> Tensor:
    """``[n_train]`` = sum_c lr_c * ||g_train||^2."""
    total = torch.zeros(n_examples(train_batch), dtype=torch.float64)
    train_batch = as_float64(train_batch)
    for ckpt in checkpoints:
        params = {k: v.double() for k, v in ckpt.params.items()}
        train = flat_loop_grads(loss, params, train_batch).double()
        for j in range(train.shape[0]):
            total[j] += ckpt.lr * torch.dot(train[j], train[j])
    return total
