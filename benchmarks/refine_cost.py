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
EK-FAC query), ``refined`` (the refined curvature with ``solver="direct"``, queried again:
the sampled Fisher and its Cholesky factor kept), ``cg`` (the same with the default
``solver="cg"``: conjugate gradient from the EK-FAC answer, ``steps`` at most),
``refined-first`` (a fresh ``with_refinement`` each time: the first query also computes the
per-example gradients and the factor, once per checkpoint) and ``functional`` (a fresh one with
``GRADIENT_BUDGET = 0``: nothing kept, so conjugate gradient with the jvp/vjp product; timed in
the first repeat only, as it is slow) and ``expected`` (conjugate gradient on the expected
Fisher, ``fisher="expected"``: a jvp and a vjp of the logits per step, nothing kept; first
repeat only). Checked beside the times: the direct answer's worst
relative residual, its distance to the explicit float64 solve (``p <= EXPLICIT_MAX``), and how
far the conjugate-gradient answer ends from it.

    python benchmarks/refine_cost.py --quick     # tiny sizes, one repeat (tests/ runs it)
    python benchmarks/refine_cost.py             # the sizes above (~5 min CPU)
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
from tracinfunc.checkpoint import loss_at
from tracinfunc.curvature import DEFAULT_SCALES, Damping, classification_sampler, fisher
from tracinfunc.curvature.flat import flatten, unflatten
from tracinfunc.grads.selection import selected_names

EXACT = tif.Projection(kind="identity")


def llama_case(quick: bool) -> dict:
    sizes = quality_lm.QUICK if quick else quality_lm.FULL
    train_set, test_set = quality_lm.load_text(sizes)
    model, ckpts = quality_lm.train(sizes, train_set, None, seed=0, every=sizes.every)
    options = tif.GradientOptions(select=quality_lm.linear_weights(model))
    return {"loss": tif.causal_lm_loss(model), "ckpts": ckpts, "train": train_set,
            "test": test_set, "options": options, "sampler": None, "n_test": sizes.n_test,
            "examples": sizes.refine_examples, "steps": sizes.refine_steps,
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
    """Medians of process CPU seconds per query call, interleaved; steps taken; residuals; the
    direct answer against the explicit solve and the conjugate-gradient answer."""
    fitted = tif.fit_curvature(case["loss"], case["ckpts"], case["train"], kind="ekfac",
                               options=case["options"], sampler=case["sampler"],
                               damping=Damping(), batch_size=case["batch_size"])

    def refine(solver="direct"):
        return fitted.with_refinement(case["train"], steps=case["steps"], solver=solver,
                                      max_examples=case["examples"], sampler=case["sampler"])

    def query(curvature):
        with warnings.catch_warnings(record=True):
            return tif.preconditioned_test_grads(case["loss"], case["ckpts"], case["test"],
                                                 curvature, projection=EXACT,
                                                 options=case["options"])

    def functional():
        budget, fisher.GRADIENT_BUDGET = fisher.GRADIENT_BUDGET, 0
        try:
            return query(refine("cg"))
        finally:
            fisher.GRADIENT_BUDGET = budget

    kept, kept_cg = refine(), refine("cg")
    runs = {"plain": lambda: query(fitted), "refined": lambda: query(kept),
            "cg": lambda: query(kept_cg), "refined-first": lambda: query(refine()),
            "functional": functional, "expected": lambda: query(fitted.with_refinement(
                case["train"], steps=case["steps"], max_examples=case["examples"],
                fisher="expected"))}
    results = {"refined": query(kept), "cg": query(kept_cg)}  # fills the kept Fisher, factors
    seconds: dict[str, list[float]] = {label: [] for label in runs}
    for repeat in range(repeats):
        for label, run in runs.items():
            if label in ("functional", "expected") and repeat:
                continue
            start = time.process_time()
            run()
            seconds[label].append(time.process_time() - start)
    median = {label: statistics.median(values) for label, values in seconds.items()}
    mark, cg_mark = (results[label].meta.extra["curvature"] for label in ("refined", "cg"))
    direct_rows = [results["refined"].read_rows(c, 0, case["n_test"])
                   for c in range(len(case["ckpts"]))]
    off_cg = max(_worst_relative(results["cg"].read_rows(c, 0, case["n_test"]), rows)
                 for c, rows in enumerate(direct_rows))
    return {"seconds": median, "n_test": case["n_test"], "steps": case["steps"],
            "examples": case["examples"], "solver": "/".join(sorted(set(mark["solvers"]))),
            "taken": max(len(r) - 1 for r in cg_mark["residuals"]),
            "residual": max(r[-1] for r in mark["residuals"]),
            "cg_residual": [max(r[0] for r in cg_mark["residuals"]),
                            max(r[-1] for r in cg_mark["residuals"])],
            "off_cg": off_cg, "off_explicit": explicit_distance(case, fitted, kept, direct_rows),
            "checkpoints": len(case["ckpts"]), "scale": DEFAULT_SCALES["ekfac"]}


def explicit_distance(case: dict, fitted, refined, direct_rows) -> float:
    """The worst row's distance of the direct answer to ``torch.linalg.solve`` of the explicit
    ``H + lambda I`` ``[p, p]`` (``H`` from the kept Fisher; ``nan`` above ``EXPLICIT_MAX``)."""
    entries = list(refined.refinement.gradients.values())
    if not entries or entries[0].matrix.shape[1] > EXPLICIT_MAX:
        return math.nan
    worst = 0.0
    # the kept Fisher's columns follow the selection's order (module order), not the layout's
    names = list(selected_names(case["ckpts"][0].params, [name for name, _ in fitted.layout]))
    for c, (ckpt, entry) in enumerate(zip(case["ckpts"], entries, strict=True)):
        loss, params = loss_at(case["loss"], ckpt), dict(ckpt.params)
        h = entry.matrix if entry.weights is None else \
            (entry.matrix.T * (entry.weights / entry.weights.sum())) @ entry.matrix
        layout = tuple((name, tuple(params[name].shape)) for name in names)
        rhs = flatten(tif.per_sample_grads(loss, options=case["options"])(params, case["test"]),
                      layout).double()
        lam = refined.damping[c]
        exact = torch.linalg.solve(h + lam * torch.eye(h.shape[0], dtype=h.dtype), rhs.T).T
        # the identity projection's rows are in sorted-name order, the solve's in the selection's
        exact = flatten(unflatten(exact, layout), tuple(sorted(layout)))
        worst = max(worst, _worst_relative(direct_rows[c].double(), exact))
    return worst


def _worst_relative(value: Tensor, exact: Tensor) -> float:
    """The worst row's ``||value - exact|| / ||exact||``."""
    return float(((value - exact).norm(dim=1) / exact.norm(dim=1).clamp_min(1e-300)).max())


EXPLICIT_MAX = 4096  # p up to which the direct answer is checked against H + lambda I [p, p]


HEADER = ("| model | ckpts | refine (examples, cg steps, taken) | solver | plain ms/ex "
          "| refined ms/ex | ratio | first query ratio | cg ratio | functional ratio "
          "| expected-Fisher cg ratio | direct residual | direct vs explicit | cg vs direct "
          "| cg residual first -> last |\n"
          "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def table_row(name: str, r: dict) -> str:
    s, n = r["seconds"], r["n_test"]
    base = max(s["plain"], 1e-9)
    return (f"| {name} | {r['checkpoints']} | {r['examples']}, {r['steps']}, {r['taken']} | "
            f"{r['solver']} | {1e3 * s['plain'] / n:.2f} | {1e3 * s['refined'] / n:.2f} | "
            f"{s['refined'] / base:.2f}x | {s['refined-first'] / base:.2f}x | "
            f"{s['cg'] / base:.2f}x | {s['functional'] / base:.2f}x | "
            f"{s['expected'] / base:.2f}x | {r['residual']:.1e} | "
            f"{r['off_explicit']:.1e} | {r['off_cg']:.2e} | "
            f"{r['cg_residual'][0]:.3g} -> {r['cg_residual'][1]:.3g} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat")
    parser.add_argument("--models", default="llama,logreg,mlp",
                        help="comma-separated: llama, logreg, mlp")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared machine: one core, comparable CPU times
    repeats = 1 if args.quick else args.repeats
    print(f"refined vs plain EK-FAC query, process CPU time, median of {repeats} "
          f"(tracinfunc from {Path(tif.__file__).parent})")
    print(HEADER, flush=True)
    for name in args.models.split(","):
        case = llama_case(args.quick) if name == "llama" else digits_case(name, args.quick)
        print(table_row(name, measure(case, repeats)), flush=True)


if __name__ == "__main__":
    main()
