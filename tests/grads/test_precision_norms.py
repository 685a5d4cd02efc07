"""Mixed precision with normalisation layers and small losses (issue 23, items 3 and 8).

Both failed on the CPU exactly as on a GPU: a LayerNorm or BatchNorm under autocast raised
"expected scalar type Half/BFloat16 but found Float", and float16 flushed the gradients of
examples with a loss near zero to exactly zero.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif

NORMS = {
    "layer_norm": lambda: nn.LayerNorm(16),
    "batch_norm": lambda: nn.BatchNorm1d(16),
    "group_norm": lambda: nn.GroupNorm(4, 16),
}


def _model(norm: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), NORMS[norm](), nn.Tanh(), nn.Linear(16, 3)).eval()
    if norm == "batch_norm":  # non-trivial running statistics
        model[1].running_mean.normal_(0, 0.3)
        model[1].running_var.uniform_(0.5, 2.0)
    return model


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_layers_under_autocast_give_gradients_close_to_float32(norm, dtype):
    model = _model(norm)
    loss = tif.loss_from_module(model, F.cross_entropy)
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(9, 6, generator=g), torch.randint(0, 3, (9,), generator=g))
    full = tif.per_sample_grads(loss)(params, batch)
    half = tif.per_sample_grads(loss, options=tif.GradientOptions(mixed_precision=dtype))(
        params, batch
    )
    tolerance = 0.05 if dtype == torch.bfloat16 else 0.01
    for name in full:
        assert half[name].dtype == torch.float32
        assert _relative_error(half[name], full[name]) < tolerance, name
    projection = tif.Projection(dim=32, seed=0)
    rows = tif.projected_grads(
        loss, projection, options=tif.GradientOptions(mixed_precision=dtype)
    )(params, batch)
    expected = tif.projected_grads(loss, projection)(params, batch)
    assert _relative_error(rows, expected) < tolerance


def test_build_store_with_a_layer_norm_under_autocast():
    model = _model("layer_norm")
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.1)]
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g))
    store = tif.build_store(
        loss,
        ckpts,
        data,
        projection=tif.Projection(dim=32, seed=0),
        options=tif.GradientOptions(mixed_precision=torch.bfloat16),
        progress=False,
    )
    assert store.meta.n_train == 12


def _confident_setup(margin: float):
    """A classifier sure of its labels: correctly labelled examples have losses ~1e-6."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 5)).eval()
    with torch.no_grad():
        model[2].weight.mul_(margin)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 20, generator=g)
    with torch.no_grad():
        y = model(x).argmax(1)
    return model, tif.loss_from_module(model, F.cross_entropy), x, y


# (30, False): losses down to ~1e-6, all flushed without scaling; (300, True): losses ~100,
# where a static 2**12 scale overflows. Losses below 2**-14 (margin 300, right labels) stay
# partly flushed: their gradients are below what a bounded scale can lift.
@pytest.mark.parametrize(("margin", "wrong"), [(30.0, False), (30.0, True), (300.0, True)])
def test_float16_gradients_of_small_and_large_losses_are_neither_flushed_nor_overflowed(
        margin, wrong):
    model, loss, x, y = _confident_setup(margin)
    if wrong:  # large losses: scaling must not overflow them
        y = (y + 1) % 5
    params = {k: v.detach() for k, v in model.named_parameters()}
    full = tif.per_sample_grads(loss)(params, (x, y))
    half = tif.per_sample_grads(loss, options=tif.GradientOptions(mixed_precision=torch.float16))(
        params, (x, y)
    )
    for name in full:
        assert bool(torch.isfinite(half[name]).all()), name
        per_example = ((half[name] - full[name]).flatten(1).norm(dim=1)
                       / full[name].flatten(1).norm(dim=1))
        assert float(per_example.max()) < 0.05, name  # unscaled float16: 1.0 (all zeros)
    rows = tif.projected_grads(
        loss,
        tif.Projection(dim=64, seed=0),
        options=tif.GradientOptions(mixed_precision=torch.float16),
    )(params, (x, y))
    reference = tif.projected_grads(loss, tif.Projection(dim=64, seed=0))(params, (x, y))
    per_row = (rows - reference).norm(dim=1) / reference.norm(dim=1)
    assert float(per_row.max()) < 0.05


def test_loss_scaling_is_exact_where_float16_does_not_underflow():
    # Scaling by a power of two and dividing after changes nothing for ordinary losses.
    from tracinfunc.grads import precision

    assert precision.loss_scale(torch.tensor(3.0), "up") == 1
    assert precision.loss_scale(torch.tensor(0.3), "up") == 2
    assert precision.loss_scale(torch.tensor(1e-9), "up") == 2**14
    assert precision.loss_scale(torch.tensor(0.0), "up") == 2**14
    # The third attempt (large losses): scaled down to ~1, never up, at most 2**-24.
    assert precision.loss_scale(torch.tensor(3.0), "down") == 0.25  # floor(-1.58) = -2
    assert precision.loss_scale(torch.tensor(-3e6), "down") == 2.0**-22
    assert precision.loss_scale(torch.tensor(1e30), "down") == 2.0**-24
    assert precision.loss_scale(torch.tensor(0.3), "down") == 1
    assert precision.loss_scale(torch.tensor(0.0), "down") == 1
    assert precision.loss_scale(torch.tensor(float("nan")), "down") == 1


def test_float16_gradients_above_65504_are_scaled_down_and_neighbours_unchanged():
    """A large loss (mse ~1e6) has gradients ~4e5, above float16's range: the third attempt
    scales its loss down to ~1 and the row comes back within float16 error of float32; rows
    of the other examples are those they get alone, bit for bit."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).eval()
    loss = tif.loss_from_module(net, F.mse_loss)
    params = {k: v.detach() for k, v in net.named_parameters()}
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(6, 4, generator=g), torch.rand(6, 1, generator=g)
    x[[1, 4]] *= 100
    y[[1, 4]] *= 3000  # gradients ~1e5 on these two only
    reference = tif.per_sample_grads(loss)(params, (x, y))
    fn = tif.per_sample_grads(loss, options=tif.GradientOptions(mixed_precision=torch.float16))
    got = fn(params, (x, y))
    assert max(float(reference[n].abs().max()) for n in reference) > 65504
    for name, value in got.items():
        error = (value - reference[name]).flatten(1).norm(dim=1)
        assert float((error / reference[name].flatten(1).norm(dim=1)).max()) < 0.02, name
        for i in (0, 2, 3, 5):
            alone = fn(params, (x[i:i + 1], y[i:i + 1]))[name][0]
            assert torch.equal(value[i], alone), (name, i)


def _signed(out, target):
    return out.sum() - target.sum()  # a residual: O(1) gradient whatever the loss


@pytest.mark.parametrize("case", ["confident", "signed", "large"])
def test_float16_stages_scale_and_retry_like_the_plain_path(case):
    """stages= scales each example's output cotangent and divides its gradients, with the
    same retries: confident rows (unscaled: all zeros), residuals whose scaled backward
    overflows, and gradients above 65504 all come back as the plain float16 path gives them
    (per_sample_grads and projected_grads)."""
    torch.manual_seed(2)
    act = nn.ReLU() if case == "large" else nn.Tanh()  # tanh saturates at inputs ~50
    net = nn.Sequential(nn.Linear(6, 32), act, nn.Linear(32, 3)).eval()
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    x = torch.randn(8, 6)
    criterion = F.cross_entropy
    if case == "confident":
        params["2.weight"], params["2.bias"] = params["2.weight"] * 60, params["2.bias"] * 60
        with torch.no_grad():
            y = torch.func.functional_call(net, params, (x,)).argmax(1)
    elif case == "signed":
        criterion = _signed
        x[[0, 3]] *= 30
        with torch.no_grad():
            y = torch.func.functional_call(net, params, (x,)).sum(1) - torch.tensor(
                [1e-6, 0.5, 0.0, 1e-7, 2.0, 1e-5, 0.3, 1e-6])
    else:
        criterion = F.mse_loss
        x = x.abs() * 50
        y = torch.rand(8, 3) * 3000
    loss = tif.loss_from_module(net, criterion)
    stages = tif.model_stages(net, criterion)
    reference = tif.per_sample_grads(loss)(params, (x, y))
    plain = tif.GradientOptions(mixed_precision=torch.float16)
    staged = tif.GradientOptions(mixed_precision=torch.float16, stages=stages)
    keep = sum(g.flatten(1).norm(dim=1) ** 2 for g in reference.values()).sqrt() >= 1e-8
    assert keep.sum() >= 6
    if case == "large":
        assert max(float(g.abs().max()) for g in reference.values()) > 65504
    for options in (plain, staged):
        got = tif.per_sample_grads(loss, options=options)(params, (x, y))
        for name, value in got.items():
            diff = (value - reference[name]).flatten(1).norm(dim=1)
            norm = reference[name].flatten(1).norm(dim=1).clamp_min(1e-30)
            assert float((diff / norm)[keep].max()) < 0.03, (case, name)
    projection = tif.Projection(dim=16, seed=0)
    rows32 = tif.projected_grads(loss, projection)(params, (x, y))
    rows16 = tif.projected_grads(loss, projection, options=staged)(params, (x, y))
    relative = (rows16 - rows32).norm(dim=1) / rows32.norm(dim=1)
    assert torch.isfinite(rows16).all() and float(relative[keep].max()) < 0.03
