"""Optimizer-aware TracIn: preconditioners from a real Adam state against hand computations."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests import numpy_projection as ref
from tests.conftest import make_data, make_mlp
from tests.reference import loop_grads

BETAS, EPS = (0.8, 0.95), 1e-6


def _trained(steps=3, optimizer_class=torch.optim.Adam, seed=0):
    """A float64 MLP, its Adam optimizer after ``steps`` full-batch steps, and its loss."""
    model = make_mlp(seed=seed)
    optimizer = optimizer_class(model.parameters(), lr=0.05, betas=BETAS, eps=EPS)
    x, y = make_data(16, seed=5)
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    model.eval()
    return model, optimizer, tif.loss_from_module(model, F.cross_entropy)


def _hand_adam(g, state, t_before):
    """LESS's Adam direction with torch's bias correction, written out."""
    b1, b2 = BETAS
    m = b1 * state["exp_avg"] + (1 - b1) * g
    v = b2 * state["exp_avg_sq"] + (1 - b2) * g**2
    t = t_before + 1
    return (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + EPS)


def _reference_rows(model, optimizer, loss, batch, transform, kind, dim, seed=0):
    """Loop gradients -> ``transform(g, state, step)`` per parameter -> explicit projection."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    grads = loop_grads(loss, params, batch)  # {name: [n, *shape]}, torch.autograd.grad
    by_name = dict(model.named_parameters())
    rows = []
    for i in range(batch[0].shape[0]):
        example = {}
        for name, g in grads.items():
            state = optimizer.state[by_name[name]]
            example[name] = transform(g[i], state, float(state["step"])).numpy()
        rows.append(ref.project(example, seed, kind, dim))
    return torch.from_numpy(np.stack(rows))


@pytest.mark.parametrize("kind", ["rademacher", "kronecker"])
def test_adam_rows_equal_hand_computation_then_explicit_projection(kind):
    model, optimizer, loss = _trained()
    batch = make_data(5, seed=7)
    precondition = tif.Preconditioner.from_optimizer(optimizer, model, kind="adam")
    fn = tif.projected_grads(loss, tif.Projection(dim=16, seed=0, kind=kind),
                             precondition=precondition)
    params = {name: p.detach() for name, p in model.named_parameters()}
    expected = _reference_rows(model, optimizer, loss, batch, _hand_adam, kind, 16)
    torch.testing.assert_close(fn(params, batch), expected, rtol=1e-10, atol=1e-12)


def test_adam_direction_is_the_update_torch_adam_would_take():
    # Independent of the formula: step a copy of the real optimizer on one example's
    # gradient with lr=1; the parameter moves by minus the preconditioned gradient.
    model, optimizer, loss = _trained(optimizer_class=torch.optim.AdamW)
    example = tuple(leaf[:1] for leaf in make_data(3, seed=9))
    precondition = tif.Preconditioner.from_optimizer(optimizer, model)
    params = {name: p.detach() for name, p in model.named_parameters()}
    grads = {name: g[0] for name, g in loop_grads(loss, params, example).items()}
    model2, optimizer2 = copy.deepcopy((model, optimizer))
    for group in optimizer2.param_groups:
        group["lr"], group["weight_decay"] = 1.0, 0.0
    before = {name: p.detach().clone() for name, p in model2.named_parameters()}
    for name, p in model2.named_parameters():
        p.grad = grads[name].clone()
    optimizer2.step()
    applied = precondition.apply(grads)
    for name, p in model2.named_parameters():
        torch.testing.assert_close(applied[name], before[name] - p.detach(), rtol=1e-9,
                                   atol=1e-12)


def test_trackstar_rows_equal_hand_computation():
    model, optimizer, loss = _trained()
    batch = make_data(4, seed=8)
    precondition = tif.Preconditioner.from_optimizer(optimizer, model, kind="trackstar")
    fn = tif.projected_grads(loss, tif.Projection(dim=12, seed=3), precondition=precondition)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def trackstar(g, state, step):
        return g / (state["exp_avg_sq"] + EPS).sqrt()

    expected = _reference_rows(model, optimizer, loss, batch, trackstar, "rademacher", 12,
                               seed=3)
    torch.testing.assert_close(fn(params, batch), expected, rtol=1e-10, atol=1e-12)


def test_state_dict_file_with_names_and_module_give_the_same_state(tmp_path):
    model, optimizer, _ = _trained()
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    names = tif.precondition.optimizer_param_names(optimizer, model)
    from_file = tif.Preconditioner.load(tmp_path / "optimizer.pt", names)
    from_module = tif.Preconditioner.from_state_dict(optimizer.state_dict(), model)
    live = tif.Preconditioner.from_optimizer(optimizer, model)
    by_name = dict(model.named_parameters())
    for other in (from_file, from_module):
        assert other.names == live.names == tuple(sorted(by_name))
        for name in live.names:
            assert torch.equal(other.state[name].exp_avg_sq,
                               optimizer.state[by_name[name]]["exp_avg_sq"])
            assert other.state[name].step == 3.0
            assert (other.state[name].beta1, other.state[name].eps) == (BETAS[0], EPS)


def test_build_store_records_kind_through_zarr_and_score_refuses_a_preconditioned_test(
        tmp_path):
    model, optimizer, loss = _trained()
    precondition = tif.Preconditioner.from_optimizer(optimizer, model, kind="trackstar")
    ckpts = [tif.Checkpoint.from_module(model, lr=0.1, name="a"),
             tif.Checkpoint.from_module(model, lr=0.2, name="b")]
    train, test = make_data(6, seed=1), make_data(3, seed=2)
    projection = tif.Projection(dim=8, seed=1)
    store = tif.build_store(loss, ckpts, train, projection=projection,
                            store=str(tmp_path / "train.zarr"), dtype=torch.float64,
                            preconditioners=[precondition, precondition])
    reopened = tif.open_store(str(tmp_path / "train.zarr"))
    assert store.meta.preconditioner == reopened.meta.preconditioner == "trackstar"
    assert tif.store.StoreMeta.from_dict(reopened.meta.to_dict()) == reopened.meta
    plain = tif.build_store(loss, ckpts, test, projection=projection, dtype=torch.float64)
    assert plain.meta.preconditioner is None
    # Preconditioned train rows against plain test rows: sum_c lr_c <P g_test, P D g_train>.
    rows = tif.projected_grads(loss, projection, precondition=precondition)
    params = dict(ckpts[0].params)
    expected = 0.3 * tif.projected_grads(loss, projection)(params, test) @ rows(params, train).T
    torch.testing.assert_close(tif.score(reopened, plain), expected)
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="test gradients must be plain"):
        tif.score(plain, store)


def test_old_metadata_reads_as_plain():
    model, _, loss = _trained(steps=1)
    store = tif.build_store(loss, [tif.Checkpoint.from_module(model)], make_data(2),
                            projection=tif.Projection(dim=4))
    data = store.meta.to_dict()
    del data["preconditioner"]
    assert tif.store.StoreMeta.from_dict(data).preconditioner is None


def test_mismatched_parameters_name_the_missing_and_extra_ones():
    model, optimizer, loss = _trained()
    precondition = tif.Preconditioner.from_optimizer(optimizer, model)
    params = {name: p.detach() for name, p in model.named_parameters()}
    fewer = tif.Preconditioner("adam", {k: v for k, v in precondition.state.items()
                                        if k != "2.weight"})
    with pytest.raises(
        tif.errors.MissingParametersError, match=r"selected parameters \['2.weight'\]"
    ):
        tif.projected_grads(loss, tif.Projection(dim=4), precondition=fewer)(
            params, make_data(2))
    # Selecting only what the state covers is fine.
    tif.projected_grads(loss, tif.Projection(dim=4), precondition=fewer,
                        options=tif.GradientOptions(select=["0.weight"]))(params, make_data(2))
    renamed = tif.Preconditioner("adam", {("head." + k): v
                                          for k, v in precondition.state.items()})
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="head.0.bias"):
        tif.build_store(loss, [tif.Checkpoint(params)], make_data(2),
                        projection=tif.Projection(dim=4), preconditioners=[renamed])


def test_names_in_the_wrong_order_give_a_shape_error():
    model, optimizer, loss = _trained()
    names = tif.precondition.optimizer_param_names(optimizer, model)
    swapped = [names[1], names[0], *names[2:]]  # weight <-> bias of the first layer
    precondition = tif.Preconditioner.from_state_dict(optimizer.state_dict(), swapped)
    params = {name: p.detach() for name, p in model.named_parameters()}
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="not in optimizer order"):
        tif.projected_grads(loss, tif.Projection(dim=4), precondition=precondition)(
            params, make_data(2))
    with pytest.raises(tif.errors.InvalidArgumentError, match="4 parameters but 2 names"):
        tif.Preconditioner.from_state_dict(optimizer.state_dict(), names[:2])


def test_module_names_refused_for_several_param_groups():
    model = make_mlp()
    optimizer = torch.optim.Adam([{"params": model[2].parameters()},
                                  {"params": model[0].parameters()}])
    with pytest.raises(tif.errors.InvalidArgumentError, match="2 param groups"):
        tif.Preconditioner.from_state_dict(optimizer.state_dict(), model)
    assert tif.precondition.optimizer_param_names(optimizer, model) == [
        "2.weight", "2.bias", "0.weight", "0.bias"]


def test_bad_arguments():
    model, optimizer, loss = _trained(steps=1)
    with pytest.raises(tif.errors.InvalidArgumentError, match="kind must be one of"):
        tif.Preconditioner.from_optimizer(optimizer, model, kind="sgd")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    F.cross_entropy(model(make_data(2)[0]), make_data(2)[1]).backward()
    sgd.step()
    with pytest.raises(tif.errors.InvalidArgumentError, match="not Adam's exp_avg"):
        tif.Preconditioner.from_optimizer(sgd, model)
    amsgrad, _, _ = _trained(steps=1)
    amsgrad_optimizer = torch.optim.Adam(amsgrad.parameters(), amsgrad=True)
    amsgrad_optimizer.zero_grad()
    F.cross_entropy(amsgrad(make_data(2)[0]), make_data(2)[1]).backward()
    amsgrad_optimizer.step()
    with pytest.raises(tif.errors.InvalidArgumentError, match="amsgrad=True"):
        tif.Preconditioner.from_optimizer(amsgrad_optimizer, amsgrad)
    with pytest.raises(tif.errors.InvalidTypeError, match="precondition must be"):
        tif.projected_grads(loss, tif.Projection(dim=4), precondition="adam")
    precondition = tif.Preconditioner.from_optimizer(optimizer, model)
    with pytest.raises(tif.errors.InvalidArgumentError, match="one tracinfunc.Preconditioner per"):
        tif.build_store(loss, [tif.Checkpoint.from_module(model)] * 2, make_data(2),
                        projection=tif.Projection(dim=4), preconditioners=[precondition])


def test_resuming_a_plain_zarr_build_with_a_preconditioner_is_refused(tmp_path):
    model, optimizer, loss = _trained(steps=1)
    ckpts = [tif.Checkpoint.from_module(model, name="a")]
    projection = tif.Projection(dim=4)
    meta = tif.build_store(loss, ckpts, make_data(4), projection=projection).meta
    writer = tif.store.ZarrWriter(tmp_path / "i.zarr", meta.replace(n_train=0, complete=False),
                            chunk_rows=2, shard_rows=2)
    writer.append(torch.zeros(1, 2, 4), torch.zeros(1, 2))  # an interrupted plain build
    precondition = tif.Preconditioner.from_optimizer(optimizer, model)
    with pytest.raises(
        tif.errors.IncompatibleGradientsError, match="cannot resume.*preconditioner"
    ):
        tif.build_store(loss, ckpts, make_data(4), projection=projection,
                        store=str(tmp_path / "i.zarr"), preconditioners=[precondition])


def test_state_of_a_model_frozen_after_training_is_taken_for_the_trainable_subset():
    """The optimizer stepped every parameter, then the first layer was frozen:
    ``Checkpoint.from_module`` keeps the trainable ones, and the state's subset is used."""
    model, optimizer, _ = _trained()
    model[0].requires_grad_(False)
    loss = tif.loss_from_module(model, F.cross_entropy)
    checkpoint = tif.Checkpoint.from_module(model)
    assert sorted(checkpoint.params) == ["2.bias", "2.weight"]
    precondition = tif.Preconditioner.from_optimizer(optimizer, model)
    assert len(precondition.names) == 4
    subset = tif.Preconditioner("adam", {name: precondition.state[name]
                                         for name in checkpoint.params})
    data, spec = make_data(4), tif.Projection(dim=4)
    for kind in (precondition, precondition.as_factored()):
        store = tif.build_store(loss, [checkpoint], data, projection=spec, preconditioners=[kind])
        expected = tif.build_store(
            loss, [checkpoint], data, projection=spec,
            preconditioners=[subset.as_factored() if kind.factored else subset])
        torch.testing.assert_close(store.read_rows(0, 0, 4), expected.read_rows(0, 0, 4),
                                   rtol=0, atol=0)
