"""Outside pass (atk40) on the refinement's exact direct solve (`solver=`), from the docs only.

Surface: `Curvature.with_refinement(..., solver="cg"|"direct")`, the kept sampled
Fisher (`H [p, p]` when `p < 2 m`, else `G [m, p]` and a Woodbury solve), its Cholesky factor
counted in `tracinfunc.curvature.fisher.GRADIENT_BUDGET`, the queries' metadata
(`meta.extra["curvature"]["solvers"]`, `["residuals"]`) and `tracinfunc score --refine-steps N
[--refine-examples M] [--refine-solver cg|direct]`.

Written against an earlier design (`solver="auto"|"direct"|"cg"`, default "auto": direct where
the Fisher is kept); adapted to the shipped one (`"cg"` the default, `"direct"` asked for,
`"auto"` refused): each test that relied on "auto" choosing the direct solve now asks for
`solver="direct"`, and each checks the property it checked before.

Every reference is an explicit float64 solve built here with `torch.autograd.grad` loops over
the exact classification sampler (every class weighted by its probability). Tests marked
FINDING fail on the code as written (they assert what the docs promise); tests marked HELD
passed when written and guard regressions.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
import tracinfunc.curvature.fisher as fisher
from tracinfunc.curvature import Damping, classification_sampler
from tracinfunc.errors import IllConditionedError, InvalidArgumentError, TracInFuncError

REPO = Path(__file__).resolve().parents[2]
P = 31  # parameters of the 3-4-3 MLP below
LAM = 0.05


def _setup(n_ckpt: int = 2, dtype: torch.dtype = torch.float64):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(dtype)
    train = (torch.randn(40, 3, dtype=dtype), torch.randint(0, 3, (40,)))
    test = (torch.randn(5, 3, dtype=dtype), torch.randint(0, 3, (5,)))
    checkpoints = []
    for c in range(n_ckpt):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
        checkpoints.append(tif.Checkpoint.from_module(model, lr=0.1 * (c + 1), name=f"c{c}"))
    loss = tif.loss_from_module(model, F.cross_entropy)
    return model, loss, checkpoints, train, test


def _module_at(model, ckpt):
    mod = copy.deepcopy(model).double()
    with torch.no_grad():
        for name, p in mod.named_parameters():
            p.copy_(ckpt.params[name].double())
    named = dict(mod.named_parameters())
    return mod, [named[k] for k in sorted(named)]  # the curvature's layout is sorted by name


def _grads(model, ckpt, x, y):
    """Per-example gradients in the layout's order, float64, by autograd loops: [n, p]."""
    mod, params = _module_at(model, ckpt)
    rows = []
    for i in range(len(x)):
        out = F.cross_entropy(mod(x[i : i + 1].double()), y[i : i + 1])
        rows.append(torch.cat([t.reshape(-1) for t in torch.autograd.grad(out, params)]))
    return torch.stack(rows)


def _fisher(model, ckpt, x, weights=None):
    """The exact-sampler Fisher of inputs x, float64: [p, p] (or weighted by the data's labels)."""
    mod, params = _module_at(model, ckpt)
    rows, ws = [], []
    for i in range(len(x)):
        probs = mod(x[i : i + 1].double()).softmax(-1).detach()[0]
        for c in range(len(probs)):
            out = F.cross_entropy(mod(x[i : i + 1].double()), torch.tensor([c]))
            rows.append(torch.cat([t.reshape(-1) for t in torch.autograd.grad(out, params)]))
            ws.append(probs[c])
    g, w = torch.stack(rows), torch.stack(ws)
    return g.T @ (w[:, None] * g) / w.sum()


def _solve(h, g, lam):
    return torch.linalg.solve(h + lam * torch.eye(h.shape[0], dtype=h.dtype), g.T).T


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def world():
    model, loss, checkpoints, train, test = _setup()
    curvature = tif.fit_curvature(loss, checkpoints, train, kind="ekfac",
                                  sampler=classification_sampler(exact=True), damping=LAM)
    return model, loss, checkpoints, train, test, curvature


@pytest.fixture
def budget(monkeypatch):
    def set_to(value):
        monkeypatch.setattr(fisher, "GRADIENT_BUDGET", value)
    return set_to


def _query(loss, checkpoints, test, curvature):
    return tif.preconditioned_test_grads(loss, checkpoints, test, curvature,
                                         projection=tif.Projection(kind="identity"))


def _mixed_sign(loss, params, batch, generator):
    x, y = batch
    return (x, y), torch.where(torch.arange(len(x)) % 2 == 0, 1.0, -0.5).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# FINDINGS (fail on the code as written)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("solver", "budget"), [("direct", None), ("cg", None), ("cg", 0)],
                         ids=["direct", "cg-kept", "cg-functional"])
@pytest.mark.parametrize("max_examples", [None, 4])
def test_refinement_condition_rule_uses_the_sampled_fisher(world, max_examples, solver, budget,
                                                           monkeypatch):
    """FINDING. Docs: refinement refuses "a zero or tiny damping (the sampled Fisher is
    rank-deficient: (s_max + lambda) / lambda must stay under MAX_CONDITION)". Refining on data
    whose sampled Fisher is larger than the fitted estimate (inputs x100) at lambda = 1e-6 gives
    a refined system with kappa 4e7 (all 40 rows) / 4e8 (first 4 rows), above MAX_CONDITION =
    8.4e6; it is accepted and solved without an error or a warning (the rule looks at the fitted
    estimate's largest eigenvalue only)."""
    model, loss, checkpoints, train, test, curvature = world
    big = (train[0] * 100, train[1])
    n = max_examples or 40
    h = _fisher(model, checkpoints[1], big[0][:n])
    kappa = ((torch.linalg.eigvalsh(h).max() + 1e-6) / 1e-6).item()
    assert kappa > tif.curvature.MAX_CONDITION  # the premise: the refined system is refused
    if budget is not None:  # (lead) the functional product's rougher estimate refuses too
        monkeypatch.setattr(tif.curvature.fisher, "GRADIENT_BUDGET", budget)
    with pytest.raises(IllConditionedError, match="sampled Fisher"):
        refined = curvature.with_damping(1e-6).with_refinement(
            big, sampler=classification_sampler(exact=True), max_examples=max_examples,
            solver=solver)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _query(loss, checkpoints, test, refined)


def test_refinement_condition_rule_on_a_small_sample_of_the_fitting_data(world):
    """FINDING (the realistic form of the one above). Refining on the first 2 examples of the
    fitting data at 1.01x the smallest damping the refusal itself suggests: the refined
    system's kappa is 1.5e7 at both checkpoints, above MAX_CONDITION = 8.4e6, and nothing is
    refused or warned."""
    model, loss, checkpoints, train, test, curvature = world
    sampler = classification_sampler(exact=True)
    refined = curvature.with_refinement(train, sampler=sampler, max_examples=2, solver="direct")
    with pytest.raises(IllConditionedError) as info:
        refined.with_damping(1e-12)
    lam = 1.01 * float(re.findall(r"with_damping\(([0-9.e+-]+)\)", str(info.value))[0])
    kappas = [(torch.linalg.eigvalsh(_fisher(model, ck, train[0][:2])).max().item() + lam) / lam
              for ck in checkpoints]
    assert min(kappas) > tif.curvature.MAX_CONDITION  # the premise
    with pytest.raises(IllConditionedError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _query(loss, checkpoints, test, refined.with_damping(lam))


def _zero_weights(loss, params, batch, generator):
    x, y = batch
    return (x, y), torch.zeros(len(x), dtype=x.dtype)


def _cancelling_weights(loss, params, batch, generator):
    x, y = batch
    return (x, y), torch.where(torch.arange(len(x)) % 2 == 0, 1.0, -1.0).to(x.dtype)


@pytest.mark.parametrize("max_examples", [None, 4])
@pytest.mark.parametrize("sampler", [_zero_weights, _cancelling_weights], ids=["zero", "sum0"])
@pytest.mark.parametrize("solver", ["direct", "cg"])
def test_weights_summing_to_zero_are_named(world, sampler, max_examples, solver):
    """FINDING. A sampler whose weights sum to 0 makes H = G^T diag(w) G / sum w a 0/0. The
    refusal is a NonFiniteGradientError blaming the data: "its per-example gradients are not
    finite; check the refinement data and the model" (the gradients are finite; the weights
    are the cause). Expected: an error naming the sampler's weights and their sum."""
    _, loss, checkpoints, train, test, curvature = world
    refined = curvature.with_refinement(train, sampler=sampler, max_examples=max_examples,
                                        solver=solver)
    with pytest.raises(TracInFuncError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _query(loss, checkpoints, test, refined)
    assert "weight" in str(info.value).lower()


def _weights_one_too_many(loss, params, batch, generator):
    x, y = batch
    return (x, y), torch.ones(len(x) + 1, dtype=x.dtype)


def _weights_column(loss, params, batch, generator):
    x, y = batch
    return (x, y), torch.ones(len(x), 1, dtype=x.dtype)


def _weights_list(loss, params, batch, generator):
    x, y = batch
    return (x, y), [1.0] * len(x)


@pytest.mark.parametrize("solver", ["direct", "cg"])
@pytest.mark.parametrize("max_examples", [None, 4])
@pytest.mark.parametrize("sampler", [_weights_one_too_many, _weights_column, _weights_list],
                         ids=["n+1", "[n,1]", "list"])
def test_sampler_weights_of_the_wrong_kind_are_refused_by_name(world, sampler, max_examples,
                                                               solver):
    """FINDING. A user's sampler returning weights of [n + 1], [n, 1] or a list escapes as a
    bare RuntimeError ("shape '[41, -1]' is invalid", "size of tensor a (31) must match") or
    TypeError ("isfinite(): argument 'input' must be Tensor"). Expected: a tracinfunc error
    naming the sampler, the expected weights ([n] tensor) and what was got (whichever solver:
    "auto" took the direct path here; "cg", now the default, is checked too)."""
    _, loss, checkpoints, train, test, curvature = world
    refined = curvature.with_refinement(train, sampler=sampler, max_examples=max_examples,
                                        solver=solver)
    with pytest.raises(TracInFuncError) as info:
        _query(loss, checkpoints, test, refined)
    assert "sampler" in str(info.value).lower()


@pytest.mark.parametrize("max_examples,limit", [(10, 10_000), (4, 3_500)],
                         ids=["H-kept: G fits, H+factor not", "G-kept: G fits, G+factor not"])
def test_direct_over_budget_message_says_what_is_over(world, budget, max_examples, limit):
    """FINDING. When G fits the budget but G (or H) with its Cholesky factor does not, the
    refusal of solver="direct" says "its per-example gradients are over GRADIENT_BUDGET"
    (false: G is 7,440 / 2,976 bytes, under 10,000 / 3,500). Expected: it names the factor
    (what is over) so the user knows how much budget to give."""
    _, loss, checkpoints, train, test, curvature = world
    budget(limit)
    refined = curvature.with_refinement(train, sampler=classification_sampler(exact=True),
                                        max_examples=max_examples, solver="direct")
    with pytest.raises(InvalidArgumentError) as info:
        _query(loss, checkpoints, test, refined)
    assert "factor" in str(info.value).lower()


def _huge_weights(loss, params, batch, generator):
    x, y = batch
    return (x, y), torch.where(torch.arange(len(x)) % 3 == 0, 2.0, 1.0).to(x.dtype) * 1e307


@pytest.mark.parametrize("solver", ["direct", "cg"])
def test_huge_finite_weights_whose_sum_overflows(world, solver):
    """FINDING. H = G^T diag(w) G / sum w does not depend on the weights' scale. Weights of
    1e307 and 2e307 over 40 rows (each finite) sum to inf: with H kept the answer silently
    becomes g / lambda (3.1 relative error against the solve with the same weights scaled to
    1 and 2), with no error or warning. Expected: the right answer (normalise before summing)
    or a refusal naming the weights."""
    model, loss, checkpoints, train, test, curvature = world
    refined = curvature.with_refinement(train, sampler=_huge_weights, solver=solver,
                                        steps=60, tolerance=1e-12)
    try:
        queries = _query(loss, checkpoints, test, refined)
    except TracInFuncError as exc:
        assert "weight" in str(exc).lower()
        return
    g = _grads(model, checkpoints[0], *test)
    rows = _grads(model, checkpoints[0], *train)
    w = torch.where(torch.arange(40) % 3 == 0, 2.0, 1.0).double()
    h = rows.T @ (w[:, None] * rows) / w.sum()
    assert _rel(queries.read_rows(0, 0, 5), _solve(h, g, LAM)) < 1e-9


# --- the CLI --------------------------------------------------------------------------------

SPEC = '''
import torch, torch.nn.functional as F
from torch import nn
import tracinfunc as tif


def make():
    {budget}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(40, 3, dtype=torch.float64); y = torch.randint(0, 3, (40,))
    xt = torch.randn(5, 3, dtype=torch.float64); yt = torch.randint(0, 3, (5,))
    cks = []
    for c in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
        cks.append(tif.Checkpoint.from_module(model, lr=0.1 * (c + 1), name=f"c{{c}}"))
    return tif.cli.Spec(loss=tif.loss_from_module(model, F.cross_entropy), train=(x, y),
                        test={{"test": (xt, yt)}}, checkpoints=cks, model=model)
'''


@pytest.fixture(scope="module")
def cli_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("atk40cli")
    (root / "spec.py").write_text(SPEC.format(budget="pass"))
    (root / "spec0.py").write_text(SPEC.format(
        budget="import tracinfunc.curvature.fisher as fisher; fisher.GRADIENT_BUDGET = 0"))
    sys.path.insert(0, str(root))
    try:
        import spec as user_spec
        s = user_spec.make()
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("spec", None)
    proj = tif.Projection(kind="identity")
    tif.build_store(s.loss, s.checkpoints, s.train, projection=proj, store=str(root / "g.zarr"))
    cur = tif.fit_curvature(s.loss, s.checkpoints, s.train, kind="ekfac", damping=LAM)
    tif.save_curvature(cur, str(root / "c.zarr"))
    return root, s, cur


def _cli(root, *args, spec="spec.py"):
    cmd = [sys.executable, "-m", "tracinfunc", "score", str(root / "g.zarr"),
           "--spec", f"{root / spec}:make", "--test", "test", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flags", [["--refine-solver", "direct"], ["--refine-examples", "4"]])
def test_cli_refine_option_without_refine_steps_is_a_usage_error(cli_world, flags):
    """FINDING. docs/cli.md: usage errors exit with status 2, and the analogous dependent
    option (--contrast-weight without --contrast) is a usage error (exit 2, checked here).
    --refine-solver / --refine-examples without --refine-steps exit 1 instead."""
    root, _, _ = cli_world
    contrast = _cli(root, "--contrast-weight", "0.5", "--output", str(root / "cw.npy"))
    assert contrast.returncode == 2
    out = _cli(root, "--curvature", str(root / "c.zarr"), *flags,
               "--output", str(root / f"u{flags[0]}.npy"))
    assert out.returncode == 2, out.stderr


def test_cli_direct_over_budget_error_names_the_cli_flags(cli_world):
    """FINDING. `score --refine-solver direct` where the Fisher is over the budget prints
    "use solver='cg', fewer refinement examples (max_examples=)", Python keywords a shell
    user cannot pass. Expected: the flags (--refine-solver cg, --refine-examples M)."""
    root, _, _ = cli_world
    out = _cli(root, "--curvature", str(root / "c.zarr"), "--refine-steps", "2",
               "--refine-solver", "direct", "--output", str(root / "d.npy"), spec="spec0.py")
    assert out.returncode == 1
    assert "--refine-solver cg" in out.stderr and "--refine-examples" in out.stderr, out.stderr
    assert not (root / "d.npy").exists()


def test_cli_unconverged_warning_names_the_cli_flag(cli_world):
    """FINDING. `score --refine-solver cg --refine-steps 2` warns "more steps
    (with_refinement(steps=...))": the Python keyword, not the flag the shell user has."""
    root, _, _ = cli_world
    out = _cli(root, "--curvature", str(root / "c.zarr"), "--refine-steps", "2",
               "--refine-solver", "cg", "--output", str(root / "w.npy"))
    assert out.returncode == 0, out.stderr
    assert "stopped at a relative residual" in out.stderr  # the premise: it warned
    assert "--refine-steps" in out.stderr, out.stderr


def test_held_cli_refined_output_never_lands_on_the_curvature(cli_world):
    """HELD: --output at the saved curvature, a file in it, or a new file inside it is refused
    even with --overwrite, and the curvature is untouched; the CLI's default solver (cg)
    equals the Python API's default."""
    root, s, cur = cli_world
    before = sorted(p.name for p in (root / "c.zarr").iterdir())
    for out in (root / "c.zarr", root / "c.zarr" / "zarr.json", root / "c.zarr" / "new.npy"):
        res = _cli(root, "--curvature", str(root / "c.zarr"), "--refine-steps", "2",
                   "--output", str(out), "--overwrite")
        assert res.returncode == 1 and "saved curvature" in res.stderr, res.stderr
    assert sorted(p.name for p in (root / "c.zarr").iterdir()) == before
    res = _cli(root, "--curvature", str(root / "c.zarr"), "--refine-steps", "2",
               "--output", str(root / "default.npy"))
    assert res.returncode == 0, res.stderr
    store = tif.GradientStore.open(str(root / "g.zarr"))
    refined = cur.with_refinement(s.train, steps=2)
    queries = tif.preconditioned_test_grads(s.loss, s.checkpoints, s.test["test"], refined,
                                            projection=store.projection)
    import numpy as np
    expected = np.asarray(tif.score(store, queries, curvature=refined))
    assert np.abs(np.load(root / "default.npy") - expected).max() <= 1e-12 * np.abs(expected).max()


# ---------------------------------------------------------------------------------------------
# HELD (passed when written; regression guards)
# ---------------------------------------------------------------------------------------------


def test_held_direct_with_mixed_sign_weights_solves_or_refuses_by_definiteness(world):
    """HELD (replaces the "auto"-era test of mixed-sign weights with H kept). Docs: with H kept
    (all 40 rows, p < 2m), solver="direct" solves ``H + lambda I`` exactly while it is positive
    definite, whatever the signs of the sampler's weights; a damping at which it is not is
    refused (IllConditionedError, "not positive definite"); with G kept (4 rows) negative
    weights are refused (InvalidArgumentError, "negative weights"). Weights 1, -0.5 make H
    indefinite (min eigenvalue -0.55 / -0.32 at the two checkpoints)."""
    model, loss, checkpoints, train, test, curvature = world
    w = torch.where(torch.arange(40) % 2 == 0, 1.0, -0.5).double()
    hs, gs = [], []
    for ck in checkpoints:
        rows = _grads(model, ck, *train)
        hs.append(rows.T @ (w[:, None] * rows) / w.sum())
        gs.append(_grads(model, ck, *test))
    lowest = [torch.linalg.eigvalsh(h).min().item() for h in hs]
    assert max(lowest) < 0  # the premise: H itself is indefinite at both checkpoints
    lam = 1.0
    assert min(lowest) + lam > 0 and min(lowest) + LAM < 0  # the premise: PD at 1.0, not at LAM
    refined = curvature.with_refinement(train, sampler=_mixed_sign, solver="direct")
    queries = _query(loss, checkpoints, test, refined.with_damping(lam))
    assert queries.meta.extra["curvature"]["solvers"] == ["direct", "direct"]
    for c in range(2):
        assert _rel(queries.read_rows(c, 0, 5), _solve(hs[c], gs[c], lam)) < 1e-12
    with pytest.raises(IllConditionedError, match="not positive definite"):
        _query(loss, checkpoints, test, refined.with_damping(LAM))
    with pytest.raises(InvalidArgumentError, match="negative weights"):
        _query(loss, checkpoints, test, curvature.with_refinement(
            train, sampler=_mixed_sign, solver="direct", max_examples=4))


@pytest.mark.parametrize("max_examples", [None, 4], ids=["H-kept", "G-kept"])
def test_held_direct_equals_explicit_float64_solve(world, max_examples):
    """HELD: both kept forms equal an explicit float64 solve to 1e-12; metadata says direct."""
    model, loss, checkpoints, train, test, curvature = world
    refined = curvature.with_refinement(train, sampler=classification_sampler(exact=True),
                                        max_examples=max_examples, solver="direct", steps=1)
    queries = _query(loss, checkpoints, test, refined)
    extra = queries.meta.extra["curvature"]
    assert extra["solvers"] == ["direct", "direct"]
    assert [len(r) for r in extra["residuals"]] == [1, 1]
    n = max_examples or 40
    for c, ckpt in enumerate(checkpoints):
        g = _grads(model, ckpt, *test)
        h = _fisher(model, ckpt, train[0][:n])
        x = _solve(h, g, LAM)
        assert _rel(queries.read_rows(c, 0, 5), x) < 1e-12
        true = ((g - x @ h.T - LAM * x).norm(dim=1) / g.norm(dim=1)).max().item()
        assert extra["residuals"][c][0] < 1e-12 and true < 1e-12


@pytest.mark.parametrize("max_examples", [None, 4], ids=["H-kept", "G-kept"])
def test_held_damping_sweep_back_and_forth_uses_no_stale_factor(world, max_examples):
    """HELD: after a first query, with_damping to other values and back: each equals its own
    explicit solve (the factor is per damping); Damping(scale) resolves per checkpoint."""
    model, loss, checkpoints, train, test, curvature = world
    n = max_examples or 40
    refined = curvature.with_refinement(train, sampler=classification_sampler(exact=True),
                                        max_examples=max_examples, solver="direct")
    hs = [_fisher(model, ck, train[0][:n]) for ck in checkpoints]
    gs = [_grads(model, ck, *test) for ck in checkpoints]
    for damping in [LAM, 0.5, 0.005, LAM, Damping(scale=1.0), Damping(scale=0.1), 2.0, LAM]:
        r = refined.with_damping(damping)
        lams = r.metadata()["damping"]
        if isinstance(damping, float):
            assert lams == [damping, damping]
        else:
            assert lams == pytest.approx([damping.scale * m for m in curvature.mean_eigenvalues()])
        queries = _query(loss, checkpoints, test, r)
        for c in range(2):
            assert _rel(queries.read_rows(c, 0, 5), _solve(hs[c], gs[c], lams[c])) < 1e-12


@pytest.mark.parametrize("max_examples,need", [(None, 120 * P * 8),
                                               (4, 12 * P * 8 + 2 * 12 * 12 * 8),
                                               (10, 2 * P * P * 8)],
                         ids=["H-kept (G must fit)", "G-kept: G+factor+BB^T", "H-kept: H+factor"])
def test_held_budget_boundary_and_eviction(model_world_3, budget, max_examples, need):
    """HELD: at exactly the needed bytes (docs: G kept counts its [m, m] factor and B B^T beside
    it, 2 x m x m x 8) the solve is direct at every checkpoint (3 checkpoints,
    room for one: eviction); one byte less, solver="cg" still works (it keeps G or H without
    the factor) and "direct" is refused; the answers equal the explicit solve in both cases,
    and after a damping change and back."""
    model, loss, checkpoints, train, test, curvature = model_world_3
    sampler = classification_sampler(exact=True)
    n = max_examples or 40
    ref = {c: _solve(_fisher(model, ck, train[0][:n]), _grads(model, ck, *test), LAM)
           for c, ck in enumerate(checkpoints)}
    budget(need)
    refined = curvature.with_refinement(train, sampler=sampler, max_examples=max_examples,
                                        solver="direct")
    for r in (refined, refined.with_damping(0.5).with_damping(LAM)):
        queries = _query(loss, checkpoints, test, r)
        assert queries.meta.extra["curvature"]["solvers"] == ["direct"] * 3
        assert max(_rel(queries.read_rows(c, 0, 5), ref[c]) for c in range(3)) < 1e-12
    budget(need - 1)
    refined = curvature.with_refinement(train, sampler=sampler, max_examples=max_examples,
                                        solver="cg", steps=60, tolerance=1e-12)
    queries = _query(loss, checkpoints, test, refined)
    assert queries.meta.extra["curvature"]["solvers"] == ["cg"] * 3
    assert max(_rel(queries.read_rows(c, 0, 5), ref[c]) for c in range(3)) < 1e-9
    with pytest.raises(InvalidArgumentError, match="GRADIENT_BUDGET"):
        _query(loss, checkpoints, test, curvature.with_refinement(
            train, sampler=sampler, max_examples=max_examples, solver="direct"))


@pytest.fixture(scope="module")
def model_world_3():
    model, loss, checkpoints, train, test = _setup(n_ckpt=3)
    curvature = tif.fit_curvature(loss, checkpoints, train, kind="ekfac",
                                  sampler=classification_sampler(exact=True), damping=LAM)
    return model, loss, checkpoints, train, test, curvature


def test_held_solvers_digests_never_mixed_and_scores_exact(world):
    """HELD: direct/cg have distinct digests and refuse each other's queries; score and
    top_k of the direct queries equal the explicit lr-weighted sum."""
    model, loss, checkpoints, train, test, curvature = world
    sampler = classification_sampler(exact=True)
    store = tif.build_store(loss, checkpoints, train, projection=tif.Projection(kind="identity"))
    refined = {s: curvature.with_refinement(train, sampler=sampler, solver=s)
               for s in ("direct", "cg")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        queries = {s: _query(loss, checkpoints, test, r) for s, r in refined.items()}
    assert len({r.digest for r in refined.values()}) == 2
    for a in refined:
        for b in refined:
            if a != b:
                with pytest.raises(tif.errors.IncompatibleGradientsError):
                    tif.score(store, queries[a], curvature=refined[b])
    expected = torch.zeros(5, 40, dtype=torch.float64)
    for ck in checkpoints:
        x = _solve(_fisher(model, ck, train[0]), _grads(model, ck, *test), LAM)
        expected += ck.lr * x @ _grads(model, ck, *train).T
    scores = torch.as_tensor(tif.score(store, queries["direct"], curvature=refined["direct"]))
    assert _rel(scores, expected) < 1e-6  # the store is float32
    values, indices = tif.top_k(store, queries["direct"], 3, curvature=refined["direct"])
    best = expected.topk(3, dim=1)
    assert torch.equal(torch.as_tensor(indices), best.indices)
    assert _rel(torch.as_tensor(values), best.values) < 1e-6


def test_held_threads_share_factors_across_dampings(world):
    """HELD: six threads query three dampings of one refined curvature at once (first query
    computes G and each damping's factor); every answer equals the explicit solve."""
    model, loss, checkpoints, train, test, curvature = world
    refined = curvature.with_refinement(train, sampler=classification_sampler(exact=True),
                                        max_examples=4, solver="direct")
    lams = [LAM, 0.5, 0.01]
    curvs = [refined.with_damping(lam) for lam in lams]
    hs = [_fisher(model, ck, train[0][:4]) for ck in checkpoints]
    gs = [_grads(model, ck, *test) for ck in checkpoints]
    got, errors = [], []

    def work(j):
        try:
            for rep in range(3):
                i = (j + rep) % 3
                got.append((i, _query(loss, checkpoints, test, curvs[i])))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(j,)) for j in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 18
    for i, queries in got:
        for c in range(2):
            assert _rel(queries.read_rows(c, 0, 5), _solve(hs[c], gs[c], lams[i])) < 1e-12


@pytest.mark.parametrize("solver,steps", [("cg", 1), ("cg", 3), ("cg", 50)])
def test_held_residual_metadata_is_true(world, solver, steps):
    """HELD: the last reported residual is the true worst relative residual of the rows."""
    model, loss, checkpoints, train, test, curvature = world
    refined = curvature.with_refinement(train, sampler=classification_sampler(exact=True),
                                        solver=solver, steps=steps, tolerance=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        queries = _query(loss, checkpoints, test, refined)
    for c, ck in enumerate(checkpoints):
        g, h = _grads(model, ck, *test), _fisher(model, ck, train[0])
        x = queries.read_rows(c, 0, 5).double()
        true = ((g - x @ h.T - LAM * x).norm(dim=1) / g.norm(dim=1)).max().item()
        reported = queries.meta.extra["curvature"]["residuals"][c]
        assert len(reported) <= steps + 1
        assert reported[-1] == pytest.approx(true, rel=1e-6)


def test_held_refusals_of_bad_settings(world):
    """HELD: bad solver (the old "auto" included, naming 'cg' and 'direct'), tolerance, steps,
    max_examples, damping and NaN test rows are refused."""
    _, loss, checkpoints, train, test, curvature = world
    for kw in [dict(solver="Direct"), dict(solver=None), dict(tolerance=0.0),
               dict(tolerance=float("nan")), dict(steps=0), dict(steps=True),
               dict(max_examples=0), dict(max_examples=2.5)]:
        with pytest.raises(InvalidArgumentError):
            curvature.with_refinement(train, **kw)
    with pytest.raises(InvalidArgumentError) as info:
        curvature.with_refinement(train, solver="auto")
    assert "'cg'" in str(info.value) and "'direct'" in str(info.value)
    refined = curvature.with_refinement(train)
    with pytest.raises(IllConditionedError):
        refined.with_damping(0.0)
    with pytest.raises(IllConditionedError):
        refined.with_damping(1e30)
    with pytest.raises(InvalidArgumentError):
        refined.with_damping(float("nan"))
    x = test[0].clone()
    x[2, 1] = float("nan")
    with pytest.raises(tif.errors.NonFiniteGradientError, match="2"):
        _query(loss, checkpoints, (x, test[1]), refined)


@pytest.mark.parametrize("max_examples", [None, 4], ids=["H-kept", "G-kept"])
def test_held_float32_model_direct_near_float64_solve(max_examples):
    """HELD: a float32 model's direct answers (float32 rows) equal the float64 solve to 1e-6."""
    model, loss, checkpoints, train, test = _setup(dtype=torch.float32)
    sampler = classification_sampler(exact=True)
    curvature = tif.fit_curvature(loss, checkpoints, train, kind="ekfac", sampler=sampler,
                                  damping=LAM)
    refined = curvature.with_refinement(train, sampler=sampler, max_examples=max_examples,
                                        solver="direct")
    queries = _query(loss, checkpoints, test, refined)
    assert queries.dtype == torch.float32
    n = max_examples or 40
    for c, ck in enumerate(checkpoints):
        x = _solve(_fisher(model, ck, train[0][:n]), _grads(model, ck, *test), LAM)
        assert _rel(queries.read_rows(c, 0, 5), x) < 1e-6


def test_held_zero_test_gradient_gives_zero_rows_and_finite_residuals(world):
    """HELD: a test example with no loss (ignore_index) has a zero gradient: its row is 0, the
    others are unchanged, residuals are finite, and a set of only such rows reports 0."""
    model, _, checkpoints, train, test, curvature = world
    loss = tif.loss_from_module(
        model, lambda out, y: F.cross_entropy(out, y, ignore_index=-100, reduction="sum"))
    y = test[1].clone()
    y[1] = -100
    for solver in ("direct", "cg"):
        refined = curvature.with_refinement(train, sampler=classification_sampler(exact=True),
                                            solver=solver)
        queries = _query(loss, checkpoints, (test[0], y), refined)
        rows = queries.read_rows(0, 0, 5)
        assert bool((rows[1] == 0).all()) and bool(torch.isfinite(rows).all())
        assert all(torch.isfinite(torch.tensor(r)).all()
                   for r in queries.meta.extra["curvature"]["residuals"])
        alone = _query(loss, checkpoints, (test[0][1:2], y[1:2]), refined)
        assert alone.read_rows(0, 0, 1).abs().max().item() == 0.0


def test_held_kept_gradients_follow_the_loss_and_the_selection(world):
    """HELD: a second loss (2 x cross-entropy) after a first query is solved with its own Fisher
    (4 H, not the kept H of the first loss); a selection (last layer) with its own."""
    model, loss, checkpoints, train, test, curvature = world
    sampler = classification_sampler(exact=True)
    refined = curvature.with_refinement(train, sampler=sampler, max_examples=4, solver="direct")
    _query(loss, checkpoints, test, refined)
    loss2 = tif.loss_from_module(model, lambda out, y: 2.0 * F.cross_entropy(out, y))
    queries = _query(loss2, checkpoints, test, refined)
    g = 2 * _grads(model, checkpoints[0], *test)
    h = 4 * _fisher(model, checkpoints[0], train[0][:4])
    assert _rel(queries.read_rows(0, 0, 5), _solve(h, g, LAM)) < 1e-12
    select = tif.GradientOptions(select=["2.*"])
    last = tif.fit_curvature(loss, checkpoints, train, kind="ekfac", sampler=sampler,
                             damping=LAM, options=select)
    queries = _query(loss, checkpoints, test, last.with_refinement(train, sampler=sampler,
                                                                   solver="direct"))
    assert queries.k == 15
    keep = slice(P - 15, P)  # '2.bias', '2.weight' come last in the sorted layout
    g = _grads(model, checkpoints[0], *test)[:, keep]
    h = _fisher(model, checkpoints[0], train[0])[keep, keep]
    assert _rel(queries.read_rows(0, 0, 5), _solve(h, g, LAM)) < 1e-12


def test_held_refinement_data_copied_and_batches_cut_by_max_examples(world):
    """HELD: max_examples cuts across batches as over one batch; changing the data in place
    after with_refinement changes nothing; re-refining with other data uses the other data."""
    model, loss, checkpoints, train, test, curvature = world
    sampler = classification_sampler(exact=True)
    x, y = train[0].clone(), train[1].clone()
    batches = [(x[:3], y[:3]), (x[3:7], y[3:7]), (x[7:], y[7:])]
    refined = curvature.with_refinement(batches, sampler=sampler, max_examples=5,
                                        solver="direct")
    x.mul_(3.0)
    queries = _query(loss, checkpoints, test, refined)
    g = _grads(model, checkpoints[0], *test)
    expected = _solve(_fisher(model, checkpoints[0], train[0][:5]), g, LAM)
    assert _rel(queries.read_rows(0, 0, 5), expected) < 1e-12
    other = refined.with_refinement((train[0].flip(0), train[1]), sampler=sampler,
                                    max_examples=5, solver="direct")
    queries = _query(loss, checkpoints, test, other)
    expected = _solve(_fisher(model, checkpoints[0], train[0].flip(0)[:5]), g, LAM)
    assert _rel(queries.read_rows(0, 0, 5), expected) < 1e-12


def test_held_indexed_top_k_self_influence_and_save_of_refined(world, tmp_path):
    """HELD: indexed_top_k of refined queries equals score's top 3; self_influence and
    save_curvature of a refined curvature are refused, and nothing is written."""
    pytest.importorskip("faiss")
    _, loss, checkpoints, train, test, curvature = world
    store = tif.build_store(loss, checkpoints, train, projection=tif.Projection(kind="identity"))
    refined = curvature.with_refinement(train, sampler=classification_sampler(exact=True),
                                        solver="direct")
    queries = _query(loss, checkpoints, test, refined)
    index = tif.build_index(store, kind="ivf_flat", nlist=1)
    _values, indices = tif.indexed_top_k(store, queries, 3, index=index, curvature=refined,
                                         nprobe=1)
    scores = torch.as_tensor(tif.score(store, queries, curvature=refined))
    assert torch.equal(torch.as_tensor(indices), scores.topk(3, dim=1).indices)
    with pytest.raises(TracInFuncError):
        tif.self_influence(store, curvature=refined)
    with pytest.raises(InvalidArgumentError, match="without_refinement"):
        tif.save_curvature(refined, str(tmp_path / "r.zarr"))
    assert not (tmp_path / "r.zarr").exists()
