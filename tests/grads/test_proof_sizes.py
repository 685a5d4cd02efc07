"""The batched path is proved on each larger run of distinct examples, and per checkpoint
buffers (atk48): a model that mixes a batch's examples only in larger runs, or only at one
checkpoint, gets its per-example rows, never rows of mixed examples."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tests.numpy_projection import project
from tests.reference import loop_grads
from tracinfunc.grads import factorized_batched

SPEC = tif.Projection(dim=16, seed=2, kind="kronecker")


class Centring(nn.Module):
    """Adds ``x - x.mean(0)`` to its input: zero for one example, not for a batch (a model
    that mixes examples), or only where ``mode`` (a buffer) is 1."""

    def __init__(self, always: bool = True) -> None:
        super().__init__()
        self.a, self.h = nn.Linear(6, 5), nn.Linear(5, 3)
        self.register_buffer("mode", torch.tensor(1.0 if always else 0.0))

    def forward(self, x):
        return self.h(torch.tanh(self.a(x + self.mode * (x - x.mean(0, keepdim=True)))))


def _expected(loss, ckpt, x, y) -> np.ndarray:
    """Each example's row: a loop of autograd.grad on the example alone, times the dense
    kronecker matrices (float64)."""
    grads = loop_grads(loss, ckpt.params, (x, y))
    return np.stack([project({n: g[i].double().numpy() for n, g in grads.items()},
                             SPEC.seed, "kronecker", SPEC.dim) for i in range(len(y))])


def _check(store, c, loss, ckpt, x, y):
    got = store.read_rows(c, 0, len(y)).double().numpy()
    want = _expected(loss.with_buffers(ckpt.buffers) if ckpt.buffers else loss, ckpt, x, y)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def _data(n=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("first", ["one example", "copies of one"])
def test_a_first_call_that_cannot_show_mixing_is_proved_again(first):
    torch.manual_seed(0)
    model = Centring().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpt = tif.Checkpoint.from_module(model, lr=0.1)
    x, y = _data()
    if first == "copies of one":
        x[:4], y[:4] = x[0], y[0]
        data = [(x[:4], y[:4]), (x[4:12], y[4:12]), (x[12:], y[12:])]
    else:
        data = [(x[:1], y[:1]), (x[1:9], y[1:9]), (x[9:], y[9:])]
    with pytest.warns(factorized_batched.BatchedPathWarning, match="differ"):
        store = tif.build_store(loss, [ckpt], data, projection=SPEC, batch_size=None,
                                progress=False, options=tif.GradientOptions(chunk_size=8))
    _check(store, 0, loss, ckpt, x, y)


def test_each_larger_run_is_proved_once(monkeypatch):
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpt = tif.Checkpoint.from_module(model, lr=0.1)
    x, y = _data(40)
    proved = []
    real = factorized_batched._prove

    def spy(plan, loss, params, batch, *args):
        proved.append(batch[0].shape[0])
        return real(plan, loss, params, batch, *args)

    monkeypatch.setattr(factorized_batched, "_prove", spy)
    sizes = [2, 2, 5, 5, 3, 8, 7, 8]
    starts = np.cumsum([0, *sizes])
    data = [(x[a:b], y[a:b]) for a, b in itertools.pairwise(starts.tolist())]
    with warnings.catch_warnings():
        warnings.simplefilter("error", factorized_batched.BatchedPathWarning)
        store = tif.build_store(loss, [ckpt], data, projection=SPEC,
                                options=tif.GradientOptions(chunk_size=8), progress=False)
    assert proved == [2, 5, 8]
    _check(store, 0, loss, ckpt, x, y)


def test_checkpoint_buffers_get_their_own_proof():
    """The model mixes examples only where its ``mode`` buffer is 1: checkpoint 1's. The
    plan proved at checkpoint 0 is not reused for it (a plan per buffers)."""
    torch.manual_seed(0)
    model = Centring(always=False).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    params = {k: v.detach() for k, v in model.named_parameters()}
    ckpts = [tif.Checkpoint(params, lr=0.1, name="c0", buffers={"mode": torch.tensor(0.0)}),
             tif.Checkpoint(params, lr=0.1, name="c1", buffers={"mode": torch.tensor(1.0)})]
    x, y = _data()
    with pytest.warns(factorized_batched.BatchedPathWarning):
        store = tif.build_store(loss, ckpts, [(x[:10], y[:10]), (x[10:], y[10:])],
                                projection=SPEC, progress=False)
    for c, ckpt in enumerate(ckpts):
        _check(store, c, loss, ckpt, x, y)


def test_equal_buffers_share_one_proof_and_changed_ones_are_proved(monkeypatch):
    """A BatchNorm model's checkpoint buffers are new tensors in every build: builds with
    equal values prove once; a build after the statistics changed proves again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 3)).eval()
    proved = []
    real = factorized_batched._prove

    def spy(plan, *args):
        proved.append(1)
        return real(plan, *args)

    monkeypatch.setattr(factorized_batched, "_prove", spy)
    x, y = _data()
    data = [(x[:10], y[:10]), (x[10:], y[10:])]

    def build():
        loss = tif.loss_from_module(model, F.cross_entropy)
        ckpt = tif.Checkpoint.from_module(model, lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", factorized_batched.BatchedPathWarning)
            store = tif.build_store(loss, [ckpt], data, projection=SPEC, batch_size=10,
                                    progress=False)
        _check(store, 0, loss, ckpt, x, y)

    for _ in range(3):
        build()
    assert len(proved) == 1
    with torch.no_grad():
        model[0].running_mean.add_(0.5)
    build()
    assert len(proved) == 2
