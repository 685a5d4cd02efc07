"""build_store: data forms, storage dtypes, and the errors for bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tracinfunc as tif
from tests.conftest import make_data, make_mlp
from tracinfunc.batches import rebatch

PROJ = tif.Projection(dim=16, seed=0)


def _rows(store):
    return torch.stack([store.read_rows(c, 0, store.n_train) for c in range(store.n_ckpt)])


def test_data_forms_give_the_same_store(mlp_setup32):
    loss, ckpts, (x, y), _ = mlp_setup32
    one_batch = tif.build_store(loss, ckpts, (x, y), projection=PROJ)
    as_list = tif.build_store(loss, ckpts, [(x[:15], y[:15]), (x[15:], y[15:])], projection=PROJ)
    as_gen = tif.build_store(loss, ckpts, ((x[i:i + 8], y[i:i + 8]) for i in range(0, 40, 8)),
                             projection=PROJ)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=13)
    as_loader = tif.build_store(loss, ckpts, loader, projection=PROJ)
    as_dict = tif.build_store(
        lambda p, ex: loss(p, (ex["x"], ex["y"])), ckpts, {"x": x, "y": y}, projection=PROJ
    )
    for other in (as_list, as_gen, as_loader, as_dict):
        assert other.shape == (3, 40, 16)
        # Batch size changes float32 matmul blocking, hence a float32 tolerance.
        torch.testing.assert_close(_rows(other), _rows(one_batch), rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=8), batch_size=st.integers(1, 12))
def test_rebatch_keeps_every_example_in_order(sizes, batch_size):
    x = torch.arange(sum(sizes))
    parts, start = [], 0
    for size in sizes:
        parts.append({"x": x[start:start + size], "twice": 2 * x[start:start + size]})
        start += size
    out = list(rebatch(parts, batch_size))
    got = [len(b["x"]) for b in out]
    assert all(n == batch_size for n in got[:-1]) and 0 < got[-1] <= batch_size if got else True
    assert torch.equal(torch.cat([b["x"] for b in out]) if out else x[:0], x)
    assert all(torch.equal(b["twice"], 2 * b["x"]) for b in out)


def test_batch_size_merges_small_batches_without_changing_rows(mlp_setup32):
    loss, ckpts, (x, y), _ = mlp_setup32
    small = [(x[i:i + 3], y[i:i + 3]) for i in range(0, 40, 3)]
    plain = tif.build_store(loss, ckpts, small, projection=PROJ)
    merged = tif.build_store(loss, ckpts, small, projection=PROJ, batch_size=16)
    assert merged.n_train == 40
    torch.testing.assert_close(_rows(merged), _rows(plain), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="batch_size must be a positive int or None, got 0"):
        tif.build_store(loss, ckpts, small, projection=PROJ, batch_size=0)


def test_metadata_describes_the_build(mlp_setup32):
    loss, ckpts, train, _ = mlp_setup32
    store = tif.build_store(loss, ckpts, train, projection=PROJ, dataset_fingerprint="digits-v1")
    meta = store.meta
    assert meta.projection == PROJ and meta.k == 16 and meta.n_train == 40
    assert [c.name for c in meta.checkpoints] == ["epoch-0", "epoch-1", "epoch-2"]
    assert meta.lrs == (0.3, 0.1, 0.05)
    assert meta.checkpoints[0].fingerprint == ckpts[0].fingerprint
    assert [name for name, _ in meta.layout] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert meta.complete and meta.dataset_fingerprint == "digits-v1"
    assert meta.library_version == tif.__version__


def test_unnamed_checkpoints_are_named_by_position(mlp_setup32):
    loss, ckpts, train, _ = mlp_setup32
    plain = [tif.Checkpoint(params=c.params, lr=c.lr) for c in ckpts]
    store = tif.build_store(loss, plain, train, projection=PROJ)
    assert [c.name for c in store.meta.checkpoints] == [f"checkpoint-{i}" for i in range(3)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_storage_scores_close_to_float32(mlp_setup32, dtype):
    loss, ckpts, train, test = mlp_setup32
    ref_store = tif.build_store(loss, ckpts, train, projection=PROJ)
    low_store = tif.build_store(loss, ckpts, train, projection=PROJ, dtype=dtype)
    test_store = tif.build_store(loss, ckpts, test, projection=PROJ)
    assert low_store.dtype == dtype and low_store.read_rows(0, 0, 2).dtype == dtype
    ref, low = tif.score(ref_store, test_store), tif.score(low_store, test_store)
    assert low.dtype == torch.float32
    assert (low - ref).norm() / ref.norm() < 1e-2
    # Norms are taken before the cast, so self-influence stays exact.
    torch.testing.assert_close(tif.self_influence(low_store), tif.self_influence(ref_store))


# --- errors ------------------------------------------------------------------------------


def test_empty_data_is_refused(mlp_setup32):
    loss, ckpts, (x, y), _ = mlp_setup32
    with pytest.raises(tif.errors.EmptyDataError, match="holds no examples"):
        tif.build_store(loss, ckpts, [], projection=PROJ)
    with pytest.raises(tif.errors.EmptyDataError, match="holds no examples"):
        tif.build_store(loss, ckpts, (x[:0], y[:0]), projection=PROJ)


def test_params_that_do_not_fit_the_loss_are_reported(mlp_setup32):
    loss, ckpts, train, _ = mlp_setup32
    renamed = tif.Checkpoint(params={f"model.{k}": v for k, v in ckpts[0].params.items()})
    with pytest.raises(tif.errors.LossFunctionError, match="parameter names"):
        tif.build_store(loss, [renamed], train, projection=PROJ)
    wrong_shape = tif.Checkpoint(params={k: v[..., :2] for k, v in ckpts[0].params.items()})
    # named before any work (stop 42), not as the first example's failure
    with pytest.raises(tif.errors.LossFunctionError,
                       match=r"'0.weight' has shape \[8, 2\] in the parameters passed, but "
                             r"\[8, 6\] in the model"):
        tif.build_store(loss, [wrong_shape], train, projection=PROJ)


def test_checkpoint_missing_or_adding_parameters_is_reported(mlp_setup32):
    # functional_call would take the module's own weight for a missing name: wrong model, no error.
    loss, ckpts, train, _ = mlp_setup32
    params = dict(ckpts[0].params)
    missing = tif.Checkpoint(params={k: v for k, v in params.items() if k != "2.bias"})
    with pytest.raises(tif.errors.LossFunctionError, match=r"missing \['2.bias'\], unknown \[\]"):
        tif.build_store(loss, [missing], train, projection=PROJ)
    with pytest.raises(tif.errors.LossFunctionError, match=r"missing \['2.bias'\]"):
        tif.per_sample_grads(loss)(missing.params, train)
    extra = tif.Checkpoint(params={**params, "head.weight": torch.zeros(2)})
    with pytest.raises(
        tif.errors.LossFunctionError, match=r"missing \[\], unknown \['head.weight'\]"
    ):
        tif.build_store(loss, [extra], train, projection=PROJ)


def test_batchnorm_switched_to_train_mode_is_refused_before_any_call():
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(),
                                torch.nn.Linear(4, 3)).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    before = {name: value.clone() for name, value in loss.buffers.items()}
    model.train()
    with pytest.raises(tif.errors.TrainModeError, match="eval"):
        tif.build_store(loss, [tif.Checkpoint.from_module(model)],
                        make_data(4, dtype=torch.float32), projection=PROJ)
    for name, value in loss.buffers.items():  # the statistics were not updated by a probe call
        assert torch.equal(value, before[name]), name


def test_non_scalar_loss_is_reported(mlp_setup32):
    loss, ckpts, train, _ = mlp_setup32
    with pytest.raises(
        tif.errors.LossFunctionError, match="must return a scalar tensor, got \\[2\\]"
    ):
        tif.build_store(lambda p, ex: loss(p, ex).repeat(2), ckpts, train, projection=PROJ)


def test_non_finite_gradients_name_checkpoint_and_rows(mlp_setup32):
    loss, ckpts, (x, y), _ = mlp_setup32
    x = x.clone()
    x[5, 0] = float("inf")
    with pytest.raises(tif.errors.NonFiniteGradientError, match=r"'epoch-0'.*examples \[5\]"):
        tif.build_store(loss, ckpts, [(x[:3], y[:3]), (x[3:], y[3:])], projection=PROJ)


@pytest.mark.parametrize("mp", [torch.float16, torch.bfloat16])
def test_non_finite_rows_under_mixed_precision_name_it(mp, mlp_setup32):
    """float16 overflows where float32 does not (here: an input of 1e6, inf in a float16
    forward): the error names mixed_precision and the wider options."""
    loss, ckpts, (x, y), _ = mlp_setup32
    x = x.clone()
    x[4] = 1e6 if mp == torch.float16 else float("inf")
    with pytest.raises(tif.errors.NonFiniteGradientError) as caught:
        tif.build_store(loss, ckpts, [(x[:3], y[:3]), (x[3:], y[3:])], projection=PROJ,
                        options=tif.GradientOptions(mixed_precision=mp))
    message = str(caught.value)
    assert "examples [4]" in message and f"mixed_precision={mp}" in message
    assert ("pass mixed_precision=torch.bfloat16" in message) == (mp == torch.float16)
    assert "None (float32)" in message or "mixed_precision=None (float32)" in message


def test_batchnorm_train_mode_loss_is_reported():
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(),
                                torch.nn.Linear(4, 3)).train()
    buffers = dict(model.named_buffers())

    def loss(params, example):
        x, y = example
        out = torch.func.functional_call(model, ({**params, **buffers},), (x[None],))
        return F.cross_entropy(out, y[None])

    ckpt = tif.Checkpoint.from_module(model)
    with pytest.raises(tif.errors.TrainModeError, match="eval mode"):
        tif.build_store(loss, [ckpt], make_data(4, dtype=torch.float32), projection=PROJ)


def test_checkpoints_of_different_models_are_refused(mlp_setup32):
    loss, ckpts, train, _ = mlp_setup32
    other = tif.Checkpoint.from_module(make_mlp(hidden=5, dtype=torch.float32))
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="same model"):
        tif.build_store(loss, [ckpts[0], other], train, projection=PROJ)


def test_bad_arguments_are_reported(mlp_setup32):
    loss, ckpts, train, _ = mlp_setup32
    with pytest.raises(TypeError, match="must be a tracinfunc.Projection"):
        tif.build_store(loss, ckpts, train, projection="rademacher")
    with pytest.raises(TypeError, match="non-empty list of tracinfunc.Checkpoint"):
        tif.build_store(loss, [], train, projection=PROJ)
    with pytest.raises(TypeError, match="pytree of tensors"):
        tif.build_store(loss, ckpts, [[1, 2, 3]], projection=PROJ)
    with pytest.raises(ValueError, match="same leading"):
        tif.build_store(loss, ckpts, (train[0], train[1][:3]), projection=PROJ)
    dup = [tif.Checkpoint(params=ckpts[0].params, name="a")] * 2
    with pytest.raises(ValueError, match="names must be distinct"):
        tif.build_store(loss, dup, train, projection=PROJ)


def test_one_checkpoint_object_is_accepted(mlp_setup32):
    loss, ckpts, train, _ = mlp_setup32
    store = tif.build_store(loss, ckpts[0], train, projection=PROJ)
    assert store.n_ckpt == 1

