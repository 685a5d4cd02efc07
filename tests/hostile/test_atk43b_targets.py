"""Outside pass atk43b (black box, docs only): integer class targets of every dtype, ``ignore_index``
inside uint8's range, NLL on log-softmax models, probability targets, and the curvature paths.

Rows are compared with a brute-force loop of ``torch.autograd.grad`` (one example at a time,
projected by the library's own identity projector); curvature paths with uint8 targets are
compared with the same call on int64 targets (the int64 paths are the library's tested ones).
FINDING tests fail on the commit they were written against; HELD tests guard regressions.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

import tracinfunc as tif
from tests.hostile import _tiny as T

ID = tif.Projection(kind="identity")
CK = T.CKPTS[:1]
Y255 = T.Y.clone()
Y255[[2, 5, 17]] = 255


def mlp(log_softmax=False):
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)] + ([nn.LogSoftmax(-1)] if log_softmax else [])
    return nn.Sequential(*layers).eval()


def loop_rows(model, crit, x, y):
    params = {k: v.detach() for k, v in model.named_parameters()}
    project = tif.projection.make_projector(ID, tif.projection.canonical_layout(params), dtype=torch.float32)
    rows = []
    for i in range(x.shape[0]):
        ps = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        loss = crit(functional_call(model, ps, (x[i : i + 1],)), y[i : i + 1])
        rows.append(project(dict(zip(ps, torch.autograd.grad(loss, list(ps.values())), strict=True))))
    return torch.stack(rows)


def lib_rows(model, crit, x, y):
    loss = tif.loss_from_module(model, crit)
    ckpts = [tif.Checkpoint.from_module(model, lr=1.0, name="a")]
    return tif.build_store(loss, ckpts, [(x[:13], y[:13]), (x[13:], y[13:])], projection=ID).read_rows(0, 0, x.shape[0])


def refined_rows(crit, targets, dtype, kind, solver):
    loss = tif.loss_from_module(T.M, crit)
    data = [(T.X[i : i + 10], targets[i : i + 10].to(dtype)) for i in range(0, 40, 10)]
    cur = tif.fit_curvature(loss, CK, data, kind=kind, damping=0.1, seed=0)
    extra = dict(batches_per_step=2, seed=1) if solver == "neumann" else {}
    cur = cur.with_refinement(data, solver=solver, steps=2, fisher="expected", **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = tif.preconditioned_test_grads(loss, CK, (T.XT, T.YT.to(dtype)), cur, projection=ID)
    return rows.read_rows(0, 0, 5)


# ---- FINDING: the expected Fisher with uint8 targets ----

@pytest.mark.parametrize("solver", ["cg", "neumann"])
@pytest.mark.parametrize("case", ["plain", "ignore255", "nll-ignore255"])
def test_expected_fisher_takes_uint8_targets(case, solver):
    """FINDING: with_refinement(fisher="expected") over uint8 targets (accepted by the criterion,
    by build_store since atk43, by fit_curvature and by the sampled refinement) fails at the
    query with a bare torch RuntimeError "gather(): Expected dtype int32/int64 for index" (not
    even a tracinfunc error), for kfac, ekfac and dense. The answer must equal int64 targets'."""
    crit, targets = {"plain": (F.cross_entropy, T.Y),
                     "ignore255": (nn.CrossEntropyLoss(ignore_index=255), Y255),
                     "nll-ignore255": (nn.NLLLoss(ignore_index=255), Y255)}[case]
    want = refined_rows(crit, targets, torch.int64, "ekfac", solver)
    got = refined_rows(crit, targets, torch.uint8, "ekfac", solver)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-9)


# ---- HELD (regression guards) ----

CASES = {
    "ce-uint8": (mlp, F.cross_entropy, T.Y.to(torch.uint8)),
    "nll-logsoftmax-uint8": (lambda: mlp(True), F.nll_loss, T.Y.to(torch.uint8)),
    "ce-ignore255-uint8-mean": (mlp, nn.CrossEntropyLoss(ignore_index=255), Y255.to(torch.uint8)),
    "ce-ignore255-uint8-sum": (mlp, nn.CrossEntropyLoss(ignore_index=255, reduction="sum"), Y255.to(torch.uint8)),
    "nll-ignore255-uint8": (lambda: mlp(True), nn.NLLLoss(ignore_index=255), Y255.to(torch.uint8)),
    "nll-weight-uint8": (lambda: mlp(True), nn.NLLLoss(weight=torch.tensor([0.3, 1.0, 2.0])), T.Y.to(torch.uint8)),
    "ce-smoothing-uint8": (mlp, nn.CrossEntropyLoss(label_smoothing=0.2), T.Y.to(torch.uint8)),
    "ce-prob-targets": (mlp, F.cross_entropy, torch.softmax(torch.randn(40, 3, generator=torch.Generator().manual_seed(3)), -1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_held_rows_equal_the_loop(case):
    """HELD: build_store rows equal the per-example autograd loop (8.9e-8 measured)."""
    make, crit, y = CASES[case]
    assert torch.allclose(lib_rows(make(), crit, T.X, y), loop_rows(make(), crit, T.X, y), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8])
def test_held_other_int_dtypes_refused_as_the_criterion_refuses_them(dtype):
    """HELD: int32/int16/int8 targets, which F.cross_entropy itself refuses on CPU, are a
    LossFunctionError naming the criterion's complaint (not silently cast)."""
    with pytest.raises(tif.errors.LossFunctionError, match="Long or Byte"):
        lib_rows(mlp(), F.cross_entropy, T.X, T.Y.to(dtype))


@pytest.mark.parametrize("kind", ["kfac", "ekfac", "dense"])
def test_held_fit_and_sampled_refinement_take_uint8(kind):
    """HELD: fit_curvature and the sampled Fisher's refinement give int64's answer for uint8."""
    def rows(dtype):
        data = [(T.X[i : i + 10], Y255[i : i + 10].to(dtype)) for i in range(0, 40, 10)]
        loss = tif.loss_from_module(T.M, nn.CrossEntropyLoss(ignore_index=255))
        cur = tif.fit_curvature(loss, CK, data, kind=kind, damping=0.1, seed=0)
        cur = cur.with_refinement(data, solver="neumann", steps=2, batches_per_step=2, seed=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tif.preconditioned_test_grads(loss, CK, (T.XT, T.YT.to(dtype)), cur, projection=ID).read_rows(0, 0, 5)
    assert torch.equal(rows(torch.uint8), rows(torch.int64))


def test_held_ignored_targets_leave_the_fisher_and_expected_matches_exact_sampler():
    """HELD: targets at ignore_index=255 change neither the expected nor the exact sampled Fisher
    (labels come from the model), and the two agree (6.8e-8 measured, 8 CG steps)."""
    from tracinfunc.curvature.samplers import classification_sampler

    def rows(crit, y, **kw):
        loss = tif.loss_from_module(T.M, crit)
        data = [(T.X[i : i + 10], y[i : i + 10]) for i in range(0, 40, 10)]
        cur = tif.fit_curvature(loss, CK, data, kind="ekfac", damping=0.1, seed=0)
        cur = cur.with_refinement(data, solver="cg", steps=8, tolerance=1e-9, **kw)
        return tif.preconditioned_test_grads(loss, CK, (T.XT, T.YT), cur, projection=ID).read_rows(0, 0, 5).double()

    ign = nn.CrossEntropyLoss(ignore_index=255)
    exp_plain, exp_ign = rows(F.cross_entropy, T.Y, fisher="expected"), rows(ign, Y255, fisher="expected")
    exact = rows(ign, Y255, sampler=classification_sampler(exact=True))
    assert torch.equal(exp_plain, exp_ign)
    assert ((exp_ign - exact).abs().max() / exact.abs().max()).item() < 1e-6
