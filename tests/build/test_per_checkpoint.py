"""Per-checkpoint projections: each checkpoint draws its own matrix, keyed by its name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.conftest import make_checkpoints, make_data, make_mlp
from tests.jax_helpers import paired_mlp, to_jax_batch


@pytest.fixture(scope="module")
def setup():
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    return loss, make_checkpoints(model), make_data(10), make_data(4, seed=7)


@pytest.mark.parametrize("kind", ["rademacher", "sjlt", "kronecker"])
def test_each_checkpoint_uses_its_own_projection(setup, kind):
    loss, ckpts, train, _ = setup
    projection = tif.Projection(dim=12, seed=3, kind=kind, per_checkpoint=True)
    store = tif.build_store(loss, ckpts, train, projection=projection)
    assert store.projection == projection and store.meta.projection.per_checkpoint
    shared = tif.Projection(dim=12, seed=3, kind=kind)
    for c, ckpt in enumerate(ckpts):
        own = tif.projected_grads(loss, projection.for_checkpoint(ckpt.name))(
            dict(ckpt.params), train)
        assert torch.equal(store.read_rows(c, 0, 10), own.float())  # stored as float32
        plain = tif.projected_grads(loss, shared)(dict(ckpt.params), train)
        assert not torch.allclose(own, plain)  # another matrix than the shared one


def test_shared_projections_keep_their_keys_and_metadata():
    """Adding the option changed nothing for stores that do not use it."""
    shared = tif.Projection(dim=12, seed=3)
    assert shared.for_checkpoint("epoch-1") is shared
    assert "per_checkpoint" not in shared.to_dict() and "checkpoint" not in shared.to_dict()
    per = tif.Projection(dim=12, seed=3, per_checkpoint=True)
    assert tif.Projection.from_dict(per.to_dict()) == per
    one = per.for_checkpoint("epoch-1")
    assert one.checkpoint == "epoch-1" and tif.Projection.from_dict(one.to_dict()) == one
    keys = tif.projection.block_seed
    assert keys(one, "w", (3, 4)) != keys(per.for_checkpoint("epoch-2"), "w", (3, 4))
    assert keys(shared, "w", (3, 4)) != keys(one, "w", (3, 4))


def test_a_projector_needs_the_checkpoint(setup):
    loss, ckpts, train, _ = setup
    per = tif.Projection(dim=12, per_checkpoint=True)
    with pytest.raises(tif.errors.InvalidProjectionError, match="for_checkpoint"):
        tif.projected_grads(loss, per)(dict(ckpts[0].params), train)
    with pytest.raises(tif.errors.InvalidProjectionError, match="checkpoint a name set only by"):
        tif.Projection(dim=12, checkpoint="epoch-1")


def test_test_gradients_must_come_from_checkpoints_of_the_same_names(setup, tmp_path):
    loss, ckpts, train, test = setup
    projection = tif.Projection(dim=12, seed=3, per_checkpoint=True)
    store = tif.build_store(loss, ckpts, train, projection=projection,
                            store=tmp_path / "g.zarr")
    reopened = tif.open_store(tmp_path / "g.zarr")
    assert reopened.projection == projection
    same = tif.build_store(loss, ckpts, test, projection=reopened.projection)
    torch.testing.assert_close(tif.score(reopened, same), tif.score(store, same))
    renamed = [tif.Checkpoint(dict(c.params), lr=c.lr, name=f"other-{i}")
               for i, c in enumerate(ckpts)]
    other = tif.build_store(loss, renamed, test, projection=projection)
    with pytest.raises(
        tif.errors.IncompatibleGradientsError, match="drawn per checkpoint, by name"
    ):
        tif.score(store, other)


def test_independent_projections_average_their_errors_out():
    """With 8 identical checkpoints a shared projection repeats one error 8 times; independent
    ones average 8 errors, so the score error against exact TracIn shrinks (~sqrt(8))."""
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    params = dict(model.named_parameters())
    ckpts = [tif.Checkpoint(params, lr=0.1, name=f"c{i}") for i in range(8)]
    train, test = make_data(30, seed=3), make_data(30, seed=4)

    def scores(projection):
        return tif.score(tif.build_store(loss, ckpts, train, projection=projection),
                         tif.build_store(loss, ckpts, test, projection=projection))

    exact = scores(tif.Projection(kind="identity"))
    errors = {}
    for per_checkpoint in (False, True):
        got = scores(tif.Projection(dim=16, seed=0, per_checkpoint=per_checkpoint))
        errors[per_checkpoint] = float((got - exact).norm() / exact.norm())
    assert errors[True] < 0.6 * errors[False], errors


def test_jax_builds_draw_the_same_per_checkpoint_projections():
    loss, ckpts, jax_loss, jax_ckpts, mapping, train, _ = paired_mlp(n_train=12)
    projection = tif.Projection(dim=12, seed=5, per_checkpoint=True)
    torch_store = tif.build_store(loss, ckpts, train, projection=projection)
    jax_store = tj.build_store(jax_loss, jax_ckpts, to_jax_batch(train), projection=projection,
                               mapping=mapping)
    for c in range(len(ckpts)):
        torch.testing.assert_close(jax_store.read_rows(c, 0, 12), torch_store.read_rows(c, 0, 12),
                                   rtol=1e-5, atol=1e-6)
