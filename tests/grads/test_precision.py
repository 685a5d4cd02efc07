"""Mixed precision: forward under autocast, float32 gradients, scores close to float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_checkpoints

PROJ = tif.Projection(dim=128, seed=0)


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 5)).eval()
    g = torch.Generator().manual_seed(1)
    train = (torch.randn(120, 20, generator=g), torch.randint(0, 5, (120,), generator=g))
    test = (torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g))
    loss = tif.loss_from_module(model, F.cross_entropy)
    return model, loss, make_checkpoints(model, n_ckpt=2, lrs=(0.1, 0.05)), train, test


def _scores(loss, ckpts, train, test, mixed_precision=None):
    options = tif.GradientOptions(mixed_precision=mixed_precision)
    store = tif.build_store(loss, ckpts, train, projection=PROJ, options=options)
    return tif.score(store, tif.build_store(loss, ckpts, test, projection=PROJ, options=options))


def _ranks(values):
    return values.argsort(dim=-1).argsort(dim=-1).double()


def _top_k_rank_correlation(reference, approx, k=20):
    """Smallest Spearman correlation, over test rows, on the reference's top-k train rows."""
    idx = reference.topk(k, dim=1).indices
    a, b = _ranks(reference.gather(1, idx)), _ranks(approx.gather(1, idx))
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    return float(((a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))).min())


def test_float16_autocast_scores_meet_the_accuracy_target():
    _, loss, ckpts, train, test = _setup()
    reference = _scores(loss, ckpts, train, test)
    approx = _scores(loss, ckpts, train, test, mixed_precision=torch.float16)
    assert float((approx - reference).norm() / reference.norm()) < 0.01
    assert _top_k_rank_correlation(reference, approx) >= 0.99


def test_bfloat16_autocast_scores_are_close_but_coarser():
    """bfloat16 keeps 8 mantissa bits (float16: 11): a few percent, documented in the README."""
    _, loss, ckpts, train, test = _setup()
    reference = _scores(loss, ckpts, train, test)
    approx = _scores(loss, ckpts, train, test, mixed_precision=torch.bfloat16)
    error = float((approx - reference).norm() / reference.norm())
    assert 0 < error < 0.08
    assert _top_k_rank_correlation(reference, approx) >= 0.9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gradients_stay_in_the_parameters_dtype(dtype):
    _, loss, ckpts, train, _ = _setup()
    params = ckpts[0].params
    grads = tif.per_sample_grads(loss, options=tif.GradientOptions(mixed_precision=dtype))(
        params, train
    )
    full = tif.per_sample_grads(loss)(params, train)
    for name, g in grads.items():
        assert g.dtype == torch.float32
        assert not torch.equal(g, full[name])  # autocast really ran in 16 bits
        # Elementwise, ReLU masks flip near zero; the gradient as a whole stays close.
        assert float((g - full[name]).norm() / full[name].norm()) < 0.1


def test_autocast_support_is_asked_of_torch():
    assert tif.grads.autocast_supported("cpu", torch.bfloat16)
    assert not tif.grads.autocast_supported("cpu", torch.float64)  # torch warns and disables it


def test_unsupported_autocast_dtype_is_reported():
    _, loss, ckpts, train, _ = _setup()
    fn = tif.projected_grads(loss, PROJ, options=tif.GradientOptions(mixed_precision=torch.float64))
    with pytest.raises(
        tif.errors.UnsupportedPrecisionError, match=r"'cpu' does not support.*bfloat16"
    ):
        fn(ckpts[0].params, train)
    with pytest.raises(tif.errors.UnsupportedPrecisionError, match="does not support"):
        tif.build_store(
            loss,
            ckpts,
            train,
            projection=PROJ,
            options=tif.GradientOptions(mixed_precision=torch.float64),
        )


def test_mixed_precision_must_be_a_dtype():
    _, loss, _, _, _ = _setup()
    with pytest.raises(TypeError, match="mixed_precision must be None, torch.bfloat16"):
        tif.per_sample_grads(loss, options=tif.GradientOptions(mixed_precision="bf16"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float16_on_cuda_matches_float32_closely():
    model, loss, ckpts, train, _ = _setup()
    model.cuda()
    loss = tif.loss_from_module(model, F.cross_entropy)
    params = {k: v.cuda() for k, v in ckpts[0].params.items()}
    batch = tuple(t.cuda() for t in train)
    full = tif.projected_grads(loss, PROJ)(params, batch)
    half = tif.projected_grads(
        loss, PROJ, options=tif.GradientOptions(mixed_precision=torch.float16)
    )(params, batch)
    assert half.dtype == torch.float32
    assert float((half - full).norm() / full.norm()) < 0.01


# float16 loss scaling: the per-example scale is ~1/|loss|, which assumes the gradient shrinks
# with the loss (cross-entropy near 0 does); a loss whose gradient does not overflowed.


def _signed_residual_setup():
    """A loss whose gradient is O(1) while the loss is ~1e-4: a signed residual near zero."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
        torch.nn.Linear(256, 1)).eval()
    with torch.no_grad():
        model[4].weight.mul_(20)
        model[2].weight.mul_(3)
        x = torch.randn(64, 20)
        target = model(x)[:, 0] + 1e-4 * torch.randn(64)

    def loss(params, example):
        xi, ti = example
        return torch.func.functional_call(model, params, (xi[None],))[0, 0] - ti

    return loss, {k: v.detach() for k, v in model.named_parameters()}, (x, target)


def _flat(grads):
    return torch.cat([g.reshape(g.shape[0], -1) for _, g in sorted(grads.items())], dim=1)


@pytest.mark.parametrize("transform", ["projected_grads", "per_sample_grads"])
def test_float16_loss_scaling_never_overflows_a_loss_whose_gradient_stays_large(transform):
    # A scale of 2**13 turned this loss's O(1) gradients into float16 infinities: NaN rows.
    loss, params, batch = _signed_residual_setup()
    half_options = tif.GradientOptions(mixed_precision=torch.float16)
    if transform == "projected_grads":
        full = tif.projected_grads(loss, PROJ)(params, batch)
        half = tif.projected_grads(loss, PROJ, options=half_options)(params, batch)
    else:
        full = _flat(tif.per_sample_grads(loss)(params, batch))
        half = _flat(tif.per_sample_grads(loss, options=half_options)(params, batch))
    assert torch.isfinite(half).all()
    per_row = (half - full).norm(dim=1) / full.norm(dim=1)
    assert float(per_row.max()) < 0.02
