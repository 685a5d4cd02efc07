"""Mislabel detection, the TracIn paper's experiment, on scikit-learn's digits.

Flip 10% of the training labels, train an MLP saving checkpoints, then inspect training
examples in order of (a) TracIn self-influence, (b) the final model's loss, (c) random order.
Prints the fraction of flipped labels found after inspecting 5/10/20/30% of the data and saves
the curve as a PNG.

Run:  python examples/mislabel_detection.py [--quick] [--out mislabel_detection.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from quickstart import load_digits_with_flipped_labels, train_with_checkpoints

import tracinfunc as tif


def recall_curve(order: torch.Tensor, flipped: torch.Tensor) -> torch.Tensor:
    """``[n]``: fraction of flipped examples among the first ``i + 1`` inspected."""
    is_flipped = torch.isin(order, flipped).double()
    return is_flipped.cumsum(0) / len(flipped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs (for tests)")
    parser.add_argument("--out", type=Path, default=Path("examples/output/mislabel_detection.png"))
    args = parser.parse_args()

    (x, y), _, flipped = load_digits_with_flipped_labels(flip_fraction=0.1, seed=0)
    epochs, every = (6, 2) if args.quick else (30, 5)
    model, checkpoints = train_with_checkpoints(x, y, epochs=epochs, every=every, lr=0.1, seed=0)

    loss = tif.loss_from_module(model, F.cross_entropy)
    store = tif.build_store(loss, checkpoints, (x, y), projection=tif.Projection(dim=512, seed=0))
    by_self_influence = tif.self_influence(store).argsort(descending=True)
    with torch.no_grad():
        by_loss = F.cross_entropy(model(x), y, reduction="none").argsort(descending=True)
    by_random = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))

    curves = {
        "TracIn self-influence": recall_curve(by_self_influence, flipped),
        "final-model loss": recall_curve(by_loss, flipped),
        "random": recall_curve(by_random, flipped),
    }
    n = len(x)
    print("fraction of flipped labels found after inspecting a fraction of the training data")
    fractions = (0.05, 0.1, 0.2, 0.3)
    print(f"{'ranking':<24}" + "".join(f"{p:>8.0%}" for p in fractions))
    for name, curve in curves.items():
        print(f"{name:<24}" + "".join(f"{curve[int(p * n) - 1]:>8.1%}" for p in fractions))
    save_plot(curves, n, args.out)
    print(f"saved {args.out}")


def save_plot(curves: dict[str, torch.Tensor], n: int, path: Path) -> None:
    import matplotlib  # optional dependency: pip install matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    inspected = torch.arange(1, n + 1) / n
    for name, curve in curves.items():
        ax.plot(inspected * 100, curve * 100, label=name)
    ax.set_xlabel("training data inspected (%)")
    ax.set_ylabel("flipped labels found (%)")
    ax.set_title("Mislabel detection on digits (10% flipped)")
    ax.set_xlim(0, 40)
    ax.grid(alpha=0.3)
    ax.legend(loc="center right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
