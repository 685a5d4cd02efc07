"""tracinfunc vs dattri 0.3.0 vs a naive torch.func reference, end to end, side by side.

The configuration of dattri PR #257: MNIST-shaped logistic regression 784 -> 10 on synthetic
data (fixed seed), 10k train / 2k test, loader batches of 100, 2 checkpoints, projection dim
512. Every method runs in its own child process (clean peak RSS), one torch thread by
default, and is timed from the first gradient to the full ``[n_test, n_train]`` score matrix,
split into ``build`` (train and test gradients, projected and stored) and ``score``:

* ``dattri``: ``TracInAttributor`` of dattri 0.3.0, in dattri's own venv (``--dattri-python``
  or ``$DATTRI_PYTHON``, default ``.venv-dattri/bin/python``, made by ``make bench-setup``);
  it recomputes the training gradients for every test batch, so it has no split;
* ``naive``: ``vmap(grad(loss))`` per loader batch, flattened, times a dense Gaussian
  ``[p, k]`` materialised once per checkpoint, then ``test @ train.T``;
* ``naive-shared``: the same with one Gaussian for every checkpoint, as tracinfunc's
  projection is (a function of seed, kind, dim, name and shape, never of the checkpoint):
  its errors then add up across checkpoints instead of averaging out, which costs agreement;
* ``tif-<kind>``: ``build_store`` (train and test) then ``score``, fed the loader's batches
  of 100 with default arguments (an in-memory build merges small batches into larger calls,
  ``tracinfunc.build.merge``); ``tif-<kind>@100`` passes ``batch_size=100``: one call per
  loader batch, as before that merge (a vmapped call costs ~2 ms here);
  ``before-tif-<kind>``: the same child importing the tracinfunc of ``--before-root``;
  ``tif-<kind>+list``: the loader's batches as a list (views, no copy), whose size is known,
  so the in-memory store's rows are written in place (a generator's are joined at the end).

Trials are interleaved (trial t runs every method once, in an order rotated by t) and the
median of each figure is reported: CPU seconds of the child process (the figure the ratios
use; on a shared machine it moves less than wall time), wall seconds and peak RSS. dattri
takes minutes a run, so it runs ``--dattri-trials`` times (default 1), inside the first trials.

Score agreement with exact (unprojected) TracIn is measured on sklearn digits (64 -> 10
logistic regression, 1437 train / 360 test, 2 checkpoints) at the same k, averaged over seeds.

    python benchmarks/vs_dattri.py --quick      # reduced sizes (shared machines)
    python benchmarks/vs_dattri.py              # the full PR #257 configuration
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    PYTHON,
    ROOT,
    Timer,
    agreement,
    check_interpreter,
    current_rss_mb,
    digits,
    emit,
    linear_model,
    machine,
    peak_rss_mb,
    python_of_dattri,
    run_child,
    synthetic,
    tiny,
    train_checkpoints,
)

KINDS = ("rademacher", "sjlt", "kronecker")
DEFAULT_METHODS = (["dattri", "naive", "naive-shared"] + [f"tif-{k}" for k in KINDS]
                   + ["tif-kronecker+list", "tif-sjlt@100", "tif-kronecker@100"])
FIGURES = ("cpu", "seconds", "build_cpu", "score_cpu", "peak_rss_mb", "baseline_rss_mb")
INSTALL_DATTRI = "create it with `make bench-setup` (or pass --dattri-python)"


# --- children -------------------------------------------------------------------------------

def _batches(x, y, batch):
    for i in range(0, len(y), batch):
        yield x[i:i + batch], y[i:i + batch]


def run_tracinfunc(problem: dict, method: str, seed: int):
    kind, _, merged = method.partition("@")
    kind, listed = kind.removesuffix("+list"), kind.endswith("+list")
    batches = (lambda x, y, b: list(_batches(x, y, b))) if listed else _batches
    import torch.nn.functional as F

    import tracinfunc as tif

    model = linear_model(problem["d_in"], problem["n_classes"]).eval()
    (x_train, y_train), (x_test, y_test) = problem["train"], problem["test"]
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = []
    for i, (state, lr) in enumerate(zip(problem["states"], problem["lrs"], strict=True)):
        ckpts.append(tif.Checkpoint.from_state_dict(state, model, lr=lr, name=f"epoch-{i}"))
    spec = (tif.Projection(kind="identity") if kind == "identity"
            else tif.Projection(dim=problem["k"], seed=seed, kind=kind))
    batch = problem["batch"]
    baseline = current_rss_mb()
    with Timer() as total:
        options = {"batch_size": int(merged)} if merged else {}
        with Timer() as build:
            store = tif.build_store(loss, ckpts, batches(x_train, y_train, batch),
                                    projection=spec, **options)
            test = tif.build_store(loss, ckpts, batches(x_test, y_test, batch),
                                   projection=store.projection, **options)
        scores = tif.score(store, test, device="cpu")
    return scores, _figures(total, build), baseline


def _figures(total: Timer, build: Timer) -> dict:
    return {"seconds": total.seconds, "cpu": total.cpu, "build_cpu": build.cpu,
            "score_cpu": total.cpu - build.cpu}


def run_naive(problem: dict, seed: int, *, shared: bool = False):
    """vmap(grad) then a dense Gaussian matmul: the straightforward torch.func reference.

    One Gaussian per checkpoint, or with ``shared`` one for all of them."""
    from torch.func import functional_call, grad, vmap

    model = linear_model(problem["d_in"], problem["n_classes"]).eval()
    (x_train, y_train), (x_test, y_test) = problem["train"], problem["test"]
    batch, k = problem["batch"], problem["k"]

    def loss(params, x, y):
        out = functional_call(model, params, (x[None],))
        return torch.nn.functional.cross_entropy(out, y[None])

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))
    baseline = current_rss_mb()
    build_cpu = 0.0
    with Timer() as timer:
        scores = torch.zeros(len(y_test), len(y_train))
        for c, (state, lr) in enumerate(zip(problem["states"], problem["lrs"], strict=True)):
            params = {n: v for n, v in state.items()}
            p = sum(v.numel() for v in params.values())
            with Timer() as make:  # generating the Gaussian counts as building
                gen = torch.Generator().manual_seed(seed * 1000 + (0 if shared else c))
                gauss = torch.randn(p, k, generator=gen) / k**0.5  # [p, k]
            build_cpu += make.cpu

            def project(x, y, params=params, gauss=gauss):
                rows = []
                for xb, yb in _batches(x, y, batch):
                    g = per_example(params, xb, yb)
                    flat = torch.cat([g[n].reshape(len(yb), -1) for n in sorted(g)], dim=1)
                    rows.append(flat @ gauss)  # [b, p] @ [p, k]
                return torch.cat(rows)

            with Timer() as build:
                train, test = project(x_train, y_train), project(x_test, y_test)
            build_cpu += build.cpu
            scores += lr * test @ train.T
    return scores, {"seconds": timer.seconds, "cpu": timer.cpu, "build_cpu": build_cpu,
                    "score_cpu": timer.cpu - build_cpu}, baseline


def child(args) -> None:
    torch.set_num_threads(args.threads)
    problem = torch.load(args.problem, weights_only=False)
    for run in (tiny(problem), problem):  # warm up, then the timed run
        if args.child in ("naive", "naive-shared"):
            scores, figures, baseline = run_naive(run, args.seed,
                                                  shared=args.child == "naive-shared")
        else:
            scores, figures, baseline = run_tracinfunc(run, args.child[len("tif-"):], args.seed)
    np.save(args.out, scores.numpy())
    emit({**figures, "peak_rss_mb": peak_rss_mb(), "baseline_rss_mb": baseline})


# --- parent ---------------------------------------------------------------------------------

def save_problem(path, train, test, *, d_in, n_classes, batch, k, seed=0):
    model = linear_model(d_in, n_classes)
    torch.manual_seed(seed)
    states, lrs = train_checkpoints(model, *train, epochs=2, lr=0.1, batch=batch, seed=seed)
    torch.save({"train": train, "test": test, "states": states, "lrs": lrs, "d_in": d_in,
                "n_classes": n_classes, "batch": batch, "k": k}, path)


def run_method(method, problem, workdir, seed, args):
    out = os.path.join(workdir, f"{method}-{seed}.npy")
    if method == "dattri":
        cmd = [args.dattri_python, os.path.join(ROOT, "benchmarks", "_dattri_child.py"),
               "--problem", problem, "--out", out, "--seed", str(seed),
               "--threads", str(args.threads)]
        env = {"OMP_NUM_THREADS": str(args.threads)}
    else:
        before = method.startswith("before-")  # the same child on another checkout's library
        cmd = [PYTHON, os.path.abspath(__file__), "--child", method.removeprefix("before-"),
               "--problem", problem, "--out", out, "--seed", str(seed),
               "--threads", str(args.threads)]
        env = {"PYTHONPATH": args.before_root if before else ROOT}
    result = run_child(cmd, env=env)
    result["scores"] = np.load(out)
    return result


def exact_scores(problem_path) -> np.ndarray:
    """Exact TracIn (identity projection, float64) of a saved problem."""
    import torch.nn.functional as F

    import tracinfunc as tif

    problem = torch.load(problem_path, weights_only=False)
    model = linear_model(problem["d_in"], problem["n_classes"]).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = [tif.Checkpoint(params={n: v.double() for n, v in state.items()}, lr=lr)
             for state, lr in zip(problem["states"], problem["lrs"], strict=True)]
    (x_train, y_train), (x_test, y_test) = problem["train"], problem["test"]
    spec = tif.Projection(kind="identity")
    store = tif.build_store(loss, ckpts, (x_train.double(), y_train), projection=spec,
                            dtype=torch.float64)
    test = tif.build_store(loss, ckpts, (x_test.double(), y_test), projection=spec,
                           dtype=torch.float64)
    return tif.score(store, test, device="cpu").numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2k train / 400 test, one trial, one agreement seed")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    parser.add_argument("--dattri-python", default=python_of_dattri())
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds for the agreement runs (default 3, --quick 1)")
    parser.add_argument("--trials", type=int, default=None,
                        help="interleaved timing trials, medians reported (default 3, --quick 1)")
    parser.add_argument("--dattri-trials", type=int, default=1,
                        help="timing trials of dattri (minutes each at full size)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--before-root", help="a checkout whose tracinfunc runs the methods "
                        "spelled before-tif-<kind> (e.g. `git archive` of the last release), "
                        "interleaved with this checkout's")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--problem", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 3)
    trials = args.trials if args.trials is not None else (1 if args.quick else 3)
    methods = args.methods.split(",")
    if any(m.startswith("before-") for m in methods) and not args.before_root:
        sys.exit("vs_dattri: before-tif-<kind> methods need --before-root")
    if "dattri" in methods:
        problem = check_interpreter(args.dattri_python, "dattri", INSTALL_DATTRI)
        if problem:
            sys.exit(f"vs_dattri: dattri is not available: {problem} (or drop it with "
                     "--methods naive,tif-sjlt,...)")
    n_train, n_test = (2000, 400) if args.quick else (10_000, 2_000)
    k, batch = 512, 100
    print(f"# vs_dattri: {datetime.date.today()}, {machine()}, {args.threads} thread(s) a child")
    print(f"# timing: synthetic 784->10 logistic regression, {n_train} train / {n_test} test, "
          f"batch {batch}, 2 checkpoints, k={k}; {trials} interleaved trials (dattri "
          f"{min(trials, args.dattri_trials)}), medians; agreement: digits 64->10, {seeds} seeds")
    with tempfile.TemporaryDirectory() as workdir:
        timing = os.path.join(workdir, "timing.pt")
        save_problem(timing, *synthetic(n_train, n_test), d_in=784, n_classes=10, batch=batch,
                     k=k)
        agree = os.path.join(workdir, "digits.pt")
        save_problem(agree, *digits(), d_in=64, n_classes=10, batch=batch, k=k)
        runs = timed_runs(methods, timing, workdir, args, trials)
        exact = exact_scores(agree)
        results = {}
        for method in methods:
            quality = [agreement(run_method(method, agree, workdir, s, args)["scores"], exact)
                       for s in range(seeds)]
            results[method] = {
                **{key: float(np.median([r[key] for r in runs[method]])) if key in
                   runs[method][0] else None for key in FIGURES},
                "trials": len(runs[method]),
                **{key: float(np.mean([q[key] for q in quality])) for key in quality[0]},
            }
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def timed_runs(methods: list[str], problem: str, workdir: str, args, trials: int) -> dict:
    """Every method's timing runs, interleaved: trial t runs each method once, in an order
    rotated by t (dattri in its first ``--dattri-trials`` trials only)."""
    runs: dict[str, list[dict]] = {method: [] for method in methods}
    for trial in range(trials):
        order = methods[trial % len(methods):] + methods[:trial % len(methods)]
        for method in order:
            if method == "dattri" and trial >= args.dattri_trials:
                continue
            result = run_method(method, problem, workdir, 0, args)
            runs[method].append({key: result[key] for key in FIGURES if key in result})
            print(f"  trial {trial}: {method} {result['cpu']:.2f} s CPU", file=sys.stderr)
    return runs


def report(results: dict) -> None:
    naive = results.get("naive", {}).get("cpu")
    dattri = results.get("dattri", {}).get("cpu")

    def seconds(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    print("| method | CPU (s) | build CPU (s) | score CPU (s) | wall (s) | x vs naive | "
          "x vs dattri | peak RSS (MiB) | peak over start (MiB) | pearson | spearman | top-10 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for method, r in results.items():
        vs_naive = f"{naive / r['cpu']:.1f}" if naive else "-"
        vs_dattri = f"{dattri / r['cpu']:.1f}" if dattri else "-"
        print(f"| {method} | {r['cpu']:.2f} | {seconds(r['build_cpu'])} | "
              f"{seconds(r['score_cpu'])} | {r['seconds']:.2f} | {vs_naive} | {vs_dattri} | "
              f"{r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] - r['baseline_rss_mb']:.0f} | "
              f"{r['pearson']:.3f} | {r['spearman']:.3f} | {r['top10']:.2f} |")


if __name__ == "__main__":
    main()
