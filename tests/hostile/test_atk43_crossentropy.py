"""Outside pass atk43 (black box, docs only): per-example cross-entropy in the batched build path.

Every row is compared with a brute-force reference: a Python loop of ``torch.autograd.grad``
over one example at a time (the criterion on ``outputs [1, ...]`` and ``target [1, ...]``, as
``loss_from_module`` documents), then the library's own projector (``make_projector``) of that
gradient. Tests marked FINDING fail on the commit they were written against (dc6a83b); the
others held and guard regressions (marked HELD).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

import tracinfunc as tif
from tracinfunc.errors import EmptyDataError, NonFiniteGradientError

KINDS = ("identity", "sjlt", "rademacher", "kronecker")
torch.manual_seed(1)
X = torch.randn(10, 6)
Y = torch.randint(0, 3, (10,))


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype).eval()


class Seq3(nn.Module):
    """Logits [b, C=3, d=4]."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 12)

    def forward(self, x):
        return self.lin(x).reshape(x.shape[0], 3, 4)


class Scaled(nn.Module):
    """Logits around 1e30."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(x) * 1e30


class DoubleCE(nn.CrossEntropyLoss):
    def forward(self, a, b):
        return 2.0 * super().forward(a, b)


def projection(kind):
    return tif.Projection(kind="identity") if kind == "identity" else tif.Projection(dim=16, seed=0, kind=kind)


def loop_rows(model, crit, x, y, proj):
    """One autograd.grad per example, projected by the library's projector: [b, k]."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    dtype = next(iter(params.values())).dtype
    project = tif.projection.make_projector(proj, tif.projection.canonical_layout(params), dtype=dtype)
    rows = []
    for i in range(x.shape[0]):
        ps = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        loss = crit(functional_call(model, ps, (x[i : i + 1],)), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(ps.values()))
        rows.append(project(dict(zip(ps, grads, strict=True))))
    return torch.stack(rows)


def lib_rows(model, crit, x, y, proj, batches=None):
    loss = tif.loss_from_module(model, crit)
    ckpts = [tif.Checkpoint.from_module(model, lr=1.0, name="a")]
    store = tif.build_store(loss, ckpts, batches or [(x, y)], projection=proj)
    return store.read_rows(0, 0, x.shape[0])


def check(model, crit, x, y, kind):
    proj = projection(kind)
    ref = loop_rows(model, crit, x, y, proj).double()
    got = lib_rows(model, crit, x, y, proj).double()
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item()), (got - ref).abs().max()


# ---- FINDING: uint8 class targets (valid for F.cross_entropy) fail in the batched path ----

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("crit", [F.cross_entropy, nn.CrossEntropyLoss(reduction="sum")], ids=["fn", "sum"])
def test_uint8_targets_rows_equal_the_loop(kind, crit):
    """FINDING (identity/sjlt/rademacher): F.cross_entropy accepts uint8 ("Long or Byte") class
    indices one example at a time, but build_store's batched cross-entropy raised
    LossFunctionError "gather(): Expected dtype int32/int64 for index", blaming the batch's
    dtypes. All four kinds fail on a fresh module; kind="kronecker" gave the right rows only on a
    module that had already been through several other cross-entropy builds (a path choice
    kept per module?)."""
    check(mlp(), crit, X, Y.to(torch.uint8), kind)


def test_uint8_targets_float64_rows_equal_the_loop():
    """FINDING: as above for a float64 model."""
    check(mlp(torch.float64), F.cross_entropy, X.double(), Y.to(torch.uint8), "identity")


# ---- HELD (regression guards) ----

def _ignored(y, value=-100):
    y = y.clone()
    y[[1, 4]] = value
    return y


W = torch.tensor([0.2, 1.0, 3.0])
CASES = {
    "plain": (mlp, F.cross_entropy, lambda: Y),
    "ignore-100-mean": (mlp, F.cross_entropy, lambda: _ignored(Y)),
    "ignore-100-sum": (mlp, nn.CrossEntropyLoss(reduction="sum"), lambda: _ignored(Y)),
    "custom-ignore": (mlp, nn.CrossEntropyLoss(ignore_index=1, reduction="sum"), lambda: Y),
    "weights-mean": (mlp, nn.CrossEntropyLoss(weight=W), lambda: Y),
    "weights-sum": (mlp, nn.CrossEntropyLoss(weight=W, reduction="sum"), lambda: Y),
    "smoothing+weights": (mlp, nn.CrossEntropyLoss(label_smoothing=0.2, weight=W), lambda: Y),
    "partial-smoothing": (mlp, functools.partial(F.cross_entropy, label_smoothing=0.1), lambda: Y),
    "prob-targets": (mlp, F.cross_entropy, lambda: torch.softmax(torch.randn(10, 3, generator=torch.Generator().manual_seed(2)), -1)),
    "subclass": (mlp, DoubleCE(), lambda: Y),
    "3d-logits-ignore-smoothing": (Seq3, nn.CrossEntropyLoss(label_smoothing=0.1, weight=W),
                                   lambda: torch.randint(0, 3, (10, 4), generator=torch.Generator().manual_seed(3))),
    "huge-logits": (Scaled, F.cross_entropy, lambda: Y),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_held_rows_equal_the_loop(case, kind):
    """HELD: every variant's rows equal the per-example loop (1e-7 relative measured)."""
    make, crit, targets = CASES[case]
    check(make().eval(), crit, X, targets(), kind)


@pytest.mark.parametrize("kind", ["identity", "kronecker"])
def test_held_float64_and_batch_of_one(kind):
    """HELD: a float64 model, and a batch of one example."""
    check(mlp(torch.float64), F.cross_entropy, X.double(), Y, kind)
    check(mlp(), F.cross_entropy, X[:1], Y[:1], kind)


def test_held_empty_batch_between_others_and_all_empty():
    """HELD: an empty batch among others is skipped; only empty data is refused."""
    proj = projection("sjlt")
    got = lib_rows(mlp(), F.cross_entropy, X, Y, proj, batches=[(X[:5], Y[:5]), (X[:0], Y[:0]), (X[5:], Y[5:])])
    assert torch.allclose(got, loop_rows(mlp(), F.cross_entropy, X, Y, proj), atol=1e-6)
    with pytest.raises(EmptyDataError):
        lib_rows(mlp(), F.cross_entropy, X[:0], Y[:0], proj)


def test_held_nan_logits_refused_by_index():
    """HELD: a NaN input row gives NonFiniteGradientError naming example 3."""
    x = X.clone()
    x[3, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"\[3\]"):
        lib_rows(mlp(), F.cross_entropy, x, Y, projection("sjlt"))


def test_held_scores_equal_the_loop():
    """HELD: score over identity rows equals the loop's inner products."""
    m = mlp()
    loss = tif.loss_from_module(m, F.cross_entropy)
    ckpts = [tif.Checkpoint.from_module(m, lr=1.0, name="a")]
    proj = tif.Projection(kind="identity")
    store = tif.build_store(loss, ckpts, [(X, Y)], projection=proj)
    tests = tif.build_store(loss, ckpts, (X[:3], Y[:3]), projection=proj)
    ref = loop_rows(m, F.cross_entropy, X, Y, proj).double()
    assert torch.allclose(tif.score(store, tests).double(), ref[:3] @ ref.T, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_held_soft_targets_with_smoothing_weights_and_3d(kind):
    """HELD: probability targets with label smoothing, class weights, and [b, C, d] logits."""
    g = torch.Generator().manual_seed(4)
    soft = torch.softmax(torch.randn(10, 3, generator=g), -1)
    check(mlp(), nn.CrossEntropyLoss(label_smoothing=0.2, weight=W), X, soft, kind)
    check(Seq3().eval(), F.cross_entropy, X, torch.softmax(torch.randn(10, 3, 4, generator=g), 1), kind)


def test_held_criterion_changed_after_loss_from_module():
    """HELD: the criterion's attributes are read at the call, as a per-example call reads them."""
    m = mlp()
    crit = nn.CrossEntropyLoss()
    loss = tif.loss_from_module(m, crit)
    crit.label_smoothing = 0.3
    proj = projection("sjlt")
    got = tif.build_store(loss, [tif.Checkpoint.from_module(m, lr=1.0, name="a")], [(X, Y)],
                          projection=proj).read_rows(0, 0, 10)
    assert torch.allclose(got, loop_rows(m, crit, X, Y, proj), atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", [5, -1])
def test_held_out_of_range_targets_refused(kind, value):
    """HELD: a class index out of range (5, or -1 that is not ignore_index) is refused."""
    y = Y.clone()
    y[2] = value
    with pytest.raises(tif.errors.LossFunctionError, match="out of bounds"):
        lib_rows(mlp(), F.cross_entropy, X, y, projection(kind))
