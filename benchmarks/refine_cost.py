"""Query cost of refined EK-FAC against the plain EK-FAC query, per test example (issue 33).

Issue 33's target: refinement (``Curvature.with_refinement``) costs at most 3x the EK-FAC query
(``tif.preconditioned_test_grads``) per test example. Models, trained as their quality
benchmarks train them (no retraining: cost only):

- ``llama``: the small Llama of ``benchmarks/quality_lm.py`` (its full sizes: 256 train / 64 test
  sequences of 32 characters, width 32, 4 checkpoints), every Linear weight selected, EK-FAC at
  the default damping, refined over 32 training sequences with 3 steps (its refined row);
- ``logreg`` and ``mlp``: digits of ``benchmarks/curvature.py`` (its ``--medium`` sizes: 500
  train / 100 test, 4 checkpoints), the exact Fisher, refined over 100 training examples with
  5 steps (its ``--refine-examples`` / ``--refine-steps`` defaults).

Timed in one run, interleaved, process CPU time, medians over ``--repeats``: ``plain`` (the
EK-FAC query), ``refined`` (the same refined curvature queried again: the per-example
gradients kept), ``refined-first`` (a fresh ``with_refinement`` each time: the first query
also computes the per-example gradients, once per checkpoint) and ``functional`` (a fresh one
with ``GRADIENT_BUDGET = 0``: the jvp/vjp product, what every query cost before; timed in the
first repeat only, as it is slow).

    python benchmarks/refine_cost.py --quick     # tiny sizes, one repeat (tests/ runs it)
    python benchmarks/refine_cost.py             # the sizes above (~5 min CPU)
    python benchmarks/refine_cost.py --models logreg,mlp --direct   # and the direct solves

``--direct`` also measures what an exact solve would cost where the per-example gradients
``G`` or ``H`` are kept (:func:`direct_solves`; not a library path): its residual, its
distance to the explicit float64 solve (small ``p``), and the refined answer's distance to it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import curvature as digits_bench
import quality
import quality_lm

import tracinfunc as tif
from tracinfunc.curvature import DEFAULT_SCALES, Damping, classification_sampler
from tracinfunc.curvature.refine import pcg_flat

try:  # the product by kept gradients (absent before it: every query was functional)
    from tracinfunc.curvature import fisher
except ImportError:
    fisher = None

EXACT = tif.Projection(kind="identity")


def llama_case(quick: bool) -> dict:
    sizes = quality_lm.QUICK if quick else quality_lm.FULL
    train_set, test_set = quality_lm.load_text(sizes)
    model, ckpts = quality_lm.train(sizes, train_set, None, seed=0, every=sizes.every)
    options = tif.GradientOptions(select=quality_lm.linear_weights(model))
    return {"loss": tif.causal_lm_loss(model), "ckpts": ckpts, "train": train_set,
            "test": test_set, "options": options, "sampler": None, "n_test": sizes.n_test,
            "examples": quality_lm.REFINE_EXAMPLES, "steps": quality_lm.REFINE_STEPS,
            "batch_size": quality_lm.BATCH}


def digits_case(name: str, quick: bool) -> dict:
    sizes = digits_bench.QUICK if quick else digits_bench.MEDIUM
    (x, y), test, _, _ = quality.load_digits(sizes)
    make = digits_bench.MODELS[name]
    _, ckpts = quality.train(make, x, y, seed=0, epochs=sizes.epochs, every=sizes.every)
    return {"loss": tif.loss_from_module(make().eval(), F.cross_entropy), "ckpts": ckpts,
            "train": (x, y), "test": test, "options": tif.GradientOptions(),
            "sampler": classification_sampler(exact=True), "n_test": sizes.n_test,
            "examples": 100, "steps": 5, "batch_size": None}


def measure(case: dict, repeats: int) -> dict:
    """Medians of process CPU seconds per query call, interleaved; steps taken; residuals."""
    fitted = tif.fit_curvature(case["loss"], case["ckpts"], case["train"], kind="ekfac",
                               options=case["options"], sampler=case["sampler"],
                               damping=Damping(), batch_size=case["batch_size"])

    def refine():
        return fitted.with_refinement(case["train"], steps=case["steps"],
                                      max_examples=case["examples"], sampler=case["sampler"])

    def query(curvature):
        with warnings.catch_warnings(record=True):
            return tif.preconditioned_test_grads(case["loss"], case["ckpts"], case["test"],
                                                 curvature, projection=EXACT,
                                                 options=case["options"])

    def functional():
        if fisher is None:  # before the kept gradients: a fresh refinement is functional
            return query(refine())
        budget, fisher.GRADIENT_BUDGET = fisher.GRADIENT_BUDGET, 0
        try:
            return query(refine())
        finally:
            fisher.GRADIENT_BUDGET = budget

    kept = refine()
    runs = {"plain": lambda: query(fitted), "refined": lambda: query(kept),
            "refined-first": lambda: query(refine()), "functional": functional}
    query(kept)  # fills the kept gradients (timed separately as refined-first)
    seconds: dict[str, list[float]] = {label: [] for label in runs}
    for repeat in range(repeats):
        for label, run in runs.items():
            if label == "functional" and repeat:
                continue
            start = time.process_time()
            result = run()
            seconds[label].append(time.process_time() - start)
            if label == "refined":
                residuals = result.meta.extra["curvature"]["residuals"]
    median = {label: statistics.median(values) for label, values in seconds.items()}
    return {"seconds": median, "n_test": case["n_test"], "steps": case["steps"],
            "examples": case["examples"], "taken": max(len(r) - 1 for r in residuals),
            "residual": [max(r[0] for r in residuals), max(r[-1] for r in residuals)],
            "checkpoints": len(case["ckpts"]), "scale": DEFAULT_SCALES["ekfac"]}


def direct_solves(case: dict, repeats: int) -> dict:
    """Measured only, not a library path (issue 33): the exact solve where the product keeps
    ``H`` (Cholesky of ``H + lambda I``, then its inverse: one matmul per query) or ``G``
    (Woodbury with ``B = sqrt(w / sum w) G``: ``R = L^-1 B`` from the Cholesky
    ``L L^T = lambda I + B B^T``, then ``x = (v - R^T (R v)) / lambda``: two matmuls per query).
    Timed interleaved with the plain query: the test gradients plus the solves, factors kept
    (``ratio``) or made again (``first``, the per-example gradients kept). Checked: the direct
    answer's relative residual ``||g - (H + lambda I) x|| / ||g||`` (by the product), its
    distance to the explicit float64 solve (``p <= EXPLICIT_MAX`` only; ``nan`` above), and the
    refined (conjugate-gradient) answer's distance to it (worst rows)."""
    from tracinfunc.checkpoint import loss_at
    from tracinfunc.curvature.flat import flatten
    from tracinfunc.curvature.samplers import default_sampler
    from tracinfunc.curvature.test_grads import RefinedSolve

    fitted = tif.fit_curvature(case["loss"], case["ckpts"], case["train"], kind="ekfac",
                               options=case["options"], sampler=case["sampler"],
                               damping=Damping(), batch_size=case["batch_size"])
    refined = fitted.with_refinement(case["train"], steps=case["steps"],
                                     max_examples=case["examples"], sampler=case["sampler"])
    names, systems = [name for name, _ in fitted.layout], []
    for c, ckpt in enumerate(case["ckpts"]):
        loss, params, lam = loss_at(case["loss"], ckpt), dict(ckpt.params), refined.damping[c]
        solve = RefinedSolve(loss, refined, c, names, params,
                             case["sampler"] or default_sampler(case["loss"]), key=c)
        if solve.product.method == "functional":
            return {}
        kept, weights = refined.refinement.gradients[c]
        grads = tif.per_sample_grads(loss, options=case["options"])
        rhs = flatten(grads(params, case["test"]), solve.layout).double()
        systems.append((loss, params, lam, kept, weights, grads, solve, rhs))

    def factor(lam, kept, weights):
        if weights is None:  # H [p, p]
            return torch.cholesky_inverse(torch.linalg.cholesky(
                kept + lam * torch.eye(kept.shape[0], dtype=kept.dtype)))
        b = kept * (weights / weights.sum()).sqrt()[:, None]  # [m, p]
        inner = b @ b.T + lam * torch.eye(b.shape[0], dtype=b.dtype)
        return torch.linalg.solve_triangular(torch.linalg.cholesky(inner), b, upper=False)

    def apply(lam, weights, made, rhs):
        return rhs @ made if weights is None else (rhs - (rhs @ made.T) @ made) / lam

    made = [factor(lam, kept, w) for _, _, lam, kept, w, *_ in systems]

    def query(first):
        for (_, params, lam, kept, w, grads, solve, _), f in zip(systems, made, strict=True):
            rhs = flatten(grads(params, case["test"]), solve.layout).double()
            apply(lam, w, factor(lam, kept, w) if first else f, rhs)

    def plain():
        with warnings.catch_warnings(record=True):
            tif.preconditioned_test_grads(case["loss"], case["ckpts"], case["test"], fitted,
                                          projection=EXACT, options=case["options"])

    seconds: dict[str, list[float]] = {"plain": [], "direct": [], "first": []}
    for _ in range(repeats):
        for label, run in (("plain", plain), ("direct", lambda: query(False)),
                           ("first", lambda: query(True))):
            start = time.process_time()
            run()
            seconds[label].append(time.process_time() - start)
    median = {label: statistics.median(values) for label, values in seconds.items()}
    off_direct, off_cg, residual = 0.0, 0.0, 0.0
    for (_, _, lam, kept, w, _, solve, rhs), f in zip(systems, made, strict=True):
        direct = apply(lam, w, f, rhs)
        applied = solve.product.flat(direct) + lam * direct
        residual = max(residual, _worst_relative(applied, rhs))
        cg, _ = pcg_flat(solve.product.flat, solve.precondition, lam, rhs, case["steps"],
                         refined.refinement.tolerance)
        off_cg = max(off_cg, _worst_relative(cg, direct))
        if rhs.shape[1] <= EXPLICIT_MAX:  # H + lambda I [p, p] formed and solved
            h = kept if w is None else (kept.T * (w / w.sum())) @ kept
            exact = torch.linalg.solve(h + lam * torch.eye(h.shape[0], dtype=h.dtype), rhs.T).T
            off_direct = max(off_direct, _worst_relative(direct, exact))
        else:
            off_direct = math.nan
    return {"kept": "H" if systems[0][4] is None else "G", "off_direct": off_direct,
            "off_cg": off_cg, "steps": case["steps"], "residual": residual,
            **{label: median[label] / max(median["plain"], 1e-9) for label in median}}


def _worst_relative(value: Tensor, exact: Tensor) -> float:
    """The worst row's ``||value - exact|| / ||exact||``."""
    return float(((value - exact).norm(dim=1) / exact.norm(dim=1).clamp_min(1e-300)).max())


DIRECT_HEADER = ("| model | kept | direct solve ratio | factorising too | direct: residual | "
                 "direct vs explicit solve | refined (CG) vs direct |\n"
                 "|---|---|---:|---:|---:|---:|---:|")
EXPLICIT_MAX = 4096  # p up to which --direct also forms and solves H + lambda I [p, p]


HEADER = ("| model | ckpts | refine (examples, steps, taken) | plain ms/ex | refined ms/ex "
          "| ratio | first query ratio | functional ratio | residual first -> last |\n"
          "|---|---:|---|---:|---:|---:|---:|---:|---|")


def table_row(name: str, r: dict) -> str:
    s, n = r["seconds"], r["n_test"]
    base = max(s["plain"], 1e-9)
    return (f"| {name} | {r['checkpoints']} | {r['examples']}, {r['steps']}, {r['taken']} | "
            f"{1e3 * s['plain'] / n:.2f} | {1e3 * s['refined'] / n:.2f} | "
            f"{s['refined'] / base:.2f}x | {s['refined-first'] / base:.2f}x | "
            f"{s['functional'] / base:.2f}x | "
            f"{r['residual'][0]:.3g} -> {r['residual'][1]:.3g} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat")
    parser.add_argument("--models", default="llama,logreg,mlp",
                        help="comma-separated: llama, logreg, mlp")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    parser.add_argument("--direct", action="store_true",
                        help="also measure an exact direct solve where H or G is kept "
                             "(measured only, not a library path)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared machine: one core, comparable CPU times
    repeats = 1 if args.quick else args.repeats
    print(f"refined vs plain EK-FAC query, process CPU time, median of {repeats} "
          f"(tracinfunc from {Path(tif.__file__).parent})")
    print(HEADER, flush=True)
    cases = {}
    for name in args.models.split(","):
        case = llama_case(args.quick) if name == "llama" else digits_case(name, args.quick)
        print(table_row(name, measure(case, repeats)), flush=True)
        if args.direct:
            cases[name] = case
    if cases:
        print(f"\nexact direct solves where H or G is kept (measured only), median of "
              f"{repeats}\n{DIRECT_HEADER}", flush=True)
    for name, case in cases.items():
        r = direct_solves(case, repeats)
        print(f"| {name} | functional product: none |" if not r else
              f"| {name} | {r['kept']} | {r['direct']:.2f}x | {r['first']:.2f}x | "
              f"{r['residual']:.1e} | {r['off_direct']:.1e} | {r['off_cg']:.2e} "
              f"({r['steps']} steps) |", flush=True)

if __name__ == "__main__":
    main()
