"""model_stages and the check that stages reproduce the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tests.conftest import make_convnet, make_data, make_mlp
from tracinfunc.grads.stages import run_stages


class TwoPart(nn.Module):
    """forward = head(body(x)), optionally with a ReLU in forward that no submodule holds."""

    def __init__(self, relu_in_forward=False):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.relu_in_forward = relu_in_forward
        self.double().eval()

    def forward(self, x):
        h = self.body(x)
        return self.head(h.relu() if self.relu_in_forward else h)


def _params(model):
    return {k: v.detach() for k, v in model.named_parameters()}


def test_sequential_children_group_after_each_parameterised_layer():
    stages = tif.model_stages(make_convnet(), F.cross_entropy)
    assert [s.name for s in stages.stages] == ["0+1", "2+3", "4"]
    assert stages.stages[0].param_names == ("0.weight", "0.bias")


@pytest.mark.parametrize("make", [make_mlp, make_convnet], ids=["mlp", "convnet"])
def test_stages_compose_to_the_model(make):
    model = make().eval()
    stages = tif.model_stages(model, F.cross_entropy)
    x = torch.randn(5, 1, 8, 8, dtype=torch.float64) if make is make_convnet else make_data(5)[0]
    got = run_stages(stages, _params(model), x, caller="test")
    torch.testing.assert_close(got, model(x), rtol=0, atol=1e-12)


def test_named_submodules_are_stages():
    model = TwoPart()
    loss = tif.loss_from_module(model, F.cross_entropy)
    stages = tif.model_stages(model, F.cross_entropy, names=["body", "head"])
    batch = make_data(6)
    got = tif.per_sample_grads(loss, stages=stages)(_params(model), batch)
    expected = tif.per_sample_grads(loss)(_params(model), batch)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-12)


def test_stages_that_miss_part_of_forward_are_refused():
    model = TwoPart(relu_in_forward=True)  # the ReLU lives in forward, in no stage
    loss = tif.loss_from_module(model, F.cross_entropy)
    stages = tif.model_stages(model, F.cross_entropy, names=["body", "head"])
    fn = tif.projected_grads(loss, tif.Projection(dim=4), stages=stages)
    with pytest.raises(tif.StageMismatchError, match="do not reproduce the model's output"):
        fn(_params(model), make_data(6))


def test_stages_in_the_wrong_order_are_refused():
    model = TwoPart()
    loss = tif.loss_from_module(model, F.cross_entropy)
    stages = tif.model_stages(model, F.cross_entropy, names=["head", "body"])
    with pytest.raises(tif.StageMismatchError, match=r"stage 0 \(head\) failed"):
        tif.per_sample_grads(loss, stages=stages)(_params(model), make_data(6))


def test_a_criterion_other_than_the_loss_is_refused():
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    stages = tif.model_stages(model, lambda out, y: F.cross_entropy(out, y) * 2)
    with pytest.raises(tif.StageMismatchError, match="reproduce the model's loss"):
        tif.per_sample_grads(loss, stages=stages)(_params(model), make_data(4))


def test_malformed_stage_lists_are_reported():
    model = TwoPart()
    with pytest.raises(TypeError, match="must be an nn.Sequential"):
        tif.model_stages(model, F.cross_entropy)
    with pytest.raises(tif.StageMismatchError, match="has no submodule 'tail'"):
        tif.model_stages(model, F.cross_entropy, names=["body", "tail"])
    with pytest.raises(tif.StageMismatchError, match=r"parameters \['head.weight'"):
        tif.model_stages(model, F.cross_entropy, names=["body"])
    stage = tif.Stage(fn=lambda p, h: h, param_names=("w",))
    with pytest.raises(tif.StageMismatchError, match="belongs to stage 0 and to stage 1"):
        tif.Stages(stages=(stage, stage), criterion=F.cross_entropy)
    with pytest.raises(TypeError, match="non-empty sequence of tracinfunc.Stage"):
        tif.Stages(stages=(), criterion=F.cross_entropy)


def test_selected_parameters_outside_every_stage_are_reported():
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    full = tif.model_stages(model, F.cross_entropy)
    partial = tif.Stages(stages=full.stages[1:], criterion=F.cross_entropy)
    with pytest.raises(tif.ParameterSelectionError, match=r"\['0.weight', '0.bias'\].*no stage"):
        tif.per_sample_grads(loss, stages=partial)(_params(model), make_data(4))


def test_stages_need_inputs_and_targets():
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    stages = tif.model_stages(model, F.cross_entropy)
    x, y = make_data(4)
    with pytest.raises(TypeError, match=r"must be \(inputs, targets\)"):
        tif.per_sample_grads(lambda p, ex: loss(p, (ex["x"], ex["y"])), stages=stages)(
            _params(model), {"x": x, "y": y})


def test_has_aux_with_stages_is_refused_up_front():
    model = make_mlp(dtype=torch.float32).eval()
    stages = tif.model_stages(model, F.cross_entropy)
    loss = tif.loss_from_module(model, F.cross_entropy)
    for transform in (tif.per_sample_grads, lambda *a, **k: tif.projected_grads(
            a[0], tif.Projection(dim=4), **k)):
        with pytest.raises(ValueError, match="has_aux=True cannot be combined with stages="):
            transform(loss, has_aux=True, stages=stages)
