"""tracinfunc vs dattri 0.3.0 vs a naive torch.func reference, end to end, side by side.

The configuration of dattri PR #257: MNIST-shaped logistic regression 784 -> 10 on synthetic
data (fixed seed), 10k train / 2k test, batch 100, 2 checkpoints, projection dim 512. Every
method runs in its own child process (clean peak RSS) and is timed from the first gradient to
the full ``[n_test, n_train]`` score matrix (gradients + store + scores):

* ``dattri``: ``TracInAttributor`` of dattri 0.3.0, in dattri's own venv (``--dattri-python``
  or ``$DATTRI_PYTHON``, default ``.venv-dattri/bin/python``, made by ``make bench-setup``);
* ``naive``: ``vmap(grad(loss))`` per batch, flattened, times a dense Gaussian ``[p, k]``
  generated once per checkpoint, then ``test @ train.T``;
* ``naive-shared``: the same with one Gaussian for every checkpoint, as tracinfunc's
  projection is (a function of seed, kind, dim, name and shape, never of the checkpoint):
  its errors then add up across checkpoints instead of averaging out, which costs agreement;
* ``tif-<kind>``: ``build_store`` (train and test) then ``score``, for each projection kind,
  fed the loader's batches of 100; ``tif-<kind>@1000`` passes ``batch_size=1000`` so that
  build_store merges them into calls of 1000 examples (a vmapped call costs ~2 ms here).

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
INSTALL_DATTRI = "create it with `make bench-setup` (or pass --dattri-python)"


# --- children -------------------------------------------------------------------------------

def _batches(x, y, batch):
    for i in range(0, len(y), batch):
        yield x[i:i + batch], y[i:i + batch]


def run_tracinfunc(problem: dict, method: str, seed: int):
    kind, _, merged = method.partition("@")
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
    with Timer() as timer:
        options = {"batch_size": int(merged)} if merged else {}
        store = tif.build_store(loss, ckpts, _batches(x_train, y_train, batch), projection=spec,
                                **options)
        test = tif.build_store(loss, ckpts, _batches(x_test, y_test, batch),
                               projection=store.projection, **options)
        scores = tif.score(store, test, device="cpu")
    return scores, timer.seconds, baseline


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
    with Timer() as timer:
        scores = torch.zeros(len(y_test), len(y_train))
        for c, (state, lr) in enumerate(zip(problem["states"], problem["lrs"], strict=True)):
            params = {n: v for n, v in state.items()}
            p = sum(v.numel() for v in params.values())
            gen = torch.Generator().manual_seed(seed * 1000 + (0 if shared else c))
            gauss = torch.randn(p, k, generator=gen) / k**0.5  # [p, k]

            def project(x, y, params=params, gauss=gauss):
                rows = []
                for xb, yb in _batches(x, y, batch):
                    g = per_example(params, xb, yb)
                    flat = torch.cat([g[n].reshape(len(yb), -1) for n in sorted(g)], dim=1)
                    rows.append(flat @ gauss)  # [b, p] @ [p, k]
                return torch.cat(rows)

            train, test = project(x_train, y_train), project(x_test, y_test)
            scores += lr * test @ train.T
    return scores, timer.seconds, baseline


def child(args) -> None:
    torch.set_num_threads(args.threads)
    problem = torch.load(args.problem, weights_only=False)
    for run in (tiny(problem), problem):  # warm up, then the timed run
        if args.child in ("naive", "naive-shared"):
            scores, seconds, baseline = run_naive(run, args.seed,
                                                  shared=args.child == "naive-shared")
        else:
            scores, seconds, baseline = run_tracinfunc(run, args.child[len("tif-"):], args.seed)
    np.save(args.out, scores.numpy())
    emit({"seconds": seconds, "peak_rss_mb": peak_rss_mb(), "baseline_rss_mb": baseline})


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
               "--problem", problem, "--out", out, "--seed", str(seed)]
        env = {"OMP_NUM_THREADS": str(args.threads)}
    else:
        cmd = [PYTHON, os.path.abspath(__file__), "--child", method, "--problem", problem,
               "--out", out, "--seed", str(seed), "--threads", str(args.threads)]
        env = {"PYTHONPATH": ROOT}
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
    parser.add_argument("--quick", action="store_true", help="2k train / 400 test")
    parser.add_argument("--methods", default=",".join(
        ["dattri", "naive", "naive-shared"] + [f"tif-{k}" for k in KINDS]
        + [f"tif-{k}@1000" for k in KINDS]))
    parser.add_argument("--dattri-python", default=python_of_dattri())
    parser.add_argument("--seeds", type=int, default=3, help="seeds for the agreement runs")
    parser.add_argument("--repeats", type=int, default=1, help="timing runs (best is kept)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--problem", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    methods = args.methods.split(",")
    if "dattri" in methods:
        problem = check_interpreter(args.dattri_python, "dattri", INSTALL_DATTRI)
        if problem:
            sys.exit(f"vs_dattri: dattri is not available: {problem} (or drop it with "
                     "--methods naive,tif-sjlt,...)")
    n_train, n_test = (2000, 400) if args.quick else (10_000, 2_000)
    k, batch = 512, 100
    print(f"# vs_dattri: {datetime.date.today()}, {machine()}")
    print(f"# timing: synthetic 784->10 logistic regression, {n_train} train / {n_test} test, "
          f"batch {batch}, 2 checkpoints, k={k}; agreement: digits 64->10, {args.seeds} seeds")
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        timing = os.path.join(workdir, "timing.pt")
        save_problem(timing, *synthetic(n_train, n_test), d_in=784, n_classes=10, batch=batch,
                     k=k)
        agree = os.path.join(workdir, "digits.pt")
        save_problem(agree, *digits(), d_in=64, n_classes=10, batch=batch, k=k)
        exact = exact_scores(agree)
        for method in methods:
            runs = [run_method(method, timing, workdir, 0, args) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r["seconds"])
            quality = [agreement(run_method(method, agree, workdir, s, args)["scores"], exact)
                       for s in range(args.seeds)]
            results[method] = {
                "seconds": best["seconds"], "peak_rss_mb": best["peak_rss_mb"],
                "baseline_rss_mb": best["baseline_rss_mb"],
                **{key: float(np.mean([q[key] for q in quality])) for key in quality[0]},
            }
            print(f"  done {method}: {best['seconds']:.2f} s", file=sys.stderr)
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def report(results: dict) -> None:
    naive = results.get("naive", {}).get("seconds")
    dattri = results.get("dattri", {}).get("seconds")
    print("| method | time (s) | x vs naive | x vs dattri | peak RSS (MiB) | peak over start "
          "(MiB) | pearson | spearman | top-10 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for method, r in results.items():
        vs_naive = f"{naive / r['seconds']:.1f}" if naive else "-"
        vs_dattri = f"{dattri / r['seconds']:.1f}" if dattri else "-"
        print(f"| {method} | {r['seconds']:.2f} | {vs_naive} | {vs_dattri} | "
              f"{r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] - r['baseline_rss_mb']:.0f} | "
              f"{r['pearson']:.3f} | {r['spearman']:.3f} | {r['top10']:.2f} |")


if __name__ == "__main__":
    main()
