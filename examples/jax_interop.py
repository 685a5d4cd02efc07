"""Train in JAX, attribute in torch: one gradient store shared by both frameworks.

1. trains a small MLP in JAX on scikit-learn's digits (10% of training labels flipped),
   written with Flax's parameter layout (``params/layers_0/kernel`` is ``[in, out]``; Flax
   itself is not needed), keeping a checkpoint every few epochs;
2. writes the training gradients from JAX (``tracinfunc.jax.build_store``), mapping the tree
   onto torch names and shapes with ``ParamMapping.flax``;
3. loads the same checkpoints into the equivalent ``torch.nn.Sequential`` and scores the
   JAX-written store from torch against torch-made test gradients, then checks the answer
   against a store written by torch and prints the cross-framework agreement;
4. returns results to JAX (``output="jax"``) for the self-influence ranking.

Run:  python examples/jax_interop.py            (about 20 s on a laptop CPU)
      python examples/jax_interop.py --quick    (fewer epochs; used by the test suite)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
import tracinfunc.jax as tj


def load_digits_with_flipped_labels(flip_fraction: float, seed: int):
    from sklearn.datasets import load_digits  # optional dependency: pip install scikit-learn

    digits = load_digits()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(digits.data))
    x = (digits.data / 16.0).astype(np.float32)[order]
    y = digits.target.astype(np.int32)[order]
    x_train, y_train, x_test, y_test = x[:1500], y[:1500].copy(), x[1500:], y[1500:]
    flipped = rng.permutation(len(x_train))[: int(flip_fraction * len(x_train))]
    y_train[flipped] = (y_train[flipped] + rng.integers(1, 10, len(flipped))) % 10
    return (x_train, y_train), (x_test, y_test), flipped


def init_params(key, sizes=(64, 32, 10)):
    """Flax ``nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(10)])`` parameter layout."""
    k0, k1 = jax.random.split(key)
    return {"params": {
        "layers_0": {"kernel": jax.random.normal(k0, sizes[:2]) / np.sqrt(sizes[0]),
                     "bias": jnp.zeros(sizes[1])},
        "layers_2": {"kernel": jax.random.normal(k1, sizes[1:]) / np.sqrt(sizes[1]),
                     "bias": jnp.zeros(sizes[2])},
    }}


def apply(variables, x):
    p = variables["params"]
    h = jax.nn.relu(x @ p["layers_0"]["kernel"] + p["layers_0"]["bias"])
    return h @ p["layers_2"]["kernel"] + p["layers_2"]["bias"]


def loss(variables, example):
    """Per-example loss in tracinfunc's convention: ``loss(params, example) -> scalar``."""
    x, y = example
    return -jax.nn.log_softmax(apply(variables, x))[y]


def train(train_data, epochs: int, lr: float, every: int):
    x, y = map(jnp.asarray, train_data)
    params = init_params(jax.random.key(0))

    @jax.jit
    def step(params, xb, yb):
        batch_loss = lambda p: jax.vmap(loss, in_axes=(None, 0))(p, (xb, yb)).mean()  # noqa: E731
        grads = jax.grad(batch_loss)(params)
        return jax.tree_util.tree_map(lambda w, g: w - lr * g, params, grads)

    checkpoints, order_key = [], jax.random.key(1)
    for epoch in range(1, epochs + 1):
        order_key, sub = jax.random.split(order_key)
        order = jax.random.permutation(sub, len(x))
        for start in range(0, len(x), 64):
            idx = order[start : start + 64]
            params = step(params, x[idx], y[idx])
        if epoch % every == 0:
            checkpoints.append(tj.Checkpoint(params, lr=lr, name=f"epoch-{epoch}"))
    return checkpoints


def torch_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs (for tests)")
    parser.add_argument("--dim", type=int, default=256, help="projected dimension k")
    parser.add_argument("--out", type=Path, help="where JAX writes the Zarr store "
                        "(default: a temporary directory, removed at the end)")
    args = parser.parse_args()
    epochs, every = (4, 2) if args.quick else (30, 10)

    train_data, test_data, flipped = load_digits_with_flipped_labels(0.1, seed=0)
    started = time.perf_counter()
    checkpoints = train(train_data, epochs=epochs, lr=0.1, every=every)
    print(f"trained in JAX: {epochs} epochs, {len(checkpoints)} checkpoints "
          f"({time.perf_counter() - started:.1f} s)")

    # 2. JAX writes the store, in torch names and layout.
    mapping = tj.ParamMapping.flax(checkpoints[0].params)
    print("parameter mapping:", ", ".join(f"{a} -> {b}" for a, b in mapping.names.items()))
    projection = tif.Projection(dim=args.dim, seed=0)
    with tempfile.TemporaryDirectory() as scratch:
        path = str(args.out or Path(scratch) / "grads-from-jax.zarr")
        started = time.perf_counter()
        tj.build_store(loss, checkpoints, train_data, projection=projection, mapping=mapping,
                       store=path)
        print(f"JAX wrote {path} in {time.perf_counter() - started:.1f} s")
        # torch reopens it as any Zarr store (here in-process; see store_reuse.py for
        # another process): same format, metadata and checksums as a torch-written one.
        # Copied to memory only because the temporary directory goes away below.
        jax_store = tif.to_memory(tif.GradientStore.open(path))
    print(f"torch opened it: {jax_store}")

    # 3. torch: the same checkpoints in an nn.Sequential, test gradients made by torch.
    model = torch_model()
    torch_ckpts = [ckpt.to_torch(mapping) for ckpt in checkpoints]
    torch_loss = tif.loss_from_module(model, F.cross_entropy)
    x_test = torch.from_numpy(test_data[0][:20])
    y_test = torch.from_numpy(test_data[1][:20]).long()
    test_store = tif.build_store(torch_loss, torch_ckpts, (x_test, y_test),
                                 projection=jax_store.projection)
    scores = tif.score(jax_store, test_store)  # torch code scoring a JAX-written store
    _, top = tif.top_k(jax_store, test_store, k=10)

    x_train = torch.from_numpy(train_data[0])
    y_train = torch.from_numpy(train_data[1]).long()
    torch_store = tif.build_store(torch_loss, torch_ckpts, (x_train, y_train),
                                  projection=projection)
    expected = tif.score(torch_store, test_store)
    _, expected_top = tif.top_k(torch_store, test_store, k=10)
    rel_err = float((scores - expected).abs().max() / expected.abs().max())
    same_top = int((top == expected_top).all(dim=1).sum())
    print(f"cross-framework agreement: max relative score error {rel_err:.2e}, "
          f"top-10 identical for {same_top} of {len(top)} test digits")

    # 4. Results straight back into JAX.
    self_influence = tif.self_influence(jax_store, output="jax")
    ranked = jnp.argsort(-self_influence)[: len(train_data[0]) // 10]
    hits = len(set(np.asarray(ranked).tolist()) & set(flipped.tolist()))
    kind = "a jax.Array" if isinstance(self_influence, jax.Array) else "not a jax.Array"
    print(f"self-influence ({kind}): the top 10% of training digits "
          f"hold {hits} of {len(flipped)} flipped labels")


if __name__ == "__main__":
    main()
