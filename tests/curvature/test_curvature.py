"""Curvature-aware TracIn against hand-written float64 references (issue 26).

References are explicit: per-example Jacobians by ``torch.autograd.functional.jacobian``, the
Gauss-Newton matrix as ``J^T (diag(p) - p p^T) J`` summed in a loop, Kronecker products by
``torch.kron``, solves by ``torch.linalg.solve``; nothing shares code with the library.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

import tracinfunc as tif
from tests.reference import flat_loop_grads
from tracinfunc.curvature import Damping, classification_sampler, fit_curvature

EXACT = classification_sampler(exact=True)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)).double().eval()


@pytest.fixture
def setup():
    model = _model()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (16,), generator=g)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.5, name="a")]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, dtype=p.dtype, generator=g))
    ckpts.append(tif.Checkpoint.from_module(model, lr=0.25, name="b"))
    return model, loss, ckpts, (x[:12], y[:12]), (x[12:], y[12:])


def _ggn(model, params, x) -> torch.Tensor:
    """``(1/n) sum_i J_i^T (diag(p_i) - p_i p_i^T) J_i`` with ``J_i`` ``[C, p]`` (sorted names)."""
    names = sorted(params)
    total = 0
    for i in range(x.shape[0]):
        def logits(*flat, row=x[i:i + 1]):
            state = dict(zip(names, flat, strict=True))
            return functional_call(model, state, (row,))[0]

        jac = torch.autograd.functional.jacobian(logits, tuple(params[n] for n in names))
        j = torch.cat([part.reshape(part.shape[0], -1) for part in jac], 1)  # [C, p]
        p = logits(*(params[n] for n in names)).softmax(-1)
        total = total + j.T @ (torch.diag(p) - torch.outer(p, p)) @ j
    return total / x.shape[0]


def test_dense_equals_hand_written_damped_gauss_newton_solve(setup):
    model, loss, ckpts, train, test = setup
    curvature = fit_curvature(loss, ckpts, train, kind="dense", damping=0.1, sampler=EXACT)
    identity = tif.Projection(kind="identity")
    got = tif.preconditioned_test_grads(loss, ckpts, test, curvature, projection=identity)
    store = tif.build_store(loss, ckpts, train, projection=identity, dtype=torch.float64,
                            progress=False)
    expected_scores = 0
    for c, ckpt in enumerate(ckpts):
        params = dict(ckpt.params)
        ggn = _ggn(model, params, train[0])
        torch.testing.assert_close(curvature.estimates[c]["matrix"], ggn)
        g_test = flat_loop_grads(loss, params, test)  # [n_test, p]
        solved = torch.linalg.solve(ggn + 0.1 * torch.eye(ggn.shape[0], dtype=ggn.dtype),
                                    g_test.T).T
        torch.testing.assert_close(got.read_rows(c, 0, 4), solved)
        expected_scores = expected_scores + ckpt.lr * solved @ flat_loop_grads(
            loss, params, train).T
    torch.testing.assert_close(tif.score(store, got, curvature=curvature), expected_scores)


def test_default_damping_is_a_multiple_of_each_checkpoints_mean_eigenvalue(setup):
    _, loss, ckpts, train, _ = setup
    curvature = fit_curvature(loss, ckpts, train, kind="dense", sampler=EXACT,
                              damping=Damping(scale=2.0))
    for c in range(2):
        matrix = curvature.estimates[c]["matrix"]
        assert curvature.damping[c] == pytest.approx(2.0 * matrix.trace() / matrix.shape[0])
    assert curvature.damping[0] != curvature.damping[1]


def _layer_io(model, params, x, y_all):
    """Per layer: inputs x ``[n, d_in]`` and, per class y, output gradients ``[n, C, d_out]``
    by autograd in a loop, with the predicted probabilities ``[n, C]``."""
    n, n_classes = x.shape[0], 3
    xs = [[], []]
    deltas = [[], []]
    probs = []
    for i in range(n):
        h0 = x[i:i + 1]
        z1 = F.linear(h0, params["0.weight"], params["0.bias"]).requires_grad_()
        h1 = torch.tanh(z1)
        z2 = F.linear(h1, params["2.weight"], params["2.bias"])
        probs.append(z2.softmax(-1)[0].detach())
        xs[0].append(h0[0])
        xs[1].append(h1[0].detach())
        per_class = [[], []]
        for label in range(n_classes):
            d1, d2 = torch.autograd.grad(F.cross_entropy(z2, torch.tensor([label])), [z1, z2],
                                         retain_graph=True)
            per_class[0].append(d1[0])
            per_class[1].append(d2[0])
        for layer in range(2):
            deltas[layer].append(torch.stack(per_class[layer]))
    return ([torch.stack(v) for v in xs], [torch.stack(v) for v in deltas],
            torch.stack(probs))


def test_kfac_equals_the_explicit_damped_kronecker_inverse(setup):
    """One meaning of damping (issue 33): ``(S (x) A + lambda I)^-1``, not pi-split factors."""
    model, loss, ckpts, train, test = setup
    lam = 0.05
    curvature = fit_curvature(loss, ckpts, train, kind="kfac", damping=lam, sampler=EXACT)
    params = dict(ckpts[0].params)
    xs, deltas, probs = _layer_io(model, params, train[0], None)
    grads = tif.per_sample_grads(loss)(params, test)
    got = curvature.precondition(0, grads)
    for layer, name in enumerate(("0", "2")):
        xa = torch.cat([xs[layer], torch.ones(xs[layer].shape[0], 1, dtype=torch.float64)], 1)
        a = xa.T @ xa / xa.shape[0]
        s = torch.einsum("nc,nci,ncj->ij", probs, deltas[layer], deltas[layer]) / xa.shape[0]
        eye = torch.eye(s.shape[0] * a.shape[0], dtype=torch.float64)
        explicit = torch.linalg.inv(torch.kron(s, a) + lam * eye)  # row-major vec(G)
        g = torch.cat([grads[f"{name}.weight"], grads[f"{name}.bias"][:, :, None]], 2)
        solved = (g.reshape(g.shape[0], -1) @ explicit.T).reshape(g.shape)
        torch.testing.assert_close(got[f"{name}.weight"], solved[:, :, :-1])
        torch.testing.assert_close(got[f"{name}.bias"], solved[:, :, -1])


def test_ekfac_eigenvalues_are_the_dense_fishers_diagonal_in_the_kfac_basis():
    """EK-FAC refits eigenvalue (o, i) as ``E[(Q_S^T G Q_A)_oi^2]``: the diagonal of the exact
    Fisher in K-FAC's Kronecker eigenbasis ``Q_S (x) Q_A``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    x, y = torch.randn(20, 4, dtype=torch.float64), torch.randint(0, 3, (20,))
    ckpts = [tif.Checkpoint.from_module(model, name="a")]
    once = Damping(1.0)
    dense = fit_curvature(loss, ckpts, (x, y), kind="dense", sampler=EXACT, damping=once)
    ekfac = fit_curvature(loss, ckpts, (x, y), kind="ekfac", sampler=EXACT, damping=once)
    estimate = ekfac.estimates[0]
    # Dense order is sorted names (bias [3], weight [3, 4]); G_aug [3, 5] row-major puts the
    # bias of output o after its 4 weights.
    order = [3 + o * 4 + i if i < 4 else o for o in range(3) for i in range(5)]
    fisher = dense.estimates[0]["matrix"][order][:, order]
    basis = torch.kron(estimate["weight:QS"], estimate["weight:QA"])
    expected = (basis.T @ fisher @ basis).diagonal().reshape(3, 5)
    torch.testing.assert_close(estimate["weight:eigen"], expected)
    assert ekfac.damping[0] == pytest.approx(dense.damping[0])  # same trace, same mean


def test_factored_kronecker_query_equals_preconditioning_then_projecting(setup):
    _, loss, ckpts, train, test = setup
    curvature = fit_curvature(loss, ckpts, train, kind="kfac", sampler=EXACT)
    projection = tif.Projection(dim=6, kind="kronecker", seed=3, per_checkpoint=True)
    factored = tif.preconditioned_test_grads(loss, ckpts, test, curvature,
                                             projection=projection)
    for c, ckpt in enumerate(ckpts):
        params = dict(ckpt.params)
        grads = curvature.precondition(c, tif.per_sample_grads(loss)(params, test))
        project = tif.projection.make_projector(projection.for_checkpoint(ckpt.name),
                                     tif.projection.canonical_layout(params), dtype=torch.float64)
        torch.testing.assert_close(factored.read_rows(c, 0, 4), vmap(project)(grads))


@pytest.mark.parametrize("projection", [
    tif.Projection(dim=8, seed=0),
    tif.Projection(dim=8, kind="sjlt", nnz=2, seed=1),
    tif.Projection(dim=9, kind="kronecker", seed=2, per_checkpoint=True),
], ids=["rademacher", "sjlt", "kronecker-per-checkpoint"])
def test_projected_score_top_k_and_self_influence_equal_explicit_solves(setup, projection):
    _, loss, ckpts, train, test = setup
    k = projection.dim
    store = tif.build_store(loss, ckpts, train, projection=projection, dtype=torch.float64,
                            progress=False)
    tests = tif.build_store(loss, ckpts, test, projection=projection, dtype=torch.float64,
                            progress=False)
    curvature = fit_curvature(loss, ckpts, train, projection=projection, sampler=EXACT)
    expected, influence = 0, 0
    for c, lr in enumerate(store.meta.lrs):
        fisher = curvature.estimates[c]["matrix"]
        damped = fisher + curvature.damping[c] * torch.eye(k, dtype=torch.float64)
        rows, queries = store.read_rows(c, 0, 12), tests.read_rows(c, 0, 4)
        expected = expected + lr * torch.linalg.solve(damped, queries.T).T @ rows.T
        influence = influence + lr * (torch.linalg.solve(damped, rows.T).T * rows).sum(1)
    torch.testing.assert_close(tif.score(store, tests, curvature=curvature), expected)
    values, _ = tif.top_k(store, tests, 3, curvature=curvature)
    torch.testing.assert_close(values, expected.sort(1, descending=True).values[:, :3])
    torch.testing.assert_close(tif.self_influence(store, curvature=curvature), influence)
    plain = tif.score(store, tests)
    assert not torch.allclose(plain, expected)  # the curvature changes the scores


def test_max_examples_fits_on_the_first_inputs_only(setup):
    _, loss, ckpts, train, _ = setup
    head = (train[0][:5], train[1][:5])
    batches = [(train[0][i:i + 3], train[1][i:i + 3]) for i in range(0, 12, 3)]
    cut = fit_curvature(loss, ckpts, batches, kind="dense", sampler=EXACT, max_examples=5)
    whole = fit_curvature(loss, ckpts, head, kind="dense", sampler=EXACT)
    assert cut.info["n_examples"] == 5
    torch.testing.assert_close(cut.estimates[1]["matrix"], whole.estimates[1]["matrix"])


def test_kfac_on_a_conv1d_layer_equals_kfac_on_the_same_linear_layer():
    """HF ``Conv1D`` stores its weight transposed; K-FAC must precondition it as the Linear."""
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    linear = _model()
    conv = nn.Sequential(pytorch_utils.Conv1D(3, 4), nn.Tanh(), nn.Linear(3, 3)).double().eval()
    with torch.no_grad():
        conv[0].weight.copy_(linear[0].weight.T)
        conv[0].bias.copy_(linear[0].bias)
        conv[2].load_state_dict(linear[2].state_dict())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 4, dtype=torch.float64, generator=g), torch.randint(0, 3, (10,))
    results = []
    for model in (linear, conv):
        loss = tif.loss_from_module(model, F.cross_entropy)
        ckpts = [tif.Checkpoint.from_module(model, name="a")]
        curvature = fit_curvature(loss, ckpts, (x, y), kind="kfac", sampler=EXACT)
        grads = tif.per_sample_grads(loss)(dict(ckpts[0].params), (x[:3], y[:3]))
        results.append(curvature.precondition(0, grads))
        projection = tif.Projection(dim=4, kind="kronecker", seed=1)
        factored = tif.preconditioned_test_grads(loss, ckpts, (x[:3], y[:3]), curvature,
                                                 projection=projection)
        project = tif.projection.make_projector(
            projection, tif.projection.canonical_layout(ckpts[0].params), dtype=torch.float64
        )
        torch.testing.assert_close(factored.read_rows(0, 0, 3), vmap(project)(results[-1]))
    torch.testing.assert_close(results[1]["0.weight"], results[0]["0.weight"].transpose(1, 2))
    torch.testing.assert_close(results[1]["0.bias"], results[0]["0.bias"])


@pytest.mark.parametrize("kind", ["dense", "kfac", "ekfac"])
def test_default_damping_uses_the_measured_multiple_for_the_kind(setup, kind):
    _, loss, ckpts, train, _ = setup
    default = fit_curvature(loss, ckpts, train, kind=kind, sampler=EXACT)
    once = fit_curvature(loss, ckpts, train, kind=kind, sampler=EXACT, damping=Damping(1.0))
    scale = tif.curvature.DEFAULT_SCALES[kind]
    assert default.damping == pytest.approx(tuple(scale * d for d in once.damping))
    assert default.info["damping"] == f"{scale:g} x mean eigenvalue"
