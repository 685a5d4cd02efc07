"""Cost of optimizer-aware TracIn: projected gradients with and without a preconditioner.

One process, side by side, median of ``--repeats`` timed calls after a warm-up call each:
plain projected gradients, the same with an Adam (LESS) and a TrackStar preconditioner, for
``sjlt`` and ``kronecker`` projections, and one batched forward+backward as the floor. With
a preconditioner ``kind="kronecker"`` leaves its factorised path (a per-element map does not
factorise) and materialises each example's gradient: the ratio shows what that costs.

    python benchmarks/preconditioning.py            # MLP 256 wide, 4 layers, batch 128, k=1024
    python benchmarks/preconditioning.py --quick    # tiny sizes (tests/ runs it)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tracinfunc as tif


def make_problem(width: int, depth: int, batch: int):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):  # a real Adam state to precondition with
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval(), optimizer, (x, y)


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: projector blocks, torch.func tracing caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="MLP 2x32, batch 16, k=64")
    args = parser.parse_args()
    if args.quick:
        args.width, args.depth, args.batch, args.dim, args.repeats = 32, 2, 16, 64, 1
    model, optimizer, batch = make_problem(args.width, args.depth, args.batch)
    loss = tif.loss_from_module(model, F.cross_entropy)
    params = {name: p.detach() for name, p in model.named_parameters()}
    n_params = sum(p.numel() for p in params.values())

    def forward_backward():
        model.zero_grad()
        F.cross_entropy(model(batch[0]), batch[1]).backward()

    floor = median_seconds(forward_backward, args.repeats)
    print(f"MLP {args.depth}x{args.width} ({n_params} parameters), batch {args.batch}, "
          f"k={args.dim}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"one batched forward+backward: {floor * 1e3:.1f} ms\n")
    print("| projection | preconditioner | ms | x plain | x fwd+bwd |")
    print("| --- | --- | ---: | ---: | ---: |")
    for kind in ("sjlt", "kronecker"):
        projection = tif.Projection(dim=args.dim, kind=kind, seed=0)
        plain = None
        for pre in (None, "adam", "trackstar"):
            precondition = (None if pre is None else
                            tif.Preconditioner.from_optimizer(optimizer, model, kind=pre))
            fn = tif.projected_grads(loss, projection, precondition=precondition)
            seconds = median_seconds(lambda fn=fn: fn(params, batch), args.repeats)
            plain = seconds if pre is None else plain
            print(f"| {kind} | {pre or 'none'} | {seconds * 1e3:.1f} | "
                  f"{seconds / plain:.2f} | {seconds / floor:.1f} |")


if __name__ == "__main__":
    main()
