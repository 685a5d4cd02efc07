"""Models whose output depends on train mode are refused, with the fix, before any work.

Dropout in train mode makes each example's gradient random (torch's vmap refuses with a raw
"called random operation"); BatchNorm uses batch statistics and updates its buffers. A HF
``Trainer`` leaves the model in train mode after ``.train()``: the LESS walkthrough hit this.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import tracinfunc as tif
from tests.conftest import make_data
from tests.lm_helpers import VOCAB, params_of, tiny_bert, tiny_gpt2, token_batch

PROJ = tif.Projection(dim=8, seed=0)
FIX = r"model\.eval\(\)"


def _dropout_mlp(p: float = 0.5) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Dropout(p), nn.Tanh(), nn.Linear(8, 3)).double()


@pytest.mark.parametrize("layer", [nn.Dropout(0.2), nn.Dropout1d(0.2), nn.AlphaDropout(0.2),
                                   nn.FeatureAlphaDropout(0.2)])
def test_dropout_in_train_mode_is_refused_naming_the_layer(layer):
    model = nn.Sequential(nn.Linear(6, 8), layer, nn.Linear(8, 3)).double().train()
    expected = rf"loss_from_module: .*1 \(dropout p=0.2\).*{FIX}"
    with pytest.raises(tif.errors.TrainModeError, match=expected):
        tif.loss_from_module(model, F.cross_entropy)


def test_dropout_with_p_zero_or_in_eval_mode_is_accepted():
    tif.loss_from_module(_dropout_mlp(p=0.0).train(), F.cross_entropy)
    loss = tif.loss_from_module(_dropout_mlp().eval(), F.cross_entropy)
    ckpt = tif.Checkpoint.from_module(loss.module)
    store = tif.build_store(loss, [ckpt], make_data(4), projection=PROJ)
    assert store.meta.n_train == 4


def test_model_put_back_in_train_mode_is_refused_by_build_store_and_grads():
    model = _dropout_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpt = tif.Checkpoint.from_module(model)
    model.train()  # e.g. Trainer.train() after the loss was made
    with pytest.raises(tif.errors.TrainModeError, match=rf"build_store: .*dropout.*{FIX}"):
        tif.build_store(loss, [ckpt], make_data(4), projection=PROJ)
    # Straight through torch.func: torch's raw "vmap: called random operation" is explained.
    with pytest.raises(tif.errors.TrainModeError, match=FIX):
        tif.per_sample_grads(loss)(dict(ckpt.params), make_data(4))


def test_model_stages_refuse_dropout_in_train_mode():
    with pytest.raises(tif.errors.TrainModeError, match=rf"model_stages: .*dropout.*{FIX}"):
        tif.model_stages(_dropout_mlp().train(), F.cross_entropy)


def test_instance_norm_tracking_statistics_is_refused_and_plain_one_accepted():
    tracking = nn.Sequential(nn.Conv1d(2, 2, 1), nn.InstanceNorm1d(2, track_running_stats=True))
    with pytest.raises(tif.errors.TrainModeError, match="running statistics"):
        tif.loss_from_module(tracking.train(), F.mse_loss)
    plain = nn.Sequential(nn.Conv1d(2, 2, 1), nn.InstanceNorm1d(2))  # same in both modes
    tif.loss_from_module(plain.train(), F.mse_loss)


@pytest.mark.parametrize("make, build, name", [
    (tiny_gpt2, tif.causal_lm_loss, "transformer.drop"),
    (tiny_bert, tif.sequence_classification_loss, "bert.embeddings.dropout"),
    (tiny_gpt2, tif.loss_from_model, "transformer.drop"),
])
def test_hf_model_left_in_train_mode_is_refused(make, build, name):
    model = make().train()
    with pytest.raises(tif.errors.TrainModeError, match=rf"loss_from_model: .*{name} .*{FIX}"):
        build(model)
    build(model.eval())


def test_hf_attention_dropout_without_a_dropout_module_is_refused():
    # Llama applies attention dropout as a float rate inside SDPA: no nn.Dropout to find.
    config = transformers.LlamaConfig(num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, hidden_size=16, intermediate_size=32,
                                      vocab_size=VOCAB, attention_dropout=0.1, bos_token_id=0,
                                      eos_token_id=0)
    model = transformers.LlamaForCausalLM(config).double().train()
    with pytest.raises(tif.errors.TrainModeError, match=rf"attention_dropout=0\.1.*{FIX}"):
        tif.causal_lm_loss(model)
    loss = tif.causal_lm_loss(model.eval())
    batch = token_batch(2, 6)
    rows = tif.per_sample_grads(loss)(params_of(model), batch)
    assert all(torch.isfinite(v).all() for v in rows.values())


def test_rate_only_in_a_hf_config_is_refused_once():
    model = tiny_gpt2().train()
    for layer in model.modules():  # what is left: the config's rates, applied functionally
        if isinstance(layer, nn.Dropout):
            layer.p = 0.0
    expected = r"GPT2LMHeadModel \(config\.attn_pdrop=0\.1\)\. "
    with pytest.raises(tif.errors.TrainModeError, match=expected):
        tif.causal_lm_loss(model)


def test_train_mode_gpt2_after_loss_was_made_is_refused_before_the_first_gradient():
    model = tiny_gpt2()
    loss = tif.causal_lm_loss(model)
    ckpt = tif.Checkpoint.from_module(model)
    model.train()
    expected = rf"build_store: .*transformer\.drop.*{FIX}"
    with pytest.raises(tif.errors.TrainModeError, match=expected):
        tif.build_store(loss, [ckpt], token_batch(2, 6), projection=PROJ)


def test_peft_wrapper_around_an_eval_model_is_accepted():
    # get_peft_model wraps the eval-mode model in a new module, in train mode, sharing its
    # config: no layer runs dropout, so nothing is refused.
    import peft

    model = peft.get_peft_model(tiny_gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"],
                                                             fan_in_fan_out=True))
    assert model.training and not model.base_model.model.training
    tif.causal_lm_loss(model)
    model.train()
    with pytest.raises(tif.errors.TrainModeError, match=r"transformer\.drop \(dropout p=0\.1\)"):
        tif.causal_lm_loss(model)


@pytest.mark.parametrize("call", ["kronecker", "fit_curvature_kfac", "fit_curvature_projected"])
def test_paths_without_vmap_refuse_a_model_put_back_in_train_mode(call):
    # The batched (kronecker, K-FAC) paths run the module's own forward, where dropout would
    # run silently with no vmap to refuse it.
    model = _dropout_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpt = tif.Checkpoint.from_module(model)
    model.train()
    calls = {
        "kronecker": lambda: tif.projected_grads(loss, tif.Projection(dim=16, kind="kronecker"))(
            dict(ckpt.params), make_data(4)),
        "fit_curvature_kfac": lambda: tif.fit_curvature(loss, [ckpt], make_data(8), kind="kfac"),
        "fit_curvature_projected": lambda: tif.fit_curvature(loss, [ckpt], make_data(8),
                                                             projection=PROJ),
    }
    with pytest.raises(tif.errors.TrainModeError, match=rf"1 \(dropout p=0\.5\).*{FIX}"):
        calls[call]()
