"""EK-FAC fit time and memory: tracinfunc against kronfluence, same model, data, checkpoints.

Each side fits EK-FAC at every checkpoint in a process of its own, on one thread: one
covariance pass (``A = E[x x^T]``, ``S = E[delta delta^T]``, labels drawn from the model: the
true Fisher), the eigendecompositions, one eigenvalue-correction pass. kronfluence 1.0.1 runs
in its own environment (``$KRONFLUENCE_PYTHON`` or ``.venv-kronfluence``, ``make bench-setup``;
``_kronfluence_child.py`` with ``fit_only``), tracinfunc in ``_tracinfunc_fit_child.py`` under
``$TRACINFUNC_PYTHON``, else kronfluence's interpreter where this checkout's tracinfunc imports
there (the same packages installed: ``make bench-setup`` adds its dependencies), else this
interpreter. kronfluence runs twice: at its defaults (float32 covariances and per-sample
gradients) and in float64 throughout, the arithmetic tracinfunc's fit uses (like for like).
Trials alternate them (interleaved, so load hits all alike); the table gives medians of the
fit's wall and process CPU seconds, the peak RSS of each process (its own ``VmHWM``: a child's
``ru_maxrss`` also holds this parent's RSS at fork), its RSS after the imports and the data
(before the model is built), and the ratios ours / kronfluence's.

Models: an MLP on sklearn digits (64-256-256-10, every Linear weight and bias) and the
2-layer Llama of ``quality_lm.py`` (every Linear weight), both at their seeded init and one
perturbed copy (two checkpoints); ``--model lm-wide``: that Llama at width 256 and 128 tokens.

    python benchmarks/curvature_fit.py --quick    # tiny sizes, one trial (tests/ runs it)
    python benchmarks/curvature_fit.py            # both models, 5 trials (a few minutes)
    python benchmarks/curvature_fit.py --model lm-wide   # 3 trials (about 2 minutes)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# model -> sizes: (n_train, width, length (LM) or hidden (MLP), trials). "lm-wide" (run when
# named: --model lm-wide) is the Llama at width 256 (MLP 1024 wide) and 128 tokens: a batch's
# output gradients (~110 MiB) and float64 terms outgrow its factors, as in real models.
FULL = {"mlp": (1797, 256, 0, 5), "lm": (256, 64, 64, 5), "lm-wide": (128, 256, 128, 3)}
QUICK = {"mlp": (200, 32, 0, 1), "lm": (16, 8, 16, 1), "lm-wide": (8, 32, 16, 1)}
DEFAULT = ("mlp", "lm")
BATCH = 32


def kronfluence_python() -> str:
    return os.environ.get("KRONFLUENCE_PYTHON", str(ROOT / ".venv-kronfluence" / "bin" / "python"))


@functools.cache
def tracinfunc_python() -> str:
    """The interpreter of tracinfunc's children: ``$TRACINFUNC_PYTHON``; else kronfluence's
    own, where this checkout's tracinfunc imports in it (``make bench-setup`` installs its
    dependencies there): both libraries then run with the same packages installed, so an RSS
    gap is the libraries', not the environments'; else this one. (The dev environment holds
    scipy, boto3 and PIL, which ``from transformers import LlamaForCausalLM`` imports where
    installed: ~47 MiB of RSS kronfluence's environment lacks.)"""
    if "TRACINFUNC_PYTHON" in os.environ:
        return os.environ["TRACINFUNC_PYTHON"]
    peer = kronfluence_python()
    if Path(peer).exists():
        probe = subprocess.run([peer, "-c", "import tracinfunc, transformers"],
                               capture_output=True, timeout=600,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        if probe.returncode == 0:
            return peer
    return sys.executable


def checkpoints(model: nn.Module) -> list[dict[str, torch.Tensor]]:
    """The seeded init and a copy with every parameter moved by 1% noise: two checkpoints."""
    g = torch.Generator().manual_seed(1)
    first = {name: value.detach().clone() for name, value in model.state_dict().items()}
    second = {name: value + 0.01 * value.abs().mean() * torch.randn(value.shape, generator=g)
              if value.is_floating_point() else value for name, value in first.items()}
    return [first, second]


def mlp_payload(n_train: int, width: int, tmp: Path) -> dict:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data[:n_train], dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target[:n_train])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                          nn.Linear(width, 10))
    torch.save(model, tmp / "model.pt")
    return {"task": "classification", "model": str(tmp / "model.pt"), "train": (x, y),
            "test": (x[:2], y[:2]), "checkpoints": checkpoints(model),
            "select": [name for name, _ in model.named_parameters()]}


def lm_payload(n_train: int, width: int, length: int, n_test: int = 2) -> dict:
    sys.path.insert(0, str(HERE))
    import quality_lm

    sizes = quality_lm.Sizes(n_train, n_test, 1, 1, 1, length, width, (), (), 1, False)
    train, test = quality_lm.load_text(sizes)
    model = quality_lm.make_model(sizes, seed=0)
    return {"task": "lm", "config": quality_lm.model_config(sizes), "train": train,
            "test": test, "checkpoints": checkpoints(model),
            "select": quality_lm.linear_weights(model)}


def measure_memory(sizes: tuple, n_test: int, k: int, tmp: Path) -> dict:
    """Peak RSS of each curvature path on the LM, fitted and scored (``n_test`` test
    sequences against the training ones), beside kronfluence's EK-FAC fit and scores."""
    n_train, width, length, trials = sizes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        payload = lm_payload(n_train, width, length, n_test)
    payload.update({"batch": BATCH, "threads": 1, "dampings": {"heuristic": None}, "k": k})
    paths = {}
    for scenario in (*SCENARIOS, "kronfluence"):
        work = tmp / scenario
        work.mkdir(exist_ok=True)
        paths[scenario] = tmp / f"memory-{scenario}.pt"
        torch.save({**payload, "scenario": scenario, "workdir": str(work),
                    "fit_only": scenario in ("ekfac-fit", "kfac-fit")}, paths[scenario])
    peers = [*SCENARIOS, "kronfluence"] if Path(kronfluence_python()).exists() else SCENARIOS
    runs: dict[str, list[dict]] = {who: [] for who in peers}
    for trial in range(trials):  # interleaved, the order alternating
        for who in peers if trial % 2 == 0 else peers[::-1]:
            runs[who].append(run_child("kronfluence" if who == "kronfluence" else "ours",
                                       paths[who], tmp / who))
    keys = ("fit_cpu_s", "peak_rss_mib", "rss_before_fit_mib", "rss_with_model_mib")
    return {"n_train": n_train, "n_test": n_test, "k": k, "trials": trials,
            "medians": {who: {key: statistics.median(r[key] for r in rows) for key in keys}
                        for who, rows in runs.items()}}


# curvature_fit.py --memory: what each is (the child's payload["scenario"])
SCENARIOS = {
    "kfac-fit": "K-FAC fit only (factors A, S per layer)",
    "ekfac-fit": "EK-FAC fit only (factors, eigenbases, eigenvalues)",
    "exact-ram": "EK-FAC fit + exact (identity) train store in RAM + exact queries, scored",
    "exact-disk": "EK-FAC fit + exact train store written to Zarr on disk, streamed, scored",
    "k-store": "EK-FAC fit + k-store in RAM, queries preconditioned then projected, scored",
    "projected": "'projected' fit on the k-store (k x k Fisher), scored",
}


def print_memory(result: dict) -> None:
    base = result["medians"].get("kronfluence")
    print(f"\nPeak RSS, 2-layer Llama, {result['n_train']} train x {result['n_test']} test "
          f"sequences, 2 checkpoints, k={result['k']}, medians of {result['trials']} "
          "interleaved trials")
    print("| path | peak RSS MiB | RSS ratio | above the model MiB | ratio | "
          "CPU s (kronfluence: fit) |")
    print("|---|---:|---:|---:|---:|---:|")
    for who, m in result["medians"].items():
        ratio = f"{m['peak_rss_mib'] / base['peak_rss_mib']:.2f}x" if base else "-"
        label = SCENARIOS.get(who, "kronfluence: EK-FAC fit + pairwise scores")
        above = f"{own(m) / own(base):.2f}x" if base else "-"
        print(f"| {label} | {m['peak_rss_mib']:.0f} | {ratio} | {own(m):.0f} | {above} | "
              f"{m['fit_cpu_s']:.2f} |")


def run_child(who: str, payload: Path, tmp: Path) -> dict:
    if who == "kronfluence":
        command = [kronfluence_python(), str(HERE / "_kronfluence_child.py"), str(payload),
                   str(tmp / "scores.pt"), str(tmp / "work")]
    else:
        command = [tracinfunc_python(), str(HERE / "_tracinfunc_fit_child.py"), str(payload)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{who} failed:\n{done.stderr[-3000:]}")
    return json.loads(next(line[7:] for line in done.stdout.splitlines()
                           if line.startswith("RESULT ")))


def measure(name: str, sizes: tuple, tmp: Path) -> dict:
    n_train, width, length, trials = sizes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        payload = (mlp_payload(n_train, width, tmp) if name == "mlp"
                   else lm_payload(n_train, width, length))
    payload.update({"batch": BATCH, "threads": 1, "fit_only": True, "dampings": {}})
    paths = {}
    for who, (_, changes) in PEERS.items():
        paths[who] = tmp / f"{name}-{who.replace(' ', '-')}.pt"
        torch.save({**payload, **changes}, paths[who])
    peers = list(PEERS) if Path(kronfluence_python()).exists() else ["ours"]
    runs: dict[str, list[dict]] = {who: [] for who in peers}
    for trial in range(trials):  # interleaved, the order alternating
        for who in peers if trial % 2 == 0 else peers[::-1]:
            runs[who].append(run_child(PEERS[who][0], paths[who], tmp))
    keys = ("fit_s", "fit_cpu_s", "peak_rss_mib", "rss_before_fit_mib", "rss_with_model_mib")
    medians = {who: {key: statistics.median(r[key] for r in rows) for key in keys}
               for who, rows in runs.items()}
    n_params = sum(v.numel() for k, v in payload["checkpoints"][0].items()
                   if k in set(payload["select"]))
    return {"model": name, "n_train": n_train, "batch": BATCH, "n_ckpt": 2,
            "n_params": n_params, "trials": trials, "medians": medians,
            "versions": {who: rows[0]["version"] for who, rows in runs.items()}}


# Who runs, and what each changes in the payload: kronfluence at its defaults (float32
# covariances and per-sample gradients, float64 eigendecompositions) and in float64 throughout,
# tracinfunc's arithmetic (like for like: ``_kronfluence_child.FLOAT64``).
PEERS = {"ours": ("ours", {}), "kronfluence": ("kronfluence", {}),
         "kronfluence float64": ("kronfluence", {"kronfluence_dtype": "float64"})}


def print_table(results: list[dict]) -> None:
    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
          f"1 thread per process, medians of interleaved trials; load "
          f"{os.getloadavg()[0]:.1f}; tracinfunc's interpreter {tracinfunc_python()}")
    print("ratios: to kronfluence at its defaults (float32 covariances) / to kronfluence in "
          "float64 (ours: float64 covariances and eigenvalue sums; like for like)")
    print("| model | who | fit wall s | fit CPU s | CPU ratio | peak RSS MiB | RSS ratio | "
          "RSS after imports + data | peak minus that | RSS with the model | fit's own: "
          "peak minus that | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for result in results:
        base = result["medians"].get("kronfluence")
        like = result["medians"].get("kronfluence float64")
        for who, m in result["medians"].items():
            ratio = (f"{m['fit_cpu_s'] / base['fit_cpu_s']:.2f}x / "
                     f"{m['fit_cpu_s'] / like['fit_cpu_s']:.2f}x") if base else "-"
            rss = (f"{m['peak_rss_mib'] / base['peak_rss_mib']:.2f}x / "
                   f"{m['peak_rss_mib'] / like['peak_rss_mib']:.2f}x") if base else "-"
            own_ratio = f"{own(m) / own(base):.2f}x / {own(m) / own(like):.2f}x" if base else "-"
            print(f"| {result['model']} ({result['n_params']} params, {result['n_train']} "
                  f"x 2 ckpts) | {who} {result['versions'][who]} | {m['fit_s']:.2f} | "
                  f"{m['fit_cpu_s']:.2f} | {ratio} | {m['peak_rss_mib']:.0f} | {rss} | "
                  f"{m['rss_before_fit_mib']:.0f} | "
                  f"{m['peak_rss_mib'] - m['rss_before_fit_mib']:.0f} | "
                  f"{m['rss_with_model_mib']:.0f} | {own(m):.0f} | {own_ratio} |")


def own(m: dict) -> float:
    """The fit's own memory: peak RSS above the RSS with the model built (what the
    environment's imports cost is below it: transformers imports more where more is
    installed)."""
    return m["peak_rss_mib"] - m["rss_with_model_mib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one trial")
    parser.add_argument("--model", choices=sorted(FULL), action="append")
    parser.add_argument("--trials", type=int, help="override the trials per model")
    parser.add_argument("--memory", action="store_true",
                        help="peak RSS of each curvature path on the LM, fitted and scored")
    args = parser.parse_args()
    table = QUICK if args.quick else FULL
    results = []
    with tempfile.TemporaryDirectory(prefix="curvature-fit-") as tmp:
        if args.memory:
            sizes = table["lm"] if args.trials is None else (*table["lm"][:3], args.trials)
            result = measure_memory(sizes, 4 if args.quick else 32, 16 if args.quick else 256,
                                    Path(tmp))
            print_memory(result)
            print("\n" + json.dumps(result))
            return
        for name in args.model or DEFAULT:
            sizes = table[name] if args.trials is None else (*table[name][:3], args.trials)
            results.append(measure(name, sizes, Path(tmp)))
    print_table(results)
    print("\n" + json.dumps(results))


if __name__ == "__main__":
    main()
