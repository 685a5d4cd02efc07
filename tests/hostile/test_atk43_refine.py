"""Outside pass atk43 (black box, docs only): Neumann refinement (``solver="neumann"``) and its CLI.

Tests marked FINDING fail on the commit they were written against (dc6a83b); the others held
and guard regressions (marked HELD). The exact answer is an explicit float64
``(H + lambda I)^-1 g`` with ``H = sum_i sum_c p_ic g_ic g_ic^T / n`` built by a Python loop.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import tracinfunc as tif
from tests.conftest import child_env
from tracinfunc.errors import (
    IllConditionedError,
    IncompatibleGradientsError,
    InvalidArgumentError,
    NonFiniteGradientError,
)

from ._tiny import CKPTS, LOSS, PROJ, XT, YT, X, Y, build, data, model

SAMPLER = tif.curvature.samplers.classification_sampler
ID = tif.Projection(kind="identity")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="module")
def cur():
    return tif.fit_curvature(LOSS, CKPTS, data(), kind="ekfac", sampler=SAMPLER(exact=True))


def rows(queries, n):
    return torch.stack([queries.read_rows(c, 0, n) for c in range(len(CKPTS))])


def query(refined, x=XT, y=YT, proj=ID):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tif.preconditioned_test_grads(LOSS, CKPTS, (x, y), refined, projection=proj)


def flat_grad(ckpt, x, y):
    ps = {k: v.detach().double().clone().requires_grad_(True) for k, v in ckpt.params.items()}
    names = sorted(ps)
    loss = F.cross_entropy(functional_call(model().double(), ps, (x[None].double(),)), y[None])
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, [ps[n] for n in names])])


def explicit_solve(ckpt, lam, x, y):
    ps = {k: v.detach().double() for k, v in ckpt.params.items()}
    H = 0
    for i in range(X.shape[0]):
        p = torch.softmax(functional_call(model().double(), ps, (X[i : i + 1].double(),)), -1)[0]
        for c in range(3):
            g = flat_grad(ckpt, X[i], torch.tensor(c))
            H = H + p[c] * torch.outer(g, g)
    H = H / X.shape[0]
    G = torch.stack([flat_grad(ckpt, x[j], y[j]) for j in range(x.shape[0])])
    return torch.linalg.solve(H + lam * torch.eye(H.shape[0], dtype=torch.float64), G.T).T


# ---- FINDING: draws over unequal batches are not unbiased ----

def test_neumann_draws_over_unequal_batches_average_to_the_full_step():
    """FINDING: docs say a drawn step's "expectation over the draws is the full step". With
    batches of 4 and 36 examples and batches_per_step=1, one step's answers over 40 seeds
    average to a point about 0.45 of the spread between the two outcomes away from the full
    step (equal batches: within sampling noise): each batch is weighted as much as the other,
    where the Fisher weights each example equally."""
    ckpts = CKPTS[:1]
    one = tif.fit_curvature(LOSS, ckpts, data(), kind="ekfac", sampler=SAMPLER(exact=True))
    kw = dict(solver="neumann", steps=1, step_size=0.5, tolerance=1e-12, sampler=SAMPLER(exact=True))
    batches = [(X[:4], Y[:4]), (X[4:], Y[4:])]

    def answer(refined):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = tif.preconditioned_test_grads(LOSS, ckpts, (XT, YT), refined, projection=ID)
        return q.read_rows(0, 0, 5).double()

    full = answer(one.with_refinement(batches, **kw))
    outs = torch.stack([answer(one.with_refinement(batches, batches_per_step=1, seed=s, **kw)) for s in range(40)])
    spread = (outs.amax(0) - outs.amin(0)).abs().max()
    assert spread > 0
    assert (outs.mean(0) - full).abs().max() < 0.25 * spread


# ---- FINDING: CLI messages name keywords, not the flags the user typed ----

def _cli(tmp_path, *extra):
    spec = tmp_path / "spec.py"
    spec.write_text(
        "import sys\n"
        f"sys.path.insert(0, {HERE!r})\n"
        "import tracinfunc as tif\n"
        "from _tiny import LOSS, CKPTS, XT, YT, M, data\n"
        "def make():\n"
        "    return tif.cli.Spec(loss=LOSS, train=data(), test={'test': (XT, YT)}, checkpoints=CKPTS, model=M)\n")
    if not (tmp_path / "grads.zarr").exists():
        build(store=str(tmp_path / "grads.zarr"))
        tif.save_curvature(tif.fit_curvature(LOSS, CKPTS, data(), kind="ekfac"), str(tmp_path / "curv.zarr"))
    env = child_env()
    cmd = [sys.executable, "-m", "tracinfunc", "score", str(tmp_path / "grads.zarr"), "--spec", f"{spec}:make",
           "--test", "test", "--curvature", str(tmp_path / "curv.zarr"), "--output", str(tmp_path / "out.npy"),
           "--quiet", "--refine-steps", "3", "--refine-solver", "neumann", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("extra,flag", [(("--refine-step-size", "nan"), "--refine-step-size"),
                                        (("--refine-step-size", "3"), "--refine-step-size"),
                                        (("--refine-batches-per-step", "99"), "--refine-batches-per-step")])
def test_cli_bad_neumann_values_name_the_flag(tmp_path, extra, flag):
    """FINDING: `score --refine-step-size nan` says "step_size must be None ... e.g.
    step_size=0.5" and `--refine-batches-per-step 99` says "batches_per_step=99 ... or None":
    the keyword names, never the flag typed (CHANGELOG: refinement messages name the CLI
    flags beside the keywords), and exit 1 where other bad values are usage errors (exit 2)."""
    proc = _cli(tmp_path, *extra)
    assert proc.returncode != 0
    assert not (tmp_path / "out.npy").exists()
    assert flag in proc.stderr, proc.stderr


# ---- FINDING: huge seeds pass with_refinement and fail at the query with a bare ValueError ----

@pytest.mark.parametrize("kw,seed", [(dict(batches_per_step=2), 2**63 - 1), (dict(batches_per_step=2), 2**64),
                                     ({}, 2**64), ({}, 2**70)])
def test_huge_seed_refused_by_with_refinement_or_used(cur, kw, seed):
    """FINDING: with_refinement accepts seed=2**64 (and, with batches_per_step, 2**63 - 1),
    then preconditioned_test_grads raises a bare ValueError "Overflow when unpacking long
    long" (not a TracInFuncError, no function, no fix). Expected: refused up front by
    with_refinement naming the range (InvalidArgumentError), or the queries made."""
    try:
        refined = cur.with_refinement(data(), solver="neumann", steps=2, seed=seed, **kw)
    except InvalidArgumentError as err:
        assert "seed" in str(err)
        return
    assert rows(query(refined), 5).isfinite().all()


# ---- HELD (regression guards) ----

@pytest.mark.parametrize("eta", [float("nan"), float("inf"), -0.5, 0.0, 2.5, 1e30, True, "0.5", torch.tensor(0.5)])
def test_held_bad_step_sizes_refused(cur, eta):
    with pytest.raises(InvalidArgumentError, match="step_size"):
        cur.with_refinement(data(), solver="neumann", step_size=eta)


@pytest.mark.parametrize("b", [0, -1, 1.5, True, 5])
def test_held_bad_batches_per_step_refused(cur, b):
    with pytest.raises(InvalidArgumentError, match="batches_per_step"):
        cur.with_refinement(data(), solver="neumann", batches_per_step=b)


@pytest.mark.parametrize("solver", ["cg", "direct"])
def test_held_neumann_keywords_refused_with_other_solvers(cur, solver):
    with pytest.raises(InvalidArgumentError, match="neumann"):
        cur.with_refinement(data(), solver=solver, batches_per_step=2)
    with pytest.raises(InvalidArgumentError, match="neumann"):
        cur.with_refinement(data(), solver=solver, step_size=0.5)


def test_held_neumann_converges_to_the_explicit_float64_solve(cur):
    """HELD: every batch per step, 2000 steps, tolerance 1e-8: within 1e-5 relative."""
    refined = cur.with_refinement(data(), sampler=SAMPLER(exact=True), solver="neumann", steps=2000, tolerance=1e-8)
    got = rows(query(refined), 5).double()
    for c, ckpt in enumerate(CKPTS):
        ref = explicit_solve(ckpt, cur.damping[c], XT, YT)
        assert (got[c] - ref).norm() / ref.norm() < 1e-5


def test_held_determinism_and_query_independence(cur):
    """HELD: same seed, same rows bit for bit; another seed differs; a query's row does not
    depend on the others solved with it (bit for bit for a subset, float rounding alone)."""
    r1 = cur.with_refinement(data(), solver="neumann", steps=8, batches_per_step=2, seed=3)
    r2 = cur.with_refinement(data(), solver="neumann", steps=8, batches_per_step=2, seed=3)
    r3 = cur.with_refinement(data(), solver="neumann", steps=8, batches_per_step=2, seed=4)
    a = rows(query(r1), 5)
    assert torch.equal(a, rows(query(r2), 5))
    assert not torch.equal(a, rows(query(r3), 5))
    assert torch.equal(rows(query(r1, XT[2:4], YT[2:4]), 2), a[:, 2:4])
    single = torch.cat([rows(query(r1, XT[i : i + 1], YT[i : i + 1]), 1) for i in range(5)], 1)
    assert torch.allclose(single, a, rtol=1e-5, atol=1e-5)


def test_held_data_forms_give_the_same_rows(cur):
    from torch.utils.data import DataLoader, TensorDataset

    kw = dict(solver="neumann", steps=6, batches_per_step=2, seed=1)
    ref = rows(query(cur.with_refinement(data(), **kw)), 5)
    assert torch.equal(rows(query(cur.with_refinement(iter(data()), **kw)), 5), ref)
    loader = DataLoader(TensorDataset(X, Y), batch_size=10)
    assert torch.equal(rows(query(cur.with_refinement(loader, **kw)), 5), ref)
    with pytest.raises(InvalidArgumentError, match="at most 1"):
        cur.with_refinement((X, Y), solver="neumann", batches_per_step=2)


def test_held_nan_test_example_refused_by_index(cur):
    """HELD (as docs/concepts/faults.md documents: refused naming the example)."""
    x = XT.clone()
    x[1, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"\[1\]"):
        query(cur.with_refinement(data(), solver="neumann", steps=3), x)


def test_held_digests_separate_neumann_settings(cur):
    store = build(projection=PROJ)
    base = cur.with_refinement(data(), solver="neumann", steps=4, step_size=0.5)
    q = query(base, proj=PROJ)
    assert tif.score(store, q, curvature=base).shape == (5, 40)
    for other in [cur.with_refinement(data(), solver="neumann", steps=4, step_size=0.25),
                  cur.with_refinement(data(), solver="neumann", steps=4, step_size=0.5, batches_per_step=2),
                  cur.with_refinement(data(), solver="neumann", steps=4),
                  cur.with_refinement(data(), solver="neumann", steps=4, step_size=0.5, fisher="expected"),
                  cur]:
        with pytest.raises(IncompatibleGradientsError):
            tif.score(store, q, curvature=other)
    drawn = cur.with_refinement(data(), solver="neumann", steps=4, batches_per_step=2, seed=0)
    qd = query(drawn, proj=PROJ)
    for other in [cur.with_refinement(data(), solver="neumann", steps=4, batches_per_step=2, seed=9),
                  cur.with_refinement(data(), solver="neumann", steps=4, batches_per_step=3, seed=0)]:
        with pytest.raises(IncompatibleGradientsError):
            tif.top_k(store, qd, 3, curvature=other)


def test_held_expected_fisher_seed_only_with_neumann(cur):
    r = cur.with_refinement(data(), fisher="expected", solver="neumann", steps=3, batches_per_step=2, seed=5)
    assert torch.equal(rows(query(r), 5), rows(query(r), 5))
    with pytest.raises(InvalidArgumentError, match="seed"):
        cur.with_refinement(data(), fisher="expected", solver="cg", seed=5)
    with pytest.raises(InvalidArgumentError, match="sampler"):
        cur.with_refinement(data(), fisher="expected", solver="neumann", sampler=SAMPLER())


def test_held_warnings_name_the_way_out(cur):
    with pytest.warns(RuntimeWarning, match=r"steps"):
        tif.preconditioned_test_grads(LOSS, CKPTS, (XT, YT), cur.with_refinement(
            data(), solver="neumann", steps=3, step_size=0.5, tolerance=1e-6), projection=ID)
    with pytest.warns(RuntimeWarning, match=r"diverged.*step"):
        tif.preconditioned_test_grads(LOSS, CKPTS, (XT, YT), cur.with_refinement(
            data(), solver="neumann", steps=5, step_size=2.0), projection=ID)


def test_held_damping_on_a_refined_curvature(cur):
    refined = cur.with_refinement(data(), solver="neumann", steps=4)
    with pytest.raises(IllConditionedError):
        refined.with_damping(0.0)
    with pytest.raises(IllConditionedError):
        refined.with_damping(1e12)
    a = refined.with_damping(1.0)
    b = cur.with_damping(1.0).with_refinement(data(), solver="neumann", steps=4)
    assert torch.equal(rows(query(a), 5), rows(query(b), 5))


def test_held_threads_give_the_same_rows(cur):
    refined = cur.with_refinement(data(), solver="neumann", steps=6, batches_per_step=2, seed=2)
    base = rows(query(refined), 5)
    out = [None] * 3

    def work(i):
        out[i] = rows(query(refined), 5)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(o is not None and torch.equal(o, base) for o in out)
