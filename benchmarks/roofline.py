"""The cost floor of any gradient method vs tracinfunc's projected per-sample gradients.

One batched forward+backward over ``B`` examples (``loss.sum().backward()``: summed
gradients, not per-example ones) is what every per-example method must at least pay. This
script times it beside ``projected_grads`` for the same ``B`` examples with each projection
kind, and ``per_sample_grads`` (full per-example gradients, unprojected), and prints the ratios.

    python benchmarks/roofline.py            # MLP 784-1024-1024-10, B=256, k=512
    python benchmarks/roofline.py --quick    # a small MLP, B=32: checks it runs (tests/)

Target (issue 5): the factorised ``kind="kronecker"`` within 3x of the batched
forward+backward on the 784-1024-1024-10 MLP.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tracinfunc as tif


def best_of(fn, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up call (one-time costs excluded)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="MLP 196-256-256-10, B=32, 2 repeats (seconds; tests/ runs it)")
    parser.add_argument("--batch", type=int, help="examples (default 256; 32 with --quick)")
    parser.add_argument("--dim", type=int, default=512, help="projected dimension k")
    parser.add_argument("--repeats", type=int, help="timed repeats (best counts)")
    parser.add_argument("--widths", type=int, nargs="+",
                        help="layer widths (default 784 1024 1024 10; 196 256 256 10 with --quick)")
    args = parser.parse_args()
    batch = args.batch or (32 if args.quick else 256)
    repeats = args.repeats or (2 if args.quick else 5)
    args.widths = args.widths or ([196, 256, 256, 10] if args.quick else [784, 1024, 1024, 10])

    torch.manual_seed(0)
    layers = []
    for d_in, d_out in zip(args.widths[:-1], args.widths[1:], strict=True):
        layers += [nn.Linear(d_in, d_out), nn.ReLU()]
    model = nn.Sequential(*layers[:-1]).eval()
    params = {name: p.detach() for name, p in model.named_parameters()}
    p = sum(v.numel() for v in params.values())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, args.widths[0], generator=g)
    y = torch.randint(0, args.widths[-1], (batch,), generator=g)
    loss = tif.loss_from_module(model, F.cross_entropy)

    def batched_forward_backward():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y, reduction="sum").backward()

    rows = [("batched forward+backward (the floor)", best_of(batched_forward_backward, repeats))]
    for kind in ("kronecker", "sjlt", "rademacher"):
        fn = tif.projected_grads(loss, tif.Projection(dim=args.dim, seed=0, kind=kind))
        rows.append((f"projected_grads kind={kind!r}",
                     best_of(lambda fn=fn: fn(params, (x, y)), repeats)))
    psg = tif.per_sample_grads(loss)
    rows.append(("per_sample_grads (full, unprojected)",
                 best_of(lambda: psg(params, (x, y)), repeats)))

    print(f"# roofline: MLP {'-'.join(map(str, args.widths))} (p={p:,}), B={batch}, "
          f"k={args.dim}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"best of {repeats}")
    floor = rows[0][1]
    print("| what | seconds | ms / example | x the floor |")
    print("| --- | ---: | ---: | ---: |")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.4f} | {1e3 * seconds / batch:.3f} | "
              f"{seconds / floor:.2f} |")


if __name__ == "__main__":
    main()
