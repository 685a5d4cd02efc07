"""K-FAC's batched capture handed to the factor sums a layer at a time, as the backward reaches
each layer (``BatchedIO.stream``), with every layer's float64 terms formed a slice of the batch
at a time (``kfac._TEMP_BYTES``): the same factors and eigenvalues as the explicit float64
references of ``test_kfac_layers`` and as the per-example capture, and no batch holding every
layer's output gradients at once.

The explicit-reference tests of ``test_kfac_layers`` run again here (imported), with every batch
fed layer by layer (the proof batch too) and slices of one example.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
import tracinfunc.curvature.capture_batched as capture_batched
import tracinfunc.curvature.fit as fit_module
import tracinfunc.curvature.kfac as kfac
from tests.conftest import make_checkpoints, make_data, make_mlp
from tests.curvature.test_kfac_layers import *  # noqa: F403 (the references, fed and sliced)
from tests.curvature.test_kfac_layers import _SharedInput
from tracinfunc.curvature import classification_sampler, fit_curvature
from tracinfunc.grads.factorized_batched import BatchedPathWarning

EXACT = classification_sampler(exact=True)
TAPPED: list[int] = []  # layer indices whose output gradient reached a tap, in order
_TAP, _PROVEN = capture_batched._Tap, fit_module.proven_io


class _CountedTap(_TAP):
    @staticmethod
    def backward(ctx, delta):
        TAPPED.append(ctx.index)
        return _TAP.backward(ctx, delta)


def _always_fed(monkeypatch) -> None:
    """Every batch through ``BatchedIO.stream`` (the proof's batch is proved, then streamed
    again), with one example a slice."""
    def proven(vmapped, batched, proof, layers):
        inner = _PROVEN(vmapped, batched, proof, layers)
        if batched is None:
            return inner

        def feed(batch, start):
            inner(batch, lambda keys: lambda *layer: None)  # the proof (or a proved batch)
            if proof.failed:
                return capture_batched.layer_by_layer(vmapped, layers)(batch, start)
            return batched.stream(batch, start)

        return feed

    monkeypatch.setattr(fit_module, "proven_io", proven)
    monkeypatch.setattr(capture_batched, "_STREAM_BYTES", -1)
    monkeypatch.setattr(capture_batched, "_Tap", _CountedTap)
    monkeypatch.setattr(kfac, "_TEMP_BYTES", 1)


@pytest.fixture(autouse=True)
def fed_and_sliced(monkeypatch):
    _always_fed(monkeypatch)
    TAPPED.clear()
    yield


class _Attention(nn.Module):
    """q, k, v read one input [b, T, 4]; ``unused`` is called but the loss never reads it
    (its output gradient is zero); ``out`` reads a row per example."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.unused, self.out = nn.Linear(4, 2), nn.Linear(12, 3)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        self.unused(x)
        mixed = torch.softmax(q @ k.transpose(1, 2), -1) @ v  # within each example
        return self.out(mixed.flatten(1))


def _attention_fit(kind, monkeypatch=None, per_example=False):
    torch.manual_seed(0)
    model = _Attention().double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(12, 3, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (12,), generator=g)
    if per_example:
        monkeypatch.setattr(fit_module, "batched_io", lambda *args: None)
    return fit_curvature(loss, make_checkpoints(model, n_ckpt=2), (x, y), kind=kind,
                         sampler=EXACT, batch_size=5)


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_fed_layers_give_the_per_example_capture_factors(kind, monkeypatch):
    fed = _attention_fit(kind)
    assert sorted(set(TAPPED)) == [0, 1, 2, 4]  # unused (3) never reaches a tap
    assert TAPPED[0] == 4 and TAPPED.count(4) >= 2 * 3 * (2 if kind == "ekfac" else 1)
    want = _attention_fit(kind, monkeypatch, per_example=True)
    for got_c, want_c in zip(fed.estimates, want.estimates, strict=True):
        assert set(got_c) == set(want_c)
        for key, value in want_c.items():
            torch.testing.assert_close(got_c[key], value, rtol=1e-10, atol=1e-13)
    zero = fed.estimates[0]["unused.weight:S"]
    assert torch.equal(zero, torch.zeros_like(zero))  # materialised as zeros, as the list


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_fed_mlp_equals_the_whole_batch_capture_bit_for_bit_run_to_run(kind):
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts, data = make_checkpoints(model, n_ckpt=2), make_data(24)
    first = fit_curvature(loss, ckpts, data, kind=kind, sampler=EXACT, batch_size=8)
    again = fit_curvature(loss, ckpts, data, kind=kind, sampler=EXACT, batch_size=8)
    for a, b in zip(first.estimates, again.estimates, strict=True):
        assert all(torch.equal(a[key], b[key]) for key in a)


def test_a_layers_output_gradient_is_freed_before_the_last_layer_is_fed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    alive: list = []
    original = kfac.FactorBatch.__call__

    def spying(self, index, x, delta):
        alive.append([ref() is not None for ref in getattr(self, "_refs", [])])
        self._refs = [*getattr(self, "_refs", []), weakref.ref(delta)]
        gc.collect()
        return original(self, index, x, delta)

    kfac.FactorBatch.__call__ = spying
    try:
        fit_curvature(loss, make_checkpoints(model, n_ckpt=1), make_data(16), kind="ekfac",
                      sampler=EXACT, batch_size=8)
    finally:
        kfac.FactorBatch.__call__ = original
    # Each batch: the layers come last first; when a layer is fed, the output gradients of
    # the layers fed before it are gone (a whole-batch capture would hold them all).
    assert sum(len(seen) == 2 for seen in alive) == 2  # the third layer fed, per batch
    assert not any(any(seen) for seen in alive), alive


def test_whole_batch_below_the_stream_threshold_streamed_above(monkeypatch):
    monkeypatch.setattr(fit_module, "proven_io", _PROVEN)  # the library's own choice
    monkeypatch.setattr(capture_batched, "_STREAM_BYTES", 32 * 2**20)
    _attention_fit("kfac")
    assert TAPPED == []  # 12 examples of a tiny model: captured whole, handed over in order
    # A threshold below the batches' output gradients: every batch after the proof streams,
    # at every checkpoint (the proof's measure is the fit's, shared by its checkpoints).
    monkeypatch.setattr(capture_batched, "_STREAM_BYTES", 1)
    _attention_fit("kfac")
    assert TAPPED.count(4) == 2 * 3 - 1  # 3 batches a checkpoint, the first proved whole


def test_an_output_written_in_place_on_a_fed_batch_falls_back_to_the_per_example_capture():
    class Late(nn.Module):  # writes into its Linear's output on the last batch only
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(6, 5), nn.Linear(5, 3)

        def forward(self, x):
            h = self.first(x)
            if x.dim() == 2 and x.shape[0] == 4 * 3:  # 4 examples, 3 labels each
                h = h.mul_(2)
            return self.second(torch.tanh(h))

    torch.manual_seed(0)
    model = Late().double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    with pytest.warns(BatchedPathWarning, match="modified in place"):
        fit_curvature(loss, make_checkpoints(model), make_data(20), kind="kfac",
                      sampler=EXACT, batch_size=8)  # 8 proved, 8, then 4 fed: per example


def test_shared_input_sums_are_never_aliased_when_fed():
    torch.manual_seed(0)
    model = _SharedInput().double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    x = torch.randn(10, 3, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (10,))
    curvature = fit_curvature(loss, make_checkpoints(model), (x, y), kind="ekfac",
                              sampler=EXACT, batch_size=4)
    estimate = curvature.estimates[0]
    assert estimate["a.weight:A"].data_ptr() != estimate["b.weight:A"].data_ptr()
    torch.testing.assert_close(estimate["a.weight:A"], estimate["b.weight:A"], rtol=0, atol=0)
    assert TAPPED  # fed layer by layer
