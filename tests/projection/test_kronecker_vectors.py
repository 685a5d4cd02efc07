"""``Projection(kind="kronecker", vectors="kronecker")``: parameters with fewer than two
dimensions projected side by side through a zero-padded near-square view.

References: the NumPy projection (``tests/numpy_projection.py``, explicit ``np.kron`` matrices
in float64, its own view rule written as loops) and per-example gradients from a Python loop
of ``torch.autograd.grad``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import tracinfunc as tif
from tests import numpy_projection as ref
from tests.lm_helpers import hf_loop_grads, params_of, tiny_gpt2, token_batch
from tracinfunc.errors import InvalidProjectionError
from tracinfunc.precondition.optimizer import AdamState
from tracinfunc.projection import canonical_layout, kronecker_factors, make_projector
from tracinfunc.projection.keys import kronecker_view

SPEC = tif.Projection(dim=48, seed=5, kind="kronecker", vectors="kronecker")


@pytest.mark.parametrize("numel", [1, 2, 3, 4, 5, 7, 16, 17, 130, 1000])
def test_view_is_the_smallest_near_square_that_holds_the_vector(numel):
    d_out, d_in = kronecker_view(SPEC, (numel,))
    assert (d_out, d_in) == ref.vector_view(numel)
    assert d_out * d_in >= numel and (d_out - 1) * d_in < numel
    assert d_in * d_in >= numel and (d_in - 1) ** 2 < numel
    assert kronecker_view(SPEC, ()) == (1, 1)
    assert kronecker_view(SPEC, (0,)) is None  # empty: nothing to project
    dense = tif.Projection(dim=48, seed=5, kind="kronecker")
    assert kronecker_view(dense, (numel,)) is None
    assert kronecker_view(dense, (3, 4, 2)) == kronecker_view(SPEC, (3, 4, 2)) == (3, 8)


@pytest.mark.parametrize("split", ["square", "shape"])
@pytest.mark.parametrize("numel", [1, 5, 16, 130])
def test_factors_of_a_vector_equal_the_numpy_reference_bit_for_bit(split, numel):
    spec = tif.Projection(dim=48, seed=5, kind="kronecker", vectors="kronecker", split=split)
    p_out, p_in = kronecker_factors(spec, "ln.bias", (numel,))
    want_out, want_in = ref.kronecker_factors(5, 48, "ln.bias", (numel,), split)
    np.testing.assert_array_equal(p_out.numpy(), want_out)
    np.testing.assert_array_equal(p_in.numpy(), want_in)


def _grads(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    shapes = {"a.weight": (6, 5), "a.bias": (6,), "norm.weight": (130,), "scalar": (),
              "conv.weight": (4, 3, 2, 2), "odd.bias": (7,), "empty.bias": (0,)}
    return {name: torch.randn(shape, generator=g, dtype=dtype) for name, shape in shapes.items()}


@pytest.mark.parametrize("split", ["square", "shape"])
def test_projector_equals_explicit_kronecker_matrices(split):
    spec = tif.Projection(dim=48, seed=5, kind="kronecker", vectors="kronecker", split=split)
    grads = _grads()
    got = make_projector(spec, canonical_layout(grads), dtype=torch.float64)(grads)
    expected = ref.project({k: v.numpy() for k, v in grads.items()}, 5, "kronecker", 48,
                           split=split, vectors="kronecker")
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)
    dense = ref.project({k: v.numpy() for k, v in grads.items()}, 5, "kronecker", 48,
                        split=split)
    assert np.abs(expected - dense).max() > 1e-3  # the option changes the projection


def test_inner_products_are_unbiased_over_seeds():
    """E[<P g, P h>] = <g, h>: the padding's rows meet zeros, the rest is Kronecker +-1."""
    g = torch.randn(130, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    h = g + 0.5 * torch.randn(130, dtype=torch.float64,
                              generator=torch.Generator().manual_seed(2))
    estimates = []
    for seed in range(400):
        spec = tif.Projection(dim=64, seed=seed, kind="kronecker", vectors="kronecker")
        project = make_projector(spec, {"v": (130,)}, dtype=torch.float64)
        estimates.append(float(project({"v": g}) @ project({"v": h})))
    mean, spread = np.mean(estimates), np.std(estimates) / math.sqrt(len(estimates))
    assert abs(mean - float(g @ h)) < 4 * spread


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.b = nn.Linear(7, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.norm(self.a(x))))


def _loop_grads(model, x, y):
    params = dict(model.named_parameters())
    out = {name: [] for name in params}
    for i in range(x.shape[0]):
        loss = nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
        for name, grad in zip(params, torch.autograd.grad(loss, list(params.values())),
                              strict=True):
            out[name].append(grad)
    return {name: torch.stack(v) for name, v in out.items()}


def _explicit(grads, spec):
    """``[n, k]`` from the NumPy projection of every example."""
    n = next(iter(grads.values())).shape[0]
    return np.stack([ref.project({k: v[i].numpy() for k, v in grads.items()}, spec.seed,
                                 "kronecker", spec.dim, split=spec.split,
                                 vectors=spec.vectors) for i in range(n)])


def test_factorised_path_equals_the_loop_reference():
    torch.manual_seed(0)
    model = _Net().double().eval()
    x, y = torch.randn(9, 5, dtype=torch.float64), torch.randint(0, 3, (9,))
    loss = tif.loss_from_module(model, nn.functional.cross_entropy)
    params = {k: v.detach() for k, v in model.named_parameters()}
    rows = tif.projected_grads(loss, SPEC)(params, (x, y))
    expected = _explicit(_loop_grads(model, x, y), SPEC)
    np.testing.assert_allclose(rows.numpy(), expected, rtol=1e-10, atol=1e-12)


def test_factorised_gpt2_all_parameters_equal_the_loop_reference():
    model = tiny_gpt2()
    params = params_of(model)
    batch = token_batch(n=3, length=8)
    rows = tif.projected_grads(tif.causal_lm_loss(model), SPEC)(params, batch)
    expected = _explicit(hf_loop_grads(model, params, batch), SPEC)
    np.testing.assert_allclose(rows.numpy(), expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("factored", [False, True])
def test_preconditioned_rows_equal_the_projection_of_the_preconditioned_loop_grads(factored):
    """Exact TrackStar (the generic path) and its factored form (the factorised path, vectors
    keep the exact diagonal)."""
    torch.manual_seed(1)
    model = _Net().double().eval()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = tif.Preconditioner("trackstar", {
        k: AdamState(torch.zeros_like(v), torch.rand_like(v) + 0.1, 3, 0.9, 0.999, 1e-8)
        for k, v in params.items()})
    if factored:
        state = state.as_factored()
    loss = tif.loss_from_module(model, nn.functional.cross_entropy)
    rows = tif.projected_grads(loss, SPEC, precondition=state)(params, (x, y))
    grads = _loop_grads(model, x, y)
    scaled = [state.apply({k: v[i] for k, v in grads.items()}) for i in range(6)]
    expected = _explicit({k: torch.stack([s[k] for s in scaled]) for k in grads}, SPEC)
    np.testing.assert_allclose(rows.numpy(), expected, rtol=1e-9, atol=1e-12)


def test_spec_checks_and_metadata_round_trip():
    assert SPEC.to_dict()["vectors"] == "kronecker"
    assert "vectors" not in tif.Projection(dim=8, kind="kronecker").to_dict()  # as before
    assert tif.Projection.from_dict(SPEC.to_dict()) == SPEC
    with pytest.raises(InvalidProjectionError, match=r"vectors must be one of 'dense', "
                                                     r"'kronecker' for kind='kronecker'"):
        tif.Projection(dim=8, kind="kronecker", vectors="sparse")
    with pytest.raises(InvalidProjectionError, match=r"got 'kronecker' with kind='rademacher'"):
        tif.Projection(dim=8, vectors="kronecker")
    with pytest.raises(InvalidProjectionError, match=r"unless Projection\(\.\.\., "
                                                     r"vectors='kronecker'\)"):
        kronecker_factors(tif.Projection(dim=8, kind="kronecker"), "b", (5,))
    with pytest.raises(InvalidProjectionError, match="an empty vector has no block"):
        kronecker_factors(SPEC, "b", (0,))


def test_a_store_records_the_option_and_refuses_mixed_queries(tmp_path):
    torch.manual_seed(2)
    model = _Net().double().eval()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    loss = tif.loss_from_module(model, nn.functional.cross_entropy)
    ckpt = tif.Checkpoint.from_module(model, lr=0.1)
    path = tmp_path / "grads.zarr"
    tif.build_store(loss, [ckpt], [(x, y)], projection=SPEC, store=str(path))
    store = tif.GradientStore.open(path)
    assert store.meta.projection == SPEC
    same = tif.build_store(loss, [ckpt], [(x[:2], y[:2])], projection=SPEC)
    expected = same.read_rows(0, 0, 2) @ store.read_rows(0, 0, 8).T * 0.1  # [2, 8]
    # float32 rows
    np.testing.assert_allclose(tif.score(store, same).numpy(), expected.numpy(), rtol=1e-5)
    dense = tif.build_store(loss, [ckpt], [(x[:2], y[:2])],
                            projection=tif.Projection(dim=48, seed=5, kind="kronecker"))
    with pytest.raises(tif.errors.TracInFuncError, match="vectors"):
        tif.score(store, dense)


def test_numpy_strings_become_str():
    spec = tif.Projection(dim=8, kind=np.str_("kronecker"), vectors=np.str_("kronecker"),
                          split=np.str_("shape"))
    assert type(spec.vectors) is str and type(spec.split) is str
    assert "np.str_" not in repr(spec)
    assert spec == tif.Projection(dim=8, kind="kronecker", vectors="kronecker", split="shape")


def test_a_parameter_over_2_32_elements_is_planned_when_projected_side_by_side():
    """Review, session 51: build_store now plans the projection first; a weight of 4.9e9
    elements has only its sides' limits under kind="kronecker" (a dense block's rows stop
    at 2**32)."""
    import pytest

    from tracinfunc.projection import plan_projection

    layout = (("w", (70_000, 70_000)),)
    assert plan_projection(tif.Projection(dim=64, kind="kronecker"), layout).k == 64
    with pytest.raises(tif.errors.InvalidProjectionError, match="2\\*\\*32"):
        plan_projection(tif.Projection(dim=64), layout)
