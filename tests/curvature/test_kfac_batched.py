"""K-FAC's batched capture (one forward and one backward of a ModuleLoss's batch) gives the
per-example capture's factors, and a model whose examples interact keeps the per-example one
with a BatchedPathWarning (issue 34). Each batch larger than every batch proved before is
proved again, on all its examples; a loss that draws random numbers is refused (atk37)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
import tracinfunc.curvature.fit as fit_module
from tests.conftest import make_checkpoints, make_data, make_mlp
from tracinfunc.curvature import classification_sampler, fit_curvature
from tracinfunc.errors import LossFunctionError
from tracinfunc.grads.factorized_batched import BatchedPathWarning

EXACT = classification_sampler(exact=True)


class _Centred(nn.Module):
    """Subtracts the batch mean before its Linear: examples interact in a batched forward."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        return self.second(h - h.mean(0, keepdim=True) + h)


def _fit(model, kind, monkeypatch=None, per_example=False, dtype=torch.float64):
    loss = tif.loss_from_module(model.eval(), F.cross_entropy)
    if per_example:
        monkeypatch.setattr(fit_module, "batched_io", lambda *args: None)
    return fit_curvature(loss, make_checkpoints(model, n_ckpt=2), make_data(24, dtype=dtype),
                         kind=kind, sampler=EXACT, batch_size=8)


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_batched_capture_gives_the_per_example_capture_factors(kind, monkeypatch):
    model = make_mlp()
    batched = _fit(model, kind)
    per_example = _fit(model, kind, monkeypatch, per_example=True)
    for got, want in zip(batched.estimates, per_example.estimates, strict=True):
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-10, atol=1e-13)


def test_float32_model_factors_are_summed_in_float64_within_float32_rounding():
    model = make_mlp(dtype=torch.float32).eval()
    ckpts, (x, y) = make_checkpoints(model, n_ckpt=2), make_data(24, dtype=torch.float32)
    wide = make_mlp().eval()
    wide_ckpts = [tif.Checkpoint({k: v.double() for k, v in c.params.items()}, lr=c.lr,
                                 name=c.name) for c in ckpts]
    got = fit_curvature(tif.loss_from_module(model, F.cross_entropy), ckpts, (x, y),
                        kind="kfac", sampler=EXACT, batch_size=8)
    want = fit_curvature(tif.loss_from_module(wide, F.cross_entropy), wide_ckpts,
                         (x.double(), y), kind="kfac", sampler=EXACT, batch_size=8)
    for c in range(2):
        for key, value in want.estimates[c].items():
            assert got.estimates[c][key].dtype == torch.float64
            torch.testing.assert_close(got.estimates[c][key], value, rtol=1e-4, atol=1e-6)


def test_interacting_examples_keep_the_per_example_capture(monkeypatch):
    torch.manual_seed(0)
    model = _Centred().double()
    with pytest.warns(BatchedPathWarning, match="examples interact"):
        fitted = _fit(model, "kfac")
    per_example = _fit(model, "kfac", monkeypatch, per_example=True)
    for key, want in per_example.estimates[0].items():
        torch.testing.assert_close(fitted.estimates[0][key], want, rtol=1e-12, atol=1e-14)


class _Mixing(nn.Module):
    """Examples ``start..`` of a batch are centred among themselves, in batches over ``over``."""

    def __init__(self, start: int, over: int) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 5), nn.Linear(5, 3)
        self.start, self.over = start, over

    def forward(self, x):
        h = torch.tanh(self.first(x))
        if h.shape[0] > self.over:
            h = torch.cat([h[:self.start], h[self.start:] - h[self.start:].mean(0, keepdim=True)])
        return self.second(h)


def _fit_batches(model, sizes, per_example=False, monkeypatch=None):
    loss = tif.loss_from_module(model.eval(), F.cross_entropy)
    if per_example:
        monkeypatch.setattr(fit_module, "batched_io", lambda *args: None)
    x, y = make_data(sum(sizes))
    ends = torch.tensor(sizes).cumsum(0).tolist()
    data = [(x[end - size:end], y[end - size:end]) for size, end in zip(sizes, ends, strict=True)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fitted = fit_curvature(loss, make_checkpoints(model, n_ckpt=2), data, kind="kfac",
                               sampler=EXACT)
    return fitted, [str(w.message) for w in caught if w.category is BatchedPathWarning]


@pytest.mark.parametrize(("start", "over", "sizes", "scale"),
                         [(0, 6, [2, 8, 8], ""), (4, 4, [8, 8, 3], ""), (0, 0, [8, 8], "reach 0:")])
def test_interaction_in_a_larger_batch_or_a_later_example_falls_back_once(
        start, over, sizes, scale, monkeypatch):
    # EXACT labels each example with each of 3 classes: batches of 2 and 8 give 6 and 24
    # rows. A first batch of 6 rows proves nothing of batches of 24; rows 4.. of a batch are
    # checked too. The fallback warns once for the fit (2 checkpoints); against a reference
    # of 0 (one example centred alone) it says so, with no relative difference.
    model = _Mixing(start, over).double()
    fitted, warned = _fit_batches(model, sizes)
    assert len(warned) == 1 and "examples interact" in warned[0], warned
    assert "batch of 24" in warned[0] and "relative" not in warned[0] and scale in warned[0]
    want, _ = _fit_batches(model, sizes, per_example=True, monkeypatch=monkeypatch)
    for got_c, want_c in zip(fitted.estimates, want.estimates, strict=True):
        for key, value in want_c.items():
            torch.testing.assert_close(got_c[key], value, rtol=1e-12, atol=1e-14)


def test_batches_no_larger_than_the_proved_one_are_not_proved_again(monkeypatch):
    model = make_mlp().double()
    calls = {"batched": [], "per_example": []}

    class Counted:  # a capture whose batches are counted, whole or fed layer by layer
        def __init__(self, name, io):
            self.name, self.io = name, io

        def __call__(self, batch):
            calls[self.name].append(batch[0].shape[0])
            return self.io(batch)

        def stream(self, batch, start):
            calls[self.name].append(batch[0].shape[0])
            return self.io.stream(batch, start)

        def __getattr__(self, name):  # what the capture measured (held_per_example)
            return getattr(self.io, name)

    def counting(name, make):
        return lambda *args: Counted(name, make(*args))

    monkeypatch.setattr(fit_module, "batched_io", counting("batched", fit_module.batched_io))
    monkeypatch.setattr(fit_module, "layer_io", counting("per_example", fit_module.layer_io))
    _, warned = _fit_batches(model, [3, 8, 5, 8])
    # Rows (3 labels an example): 9 and 24 are proved against the per-example capture, 15 and
    # 24 again are not; the second checkpoint proves nothing again.
    assert not warned
    assert calls == {"batched": [9, 24, 15, 24] * 2, "per_example": [9, 24]}


def test_a_loss_that_draws_random_numbers_is_refused():
    class Dropped(nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.5, training=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), Dropped(), nn.Linear(5, 3)).double()
    with pytest.raises(LossFunctionError, match="draws random numbers"):
        _fit_batches(model, [8])


def test_the_proof_on_slices_of_a_batch_finds_what_the_whole_batch_proof_finds(monkeypatch):
    # One example a slice: each slice's per-example capture is compared with its rows of
    # the batched capture, and the maxima over the slices are the batch's (same warning,
    # same fallback, same factors).
    import tracinfunc.curvature.capture_batched as capture_batched

    model = _Mixing(4, 4).double()
    whole = _fit_batches(model, [8, 8, 3])
    calls = []
    original = fit_module.layer_io

    def counting(*args):
        io = original(*args)
        return lambda batch: calls.append(batch[0].shape[0]) or io(batch)

    monkeypatch.setattr(capture_batched, "_PROOF_BYTES", 1)
    monkeypatch.setattr(fit_module, "layer_io", counting)
    sliced = _fit_batches(model, [8, 8, 3])
    assert sliced[1] == whole[1] and len(sliced[1]) == 1, sliced[1]
    assert calls[:24] == [1] * 24  # the proof: 24 rows one by one; then the fallback's batches
    for got_c, want_c in zip(sliced[0].estimates, whole[0].estimates, strict=True):
        for key, value in want_c.items():
            torch.testing.assert_close(got_c[key], value, rtol=0, atol=0)


def test_slice_gaps_keep_a_nan_as_one_maximum_over_the_batch_does():
    from tracinfunc.curvature.capture_batched import _larger

    assert math.isnan(_larger(math.nan, 1.0)) and math.isnan(_larger(1.0, math.nan))
    assert _larger(2.0, 1.0) == 2.0


class _InputWrittenAfterRead(nn.Module):
    """``second`` reads ``h``, then ``h`` is written in place (atk49)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.out = nn.Linear(6, 5), nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.first(x)
        read = self.second(h)
        h.add_(1.0)
        return self.out(torch.tanh(read) + h)


@pytest.mark.parametrize("form", ["module loss", "plain loss"])
def test_a_layer_input_written_after_the_layer_read_it_is_refused(form):
    # The batched capture and the per-example one (a plain loss, or the fallback) both kept
    # the input tensor, not its values: A was formed from the written values, silently.
    model = _InputWrittenAfterRead().double().eval()
    module_loss = tif.loss_from_module(model, F.cross_entropy)
    loss, sampler = (module_loss, EXACT) if form == "module loss" else (
        lambda params, example: module_loss(params, example),  # the data's own labels
        lambda loss, params, batch, generator: (batch, torch.ones(batch[0].shape[0])))
    with pytest.raises(LossFunctionError, match="wrote into a layer's input in place"):
        fit_curvature(loss, make_checkpoints(model, n_ckpt=1), make_data(12), kind="kfac",
                      sampler=sampler, batch_size=4)
