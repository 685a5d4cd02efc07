"""Memory and speed techniques side by side: peak memory, time, and score error vs float32.

Every configuration runs in a fresh subprocess (so peak RSS, the process's maximum resident
set size, belongs to that configuration alone; with CUDA also ``torch.cuda.max_memory_allocated``),
computes projected gradients of ``n_train`` training and ``n_test`` test examples with
:func:`tracinfunc.projected_grads`, and writes its scores ``[n_test, n_train]``; this process
compares them with the float32 baseline and prints one table per model.

    python benchmarks/memory_techniques.py --quick     # tiny MLP only: checks it runs (tests/)
    python benchmarks/memory_techniques.py --full      # the issue's sizes: ~10M-parameter MLP,
                                                       # batch 256; ~11 GB peak for the baseline

Targets at full size (deep MLP, batch 256): checkpointing and offloading each cut peak memory
at least 2x vs the plain vmap path; last-layer-only at least 5x faster than full gradients.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tracinfunc as tif

SIZES = {
    # model: (quick, full) keyword arguments
    "mlp": ({"width": 128, "depth": 4, "batch": 16, "n_train": 32},
            {"width": 1024, "depth": 10, "batch": 256, "n_train": 512}),
    "convnet": ({"channels": 4, "batch": 16, "n_train": 32},
                {"channels": 32, "batch": 256, "n_train": 512}),
}
N_TEST = 16
N_CLASSES = 10
PROJECTION = tif.Projection(dim=512, seed=0, kind="sjlt")
CONFIGS = [
    "baseline", "+mixed precision bf16", "+mixed precision fp16", "+checkpointing",
    "+offloading", "+layer selection (last layer)", "+layer selection + frozen prefix",
    "+automatic chunking", "checkpointing + bf16 + chunking",
]


def make_model(name: str, size: dict) -> tuple[nn.Sequential, tuple[int, ...]]:
    torch.manual_seed(0)
    if name == "mlp":
        width, layers = size["width"], []
        for _ in range(size["depth"]):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, N_CLASSES)).eval(), (width,)
    c = size["channels"]
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * c * 8 * 8, 128), nn.ReLU(), nn.Linear(128, N_CLASSES),
    ).eval(), (3, 32, 32)


def make_data(shape: tuple[int, ...], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs with labels from a random linear teacher, 10% of them flipped."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, *shape, generator=g)
    teacher = torch.randn(x[0].numel(), N_CLASSES, generator=g)
    y = (x.flatten(1) @ teacher).argmax(1)
    flip = torch.rand(n, generator=g) < 0.1
    y[flip] = torch.randint(0, N_CLASSES, (int(flip.sum()),), generator=g)
    return x, y


def train_briefly(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 30) -> None:
    """A few SGD steps, so that scores have the structure of a trained model (at random
    initialisation, all examples of one class score within ~1% of each other and top-k
    ranks are ties broken by rounding)."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        i = (step * 64) % x.shape[0]
        optimizer.zero_grad()
        F.cross_entropy(model(x[i:i + 64]), y[i:i + 64]).backward()
        optimizer.step()
    model.eval()


def options_for(config: str, model: nn.Sequential, params: dict, batch: int) -> dict:
    stages = tif.model_stages(model, F.cross_entropy)
    p = sum(v.numel() for v in params.values())
    # An eighth of the plain path's per-example gradient memory for the whole batch.
    budget = max(batch * p * 4 // 8, 3 * 4 * p)
    return {
        "baseline": {},
        "+mixed precision bf16": {"mixed_precision": torch.bfloat16},
        "+mixed precision fp16": {"mixed_precision": torch.float16},
        "+checkpointing": {"stages": stages},
        "+offloading": {"stages": stages, "offload": True},
        "+layer selection (last layer)": {"select": tif.last_layers(1)},
        "+layer selection + frozen prefix": {"select": tif.last_layers(1), "stages": stages},
        "+automatic chunking": {"memory_budget": budget},
        "checkpointing + bf16 + chunking": {"stages": stages, "mixed_precision": torch.bfloat16,
                                            "memory_budget": budget},
    }[config]


def prepare(model_name: str, full: bool, path: str) -> None:
    """Train the model briefly once and save it, so every configuration scores the same one."""
    size = SIZES[model_name][int(full)]
    model, shape = make_model(model_name, size)
    x, y = make_data(shape, size["n_train"] + N_TEST)
    train_briefly(model, x[:size["n_train"]], y[:size["n_train"]])
    torch.save(model.state_dict(), path)


def worker(model_name: str, config: str, full: bool, out: str, repeats: int) -> None:
    """One configuration in this (fresh) process; writes scores and measurements to ``out``."""
    size = SIZES[model_name][int(full)]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, shape = make_model(model_name, size)
    model.load_state_dict(torch.load(str(Path(out).parent / f"{model_name}.pt")))
    model.to(device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    n = size["n_train"] + N_TEST
    x, y = (t.to(device) for t in make_data(shape, n))
    loss = tif.loss_from_module(model, F.cross_entropy)
    options = options_for(config, model, params, size["batch"])
    fn = tif.projected_grads(loss, PROJECTION, options=tif.GradientOptions(**options))
    fn(params, (x[:2], y[:2]))  # set-up outside the timing: projection blocks, stage check
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    b, n_train = size["batch"], size["n_train"]
    seconds = float("inf")
    for _ in range(repeats):  # the fastest pass: the machine may be shared
        start = time.perf_counter()
        train = torch.cat([fn(params, (x[i:i + b], y[i:i + b])) for i in range(0, n_train, b)])
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = min(seconds, time.perf_counter() - start)
    test = fn(params, (x[n_train:], y[n_train:]))
    torch.save({"scores": (test @ train.T).cpu()}, out + ".pt")
    result = {
        "seconds": seconds, "n_train": n_train, "batch": b,
        "n_params": sum(v.numel() for v in params.values()),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cuda_peak_mib": (torch.cuda.max_memory_allocated() / 2**20
                          if device.type == "cuda" else None),
        "chunk_size": (tif.grads.chunk_size_for_budget(options["memory_budget"], n_params=_largest(
            options, params)) if "memory_budget" in options else None),
    }
    Path(out + ".json").write_text(json.dumps(result))


def _largest(options: dict, params: dict) -> int:
    if "stages" not in options:
        return sum(v.numel() for v in params.values())
    return max(sum(params[n].numel() for n in s.param_names) for s in options["stages"].stages)


def repeated_builds(full: bool) -> None:
    """Worker: build a store five times in one process; RSS must not grow after the first."""
    size = SIZES["mlp"][int(full)]
    model, shape = make_model("mlp", size)
    loss = tif.loss_from_module(model, F.cross_entropy)
    stages = tif.model_stages(model, F.cross_entropy)
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(size["n_train"], *shape, generator=g),
            torch.randint(0, N_CLASSES, (size["n_train"],), generator=g))
    batches = [(data[0][i:i + size["batch"]], data[1][i:i + size["batch"]])
               for i in range(0, size["n_train"], size["batch"])]
    ckpt = [tif.Checkpoint.from_module(model)]

    def build() -> None:
        tif.build_store(
            loss,
            ckpt,
            batches,
            projection=PROJECTION,
            options=tif.GradientOptions(stages=stages, offload=True),
        )

    build()  # first use: lazy imports and torch's one-time set-up
    rss = []
    for _ in range(5):
        build()
        rss.append(_current_rss_mib())
    # What is left for the cyclic garbage collector after a build (everything else is freed
    # by reference counting the moment the build returns).
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    build()
    gc.collect()
    tensors = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    kinds = sorted({type(o).__name__ for o in gc.garbage if type(o).__module__.startswith(
        "tracinfunc")})
    gc.set_debug(0)
    print(json.dumps({"rss": rss, "cyclic_tensors": len(tensors),
                      "cyclic_mib": sum(t.numel() * t.element_size() for t in tensors) / 2**20,
                      "cyclic_tracinfunc_objects": kinds}))


def _current_rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _run_worker(args: list[str]) -> None:
    subprocess.run([sys.executable, __file__, *args], check=True)


def _rank_correlation(reference: torch.Tensor, approx: torch.Tensor, k: int = 10) -> float:
    """Smallest Spearman correlation over test rows, on each row's reference top-k."""
    idx = reference.topk(k, dim=1).indices
    a = reference.gather(1, idx).argsort(1).argsort(1).double()
    b = approx.gather(1, idx).argsort(1).argsort(1).double()
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    return float(((a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))).min())


def _top_overlap(reference: torch.Tensor, approx: torch.Tensor, k: int = 10) -> float:
    """Mean over test rows of |top-k(reference) & top-k(approx)| / k."""
    a, b = reference.topk(k, dim=1).indices, approx.topk(k, dim=1).indices
    return float(sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b, strict=True))
                 / (k * a.shape[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--quick", action="store_true",
                      help="a tiny MLP (--models convnet adds the convnet): seconds a config")
    size.add_argument("--full", action="store_true", help="the issue's sizes (~11 GB peak)")
    size.add_argument("--worker", nargs=3, metavar=("MODEL", "CONFIG", "OUT"),
                      help=argparse.SUPPRESS)
    size.add_argument("--repeated-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-full", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", choices=list(SIZES),
                        help="default: both with --full, the mlp with --quick")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads per worker (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes; the fastest counts")
    args = parser.parse_args()
    if args.worker:
        if args.threads:
            torch.set_num_threads(args.threads)
        worker(args.worker[0], args.worker[1], args.worker_full, args.worker[2], args.repeats)
        return
    if args.repeated_worker:
        repeated_builds(args.worker_full)
        return
    full = ["--worker-full"] if args.full else []
    full += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = args.threads or torch.get_num_threads()
    print(f"device={device}, torch {torch.__version__}, threads={threads}, "
          f"projection={PROJECTION}, {'full' if args.full else 'quick'} size")
    models = args.models or (list(SIZES) if args.full else ["mlp"])
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in models:
            prepare(model_name, args.full, str(Path(tmp) / f"{model_name}.pt"))
            rows = {}
            for config in CONFIGS:
                out = str(Path(tmp) / f"{model_name}-{CONFIGS.index(config)}")
                _run_worker(["--worker", model_name, config, out, *full])
                rows[config] = (json.loads(Path(out + ".json").read_text()),
                                torch.load(out + ".pt")["scores"])
            _print_table(model_name, rows, device)
        result = subprocess.run([sys.executable, __file__, "--repeated-worker", *full],
                                check=True, capture_output=True, text=True)
        report = json.loads(result.stdout.strip().splitlines()[-1])
        rss = report["rss"]
        print("\nRepeated builds (mlp, checkpointing + offloading, one process), current RSS "
              "after each, MiB: " + ", ".join(f"{v:.0f}" for v in rss)
              + f"  (growth after the first: {rss[-1] - rss[0]:+.0f} MiB)")
        print(f"Left to the cyclic garbage collector by one build: {report['cyclic_tensors']} "
              f"tensors, {report['cyclic_mib']:.1f} MiB, in tracinfunc objects "
              f"{report['cyclic_tracinfunc_objects']}")


def _print_table(model_name: str, rows: dict, device: str) -> None:
    base, base_scores = rows["baseline"]
    print(f"\n{model_name}: p={base['n_params']:,} parameters, n_train={base['n_train']}, "
          f"n_test={N_TEST}")
    cuda = device == "cuda"
    header = (f"{'configuration':34} {'batch':>5} {'chunk':>5} {'peak RSS MiB':>12} "
              + (f"{'CUDA peak MiB':>13} " if cuda else "")
              + f"{'mem x':>6} {'s / 1k ex':>9} {'speed-up':>8} {'score err':>9} "
              + f"{'top-10 rho':>10} {'top-10 set':>10}")
    print(header)
    print("-" * len(header))
    for config, (result, scores) in rows.items():
        per_1k = result["seconds"] / result["n_train"] * 1000
        error = float((scores - base_scores).norm() / base_scores.norm())
        memory = (base["cuda_peak_mib"] / result["cuda_peak_mib"] if cuda
                  else base["peak_rss_mib"] / result["peak_rss_mib"])
        print(f"{config:34} {result['batch']:>5} {result['chunk_size'] or '-':>5} "
              f"{result['peak_rss_mib']:>12.0f} "
              + (f"{result['cuda_peak_mib']:>13.0f} " if cuda else "")
              + f"{memory:>6.2f} {per_1k:>9.2f} {base['seconds'] / result['seconds']:>8.2f} "
              f"{error:>9.2e} {_rank_correlation(base_scores, scores):>10.3f} "
              f"{_top_overlap(base_scores, scores):>10.2f}")
    top = base_scores.topk(10, dim=1).values
    spread = ((top[:, 0] - top[:, -1]) / top[:, 0].abs()).median()
    print(f"(top-10 rho: smallest Spearman over test rows within the baseline's top 10; "
          f"top-10 set: mean overlap of the top-10 sets. The baseline's 10 best scores of a "
          f"test row span a median {float(spread):.1%} of the best one.)")


if __name__ == "__main__":
    main()
