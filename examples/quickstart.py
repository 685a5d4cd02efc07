"""Quickstart: which training digits made the model say this?

Trains a small MLP on scikit-learn's digits (shipped with the package, no download) with 10%
of the training labels flipped, saving a checkpoint every few epochs. Then:

1. builds a store of projected per-example gradients at every checkpoint (once),
2. scores held-out digits against it: top proponents and opponents of each prediction,
3. ranks training examples by self-influence and counts how many flipped labels sit in the
   top 10% (the TracIn paper's mislabel-detection experiment).

Run:  python examples/quickstart.py            (about 10 s on a laptop CPU)
      python examples/quickstart.py --quick    (fewer epochs; used by the test suite)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif


def load_digits_with_flipped_labels(flip_fraction: float, seed: int):
    """Digits as float32 tensors; a fixed random ``flip_fraction`` of train labels changed."""
    from sklearn.datasets import load_digits  # optional dependency: pip install scikit-learn

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=g)
    train_idx, test_idx = order[:1500], order[1500:]
    x_train, y_train = x[train_idx], y[train_idx].clone()
    flipped = torch.randperm(len(x_train), generator=g)[: int(flip_fraction * len(x_train))]
    # Shift each flipped label by 1..9 so it is always wrong.
    y_train[flipped] = (y_train[flipped] + torch.randint(1, 10, (len(flipped),), generator=g)) % 10
    return (x_train, y_train), (x[test_idx], y[test_idx]), flipped


def train_with_checkpoints(x, y, *, epochs: int, every: int, lr: float, seed: int):
    """Plain SGD; a Checkpoint (params copy + lr) every ``every`` epochs."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    checkpoints = []
    for epoch in range(1, epochs + 1):
        for batch in torch.randperm(len(x)).split(32):
            optimizer.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
        if epoch % every == 0:
            checkpoints.append(tif.Checkpoint.from_module(model, lr=lr, name=f"epoch-{epoch}"))
    return model.eval(), checkpoints


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs (for tests)")
    parser.add_argument("--dim", type=int, default=512, help="projected dimension k")
    parser.add_argument("--out", type=Path, default=Path("examples/output/quickstart.png"),
                        help="where to save the picture of proponents and opponents")
    args = parser.parse_args()
    started = time.perf_counter()

    train, test, flipped = load_digits_with_flipped_labels(flip_fraction=0.1, seed=0)
    epochs, every = (6, 2) if args.quick else (30, 6)
    model, checkpoints = train_with_checkpoints(*train, epochs=epochs, every=every, lr=0.1, seed=0)
    accuracy = (model(test[0]).argmax(1) == test[1]).float().mean().item()
    print(f"trained {epochs} epochs on {len(train[0])} digits ({len(flipped)} labels flipped); "
          f"held-out accuracy {accuracy:.1%}; {len(checkpoints)} checkpoints")

    loss = tif.loss_from_module(model, F.cross_entropy)
    projection = tif.Projection(dim=args.dim, seed=0, kind="rademacher")
    t0 = time.perf_counter()
    store = tif.build_store(loss, checkpoints, train, projection=projection)
    print(f"built {store} in {time.perf_counter() - t0:.2f} s")

    queries = (test[0][:5], test[1][:5])
    test_grads = tif.build_store(loss, checkpoints, queries, projection=store.projection)
    # Cosine TracIn: raw inner products favour examples with huge gradients (often the flipped
    # ones), so proponents by cosine are the examples that pushed in the same direction.
    pro_vals, pro_idx = tif.top_k(store, test_grads, k=3, normalize=True)
    opp_vals, opp_idx = tif.top_k(store, test_grads, k=3, largest=False, normalize=True)
    flipped_set = set(flipped.tolist())

    def describe(indices, values):
        # "*" marks a training example whose label was flipped.
        return ", ".join(
            f"#{j} (label {train[1][j]}{'*' if j in flipped_set else ''}, {v:+.3f})"
            for j, v in zip(indices.tolist(), values.tolist(), strict=True)
        )

    print("cosine-TracIn proponents and opponents of held-out digits (* = flipped label):")
    for i in range(len(queries[1])):
        print(f"  test digit {i} (label {queries[1][i]}): proponents "
              f"{describe(pro_idx[i], pro_vals[i])}; opponents {describe(opp_idx[i], opp_vals[i])}")

    save_picture(queries, train, flipped_set, (pro_vals, pro_idx), (opp_vals, opp_idx), args.out)
    print(f"saved {args.out}")

    si = tif.self_influence(store)
    inspected = si.argsort(descending=True)[: len(si) // 10]
    found = torch.isin(inspected, flipped).sum().item()
    print(f"self-influence: top 10% of training examples ({len(inspected)}) hold {found} of "
          f"{len(flipped)} flipped labels ({found / len(flipped):.0%}; random inspection finds "
          "about 10%)")
    print(f"total wall time {time.perf_counter() - started:.1f} s")


def save_picture(queries, train, flipped_set, proponents, opponents, path: Path) -> None:
    """One row per test digit: the digit, its proponents (green), its opponents (red)."""
    import matplotlib  # optional dependency: pip install matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_rows, k = len(queries[1]), proponents[1].shape[1]
    fig, axes = plt.subplots(n_rows, 1 + 2 * k, figsize=(1.3 * (1 + 2 * k), 1.5 * n_rows))
    for i in range(n_rows):
        cells = [(queries[0][i], f"test: {queries[1][i]}", "black")]
        for (values, indices), color in ((proponents, "green"), (opponents, "red")):
            for j, v in zip(indices[i].tolist(), values[i].tolist(), strict=True):
                star = "*" if j in flipped_set else ""
                cells.append((train[0][j], f"{train[1][j]}{star} {v:+.2f}", color))
        for ax, (image, title, color) in zip(axes[i], cells, strict=True):
            ax.imshow(image.reshape(8, 8), cmap="gray_r")
            ax.set_title(title, fontsize=8, color=color)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle("held-out digits; cosine-TracIn proponents (green), opponents (red); "
                 "* = flipped label",
                 fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
