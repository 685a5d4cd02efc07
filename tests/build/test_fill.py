"""torch and JAX builds share one loop (tracinfunc.build.loop): they agree on every edge case."""

from __future__ import annotations

import math

import pytest
import torch

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.jax_helpers import paired_mlp, to_jax_batch

PROJECTION = tif.Projection(dim=16, seed=5)


@pytest.fixture(scope="module")
def paired():
    return paired_mlp(n_train=40)


def _build(paired, frontend, data, **options):
    """``tif.build_store`` or ``tj.build_store`` on the same weights and data."""
    loss, ckpts, jax_loss, jax_ckpts, mapping, _, _ = paired
    if frontend == "torch":
        return tif.build_store(loss, ckpts, data, projection=PROJECTION, **options)
    return tj.build_store(jax_loss, jax_ckpts, data, projection=PROJECTION, mapping=mapping,
                          **options)


def _both_builds(paired, torch_data, jax_data):
    """``[torch outcome, JAX outcome]``: each a store or the TracInFuncError it raised."""
    outcomes = []
    for frontend, data in (("torch", torch_data), ("jax", jax_data)):
        try:
            outcomes.append(_build(paired, frontend, data))
        except tif.TracInFuncError as error:
            outcomes.append(error)
    return outcomes


@pytest.mark.parametrize("lr", [math.nan, math.inf, -math.inf])
def test_non_finite_lr_is_the_same_error(paired, lr):
    params = paired[1][0].params
    jax_params = paired[3][0].params
    with pytest.raises(
        tif.errors.InvalidArgumentError, match=r"Checkpoint: lr must be finite"
    ) as t:
        tif.Checkpoint(params, lr=lr)
    with pytest.raises(
        tif.errors.InvalidArgumentError, match=r"Checkpoint: lr must be finite"
    ) as j:
        tj.Checkpoint(jax_params, lr=lr)
    assert type(t.value) is type(j.value)


@pytest.mark.parametrize("lr", [1e39, 1e-320, 1e-39, 10**400])
def test_lr_outside_float32_is_the_same_error(paired, lr):
    """Scores are float32: 1e39 would make them inf, 1e-320 (0 in float32) all zero."""
    for checkpoint, params in ((tif.Checkpoint, paired[1][0].params),
                               (tj.Checkpoint, paired[3][0].params)):
        with pytest.raises(tif.errors.InvalidArgumentError, match=r"lr must lie in float32"):
            checkpoint(params, lr=lr)
    assert tif.Checkpoint(paired[1][0].params, lr=3e38).lr == 3e38  # in range: kept exactly


@pytest.mark.parametrize("lr", ["0.1", True, None])
def test_non_numeric_lr_is_the_same_error(paired, lr):
    with pytest.raises(tif.errors.InvalidTypeError, match="lr must be a number"):
        tif.Checkpoint(paired[1][0].params, lr=lr)
    with pytest.raises(tif.errors.InvalidTypeError, match="lr must be a number"):
        tj.Checkpoint(paired[3][0].params, lr=lr)


@pytest.mark.parametrize("how", ["empty list", "zero-size batch"])
def test_empty_data_is_the_same_error(paired, how):
    train = paired[5]
    empty = (train[0][:0], train[1][:0])
    torch_data, jax_data = ([], []) if how == "empty list" else (empty, to_jax_batch(empty))
    outcomes = _both_builds(paired, torch_data, jax_data)
    assert all(isinstance(o, tif.errors.EmptyDataError) for o in outcomes), outcomes
    assert all("data holds no examples" in str(o) for o in outcomes)


def test_non_finite_rows_are_the_same_error(paired):
    train = paired[5]
    x = train[0].clone()
    x[3] = math.inf  # a non-finite input gives NaN gradients for example 3 only
    outcomes = _both_builds(paired, (x, train[1]), to_jax_batch((x, train[1])))
    assert all(isinstance(o, tif.errors.NonFiniteGradientError) for o in outcomes), outcomes
    assert all("examples [3]" in str(o) for o in outcomes)


class _Interrupted(Exception):
    pass


def _dies_after(batches, n):
    for i, batch in enumerate(batches):
        if i == n:
            raise _Interrupted
        yield batch


@pytest.mark.parametrize("cut", [1, 3])
def test_resume_is_bit_identical_from_torch_and_from_jax(paired, tmp_path, cut):
    """Both frontends interrupted after ``cut`` batches resume to the uninterrupted rows,
    with batches of 7 straddling the 8-row shards (the straddling batch is recomputed)."""
    train = paired[5]
    torch_batches = [(train[0][i:i + 7], train[1][i:i + 7]) for i in range(0, 40, 7)]
    data = {"torch": torch_batches, "jax": [to_jax_batch(b) for b in torch_batches]}
    for frontend, batches in data.items():
        path = tmp_path / f"{frontend}.zarr"

        def writer(meta, path=path):
            return tif.store.ZarrWriter(path, meta, chunk_rows=8, shard_rows=8)

        # the uninterrupted build of the same target (an in-memory build merges small batches)
        whole = _build(paired, frontend, batches, store=lambda meta, frontend=frontend:
                       tif.store.ZarrWriter(tmp_path / f"whole-{frontend}.zarr", meta,
                                            chunk_rows=8, shard_rows=8))
        with pytest.raises(_Interrupted):
            _build(paired, frontend, _dies_after(batches, cut), store=writer)
        with pytest.raises(tif.errors.IncompleteStoreError):
            tif.open_store(path)
        resumed = _build(paired, frontend, batches, store=writer)
        for c in range(resumed.n_ckpt):
            assert torch.equal(resumed.read_rows(c, 0, 40), whole.read_rows(c, 0, 40))
            assert torch.equal(resumed.read_norms(c, 0, 40), whole.read_norms(c, 0, 40))


def test_resuming_with_less_data_is_the_same_error(paired, tmp_path):
    train = paired[5]
    torch_batches = [(train[0][i:i + 8], train[1][i:i + 8]) for i in range(0, 40, 8)]
    data = {"torch": torch_batches, "jax": [to_jax_batch(b) for b in torch_batches]}
    messages = []
    for frontend, batches in data.items():
        path = tmp_path / f"{frontend}.zarr"

        def writer(meta, path=path):
            return tif.store.ZarrWriter(path, meta, chunk_rows=8, shard_rows=8)

        with pytest.raises(_Interrupted):
            _build(paired, frontend, _dies_after(batches, 3), store=writer)
        with pytest.raises(tif.errors.EmptyDataError) as error:
            _build(paired, frontend, batches[:2], store=writer)
        messages.append(str(error.value).split(": ", 1)[1])
    assert messages[0] == messages[1]  # the same words; only the function name differs
