"""Per-checkpoint buffers: each checkpoint is differentiated with its own BatchNorm statistics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tests.reference import flat_loop_grads
from tracinfunc.errors import LossFunctionError


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double()


def checkpoints_differing_in_statistics(model):
    ckpts = []
    for i, shift in enumerate([0.0, 1.5]):
        with torch.no_grad():
            model[1].running_mean.fill_(shift)
            model[1].running_var.fill_(1.0 + shift)
        ckpts.append(tif.Checkpoint.from_state_dict(model.state_dict(), model, name=f"c{i}"))
    return ckpts


def test_checkpoints_keep_buffers_and_build_store_uses_them():
    model = bn_model().eval()
    ckpts = checkpoints_differing_in_statistics(model)  # the module is left at the last one
    assert set(ckpts[0].buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert ckpts[0].fingerprint != ckpts[1].fingerprint  # same params, other statistics
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,)))
    store = tif.build_store(loss, ckpts, batch, projection=tif.Projection(kind="identity"),
                            dtype=torch.float64)
    rows = torch.stack([store.read_rows(c, 0, 5) for c in range(2)])
    for index, ckpt in enumerate(ckpts):
        with torch.no_grad():  # brute force: a module carrying this checkpoint's statistics
            model[1].running_mean.copy_(ckpt.buffers["1.running_mean"])
            model[1].running_var.copy_(ckpt.buffers["1.running_var"])
        reference = flat_loop_grads(tif.loss_from_module(model, F.cross_entropy),
                                    dict(ckpt.params), batch)
        got = tif.projected_grads(
            tif.checkpoint.loss_at(loss, ckpt), tif.Projection(kind="identity")
        )(dict(ckpt.params), batch)
        torch.testing.assert_close(got, reference, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(rows[index].double(), reference, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(
        flat_loop_grads(tif.checkpoint.loss_at(loss, ckpts[0]), dict(ckpts[0].params), batch),
        flat_loop_grads(tif.checkpoint.loss_at(loss, ckpts[1]), dict(ckpts[1].params), batch),
    )


def test_plain_losses_and_unknown_buffers():
    model = bn_model().eval()
    ckpt = tif.Checkpoint.from_module(model)

    def plain(params, example):
        return params["0.bias"].sum() * example.sum()

    assert tif.checkpoint.loss_at(plain, ckpt) is plain  # a plain loss owns its state
    loss = tif.loss_from_module(model, F.cross_entropy)
    try:
        loss.with_buffers({"nope": torch.zeros(1)})
    except LossFunctionError as error:
        assert "ModuleLoss.with_buffers" in str(error)
    else:
        raise AssertionError("unknown buffers were accepted")


def test_equal_buffers_share_the_loss():
    model = bn_model().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpt = tif.Checkpoint.from_module(model)
    assert tif.checkpoint.loss_at(loss, ckpt) is loss
