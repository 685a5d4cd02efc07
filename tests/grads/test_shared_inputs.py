"""A call's raw inputs projected once for all its checkpoints (``grads/shared_inputs.py``):
rows bit for bit those of a product per checkpoint, the product computed once per call, and
never reused for memory that changed or is not the batch's."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tests.numpy_projection import project
from tests.reference import loop_grads
from tracinfunc.build import torch as build_torch
from tracinfunc.grads import factorized_batched, shared_inputs
from tracinfunc.grads.shared_inputs import input_product, sharing_inputs

SPEC = tif.Projection(dim=48, seed=3, kind="kronecker")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 5)).eval()


def _checkpoints(model: nn.Module, n: int = 3) -> list[tif.Checkpoint]:
    base = {k: v.detach() for k, v in model.named_parameters()}
    return [tif.Checkpoint({k: v + 0.05 * i for k, v in base.items()}, lr=0.1 * (i + 1),
                           name=f"c{i}") for i in range(n)]


def _data(n: int = 90, batch: int = 10):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)
    return x, y, [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]


def _build(loss, ckpts, data, spec=SPEC, **options):
    return tif.build_store(loss, ckpts, data, projection=spec, progress=False, **options)


def _unshared(monkeypatch) -> None:
    monkeypatch.setattr(build_torch, "sharing_inputs", lambda batch: contextlib.nullcontext())


def _rows(store) -> list[torch.Tensor]:
    return [store.read_rows(c, 0, store.n_train) for c in range(store.n_ckpt)]


@pytest.mark.parametrize("as_list", [True, False])
@pytest.mark.parametrize("per_checkpoint", [False, True])
def test_rows_equal_a_product_per_checkpoint(monkeypatch, as_list, per_checkpoint):
    model = _mlp()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = _checkpoints(model)
    _, _, batches = _data()
    spec = tif.Projection(dim=48, seed=3, kind="kronecker", per_checkpoint=per_checkpoint)
    data = batches if as_list else iter(batches)
    shared = _rows(_build(loss, ckpts, data, spec))
    with monkeypatch.context() as patch:
        _unshared(patch)
        alone = _rows(_build(loss, ckpts, batches if as_list else iter(batches), spec))
    for c, (a, b) in enumerate(zip(shared, alone, strict=True)):
        assert torch.equal(a, b), f"checkpoint {c}"


def test_rows_match_the_brute_force_reference():
    """Every checkpoint's rows, the first layer's input side shared, against a loop of
    ``torch.autograd.grad`` per example times the dense kronecker matrices (float64)."""
    model = _mlp()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = _checkpoints(model)
    x, y, batches = _data(30)
    store = _build(loss, ckpts, batches)
    for c, ckpt in enumerate(ckpts):
        grads = loop_grads(loss, ckpt.params, (x, y))
        expected = np.stack([
            project({n: g[i].double().numpy() for n, g in grads.items()}, SPEC.seed,
                    "kronecker", SPEC.dim) for i in range(len(y))])
        got = store.read_rows(c, 0, len(y)).double().numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())


def test_the_product_is_computed_once_per_call(monkeypatch):
    model = _mlp()
    loss = tif.loss_from_module(model, F.cross_entropy)
    _, _, batches = _data()
    asked, computed = [], []
    real = shared_inputs.input_product

    def spy(x, p):
        scope = shared_inputs._SCOPE.get()
        kept = [] if scope is None else [value[3] for value in scope.products.values()]
        out = real(x, p)
        asked.append(x.shape[-1])
        if all(out is not product for product in kept):
            computed.append(x.shape[-1])
        return out

    monkeypatch.setattr(factorized_batched, "input_product", spy)
    store = _build(loss, _checkpoints(model, 3), batches, batch_size=30)
    assert store.n_train == 90
    # 3 calls x 3 checkpoints x 2 layers ask; the first layer (input width 12, the batch)
    # is computed once a call, the second (width 8, a hidden input) every time
    assert asked.count(12) == 9 and asked.count(8) == 9, asked
    assert computed.count(12) == 3 and computed.count(8) == 9, computed


class TestInputProduct:
    def test_outside_a_block_it_is_the_product(self):
        x, p = torch.randn(6, 4), torch.randn(4, 3)
        assert torch.equal(input_product(x, p), x @ p)
        assert shared_inputs._SCOPE.get() is None

    def test_the_same_leaf_is_projected_once(self):
        x, p = torch.randn(6, 4), torch.randn(4, 3)
        with sharing_inputs((x, torch.arange(6))):
            first = input_product(x, p)
            assert input_product(x.view(6, 1, 4).reshape(6, 4), p) is first
            assert torch.equal(first, x @ p)
        assert shared_inputs._SCOPE.get() is None

    def test_a_write_into_the_leaf_recomputes(self):
        x, p = torch.randn(6, 4), torch.randn(4, 3)
        with sharing_inputs([x]):
            first = input_product(x, p)
            x.mul_(2)  # the loss writing its input between checkpoints
            again = input_product(x, p)
            assert again is not first
            assert torch.equal(again, x @ p)

    def test_a_write_into_p_or_another_p_recomputes(self):
        x, p, q = torch.randn(6, 4), torch.randn(4, 3), torch.randn(4, 3)
        with sharing_inputs(x):
            first = input_product(x, p)
            assert torch.equal(input_product(x, q), x @ q)
            p.add_(1)
            assert torch.equal(input_product(x, p), x @ p)
            assert not torch.equal(x @ p, first)

    @pytest.mark.parametrize("derive", [
        lambda x: x + 0,  # same values, other memory
        lambda x: x[:3],  # part of the leaf
        lambda x: x.t().contiguous().t(),  # same values, not contiguous
        lambda x: x.double(),  # a cast
    ])
    def test_anything_but_the_leaf_is_computed(self, derive):
        x, p = torch.randn(6, 4), torch.randn(4, 3)
        with sharing_inputs({"x": x}):
            first = input_product(x, p)
            other = derive(x)
            p_other = p.double() if other.dtype == torch.float64 else p
            out = input_product(other, p_other)
            assert out is not first
            assert torch.equal(out, other @ p_other)

    def test_a_non_contiguous_leaf_is_not_shared(self):
        x, p = torch.randn(4, 6).t(), torch.randn(4, 3)
        with sharing_inputs([x]):
            assert shared_inputs._SCOPE.get() is None
            assert torch.equal(input_product(x.contiguous(), p), x.contiguous() @ p)

    def test_inference_tensors_are_not_shared(self):
        with torch.inference_mode():
            x = torch.randn(6, 4)
        p = torch.randn(4, 3)
        with sharing_inputs([x]):
            assert shared_inputs._SCOPE.get() is None
            assert torch.equal(input_product(x, p), x @ p)

    def test_blocks_nest_and_restore(self):
        x, y, p = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 3)
        with sharing_inputs([x]):
            outer = input_product(x, p)
            with sharing_inputs([y]):
                assert input_product(x, p) is not outer  # not this block's leaf
            assert input_product(x, p) is outer

    def test_a_failing_block_restores_the_scope(self):
        x = torch.randn(6, 4)
        with pytest.raises(ValueError), sharing_inputs([x]):
            raise ValueError("inside")
        assert shared_inputs._SCOPE.get() is None


def test_a_model_writing_its_batch_in_place_is_refused_as_before(monkeypatch):
    """A model adding to its input in place (the batch, between checkpoints) is refused
    (``build/unchanged.py``) with the same error with or without sharing (the unit tests
    above show a write after a product recomputes it)."""

    class Shifting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _mlp()

        def forward(self, x):
            x.add_(0.25)  # in place, on the batch itself
            return self.inner(x)

    model = Shifting().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = _checkpoints(model, 2)
    with pytest.raises(tif.errors.LossFunctionError, match="wrote into its batch in place"):
        _build(loss, ckpts, _data(40)[2])
    with monkeypatch.context() as patch, \
            pytest.raises(tif.errors.LossFunctionError, match="wrote into its batch in place"):
        _unshared(patch)
        _build(loss, ckpts, _data(40)[2])


def test_an_inference_mode_factor_is_not_shared():
    x = torch.randn(6, 4)
    with torch.inference_mode():
        p = torch.randn(4, 3)
    with sharing_inputs([x]):
        first = input_product(x, p)
        assert input_product(x, p) is not first
        assert torch.equal(first, x @ p)
