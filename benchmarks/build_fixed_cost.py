"""The fixed cost of a new gradient function: one batch per ``projected_grads`` call (issue 34).

``build_store`` makes a new gradient function for every call (every checkpoint set, every
test-gradient build of a query); the factorised kronecker path's first batch used to discover
the layers, check them on one example and prove the batched path against a per-example
backward: about two floor batches each time. Plans are now shared between functions for the
same loss and layout (:mod:`tracinfunc.grads.plan_cache`). One process, 1 thread, CPU time,
interleaved (floor, reused, fresh, fresh without the shared plans), medians:

- ``reused``: one function, called again (the cost of a batch in a long build);
- ``fresh``: a new ``projected_grads`` per batch, as a ``build_store`` per batch does;
- ``fresh, plans cleared``: the same with the shared plans forgotten first (before issue 34).

    python benchmarks/build_fixed_cost.py            # GPT-2 4x128, matched, k=4096, b=8
    python benchmarks/build_fixed_cost.py --model gpt2 --repeats 3   # GPT-2 small's shape
    python benchmarks/build_fixed_cost.py --quick    # a tiny GPT-2, seconds
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> dict:
    import llm_throughput as lm
    import torch

    import tracinfunc as tif
    from tracinfunc.grads.plan_cache import clear_plans

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--model", default="small", choices=["small", "gpt2"],
                        help="GPT-2 4x128, or GPT-2 small's shape (124M)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model, config = lm.build(args.model, args.quick)
    batch, tokens = (4, 16) if args.quick else (8, 64)
    batches = lm.token_batches(config, 3, batch, tokens, seed=1)
    names = lm.matched_names(model)
    params = {name: value.detach() for name, value in model.named_parameters()}
    loss = tif.causal_lm_loss(model)
    spec = tif.Projection(dim=64 if args.quick else args.k, kind="kronecker")
    options = tif.GradientOptions(select=names)

    def fresh(b, clear: bool = False):
        if clear:
            clear_plans()
        return tif.projected_grads(loss, spec, options=options)(params, b)

    reused = tif.projected_grads(loss, spec, options=options)
    reused(params, batches[0])
    fresh(batches[0])
    times: dict[str, list[float]] = {"floor": [], "reused": [], "fresh": [],
                                     "fresh, plans cleared": []}
    for r in range(1 if args.quick else args.repeats):
        b = batches[r % len(batches)]
        model.zero_grad(set_to_none=True)
        times["floor"].append(_cpu(lambda b=b: lm.floor_step(model, b)))
        model.zero_grad(set_to_none=True)
        times["reused"].append(_cpu(lambda b=b: reused(params, b)))
        times["fresh"].append(_cpu(lambda b=b: fresh(b)))
        times["fresh, plans cleared"].append(_cpu(lambda b=b: fresh(b, clear=True)))
    floor = statistics.median(times["floor"])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    shape = "tiny" if args.quick else {"small": "4x128", "gpt2": "small (124M)"}[args.model]
    print(f"GPT-2 {shape} matched, k={spec.dim}, b={batch}, "
          f"T={tokens}; 1 thread, CPU time, medians; peak RSS {rss:.0f} MiB")
    result = {}
    for label, values in times.items():
        result[label] = statistics.median(values) / floor
        print(f"{label:<24} x floor {result[label]:5.2f}")
    return result


def _cpu(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


if __name__ == "__main__":
    main()
