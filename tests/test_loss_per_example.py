"""ModuleLoss.per_example: one vmapped criterion call, or row by row where it cannot vmap."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
import tracinfunc.loss as loss_module
from tests.conftest import make_data, make_mlp


def _loop(model, criterion, params, x, y):
    """The reference: the loss of each example on its own, through the module."""
    return torch.stack([criterion(torch.func.functional_call(model, params, (x[i:i + 1],)),
                                  y[i:i + 1]) for i in range(len(y))])


def test_per_example_equals_the_loss_of_each_example():
    model = make_mlp().eval()  # float64
    params = dict(model.named_parameters())
    x, y = make_data(9, seed=1)
    loss = tif.loss_from_module(model, F.cross_entropy)
    got = loss.per_example(params, (x, y))
    assert got.shape == (9,)
    torch.testing.assert_close(got, _loop(model, F.cross_entropy, params, x, y))


def test_a_criterion_without_a_batching_rule_goes_row_by_row():
    def criterion(outputs, target):  # .item() has no vmap rule
        return F.cross_entropy(outputs, target) * (1.0 if target.sum().item() >= 0 else 2.0)

    model = make_mlp().eval()
    params = dict(model.named_parameters())
    x, y = make_data(5, seed=2)
    loss = tif.loss_from_module(model, criterion)
    torch.testing.assert_close(loss.per_example(params, (x, y)),
                               _loop(model, criterion, params, x, y))


def _vmapped(criterion, outputs, target):
    """What ``per_example`` computed before its cross-entropy shortcut: one vmapped call."""
    return torch.func.vmap(lambda row, t: criterion(row.unsqueeze(0), t.unsqueeze(0)))(
        outputs, target)


@pytest.mark.parametrize("criterion", [F.cross_entropy, torch.nn.CrossEntropyLoss()],
                         ids=["function", "module"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cross_entropy_rows_equal_the_vmapped_criterion_bit_for_bit(criterion, dtype):
    """The shortcut (``reduction="none"``) gives the vmapped per-row losses and gradients
    exactly: rows built with it are the rows built before it."""
    generator = torch.Generator().manual_seed(3)
    for b, classes in ((1, 10), (700, 10), (33, 1000), (5, 2)):
        logits = (torch.randn(b, classes, generator=generator, dtype=dtype) * 8)
        target = torch.randint(0, classes, (b,), generator=generator)
        got_in, want_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        got = loss_module._cross_entropy_rows(criterion, got_in, target)
        want = _vmapped(criterion, want_in, target)
        assert got is not None
        assert torch.equal(got, want)
        got.sum().backward()
        want.sum().backward()
        assert torch.equal(got_in.grad, want_in.grad)


def test_cross_entropy_rows_leave_other_criteria_and_ignored_targets_to_vmap():
    logits = torch.randn(4, 3)
    target = torch.tensor([0, 1, 2, 1])
    ignored = torch.tensor([0, -100, 2, 1])
    assert loss_module._cross_entropy_rows(F.cross_entropy, logits, ignored) is None
    assert loss_module._cross_entropy_rows(F.nll_loss, logits, target) is None
    assert loss_module._cross_entropy_rows(torch.nn.CrossEntropyLoss(label_smoothing=0.1),
                                           logits, target) is None
    assert loss_module._cross_entropy_rows(torch.nn.CrossEntropyLoss(weight=torch.ones(3)),
                                           logits, target) is None
    assert loss_module._cross_entropy_rows(F.cross_entropy, logits, target.int()) is None
    assert loss_module._cross_entropy_rows(F.cross_entropy, logits[None], target) is None
    # an ignored target alone is a mean over nothing: NaN, as the vmapped call gives it
    model = torch.nn.Linear(3, 3).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    got = loss.per_example(dict(model.named_parameters()), (logits, ignored))
    assert torch.isnan(got[1]) and torch.isfinite(got[[0, 2, 3]]).all()
