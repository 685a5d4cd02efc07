"""Factorised plans are proved once per loss and layout, and never served to another loss."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import tracinfunc as tif
from tests.conftest import make_data, make_mlp
from tests.grads.test_factorized_batched import SPEC, Interacting, params_of, plan_of
from tracinfunc.grads.factorized import factorized_projected_grads
from tracinfunc.grads.factorized_batched import BatchedPathWarning


def test_a_second_function_for_the_same_loss_reuses_the_proved_plan():
    model, batch = make_mlp().eval(), make_data(6)
    loss, params = tif.loss_from_module(model, F.cross_entropy), params_of(model)
    first = factorized_projected_grads(loss, SPEC)
    rows = first(params, batch)
    second = factorized_projected_grads(loss, SPEC)
    again = second(params, batch)
    assert plan_of(second) is plan_of(first)
    assert plan_of(second).batched == "forward"
    torch.testing.assert_close(again, rows, rtol=0, atol=0)
    other_params = {name: value + 0.5 for name, value in params.items()}  # another checkpoint
    expected = factorized_projected_grads(loss, SPEC, batched=False)(other_params, batch)
    torch.testing.assert_close(second(other_params, batch), expected, rtol=1e-10, atol=1e-12)


def test_a_model_changed_in_place_is_proved_again():
    """The same loss object, but its model now mixes examples in a batched forward: a plan
    proved before the change would give wrong rows; the new one falls back, with the reason."""
    model = Interacting().double().eval()
    model.forward = lambda x: model.head(torch.tanh(model.fc(x)))  # no mixing yet
    loss, batch = tif.loss_from_module(model, F.cross_entropy), make_data(6)
    params = params_of(model)
    fn = factorized_projected_grads(loss, SPEC)
    fn(params, batch)
    assert plan_of(fn).batched == "forward"
    del model.forward  # back to Interacting.forward: rows interact
    again = factorized_projected_grads(loss, SPEC)
    with pytest.warns(BatchedPathWarning, match="examples may interact"):
        got = again(params, batch)
    assert plan_of(again) is not plan_of(fn) and plan_of(again).batched == "vmap"
    expected = factorized_projected_grads(loss, SPEC, batched=False)(params, batch)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_another_loss_over_the_same_model_gets_its_own_proof():
    model, batch = make_mlp().eval(), make_data(6)
    params = params_of(model)

    def plain(p, example):
        x, y = example
        return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    def doubled(p, example):
        return 2 * plain(p, example)

    one, two = (factorized_projected_grads(loss, SPEC) for loss in (plain, doubled))
    rows_one, rows_two = one(params, batch), two(params, batch)
    assert plan_of(one) is not plan_of(two)
    torch.testing.assert_close(rows_two, 2 * rows_one, rtol=1e-10, atol=1e-12)


def test_a_model_swapped_behind_the_same_loss_is_re_checked():
    """A callable object whose model attribute is replaced by another of the same shape: the
    layers called differ, so the shared plan is not reused (no error, the right rows)."""

    class Loss:
        def __init__(self, model):
            self.model = model

        def __call__(self, p, example):
            x, y = example
            return F.cross_entropy(functional_call(self.model, p, (x[None],)), y[None])

    loss, batch = Loss(make_mlp().eval()), make_data(6)
    first = factorized_projected_grads(loss, SPEC)
    first(params_of(loss.model), batch)
    loss.model = make_mlp().eval()
    params = params_of(loss.model)
    second = factorized_projected_grads(loss, SPEC)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = second(params, batch)
    assert plan_of(second) is not plan_of(first)
    expected = factorized_projected_grads(loss, SPEC, batched=False)(params, batch)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_a_submodule_swapped_for_one_of_the_same_type_is_proved_again():
    model, batch = make_mlp().eval(), make_data(6)
    loss = tif.loss_from_module(model, F.cross_entropy)
    first = factorized_projected_grads(loss, SPEC)
    first(params_of(model), batch)
    model[0] = torch.nn.Linear(model[0].in_features, model[0].out_features).double()
    params = params_of(model)
    second = factorized_projected_grads(loss, SPEC)
    got = second(params, batch)
    assert plan_of(second) is not plan_of(first)
    expected = factorized_projected_grads(loss, SPEC, batched=False)(params, batch)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("change", ["train mode", "projection", "dtype"])
def test_what_the_plan_depends_on_is_in_its_key(change):
    model, batch = make_mlp().eval(), make_data(6)
    loss, params = tif.loss_from_module(model, F.cross_entropy), params_of(model)
    first = factorized_projected_grads(loss, SPEC)
    first(params, batch)
    spec = SPEC
    if change == "train mode":
        model[1].train()  # a submodule's mode (no parameters) changes
    elif change == "projection":
        spec = tif.Projection(dim=16, seed=4, kind="kronecker")
    else:
        params = {name: value.float() for name, value in params.items()}
        batch = (batch[0].float(), batch[1])
        model.float()
    second = factorized_projected_grads(loss, spec)
    second(params, batch)
    assert plan_of(second) is not plan_of(first)
