"""model_stages and the check that stages reproduce the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tests.conftest import make_convnet, make_data, make_mlp
from tests.reference import loop_grads
from tracinfunc.errors import StageMismatchError
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
    got = run_stages(stages, _params(model), x)
    torch.testing.assert_close(got, model(x), rtol=0, atol=1e-12)


def test_named_submodules_are_stages():
    model = TwoPart()
    loss = tif.loss_from_module(model, F.cross_entropy)
    stages = tif.model_stages(model, F.cross_entropy, names=["body", "head"])
    batch = make_data(6)
    got = tif.per_sample_grads(loss, options=tif.GradientOptions(stages=stages))(
        _params(model), batch
    )
    expected = tif.per_sample_grads(loss)(_params(model), batch)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-12)


def test_stages_that_miss_part_of_forward_are_refused():
    model = TwoPart(relu_in_forward=True)  # the ReLU lives in forward, in no stage
    loss = tif.loss_from_module(model, F.cross_entropy)
    stages = tif.model_stages(model, F.cross_entropy, names=["body", "head"])
    fn = tif.projected_grads(
        loss, tif.Projection(dim=4), options=tif.GradientOptions(stages=stages)
    )
    with pytest.raises(tif.errors.StageMismatchError, match="do not reproduce the model's output"):
        fn(_params(model), make_data(6))


def test_stages_in_the_wrong_order_are_refused():
    model = TwoPart()
    loss = tif.loss_from_module(model, F.cross_entropy)
    stages = tif.model_stages(model, F.cross_entropy, names=["head", "body"])
    with pytest.raises(tif.errors.StageMismatchError, match=r"stage 0 \(head\) failed"):
        tif.per_sample_grads(loss, options=tif.GradientOptions(stages=stages))(
            _params(model), make_data(6)
        )


def test_a_criterion_other_than_the_loss_is_refused():
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    stages = tif.model_stages(model, lambda out, y: F.cross_entropy(out, y) * 2)
    with pytest.raises(tif.errors.StageMismatchError, match="reproduce the model's loss"):
        tif.per_sample_grads(loss, options=tif.GradientOptions(stages=stages))(
            _params(model), make_data(4)
        )


def test_malformed_stage_lists_are_reported():
    model = TwoPart()
    with pytest.raises(TypeError, match="must be an nn.Sequential"):
        tif.model_stages(model, F.cross_entropy)
    with pytest.raises(tif.errors.StageMismatchError, match="has no submodule 'tail'"):
        tif.model_stages(model, F.cross_entropy, names=["body", "tail"])
    with pytest.raises(tif.errors.StageMismatchError, match=r"parameters \['head.weight'"):
        tif.model_stages(model, F.cross_entropy, names=["body"])
    stage = tif.grads.Stage(fn=lambda p, h: h, param_names=("w",))
    with pytest.raises(tif.errors.StageMismatchError, match="belongs to stage 0 and to stage 1"):
        tif.grads.Stages(stages=(stage, stage), criterion=F.cross_entropy)
    with pytest.raises(TypeError, match="non-empty sequence of tracinfunc.grads.Stage"):
        tif.grads.Stages(stages=(), criterion=F.cross_entropy)


def test_selected_parameters_outside_every_stage_are_reported():
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    full = tif.model_stages(model, F.cross_entropy)
    partial = tif.grads.Stages(stages=full.stages[1:], criterion=F.cross_entropy)
    with pytest.raises(
        tif.errors.ParameterSelectionError, match=r"\['0.weight', '0.bias'\].*no stage"
    ):
        tif.per_sample_grads(loss, options=tif.GradientOptions(stages=partial))(
            _params(model), make_data(4)
        )


def test_stages_need_inputs_and_targets():
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    stages = tif.model_stages(model, F.cross_entropy)
    x, y = make_data(4)
    with pytest.raises(TypeError, match=r"must be \(inputs, targets\)"):
        tif.per_sample_grads(
            lambda p, ex: loss(p, (ex["x"], ex["y"])), options=tif.GradientOptions(stages=stages)
        )(_params(model), {"x": x, "y": y})


def test_has_aux_with_stages_is_refused_up_front():
    model = make_mlp(dtype=torch.float32).eval()
    stages = tif.model_stages(model, F.cross_entropy)
    loss = tif.loss_from_module(model, F.cross_entropy)
    for transform in (tif.per_sample_grads, lambda *a, **k: tif.projected_grads(
            a[0], tif.Projection(dim=4), **k)):
        with pytest.raises(ValueError, match="has_aux=True cannot be combined with stages="):
            transform(loss, has_aux=True, options=tif.GradientOptions(stages=stages))


class GlueNet(nn.Module):
    """A conv body, then a flatten that only ``forward`` does, then a head (ResNet's shape)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU())
        self.fc = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.flatten(self.body(x), 1))


class TiedLM(nn.Module):
    """Token embedding, a body, and an output head tied to the embedding (GPT-2's shape)."""

    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.body = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.wte(ids))))


def tokens_ce(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_functional_glue_between_submodules_equals_the_plain_path():
    torch.manual_seed(0)
    model = GlueNet().double().eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 1, 6, 6, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (4,), generator=g))
    loss = tif.loss_from_module(model, F.cross_entropy)
    stages = tif.model_stages(model, F.cross_entropy,
                              names=["body", lambda h: torch.flatten(h, 1), "fc"])
    assert len(stages.stages) == 2
    plain = tif.per_sample_grads(loss)(params, batch)
    staged = tif.per_sample_grads(loss, options=tif.GradientOptions(stages=stages))(params, batch)
    for name in plain:
        torch.testing.assert_close(staged[name], plain[name], rtol=1e-10, atol=1e-12)
    with pytest.raises(StageMismatchError):  # without the glue the stages cannot compose
        tif.per_sample_grads(
            loss,
            options=tif.GradientOptions(
                stages=tif.model_stages(model, F.cross_entropy, names=["body", "fc"])
            ),
        )(params, batch)


def test_tied_weights_in_two_stages_sum_their_gradients():
    torch.manual_seed(0)
    model = TiedLM().double().eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    assert "head.weight" not in params  # listed once, as wte.weight
    g = torch.Generator().manual_seed(2)
    batch = (torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g))
    loss = tif.loss_from_module(model, tokens_ce)
    stages = tif.model_stages(model, tokens_ce, names=["wte", "body", lambda h: torch.tanh(h),
                                                       "head"])
    assert stages.tied == {"wte.weight"}
    reference = loop_grads(loss, params, batch)
    staged = tif.per_sample_grads(loss, options=tif.GradientOptions(stages=stages))(params, batch)
    for name in reference:
        torch.testing.assert_close(staged[name], reference[name], rtol=1e-10, atol=1e-12)
    spec = tif.Projection(dim=8, seed=1, kind="sjlt")
    torch.testing.assert_close(
        tif.projected_grads(loss, spec, options=tif.GradientOptions(stages=stages))(params, batch),
        tif.projected_grads(loss, spec)(params, batch),
        rtol=1e-10,
        atol=1e-12,
    )
