"""Layer selection: names, module names, globs, last_layers; layouts cover only the subset."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_checkpoints, make_data, make_mlp
from tests.reference import exact_tracin, loop_grads

PARAMS = {"0.weight": torch.zeros(8, 6), "0.bias": torch.zeros(8),
          "2.weight": torch.zeros(3, 8), "2.bias": torch.zeros(3)}


@pytest.mark.parametrize(("select", "expected"), [
    (None, ["0.weight", "0.bias", "2.weight", "2.bias"]),
    ("2.weight", ["2.weight"]),
    (["2"], ["2.weight", "2.bias"]),                     # a module name
    (["*.bias"], ["0.bias", "2.bias"]),                  # a glob
    (["2.bias", "0.weight"], ["0.weight", "2.bias"]),    # params order, not list order
    (tif.last_layers(1), ["2.weight", "2.bias"]),
    (tif.last_layers(2), ["0.weight", "0.bias", "2.weight", "2.bias"]),
])
def test_selection_resolves_against_parameter_names(select, expected):
    assert list(tif.select_params(PARAMS, select)) == expected


def test_selected_gradients_equal_the_reference_subset():
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    params = {k: v.detach() for k, v in model.named_parameters()}
    batch = make_data(7)
    full = loop_grads(loss, params, batch)
    got = tif.per_sample_grads(loss, options=tif.GradientOptions(select=["2", "0.bias"]))(
        params, batch
    )
    assert list(got) == ["0.bias", "2.weight", "2.bias"]
    for name, g in got.items():
        torch.testing.assert_close(g, full[name], rtol=0, atol=1e-12)


def test_store_layout_and_scores_cover_only_the_selection(mlp_setup):
    loss, ckpts, train, test = mlp_setup
    options = {"projection": tif.Projection(kind="identity"),
               "options": tif.GradientOptions(select=tif.last_layers(1))}
    store = tif.build_store(loss, ckpts, train, **options)
    test_store = tif.build_store(loss, ckpts, test, **options)
    assert [name for name, _ in store.meta.layout] == ["2.bias", "2.weight"]
    assert store.meta.k == 3 + 3 * 8

    def last_layer_loss(last, example):  # the reference differentiates only the last layer
        return loss({**ckpt_params, **last}, example)

    expected = torch.zeros(5, 11, dtype=torch.float64)
    for ckpt in ckpts:
        ckpt_params = dict(ckpt.params)
        last = {k: v for k, v in ckpt.params.items() if k.startswith("2.")}
        expected += exact_tracin(last_layer_loss, [tif.Checkpoint(last, lr=ckpt.lr)], train, test)
    # The store keeps float32 rows; the reference is float64.
    torch.testing.assert_close(tif.score(store, test_store).double(), expected, rtol=1e-5,
                               atol=1e-6)


def test_scoring_against_another_selection_is_refused(mlp_setup):
    loss, ckpts, train, test = mlp_setup
    proj = tif.Projection(dim=8)
    store = tif.build_store(
        loss, ckpts, train, projection=proj, options=tif.GradientOptions(select=tif.last_layers(1))
    )
    whole = tif.build_store(loss, ckpts, test, projection=proj)
    with pytest.raises(
        tif.errors.IncompatibleGradientsError, match="same model and layer selection"
    ):
        tif.score(store, whole)


@pytest.mark.parametrize(("select", "match"), [
    ([], "selects no parameters"),
    (["fc.*"], r"\['fc\.\*'\] match no parameter; the parameters are \[0\.weight"),
    (["2.weight", "head"], r"\['head'\] match no parameter"),
    (tif.last_layers(3), r"last_layers\(3\) asks for more layers than the parameters have \(2"),
])
def test_selecting_no_or_unknown_parameters_is_reported(select, match):
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    fn = (
        tif.per_sample_grads(loss, options=tif.GradientOptions(select=select))
        if select != []
        else None
    )
    with pytest.raises(tif.errors.ParameterSelectionError, match=match):
        if fn is None:
            tif.per_sample_grads(
                loss, options=tif.GradientOptions(select=select)
            )  # refused before any call
        fn(dict(model.named_parameters()), make_data(3))
    ckpts = make_checkpoints(model, n_ckpt=1)
    with pytest.raises(
        tif.errors.ParameterSelectionError, match=match.replace("select_params", "")
    ):
        tif.build_store(loss, ckpts, make_data(3), projection=tif.Projection(dim=4),
                        options=tif.GradientOptions(select=select))


def test_bad_selection_values_are_reported():
    with pytest.raises(tif.errors.ParameterSelectionError, match="positive int"):
        tif.last_layers(0)
    with pytest.raises(TypeError, match="select must be a name or glob pattern"):
        tif.select_params(PARAMS, 3)
