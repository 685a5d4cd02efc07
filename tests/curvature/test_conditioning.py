"""Damped solves whose condition number makes scores meaningless are refused (issue 31, 11).

Condition numbers are checked against explicit float64 matrices: ``torch.linalg.cond`` of
``H + lambda I`` (``"dense"``, ``"projected"``, each block), of the Kronecker product of K-FAC's
damped factors, and of EK-FAC's ``Q diag(eigen + lambda) Q^T``.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.curvature import Damping, classification_sampler, fit_curvature
from tracinfunc.curvature.conditioning import MAX_CONDITION
from tracinfunc.errors import IllConditionedError, InvalidArgumentError

PROJECTION = tif.Projection(dim=64, seed=0)
EXACT = classification_sampler(exact=True)


@pytest.fixture
def setup():
    """p = 27 parameters, 5 examples: every Fisher here is rank-deficient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    ckpts = [tif.Checkpoint.from_module(model, lr=0.5, name="a")]
    store = tif.build_store(loss, ckpts, (x, y), projection=PROJECTION, progress=False)
    tests = tif.build_store(loss, ckpts, (x[:3], y[:3]), projection=PROJECTION, progress=False)
    return loss, ckpts, (x, y), store, tests


def _explicit(curvature, ckpt: int = 0) -> list[torch.Tensor]:
    """Every damped system the curvature solves at ``ckpt``, as an explicit float64 matrix."""
    estimate, damping = curvature.estimates[ckpt], curvature.damping[ckpt]
    if curvature.kind in ("dense", "projected"):
        names = [f"block:{i}" for i in range(len(curvature.blocks))] or ["matrix"]
        return [estimate[n] + damping * torch.eye(estimate[n].shape[0], dtype=torch.float64)
                for n in names]
    out = []
    for layer in curvature.layers:
        w = layer.weight
        if curvature.kind == "ekfac":
            q = torch.kron(estimate[f"{w}:QS"], estimate[f"{w}:QA"])
            out.append(q @ torch.diag(estimate[f"{w}:eigen"].reshape(-1) + damping) @ q.T)
            continue
        a, s = estimate[f"{w}:A"], estimate[f"{w}:S"]
        eye = torch.eye(s.shape[0] * a.shape[0], dtype=torch.float64)
        out.append(torch.kron(s, a) + damping * eye)
    return out


def _explicit_condition(curvature, ckpt: int = 0) -> float:
    return max(float(torch.linalg.cond(m)) for m in _explicit(curvature, ckpt))


@pytest.mark.parametrize("kind", ["dense", "projected", "kfac", "ekfac", "blocks"])
def test_condition_numbers_match_explicit_matrices(setup, kind):
    loss, ckpts, data, _, _ = setup
    blocks = kind == "blocks"
    curvature = fit_curvature(
        loss, ckpts, data, kind="projected" if blocks else kind, sampler=EXACT,
        projection=tif.Projection(kind="identity") if blocks else PROJECTION,
        block_diagonal=blocks)
    for scale in (1.0, 1e-3):
        damped = curvature.with_damping(Damping(scale))
        got = damped.condition_numbers()[0]
        assert got == pytest.approx(_explicit_condition(damped), rel=1e-6)


@pytest.mark.parametrize("kind", ["dense", "projected", "kfac", "ekfac"])
def test_zero_damping_on_a_rank_deficient_fisher_is_refused(setup, kind):
    loss, ckpts, data, _, _ = setup
    curvature = fit_curvature(loss, ckpts, data, kind=kind, projection=PROJECTION)
    with pytest.raises(IllConditionedError,
                       match=r"Curvature.with_damping: .*checkpoint 0 \('a'\) has condition "
                             r"number .* above 8.39e\+06.*with_damping\(") as raised:
        curvature.with_damping(0.0)
    # The suggested damping is the smallest that passes (2 significant digits, rounded up).
    suggested = float(re.search(r"curvature.with_damping\(([^)]+)\)",
                                str(raised.value)).group(1))
    fixed = curvature.with_damping(suggested)
    assert _explicit_condition(fixed) <= MAX_CONDITION * (1 + 1e-6)
    with pytest.raises(IllConditionedError):
        curvature.with_damping(suggested * 0.8)
    scale = float(re.search(r"Damping\(scale=([^)]+)\)", str(raised.value)).group(1))
    assert curvature.with_damping(Damping(scale)).condition_numbers()[0] <= MAX_CONDITION


def test_every_solve_refuses_an_ill_conditioned_curvature(setup):
    """fit_curvature(damping=0.0) keeps the (expensive) fit; its first use refuses it."""
    loss, ckpts, data, store, tests = setup
    curvature = fit_curvature(loss, ckpts, data, projection=PROJECTION, damping=0.0)
    assert curvature.condition_numbers()[0] > MAX_CONDITION
    with pytest.raises(IllConditionedError, match=r"^score: .*condition number"):
        tif.score(store, tests, curvature=curvature)
    with pytest.raises(IllConditionedError, match=r"^self_influence: "):
        tif.self_influence(store, curvature=curvature)
    for kind in ("dense", "kfac", "ekfac"):
        full = fit_curvature(loss, ckpts, data, kind=kind, damping=0.0)
        with pytest.raises(IllConditionedError, match=r"^preconditioned_test_grads: "):
            tif.preconditioned_test_grads(loss, ckpts, data, full, projection=PROJECTION)
    assert tif.score(store, tests, curvature=curvature.with_damping(Damping())).isfinite().all()


def _gaussian_sampler(loss, params, batch, generator):
    """Labels ``f(x) -/+ 1`` weighted 1/2: ``E[g g^T] = E[x x^T]``, the exact Gauss-Newton
    matrix of ``(f - y)^2 / 2`` for a linear ``f`` (full rank with more examples than inputs;
    a softmax Fisher never is: its rows sum to zero over the classes)."""
    x, _ = batch
    f = (x @ params["weight"].T)[:, 0]
    return (torch.cat([x, x]), torch.cat([f - 1, f + 1])), torch.full(
        (2 * x.shape[0],), 0.5, dtype=torch.float64)


def _regression(scale: float = 1.0):
    """Linear least squares in float64, 50 examples of 3 inputs: a full-rank Fisher."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False).double().eval()
    loss = tif.loss_from_module(model, lambda out, y: 0.5 * (out[:, 0] - y).square().sum())
    data = (scale * torch.randn(50, 3, dtype=torch.float64), torch.randn(50, dtype=torch.float64))
    ckpts = [tif.Checkpoint.from_module(model, lr=1.0, name="w")]
    return fit_curvature(loss, ckpts, data, kind="dense", sampler=_gaussian_sampler), data


def test_zero_damping_on_a_well_conditioned_fisher_is_accepted():
    curvature, data = _regression()
    undamped = curvature.with_damping(0.0)
    x = data[0]
    explicit = float(torch.linalg.cond(x.T @ x / 50))
    assert undamped.condition_numbers()[0] == pytest.approx(explicit, rel=1e-9)
    assert explicit < MAX_CONDITION


@pytest.mark.parametrize("bad", [-1.0, -1e-12, float("nan"), float("inf"), -float("inf")])
def test_negative_nan_and_infinite_dampings_are_refused(setup, bad):
    loss, ckpts, data, _, _ = setup
    curvature = fit_curvature(loss, ckpts, data, projection=PROJECTION)
    with pytest.raises(InvalidArgumentError, match="damping must be a finite float >= 0"):
        curvature.with_damping(bad)
    with pytest.raises(InvalidArgumentError, match="damping must be a finite float >= 0"):
        fit_curvature(loss, ckpts, data, projection=PROJECTION, damping=bad)
    with pytest.raises(InvalidArgumentError, match="scale must be a positive finite number"):
        Damping(bad)


def test_a_damping_that_overflows_is_refused():
    curvature, _ = _regression(scale=100.0)
    assert curvature.mean_eigenvalues()[0] > 1  # so 1.7e308 times it overflows
    with pytest.raises(InvalidArgumentError, match="lambda = inf.*must be finite"):
        curvature.with_damping(Damping(1.7e308))


@pytest.mark.parametrize("kind", ["projected", "dense", "kfac", "ekfac"])
def test_huge_damping_scores_near_zero_never_nan(setup, kind):
    loss, ckpts, data, store, tests = setup
    curvature = fit_curvature(loss, ckpts, data, kind=kind, projection=PROJECTION)
    for damping in (1e30, 1e300):
        damped = curvature.with_damping(damping)
        queries = tests if kind == "projected" else tif.preconditioned_test_grads(
            loss, ckpts, (data[0][:3], data[1][:3]), damped, projection=PROJECTION)
        scores = tif.score(store, queries, curvature=damped)
        assert scores.isfinite().all() and scores.abs().max() < 1e-20


def test_a_saved_ill_conditioned_curvature_loads_and_is_refused_at_use(setup, tmp_path,
                                                                       capsys):
    """Nothing is lost: it loads (so it can be re-damped), and every use refuses it, the
    CLI with the same one-line message."""
    from tracinfunc.cli import main

    loss, ckpts, data, store, tests = setup
    curvature = fit_curvature(loss, ckpts, data, projection=PROJECTION, damping=0.0)
    path = tif.save_curvature(curvature, tmp_path / "c.zarr")
    loaded = tif.load_curvature(path)
    assert loaded.digest == curvature.digest
    with pytest.raises(IllConditionedError, match=r"^top_k: "):
        tif.top_k(store, tests, 2, curvature=loaded)
    assert tif.top_k(store, tests, 2, curvature=loaded.with_damping(Damping()))[0].isfinite().all()
    store_path = tmp_path / "s.zarr"
    tif.build_store(loss, ckpts, data, projection=PROJECTION, store=str(store_path),
                    progress=False)
    code = main(["self-influence", str(store_path), "--curvature", str(path),
                 "--output", str(tmp_path / "si.json"), "--quiet"])
    assert code != 0 and not (tmp_path / "si.json").exists()
    assert "condition number" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_curvature_built_with_a_bad_damping_is_refused(setup, bad):
    from dataclasses import replace

    loss, ckpts, data, _, _ = setup
    curvature = fit_curvature(loss, ckpts, data, projection=PROJECTION)
    with pytest.raises(InvalidArgumentError, match="every damping must be a finite float >= 0"):
        replace(curvature, damping=(bad,))


def test_a_non_finite_estimate_is_refused_as_such(setup):
    from dataclasses import replace

    loss, ckpts, data, store, tests = setup
    curvature = fit_curvature(loss, ckpts, data, projection=PROJECTION)
    matrix = curvature.estimates[0]["matrix"].clone()
    matrix[0, 0] = float("nan")
    broken = replace(curvature, estimates=({"matrix": matrix},))
    with pytest.raises(IllConditionedError, match=r"^score: .*holds NaN or infinite values"):
        tif.score(store, tests, curvature=broken)
