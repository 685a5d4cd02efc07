"""K-FAC's batched capture (one forward and one backward of a ModuleLoss's batch) gives the
per-example capture's factors, and a model whose examples interact keeps the per-example one
with a BatchedPathWarning (issue 34)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
import tracinfunc.curvature.fit as fit_module
from tests.conftest import make_checkpoints, make_data, make_mlp
from tracinfunc.curvature import classification_sampler, fit_curvature
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
