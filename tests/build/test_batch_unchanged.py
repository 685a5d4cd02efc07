"""A loss that writes into its batch is refused (``build/unchanged.py``): every checkpoint
must see the same examples, and the caller's data of a merged build stays as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_checkpoints, make_data, make_mlp
from tracinfunc.build.unchanged import batch_versions, check_batch_unchanged

KINDS = ["identity", "rademacher", "sjlt", "kronecker"]


def _projection(kind):
    return tif.Projection(kind="identity") if kind == "identity" else \
        tif.Projection(dim=16, seed=0, kind=kind)


def _setup():
    model = make_mlp(dtype=torch.float32).eval()
    x, y = make_data(n=24, dtype=torch.float32)
    return tif.loss_from_module(model, F.cross_entropy), make_checkpoints(model), x, y


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", ["list", "generator", "batch_size", "one batch"])
def test_a_loss_writing_into_its_batch_is_refused(kind, form):
    loss, ckpts, x, y = _setup()
    x0 = x.clone()

    def writes(params, example):
        example[0].mul_(2)
        return loss(params, example)

    batches = [(x[i:i + 6], y[i:i + 6]) for i in range(0, 24, 6)]
    data = {"list": batches, "generator": iter(batches), "batch_size": batches,
            "one batch": (x, y)}[form]
    options = {"batch_size": 6} if form == "batch_size" else {}
    with pytest.raises(tif.errors.LossFunctionError, match="wrote into its batch in place"):
        tif.build_store(writes, ckpts, data, projection=_projection(kind), progress=False,
                        **options)
    if form in ("list", "generator"):  # merged calls hold copies: the caller's x is intact
        assert torch.equal(x, x0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_loss_writing_into_a_copy_builds_as_one_that_does_not(kind):
    loss, ckpts, x, y = _setup()

    def copies(params, example):
        inputs = example[0].clone()
        inputs.mul_(1.0)
        return loss(params, (inputs, example[1]))

    batches = [(x[i:i + 6], y[i:i + 6]) for i in range(0, 24, 6)]
    a = tif.build_store(copies, ckpts, batches, projection=_projection(kind), progress=False)
    b = tif.build_store(loss, ckpts, batches, projection=_projection(kind), progress=False)
    for c in range(a.n_ckpt):
        torch.testing.assert_close(a.read_rows(c, 0, 24), b.read_rows(c, 0, 24),
                                   rtol=1e-5, atol=1e-6)


def test_versions_of_a_batch():
    x, y = torch.randn(4, 3), torch.arange(4)
    with torch.inference_mode():
        z = torch.ones(4)
    batch = {"x": x, "y": y, "z": z}
    versions = batch_versions(batch)
    assert versions[2] is None  # an inference tensor has no version counter
    check_batch_unchanged(batch, versions)
    y.add_(1)
    with pytest.raises(tif.errors.LossFunctionError,
                       match=r"tensor 1 of the batch, int64, each example's of shape \[\]"):
        check_batch_unchanged(batch, versions)
