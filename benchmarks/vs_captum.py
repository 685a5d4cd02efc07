"""tracinfunc vs captum's TracInCP and TracInCPFastRandProj, side by side on the same checkpoints.

An MLP 64-32-10 trained on sklearn digits with SGD, 3 checkpoints saved as state-dict files
(captum loads files; each file also records its learning rate). Every method runs in a fresh
child process (peak RSS is its own), warms up on a slice, then is timed from the files to the
``[n_test, n_train]`` score matrix:

* ``captum-TracInCP``: exact TracIn over every parameter (``sample_wise_grads_per_batch``);
* ``tif-identity``: tracinfunc's exact TracIn (``Projection(kind="identity")``);
* ``tif-<kind>``: projected to ``k`` dimensions (rademacher, sjlt, kronecker);
* ``captum-FastRandProj``: TracInCPFastRandProj, which (like captum's TracInCPFast) uses the
  last Linear layer's *weight* gradient only, randomly projected, with ``projection_dim=k``;
* ``tif-last-<kind>``: tracinfunc on the same quantity (``select=["2.weight"]``), projected.

Exact methods are compared with a float64 reference (max relative error); projected ones by
pearson / mean spearman / top-10 overlap with the exact scores of the same quantity.

    python benchmarks/vs_captum.py --quick     # 400 train / 100 test, k=64
    python benchmarks/vs_captum.py             # 1437 train / 360 test, k=256
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

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
    machine,
    peak_rss_mb,
    run_child,
)

LAST = "2.weight"  # the last Linear layer's weight in nn.Sequential(Linear, Tanh, Linear)
METHODS = ("captum-TracInCP", "tif-identity", "tif-rademacher", "tif-sjlt", "tif-kronecker",
           "captum-FastRandProj", "tif-last-kronecker", "tif-last-sjlt")


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def prepare(workdir: str, n_train: int, n_test: int) -> dict:
    """Train with SGD, save 3 checkpoints (state dict + learning_rate) and the data."""
    (x_train, y_train), (x_test, y_test) = digits()
    x_train, y_train, x_test, y_test = x_train[:n_train], y_train[:n_train], x_test[:n_test], \
        y_test[:n_test]
    torch.manual_seed(0)
    model, lr = make_model(), 0.05
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    files = []
    for epoch in range(1, 7):
        for i in range(0, n_train, 32):
            optimizer.zero_grad()
            F.cross_entropy(model(x_train[i:i + 32]), y_train[i:i + 32]).backward()
            optimizer.step()
        if epoch % 2 == 0:
            path = os.path.join(workdir, f"epoch-{epoch}.pt")
            torch.save({**model.state_dict(), "learning_rate": lr}, path)
            files.append(path)
    problem = {"train": (x_train, y_train), "test": (x_test, y_test), "files": files}
    torch.save(problem, os.path.join(workdir, "problem.pt"))
    return problem


def load_checkpoint(model: nn.Module, path: str) -> float:
    """captum's checkpoints_load_func: load the weights, return the learning rate."""
    state = torch.load(path, weights_only=True)
    lr = float(state.pop("learning_rate"))
    model.load_state_dict(state)
    return lr


def _no_neighbors_class():
    """captum's default nearest-neighbour index needs ``annoy``; score mode never queries it."""
    from captum.influence._utils.nearest_neighbors import NearestNeighbors

    class NoNeighbors(NearestNeighbors):
        def setup(self, data: torch.Tensor) -> None:
            pass

        def get_nearest_neighbors(self, query: torch.Tensor, k: int):
            raise NotImplementedError("vs_captum compares influence scores, not neighbours")

    return NoNeighbors


def _NoNeighbors():
    return _no_neighbors_class()()


# --- children -------------------------------------------------------------------------------

def run_captum(problem: dict, method: str, k: int, seed: int) -> torch.Tensor:
    from captum.influence import TracInCP, TracInCPFastRandProj
    from torch.utils.data import TensorDataset

    model = make_model().eval()
    train = TensorDataset(*problem["train"])
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    if method == "captum-TracInCP":
        tracin = TracInCP(model, train, problem["files"], checkpoints_load_func=load_checkpoint,
                          loss_fn=loss_fn, batch_size=100, sample_wise_grads_per_batch=True)
    else:
        tracin = TracInCPFastRandProj(model, model[2], train, problem["files"],
                                      checkpoints_load_func=load_checkpoint, loss_fn=loss_fn,
                                      batch_size=100, projection_dim=k, seed=seed,
                                      nearest_neighbors=_NoNeighbors())
    return tracin.influence(problem["test"], k=None)  # scores [n_test, n_train]


def run_tracinfunc(problem: dict, method: str, k: int, seed: int) -> torch.Tensor:
    import tracinfunc as tif

    model = make_model().eval()
    checkpoints = []
    for path in problem["files"]:
        lr = load_checkpoint(model, path)
        checkpoints.append(tif.Checkpoint.from_module(model, lr=lr, name=os.path.basename(path)))
    loss = tif.loss_from_module(model, F.cross_entropy)
    kind = method.rsplit("-", 1)[1]
    projection = (tif.Projection(kind="identity") if kind == "identity"
                  else tif.Projection(dim=k, seed=seed, kind=kind))
    select = [LAST] if method.startswith("tif-last-") else None
    x, y = problem["train"]
    batches = [(x[i:i + 100], y[i:i + 100]) for i in range(0, len(y), 100)]
    store = tif.build_store(
        loss,
        checkpoints,
        batches,
        projection=projection,
        options=tif.GradientOptions(select=select),
    )
    test = tif.build_store(loss, checkpoints, problem["test"], projection=projection,
                           options=tif.GradientOptions(select=select))
    return tif.score(store, test, device="cpu")


def child(args) -> None:
    torch.set_num_threads(args.threads)
    problem = torch.load(args.problem, weights_only=False)
    run = run_captum if args.child.startswith("captum") else run_tracinfunc
    warm = {**problem, "train": tuple(t[:100] for t in problem["train"]),
            "test": tuple(t[:10] for t in problem["test"])}
    run(warm, args.child, args.k, args.seed)  # one-time costs are not what is compared
    baseline = current_rss_mb()
    with Timer() as timer:
        scores = run(problem, args.child, args.k, args.seed)
    np.save(args.out, scores.detach().numpy())
    emit({"seconds": timer.seconds, "peak_rss_mb": peak_rss_mb(), "baseline_rss_mb": baseline})


# --- parent ---------------------------------------------------------------------------------

def exact(problem: dict, select) -> np.ndarray:
    """Float64 exact TracIn of the saved checkpoints (all parameters, or ``select``)."""
    import tracinfunc as tif

    model = make_model().double().eval()
    checkpoints = []
    for path in problem["files"]:
        lr = load_checkpoint(model, path)
        checkpoints.append(tif.Checkpoint.from_module(model, lr=lr))
    loss = tif.loss_from_module(model, F.cross_entropy)
    spec = tif.Projection(kind="identity")
    (x, y), (xt, yt) = problem["train"], problem["test"]
    store = tif.build_store(
        loss,
        checkpoints,
        (x.double(), y),
        projection=spec,
        options=tif.GradientOptions(select=select),
        dtype=torch.float64,
    )
    test = tif.build_store(
        loss,
        checkpoints,
        (xt.double(), yt),
        projection=spec,
        options=tif.GradientOptions(select=select),
        dtype=torch.float64,
    )
    return tif.score(store, test, device="cpu").numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="400 train / 100 test, k=64")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--problem", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, default=256, help="projection dimension")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if any(m.startswith("captum") for m in args.methods.split(",")):
        missing = check_interpreter(PYTHON, "captum", "install it with `make bench-setup` "
                                    "(pip install -e '.[bench]')")
        if missing:
            sys.exit(f"vs_captum: captum is not available: {missing}")
    n_train, n_test, k = (400, 100, 64) if args.quick else (1437, 360, args.k)
    print(f"# vs_captum: {datetime.date.today()}, {machine()}")
    print(f"# MLP 64-32-10 on digits, {n_train} train / {n_test} test, 3 checkpoints, k={k}")
    with tempfile.TemporaryDirectory() as workdir:
        problem = prepare(workdir, n_train, n_test)
        references = {"all": exact(problem, None), "last": exact(problem, [LAST])}
        print("| method | quantity | time (s) | peak RSS (MiB) | peak over start (MiB) | "
              "max rel err vs exact | pearson | spearman | top-10 |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for method in args.methods.split(","):
            out = os.path.join(workdir, f"{method}.npy")
            result = run_child([PYTHON, os.path.abspath(__file__), "--child", method,
                                "--problem", os.path.join(workdir, "problem.pt"), "--out", out,
                                "--k", str(k), "--threads", str(args.threads)],
                               env={"PYTHONPATH": ROOT})
            scores = np.load(out).astype(np.float64)
            last = method in ("captum-FastRandProj",) or method.startswith("tif-last-")
            reference = references["last" if last else "all"]
            quality = agreement(scores, reference)
            rel = float(np.abs(scores - reference).max() / np.abs(reference).max())
            print(f"| {method} | {'last-layer weight' if last else 'all parameters'} | "
                  f"{result['seconds']:.3f} | {result['peak_rss_mb']:.0f} | "
                  f"{result['peak_rss_mb'] - result['baseline_rss_mb']:.0f} | {rel:.1e} | "
                  f"{quality['pearson']:.4f} | {quality['spearman']:.3f} | "
                  f"{quality['top10']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
