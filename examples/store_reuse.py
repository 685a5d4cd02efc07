"""Build a Zarr gradient store once; reopen it in another process for two experiments.

The expensive part of TracIn is the training gradients. This example computes them once,
writes them to ``grads.zarr`` with the checkpoints saved beside it as state-dict files, and
then starts a *second Python process* that reopens the store read-only and runs:

A. **Proponents of mistakes**: for held-out digits the model gets wrong, the training
   examples that pushed hardest toward the wrong answer (cosine TracIn) - how many of them
   carry the wrong answer as their (possibly flipped) label.
B. **Label noise audit**: rank training examples by self-influence and count flipped labels
   in the top 10%, which needs nothing but the store's row norms.

Neither experiment recomputes a training gradient; a test query that used checkpoints other
than the store's would be refused (the store records their fingerprints).

Run:  python examples/store_reuse.py              (about 15 s on a laptop CPU)
      python examples/store_reuse.py --quick      (used by the test suite)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quickstart import load_digits_with_flipped_labels, train_with_checkpoints


def build(workdir: Path, *, quick: bool) -> None:
    """Process 1: train, save checkpoints as files, write the store, then exit."""
    train, _, flipped = load_digits_with_flipped_labels(flip_fraction=0.1, seed=0)
    epochs, every = (6, 2) if quick else (30, 6)
    model, checkpoints = train_with_checkpoints(*train, epochs=epochs, every=every, lr=0.1, seed=0)
    for checkpoint in checkpoints:  # what a training script would have saved anyway
        torch.save(dict(checkpoint.params), workdir / f"{checkpoint.name}.pt")
    (workdir / "run.json").write_text(json.dumps({
        "checkpoints": [{"name": c.name, "lr": c.lr} for c in checkpoints],
        "flipped": flipped.tolist(),
    }))
    loss = tif.loss_from_module(model, F.cross_entropy)
    t0 = time.perf_counter()
    store = tif.build_store(loss, checkpoints, train, store=str(workdir / "grads.zarr"),
                            projection=tif.Projection(dim=512, seed=0),
                            dataset_fingerprint="sklearn-digits:first-1500:flip-0.1-seed-0")
    print(f"[build process] wrote {store} in {time.perf_counter() - t0:.2f} s")


def experiments(workdir: Path) -> None:
    """Process 2: reopen the store read-only and run two experiments on it."""
    t0 = time.perf_counter()
    store = tif.GradientStore.open(str(workdir / "grads.zarr"))
    print(f"[experiment process] reopened {store} in {1e3 * (time.perf_counter() - t0):.0f} ms")
    run = json.loads((workdir / "run.json").read_text())
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).eval()
    checkpoints = [
        tif.Checkpoint.load(workdir / f"{c['name']}.pt", model, lr=c["lr"], name=c["name"])
        for c in run["checkpoints"]
    ]
    train, test, _ = load_digits_with_flipped_labels(flip_fraction=0.1, seed=0)
    flipped = torch.tensor(run["flipped"])
    loss = tif.loss_from_module(model, F.cross_entropy)

    # A. Proponents of the final model's mistakes on held-out digits.
    model.load_state_dict(checkpoints[-1].params)
    with torch.no_grad():
        predicted = model(test[0]).argmax(1)
    wrong = (predicted != test[1]).nonzero().squeeze(1)
    # Attribute the *prediction*: the loss against the predicted label.
    queries = (test[0][wrong], predicted[wrong])
    timings = []
    for _ in range(2):  # the first call in a process also pays torch.func's one-off start-up
        t0 = time.perf_counter()
        test_grads = tif.build_store(loss, checkpoints, queries, projection=store.projection)
        _, proponents = tif.top_k(store, test_grads, k=5, normalize=True)
        timings.append(time.perf_counter() - t0)
    share = (train[1][proponents] == predicted[wrong, None]).float().mean().item()
    among_flipped = torch.isin(proponents, flipped).float().mean().item()
    print(f"A. {len(wrong)} held-out mistakes scored in {timings[1] * 1e3:.0f} ms "
          f"(first call in this process {timings[0] * 1e3:.0f} ms): "
          f"{share:.0%} of their top-5 proponents carry the wrongly predicted label, "
          f"{among_flipped:.0%} are flipped examples (10% of the training set is)")

    # B. Label-noise audit from the row norms alone.
    t0 = time.perf_counter()
    inspected = tif.self_influence(store).argsort(descending=True)[: store.meta.n_train // 10]
    found = torch.isin(inspected, flipped).sum().item()
    print(f"B. self-influence in {1e3 * (time.perf_counter() - t0):.0f} ms: the top 10% hold "
          f"{found} of {len(flipped)} flipped labels ({found / len(flipped):.0%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs (for tests)")
    parser.add_argument("--workdir", type=Path, help="keep the store here (default: temporary)")
    parser.add_argument("--experiments-only", type=Path, metavar="WORKDIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.experiments_only:  # the second process
        experiments(args.experiments_only)
        return
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        build(workdir, quick=args.quick)
        # A fresh interpreter: nothing survives from the build but the files on disk.
        subprocess.run([sys.executable, __file__, "--experiments-only", str(workdir)], check=True)


if __name__ == "__main__":
    main()
