"""K-FAC and EK-FAC for ``nn.Conv2d`` (KFC: unfolded patches) and ``nn.Embedding`` (diagonal
``A``: token frequencies), against explicit float64 references (issue 26).

Patches are cut by Python loops over output positions, output gradients taken by autograd per
example and per class, and the damped Kronecker inverse formed by ``torch.kron``; nothing shares
code with the library.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap

import tracinfunc as tif
from tracinfunc.curvature import Damping, classification_sampler, fit_curvature
from tracinfunc.errors import InvalidArgumentError

EXACT = classification_sampler(exact=True)
LAM = 0.05


def _damped(a, s, lam):
    """``(A, S, lambda)``: the factors (``A`` may be a diagonal given as a vector)."""
    return (torch.diag(a) if a.dim() == 1 else a), s, lam


def _solve(g, a, s, lam):
    """``(S (x) A + lambda I)^-1 vec(G)`` for ``G [b, d_out, d_a]``, row-major vec."""
    eye = torch.eye(s.shape[0] * a.shape[0], dtype=torch.float64)
    explicit = torch.linalg.inv(torch.kron(s, a) + lam * eye)
    return (g.reshape(g.shape[0], -1) @ explicit.T).reshape(g.shape)


# --- Conv2d -----------------------------------------------------------------------------------

def _conv_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, kernel_size=2, stride=2, padding=1), nn.Tanh(),
                         nn.Flatten(), nn.Linear(3 * 3 * 3, 3)).double().eval()


def _patches(x, kernel=2, stride=2, padding=1):
    """``[L, C_in kh kw]`` by loops over output positions (row-major), zero padding."""
    padded = F.pad(x, (padding,) * 4)
    rows = []
    for i in range(0, padded.shape[1] - kernel + 1, stride):
        for j in range(0, padded.shape[2] - kernel + 1, stride):
            rows.append(padded[:, i:i + kernel, j:j + kernel].reshape(-1))
    return torch.stack(rows)


def _conv_factors(model, x):
    """Conv layer's ``A = E[(1/L) sum_l xa xa^T]``, ``S = E_y~p[sum_l delta delta^T]``."""
    n = x.shape[0]
    a = s = 0
    for i in range(n):
        xa = torch.cat([_patches(x[i]), torch.ones(9, 1, dtype=torch.float64)], 1)  # [L, 9]
        a = a + xa.T @ xa / xa.shape[0]
        z = model[0](x[i:i + 1]).detach().requires_grad_()
        logits = model[3](model[2](torch.tanh(z)))
        probs = logits.softmax(-1)[0].detach()
        for label in range(3):
            (delta,) = torch.autograd.grad(F.cross_entropy(logits, torch.tensor([label])), z,
                                           retain_graph=True)
            d = delta[0].reshape(3, -1).T  # [L, C_out]
            s = s + probs[label] * d.T @ d
    return a / n, s / n


@pytest.fixture
def conv():
    model = _conv_model()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 2, 4, 4, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (10,), generator=g)
    return model, loss, [tif.Checkpoint.from_module(model, name="a")], (x, y)


def test_conv2d_kfac_equals_the_explicit_kronecker_inverse(conv):
    model, loss, ckpts, (x, y) = conv
    select = ["0.weight", "0.bias"]
    curvature = fit_curvature(loss, ckpts, (x[:8], y[:8]), kind="kfac", damping=LAM,
                              sampler=EXACT, options=tif.GradientOptions(select=select))
    a, s = _conv_factors(model, x[:8])
    torch.testing.assert_close(curvature.estimates[0]["0.weight:A"], a)
    torch.testing.assert_close(curvature.estimates[0]["0.weight:S"], s)
    grads = tif.per_sample_grads(loss, options=tif.GradientOptions(select=select))(
        dict(ckpts[0].params), (x[8:], y[8:]))
    got = curvature.precondition(0, grads)
    g = torch.cat([grads["0.weight"].reshape(2, 3, 8), grads["0.bias"][:, :, None]], 2)
    solved = _solve(g, *_damped(a, s, LAM))
    torch.testing.assert_close(got["0.weight"], solved[:, :, :8].reshape(2, 3, 2, 2, 2))
    torch.testing.assert_close(got["0.bias"], solved[:, :, 8])


def test_conv2d_factored_kronecker_query_equals_preconditioning_then_projecting(conv):
    _, loss, ckpts, (x, y) = conv
    curvature = fit_curvature(loss, ckpts, (x, y), kind="kfac", sampler=EXACT)  # conv + linear
    projection = tif.Projection(dim=6, kind="kronecker", seed=3)
    factored = tif.preconditioned_test_grads(loss, ckpts, (x[:3], y[:3]), curvature,
                                             projection=projection)
    params = dict(ckpts[0].params)
    grads = curvature.precondition(0, tif.per_sample_grads(loss)(params, (x[:3], y[:3])))
    project = tif.projection.make_projector(projection, tif.projection.canonical_layout(params),
                                            dtype=torch.float64)
    torch.testing.assert_close(factored.read_rows(0, 0, 3), vmap(project)(grads))


def _ekfac_matches_dense(loss, ckpts, data, select, order):
    """EK-FAC's eigenvalues are the exact Fisher's diagonal in K-FAC's eigenbasis."""
    once = Damping(1.0)
    dense = fit_curvature(loss, ckpts, data, kind="dense", sampler=EXACT, damping=once,
                          options=tif.GradientOptions(select=select))
    ekfac = fit_curvature(loss, ckpts, data, kind="ekfac", sampler=EXACT, damping=once,
                          options=tif.GradientOptions(select=select))
    estimate = ekfac.estimates[0]
    name = next(n for n in select if n.endswith("weight"))
    q_s = estimate[f"{name}:QS"].contiguous()
    q_a = estimate.get(f"{name}:QA")
    q_a = (torch.eye(len(order) // q_s.shape[0], dtype=torch.float64) if q_a is None
           else q_a.contiguous())
    basis = torch.kron(q_s, q_a)
    fisher = dense.estimates[0]["matrix"][order][:, order]
    expected = (basis.T @ fisher @ basis).diagonal().reshape(estimate[f"{name}:eigen"].shape)
    torch.testing.assert_close(estimate[f"{name}:eigen"], expected)
    assert ekfac.damping[0] == pytest.approx(dense.damping[0])  # same trace, same mean


def test_conv2d_ekfac_eigenvalues_are_the_dense_fishers_diagonal(conv):
    _, loss, ckpts, data = conv
    # Sorted names: 0.bias [3] then 0.weight [3, 8]; G_aug [3, 9] puts bias o after its weights.
    order = [3 + o * 8 + i if i < 8 else o for o in range(3) for i in range(9)]
    _ekfac_matches_dense(loss, ckpts, data, ["0.weight", "0.bias"], order)


# --- Embedding --------------------------------------------------------------------------------

VOCAB, DIM, LENGTH = 6, 3, 4


@pytest.fixture
def embedding():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, DIM, padding_idx=0), nn.Tanh(), nn.Flatten(),
                          nn.Linear(LENGTH * DIM, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (12, LENGTH), generator=g)
    ids[0, 0] = ids[1, 2] = 0  # padding positions
    y = torch.randint(0, 3, (12,), generator=g)
    return model, loss, [tif.Checkpoint.from_module(model, name="a")], (ids, y)


def _embedding_factors(model, ids):
    """``A = diag(E[(1/T) counts])`` ``[V]``, ``S = E_y~p[sum_t delta delta^T]`` (padding
    positions carry no gradient)."""
    n = ids.shape[0]
    a = torch.zeros(VOCAB, dtype=torch.float64)
    s = 0
    for i in range(n):
        for t in range(LENGTH):
            a[ids[i, t]] += 1 / LENGTH
        z = model[0](ids[i:i + 1]).detach().requires_grad_()  # [1, T, d]
        logits = model[3](model[2](torch.tanh(z)))
        probs = logits.softmax(-1)[0].detach()
        keep = (ids[i] != 0).double()[:, None]
        for label in range(3):
            (delta,) = torch.autograd.grad(F.cross_entropy(logits, torch.tensor([label])), z,
                                           retain_graph=True)
            d = delta[0] * keep  # [T, d]
            s = s + probs[label] * d.T @ d
    return a / n, s / n


def test_embedding_kfac_equals_the_explicit_kronecker_inverse(embedding):
    model, loss, ckpts, (ids, y) = embedding
    select = ["0.weight"]
    curvature = fit_curvature(loss, ckpts, (ids[:10], y[:10]), kind="kfac", damping=LAM,
                              sampler=EXACT, options=tif.GradientOptions(select=select))
    a, s = _embedding_factors(model, ids[:10])
    assert curvature.estimates[0]["0.weight:A"].shape == (VOCAB,)  # diagonal, as a vector
    torch.testing.assert_close(curvature.estimates[0]["0.weight:A"], a)
    torch.testing.assert_close(curvature.estimates[0]["0.weight:S"], s)
    grads = tif.per_sample_grads(loss, options=tif.GradientOptions(select=select))(
        dict(ckpts[0].params), (ids[10:], y[10:]))
    g = grads["0.weight"].transpose(1, 2)  # [b, d_out = DIM, d_in = VOCAB]
    solved = _solve(g, *_damped(a, s, LAM))
    got = curvature.precondition(0, grads)
    torch.testing.assert_close(got["0.weight"], solved.transpose(1, 2))
    assert torch.all(got["0.weight"][:, 0] == 0)  # the padding row stays without gradient


def test_embedding_ekfac_eigenvalues_are_the_dense_fishers_diagonal(embedding):
    _, loss, ckpts, data = embedding
    # Dense order: weight [V, d] row-major (v * d + o); G [d, V] row-major is (o, v).
    order = [v * DIM + o for o in range(DIM) for v in range(VOCAB)]
    _ekfac_matches_dense(loss, ckpts, data, ["0.weight"], order)


def test_embedding_kfac_scores_through_a_kronecker_store(embedding):
    """Embeddings take the generic path (ids are not features): precondition, then project."""
    _, loss, ckpts, (ids, y) = embedding
    curvature = fit_curvature(loss, ckpts, (ids, y), kind="kfac", sampler=EXACT)
    projection = tif.Projection(dim=4, kind="kronecker", seed=1)
    rows = tif.preconditioned_test_grads(loss, ckpts, (ids[:3], y[:3]), curvature,
                                         projection=projection)
    params = dict(ckpts[0].params)
    grads = curvature.precondition(0, tif.per_sample_grads(loss)(params, (ids[:3], y[:3])))
    project = tif.projection.make_projector(projection, tif.projection.canonical_layout(params),
                                            dtype=torch.float64)
    torch.testing.assert_close(rows.read_rows(0, 0, 3), vmap(project)(grads))


@pytest.mark.parametrize(("module", "why"), [
    (nn.Conv2d(2, 2, 2, groups=2), "Conv2d with groups=2"),
    (nn.Conv2d(2, 2, 2, padding=1, padding_mode="reflect"), "padding_mode='reflect'"),
])
def test_unsupported_conv2d_options_are_refused_by_name(module, why):
    model = nn.Sequential(module, nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(1, 2, 4, 4))
    loss = tif.loss_from_module(model.eval(), F.cross_entropy)
    data = (torch.randn(4, 2, 4, 4), torch.randint(0, 3, (4,)))
    with pytest.raises(InvalidArgumentError, match=re.escape(why)):
        fit_curvature(loss, [tif.Checkpoint.from_module(model)], data, kind="kfac")


def test_embedding_with_max_norm_is_refused_by_name():
    model = nn.Sequential(nn.Embedding(5, 2, max_norm=1.0), nn.Flatten(), nn.Linear(4, 3))
    loss = tif.loss_from_module(model.eval(), F.cross_entropy)
    data = (torch.randint(0, 5, (4, 2)), torch.randint(0, 3, (4,)))
    with pytest.raises(InvalidArgumentError, match=r"'0.weight' \(Embedding with max_norm"):
        fit_curvature(loss, [tif.Checkpoint.from_module(model)], data, kind="kfac")


# --- Layers reading one input (q, k, v of attention) ------------------------------------------

class _SharedInput(nn.Module):
    """``a`` and ``b`` read the same ``x [b, T, 4]`` (T = 3: the batched rotation); ``c`` one
    row per example (T = 1: the rank-one eigenvalue update)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 2), nn.Linear(4, 2), nn.Linear(6, 3)

    def forward(self, x):
        return self.c((self.a(x) + torch.tanh(self.b(x))).flatten(1))


@pytest.fixture
def shared_input():
    torch.manual_seed(0)
    model = _SharedInput().double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 3, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (10,), generator=g)
    return model, loss, [tif.Checkpoint.from_module(model, name="a")], (x, y)


def test_layers_reading_one_input_each_get_its_exact_factor(shared_input):
    _, loss, ckpts, (x, y) = shared_input
    curvature = fit_curvature(loss, ckpts, (x, y), kind="kfac", sampler=EXACT, damping=LAM,
                              batch_size=4)
    rows = torch.cat([x, torch.ones(10, 3, 1, dtype=torch.float64)], -1)  # [n, T, 5]
    a = sum(rows[i].T @ rows[i] / 3 for i in range(10)) / 10  # E[(1/T) sum_t x_t x_t^T]
    torch.testing.assert_close(curvature.estimates[0]["a.weight:A"], a)
    torch.testing.assert_close(curvature.estimates[0]["b.weight:A"], a)
    assert curvature.estimates[0]["a.weight:A"].data_ptr() != \
        curvature.estimates[0]["b.weight:A"].data_ptr()  # one sum each, never aliased


def test_layers_reading_one_input_ekfac_eigenvalues_are_the_dense_fishers_diagonal(
        shared_input):
    _, loss, ckpts, data = shared_input
    once = Damping(1.0)
    dense = fit_curvature(loss, ckpts, data, kind="dense", sampler=EXACT, damping=once)
    ekfac = fit_curvature(loss, ckpts, data, kind="ekfac", sampler=EXACT, damping=once,
                          batch_size=4)
    estimate, fisher = ekfac.estimates[0], dense.estimates[0]["matrix"]
    sizes = {"a.bias": 2, "a.weight": 8, "b.bias": 2, "b.weight": 8, "c.bias": 3,
             "c.weight": 18}  # the dense layout: names sorted
    offsets = dict(zip(sizes, [sum(list(sizes.values())[:i]) for i in range(len(sizes))],
                       strict=True))
    for name, d_out, d_in in (("a", 2, 4), ("b", 2, 4), ("c", 3, 6)):
        order = [offsets[f"{name}.weight"] + o * d_in + i if i < d_in
                 else offsets[f"{name}.bias"] + o for o in range(d_out) for i in range(d_in + 1)]
        basis = torch.kron(estimate[f"{name}.weight:QS"], estimate[f"{name}.weight:QA"])
        expected = (basis.T @ fisher[order][:, order] @ basis).diagonal().reshape(d_out, -1)
        torch.testing.assert_close(estimate[f"{name}.weight:eigen"], expected)


class _ThreeReaders(nn.Module):
    """``a``, ``b`` and ``d`` read the same ``x [b, T, 4]`` (q, k and v of attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.d = nn.Linear(4, 2), nn.Linear(4, 2), nn.Linear(4, 2)
        self.c = nn.Linear(6, 3)

    def forward(self, x):
        return self.c((self.a(x) * torch.tanh(self.b(x)) + self.d(x)).flatten(1))


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_three_layers_reading_one_input_each_get_its_exact_factor_over_batches(kind):
    # The second and third readers once stored the first batch's shared A term itself, so
    # each later batch added into one tensor twice (k and v of every attention; found in
    # session 49).
    torch.manual_seed(0)
    model = _ThreeReaders().double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, 3, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (10,), generator=g)
    curvature = fit_curvature(loss, [tif.Checkpoint.from_module(model, name="a")], (x, y),
                              kind=kind, sampler=EXACT, damping=LAM, batch_size=3)
    rows = torch.cat([x, torch.ones(10, 3, 1, dtype=torch.float64)], -1)  # [n, T, 5]
    a = sum(rows[i].T @ rows[i] / 3 for i in range(10)) / 10  # E[(1/T) sum_t x_t x_t^T]
    estimate = curvature.estimates[0]
    for name in ("a", "b", "d"):
        torch.testing.assert_close(estimate[f"{name}.weight:A"], a)
    pointers = [estimate[f"{name}.weight:{side}"].data_ptr() for name in "abdc" for side in "AS"]
    assert len(set(pointers)) == len(pointers)  # one sum each, never aliased
