"""tracinfunc.jax.build_store against plain JAX (issue 32 item 4), 1 thread, process CPU time.

The plain-JAX baseline is what a JAX user writes by hand: a held ``jax.jit`` of
``vmap(grad)`` flattened and multiplied by a ``[p, k]`` projection matrix, rows stacked in
NumPy and written with ``np.save``. It is compared with ``tj.build_store`` to memory and to
Zarr (Rademacher projection, k=512, 3 checkpoints), interleaved trial by trial so load hits
both alike:

- **warm**: the second and later calls with the same loss (compiled programs held);
- **first call**: a new loss function (a new closure: nothing cached), so the compilation is
  counted, for the baseline (a new ``jax.jit``) as for tracinfunc.

Models: the digits MLP of the issue (64-32-10, p=2410, n=1000 in batches of 200; ``--quick``:
n=100, one trial, no LM) and a small Flax linen transformer LM.

``--fit`` section (run by default): ``tracinfunc.jax.fit_curvature`` against
``tracinfunc.fit_curvature`` on the torch twin of the digits MLP (the same float32 weights,
data, sampled labels and damping), warm and first call, per kind (``projected`` k=512,
``dense``, ``kfac``, ``ekfac``), with the largest relative difference of the fitted
estimates (eigenvector factors compared as projectors ``Q Q^T``).

Usage: ``python benchmarks/jax_build.py [--quick] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

# One thread for XLA and torch, set before either is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                                   "intra_op_parallelism_threads=1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tracinfunc as tif
import tracinfunc.jax as tj

torch.set_num_threads(1)
K = 512


def digits_problem(n: int) -> dict:
    """The issue's MLP on sklearn digits (or random 8x8 images when sklearn is missing)."""
    try:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x, y = (x[:n] / 16.0).astype(np.float32), y[:n].astype(np.int32)
    except ImportError:  # pragma: no cover
        rng = np.random.default_rng(0)
        x, y = rng.random((n, 64), np.float32), rng.integers(0, 10, n).astype(np.int32)
    rng = np.random.default_rng(1)
    snapshots = []
    for _ in range(3):
        snapshots.append({
            "params": {"layers_0": {"kernel": rng.normal(0, 0.2, (64, 32)).astype(np.float32),
                                    "bias": np.zeros(32, np.float32)},
                       "layers_2": {"kernel": rng.normal(0, 0.2, (32, 10)).astype(np.float32),
                                    "bias": np.zeros(10, np.float32)}}})

    def make_loss():
        def loss(variables, example):
            xi, yi = example
            p = variables["params"]
            h = jnp.tanh(xi @ p["layers_0"]["kernel"] + p["layers_0"]["bias"])
            return -jax.nn.log_softmax(h @ p["layers_2"]["kernel"] + p["layers_2"]["bias"])[yi]
        return loss

    return {"name": "digits MLP", "data": (x, y), "snapshots": snapshots,
            "batch": min(200, n), "make_loss": make_loss,
            "mapping": tj.ParamMapping.flax(snapshots[0])}


def lm_problem(n: int) -> dict | None:
    """A one-block Flax linen transformer LM (vocab 64, d 32, sequences of 16 tokens)."""
    try:
        import flax.linen as nn
    except ImportError:  # pragma: no cover
        return None

    class Block(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            h = nn.Embed(64, 32)(tokens) + self.param("pos", nn.initializers.normal(0.02),
                                                     (16, 32))
            mask = nn.make_causal_mask(tokens)
            h = h + nn.SelfAttention(num_heads=2)(nn.LayerNorm()(h), mask=mask)
            h = h + nn.Dense(32)(jax.nn.gelu(nn.Dense(64)(nn.LayerNorm()(h))))
            return nn.Dense(64)(nn.LayerNorm()(h))

    model = Block()
    tokens = np.random.default_rng(2).integers(0, 64, (n, 16)).astype(np.int32)
    snapshots = [model.init(jax.random.key(seed), tokens[0]) for seed in range(3)]

    def make_loss():
        def loss(variables, seq):
            logits = model.apply(variables, seq)[:-1]
            return -jnp.take_along_axis(jax.nn.log_softmax(logits), seq[1:, None], -1).sum()
        return loss

    return {"name": "Flax transformer LM", "data": tokens, "snapshots": snapshots,
            "batch": min(50, n), "make_loss": make_loss,
            "mapping": tj.ParamMapping.flax(snapshots[0])}


def batches(data, batch: int):
    n = len(jax.tree_util.tree_leaves(data)[0])
    return [jax.tree_util.tree_map(lambda a, s=s: a[s:s + batch], data)
            for s in range(0, n, batch)]


def baseline(loss, snapshots, data, batch, matrix, out_path, fn=None):
    """Plain JAX: jit(vmap(grad)) flattened @ P, stacked, np.save. Returns the held fn."""
    if fn is None:
        def rows(params, b):
            grads = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, b)
            flat = jnp.concatenate([g.reshape(g.shape[0], -1)
                                    for g in jax.tree_util.tree_leaves(grads)], axis=1)
            return flat @ matrix
        fn = jax.jit(rows)
    parts = [[np.asarray(fn(params, b)) for b in batches(data, batch)] for params in snapshots]
    np.save(out_path, np.stack([np.concatenate(p) for p in parts]))
    return fn


def run(problem: dict, repeats: int, workdir: str) -> dict:
    projection = tif.Projection(dim=K, seed=0)
    data, batch, mapping = problem["data"], problem["batch"], problem["mapping"]
    snapshots = [jax.tree_util.tree_map(jnp.asarray, s) for s in problem["snapshots"]]
    ckpts = [tj.Checkpoint(s, lr=0.1, name=f"c{i}") for i, s in enumerate(snapshots)]
    p = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(snapshots[0]))
    matrix = jax.random.rademacher(jax.random.key(0), (p, K), jnp.float32) / np.sqrt(K)
    held_loss = problem["make_loss"]()
    times = {name: [] for name in ("baseline warm", "memory warm", "zarr warm",
                                   "baseline first", "memory first")}

    def timed(name, fn):
        start = time.process_time()
        fn()
        times[name].append(time.process_time() - start)

    held = baseline(held_loss, snapshots, data, batch, matrix, f"{workdir}/b.npy")
    tj.build_store(held_loss, ckpts, batches(data, batch), projection=projection,
                   mapping=mapping)  # warm up the held loss's program
    for trial in range(repeats):
        timed("baseline warm", lambda: baseline(held_loss, snapshots, data, batch, matrix,
                                                f"{workdir}/b.npy", held))
        timed("memory warm", lambda: tj.build_store(
            held_loss, ckpts, batches(data, batch), projection=projection, mapping=mapping))
        path = f"{workdir}/{problem['name'].replace(' ', '_')}-{trial}.zarr"
        timed("zarr warm", lambda path=path: tj.build_store(
            held_loss, ckpts, batches(data, batch), projection=projection, mapping=mapping,
            store=path))
        fresh = problem["make_loss"]()
        timed("baseline first", lambda fresh=fresh: baseline(
            fresh, snapshots, data, batch, matrix, f"{workdir}/b.npy"))
        fresh = problem["make_loss"]()
        timed("memory first", lambda fresh=fresh: tj.build_store(
            fresh, ckpts, batches(data, batch), projection=projection, mapping=mapping))
    return {name: float(np.median(values)) for name, values in times.items()} | {"p": p}


FIT_KINDS = ("projected", "dense", "kfac", "ekfac")


def fit_problem(n: int) -> dict:
    """The digits MLP as a torch model and its Flax linen twin holding the same weights."""
    import flax.linen as nn

    from tracinfunc.curvature import classification_sampler

    x, y = digits_problem(n)["data"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 10)).eval()
    ckpts = []
    for i in range(3):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
        ckpts.append(tif.Checkpoint.from_module(model, lr=0.1, name=f"c{i}"))
    flax_model = nn.Sequential([nn.Dense(32), nn.tanh, nn.Dense(10)])
    mapping = tj.ParamMapping.flax(flax_model.init(jax.random.key(0), jnp.zeros(64)))
    jax_ckpts = [tj.Checkpoint(mapping.from_torch(c.params), lr=c.lr, name=c.name)
                 for c in ckpts]
    batch = 200
    torch_data = [(torch.from_numpy(x[s:s + batch]), torch.from_numpy(y[s:s + batch]).long())
                  for s in range(0, n, batch)]
    jax_data = [(jnp.asarray(x[s:s + batch]), jnp.asarray(y[s:s + batch]))
                for s in range(0, n, batch)]

    def make_jax():
        def logits(params, xi):
            return flax_model.apply(params, xi)

        def loss(params, example):
            xi, yi = example
            return -jax.nn.log_softmax(flax_model.apply(params, xi))[yi]
        return loss, tj.classification_sampler(logits)

    return {"torch": (tif.loss_from_module(model, F.cross_entropy), ckpts, torch_data,
                      classification_sampler()),
            "jax": (make_jax, jax_ckpts, jax_data, mapping)}


def largest_difference(got, expected) -> float:
    """Max over estimates of max|got - expected| / max|expected| (factors as Q Q^T)."""
    worst = 0.0
    for mine, theirs in zip(got.estimates, expected.estimates, strict=True):
        for key, value in theirs.items():
            other = mine[key]
            if key.endswith((":QA", ":QS")):  # eigenvectors: equal up to sign
                value, other = value @ value.T, other @ other.T
            scale = float(value.abs().max()) or 1.0
            worst = max(worst, float((other - value).abs().max()) / scale)
    return worst


def run_fit(problem: dict, repeats: int) -> dict:
    loss, ckpts, torch_data, sampler = problem["torch"]
    make_jax, jax_ckpts, jax_data, mapping = problem["jax"]
    projection = tif.Projection(dim=K, seed=0)
    results = {}
    for kind in FIT_KINDS:
        extra = {"projection": projection} if kind == "projected" else {}
        times = {name: [] for name in ("torch", "jax warm", "jax first")}
        held_loss, held_sampler = make_jax()

        def fit_jax(jax_loss, jax_sampler, kind=kind, extra=extra):
            return tj.fit_curvature(jax_loss, jax_ckpts, jax_data, kind=kind, mapping=mapping,
                                    sampler=jax_sampler, **extra)

        def fit_torch(kind=kind, extra=extra):
            return tif.fit_curvature(loss, ckpts, torch_data, kind=kind, sampler=sampler,
                                     **extra)

        difference = largest_difference(fit_jax(held_loss, held_sampler), fit_torch())
        for _ in range(repeats):
            for name, fn in (("torch", fit_torch),
                             ("jax warm", lambda h=held_loss, hs=held_sampler: fit_jax(h, hs)),
                             ("jax first", lambda: fit_jax(*make_jax()))):
                start = time.process_time()
                fn()
                times[name].append(time.process_time() - start)
        results[kind] = {name: float(np.median(v)) for name, v in times.items()}
        results[kind]["difference"] = difference
    return results


def print_fit_table(results: dict, n: int) -> None:
    print(f"\n### fit_curvature from JAX vs torch on the twin (digits MLP, n={n}, 3 "
          "checkpoints, 1 thread CPU s, median)\n")
    print("| kind | torch s | JAX warm s | warm / torch | JAX first call s | first / torch | "
          "max rel. difference |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind, r in results.items():
        print(f"| {kind} | {r['torch']:.3f} | {r['jax warm']:.3f} | "
              f"{r['jax warm'] / r['torch']:.2f} | {r['jax first']:.3f} | "
              f"{r['jax first'] / r['torch']:.2f} | {r['difference']:.1e} |")


def print_table(name: str, result: dict, n: int) -> None:
    warm, first = result["baseline warm"], result["baseline first"]
    print(f"\n### {name} (n={n}, p={result['p']}, k={K}, 3 checkpoints, 1 thread CPU s, "
          "median)\n")
    print("| method | warm s | warm / baseline | first call s | first / baseline |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| plain JAX (jit(vmap(grad)) @ P, np.save) | {warm:.3f} | 1.00 | {first:.3f} | "
          "1.00 |")
    print(f"| tj.build_store to memory | {result['memory warm']:.3f} | "
          f"{result['memory warm'] / warm:.2f} | {result['memory first']:.3f} | "
          f"{result['memory first'] / first:.2f} |")
    print(f"| tj.build_store to Zarr | {result['zarr warm']:.3f} | "
          f"{result['zarr warm'] / warm:.2f} | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, seconds")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--only", choices=("build", "fit"), default=None,
                        help="run one section (default: both)")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 7)
    with tempfile.TemporaryDirectory() as workdir:
        n = 100 if args.quick else 1000
        if args.only in (None, "build"):
            print_table("digits MLP", run(digits_problem(n), repeats, workdir), n)
            # --quick (the test suite's smoke run) skips the LM: its four compilations are
            # most of the run's time, and the MLP exercises the same code.
            lm = None if args.quick else lm_problem(200)
            if lm is not None:
                print_table(lm["name"], run(lm, repeats, workdir), len(lm["data"]))
        if args.only in (None, "fit"):
            print_fit_table(run_fit(fit_problem(n), repeats), n)
    print("\njax_build: done")


if __name__ == "__main__":
    main()
