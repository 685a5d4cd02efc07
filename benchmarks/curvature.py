"""Curvature-aware TracIn on digits: LDS of every curvature kind against damping (issue 26).

The harness of ``benchmarks/quality.py`` (its data split, SGD training with a checkpoint every
``every`` epochs, retrained half-subsets, correct-class margins), scored four ways over the same
training stores: plain TracIn; and with each checkpoint's test gradients preconditioned by
``(H_c + lambda_c I)^-1`` from ``dense``, ``kfac``, ``ekfac`` (full space, exact store) and
``projected`` / ``kfac`` through a projection at each ``k`` (256, 1024, 4096; 4096 is above
``p`` for both models, where the projection is an embedding). ``lambda_c = scale x`` the
checkpoint's mean eigenvalue, swept over ``SCALES``; the curvature is fitted once per kind
(the exact Fisher: every class weighted by its probability) and only ``lambda`` changes.
The ``-last`` rows score and fit the last checkpoint only (the full-space kinds, exact store).

    python benchmarks/curvature.py --quick          # seconds; tests/ runs it
    python benchmarks/curvature.py                  # 1000 train / 300 test, 60 subsets

Prints a markdown table per model, writes ``--out``/curvature.json and curvature.png (LDS
against the damping scale, one line per kind). For every curvature it also runs
``choose_damping`` (held-out loss change of the damped Newton step, no retraining) on a
validation split of the digits left over by the train/test split, and prints the multiple it
picks beside the LDS-best one and the default, each with its LDS.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality

import tracinfunc as tif
import tracinfunc.evaluate as ev
from tracinfunc.curvature import (
    DEFAULT_SCALES,
    choose_damping,
    classification_sampler,
    fit_curvature,
)

SCALES = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
QUICK_SCALES = (1.0, 10.0)
FULL = quality.Sizes(1000, 300, 60, 24, 4, (256, 1024, 4096), 0)
QUICK = quality.Sizes(100, 20, 6, 3, 1, (64,), 0)


def _with_scale(curvature, base_scale: float, scale: float):
    """The same estimates with ``lambda_c`` rescaled from ``base_scale`` to ``scale``."""
    damping = tuple(d * scale / base_scale for d in curvature.damping)
    return dataclasses.replace(curvature, damping=damping)


def validation_split(sizes: quality.Sizes, x_train: torch.Tensor, n_val: int):
    """Digits outside ``quality.load_digits``'s train and test rows (its permutation, redrawn
    and checked against its train rows), for the held-out damping choice."""
    from sklearn.datasets import load_digits as sk_digits

    digits = sk_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    assert torch.equal(x[order[:sizes.n_train]], x_train), "quality.load_digits changed"
    rest = order[sizes.n_train + sizes.n_test:][:n_val]
    return x[rest], torch.tensor(digits.target)[rest]


def evaluate_model(name: str, sizes: quality.Sizes, scales, out: Path) -> dict:
    make = quality.MODELS[name]
    (x, y), (x_test, y_test), _, _ = quality.load_digits(sizes)
    validation = validation_split(sizes, x, sizes.n_test)
    _, ckpts = quality.train(make, x, y, seed=0, epochs=sizes.epochs, every=sizes.every)
    truth = quality.retrain(make, (x, y), (x_test, y_test), sizes, out, name, seed=0)
    loss = tif.loss_from_module(make().eval(), F.cross_entropy)
    sampler = classification_sampler(exact=True)
    rows, choices = [], []

    def choose(label, kind, fitted):
        start = time.perf_counter()
        choice = choose_damping(fitted, loss, ckpts, (x, y), validation, scales=scales)
        choices.append({"config": label, "kind": kind, "heldout": choice.scale,
                        "default": DEFAULT_SCALES[kind], "loss_change": list(choice.values),
                        "choose_s": time.perf_counter() - start})

    def measure(label, kind, k, scale, scores, seconds):
        result = ev.lds(scores, truth.subsets, truth.outputs, n_bootstrap=0)
        rows.append({"config": label, "kind": kind, "k": k, "scale": scale,
                     "lds": result.mean, "fit_s": seconds})

    def stores(projection):
        train = tif.build_store(loss, ckpts, (x, y), projection=projection, progress=False)
        test = tif.build_store(loss, ckpts, (x_test, y_test), projection=train.projection,
                               progress=False)
        return train, test

    exact = tif.Projection(kind="identity")
    full_space = ["dense", "kfac", "ekfac"]
    if sum(p.numel() for p in ckpts[0].params.values()) > 5000:
        full_space.remove("dense")
    # every checkpoint, and the last only (the "-last" rows): the same fits at one checkpoint
    for suffix, chosen in (("", ckpts), ("-last", ckpts[-1:])):
        train = tif.build_store(loss, chosen, (x, y), projection=exact, progress=False)
        test = tif.build_store(loss, chosen, (x_test, y_test), projection=exact, progress=False)
        measure(f"tracin-exact{suffix}", "tracin", None, None, tif.score(train, test), 0.0)
        for kind in full_space:
            start = time.perf_counter()
            fitted = fit_curvature(loss, chosen, (x, y), kind=kind, sampler=sampler,
                                   damping=tif.curvature.Damping(1.0))
            seconds = time.perf_counter() - start
            for scale in scales:
                curvature = _with_scale(fitted, 1.0, scale)
                queries = tif.preconditioned_test_grads(loss, chosen, (x_test, y_test),
                                                        curvature, projection=exact)
                measure(f"{kind}-exact{suffix}", kind, None, scale,
                        tif.score(train, queries, curvature=curvature), seconds)
            if not suffix:  # the held-out choice, for the all-checkpoint fits
                choose(f"{kind}-exact", kind, fitted)
    for k in sizes.ks:
        for projection, kind in ((tif.Projection(dim=k, seed=0), "projected"),
                                 (tif.Projection(dim=k, kind="kronecker", seed=0), "kfac")):
            train_k, test_k = stores(projection)
            measure(f"tracin-{projection.kind}-{k}", "tracin", k, None,
                    tif.score(train_k, test_k), 0.0)
            start = time.perf_counter()
            fitted = fit_curvature(loss, ckpts, (x, y), kind=kind, projection=projection,
                                   sampler=sampler, damping=tif.curvature.Damping(1.0))
            seconds = time.perf_counter() - start
            for scale in scales:
                curvature = _with_scale(fitted, 1.0, scale)
                queries = test_k if kind == "projected" else tif.preconditioned_test_grads(
                    loss, ckpts, (x_test, y_test), curvature, projection=projection)
                measure(f"{kind}-{projection.kind}-{k}", kind, k, scale,
                        tif.score(train_k, queries, curvature=curvature), seconds)
            choose(f"{kind}-{projection.kind}-{k}", kind, fitted)
    return {"model": name, "rows": rows, "choices": choices}


def print_table(result: dict, scales) -> None:
    print(f"\n### {result['model']}: LDS against damping (lambda_c = scale x mean eigenvalue)\n")
    print("| config | " + " | ".join(f"{s:g}x" for s in scales) + " | fit (s) |")
    print("|---|" + "---:|" * (len(scales) + 1))
    by_config: dict[str, dict] = {}
    for row in result["rows"]:
        by_config.setdefault(row["config"], {})[row["scale"]] = row
    for config, cells in by_config.items():
        if None in cells:  # plain TracIn: one number
            print(f"| {config} | " + " | ".join(f"{cells[None]['lds']:.3f}" for _ in scales)
                  + " | - |")
            continue
        fit = next(iter(cells.values()))["fit_s"]
        print(f"| {config} | " + " | ".join(f"{cells[s]['lds']:.3f}" for s in scales)
              + f" | {fit:.1f} |")


def print_choices(result: dict) -> None:
    """Per curvature: the LDS-best multiple, the default and the held-out choice, with LDS."""
    print(f"\n### {result['model']}: damping chosen (multiple of the mean eigenvalue, LDS)\n")
    print("| config | LDS-best | default | held-out (no retraining) | choose (s) |")
    print("|---|---:|---:|---:|---:|")
    for choice in result["choices"]:
        curve = {row["scale"]: row["lds"] for row in result["rows"]
                 if row["config"] == choice["config"]}
        best = max(curve, key=curve.get)

        def cell(scale, curve=curve):
            return f"{scale:g}x ({curve[scale]:.3f})" if scale in curve else f"{scale:g}x (-)"

        print(f"| {choice['config']} | {cell(best)} | {cell(choice['default'])} | "
              f"{cell(choice['heldout'])} | {choice['choose_s']:.1f} |")


def save_plot(results: list[dict], scales, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        by_config: dict[str, list] = {}
        for row in result["rows"]:
            by_config.setdefault(row["config"], []).append(row)
        for config, rows in by_config.items():
            if rows[0]["scale"] is None:  # plain TracIn: gray, exact store solid
                style = "-" if config == "tracin-exact" else (0, (2, 2 + len(config) % 3))
                ax.axhline(rows[0]["lds"], color="gray", linestyle=style, linewidth=1,
                           label=config)
            else:
                ax.plot([r["scale"] for r in rows], [r["lds"] for r in rows], marker="o",
                        label=config)
        ax.set_xscale("log")
        ax.set_xlabel("damping: multiple of the mean eigenvalue")
        ax.set_ylabel("LDS")
        ax.set_title(result["model"])
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/output/curvature"))
    parser.add_argument("--model", choices=sorted(quality.MODELS), action="append")
    args = parser.parse_args()
    sizes, scales = (QUICK, QUICK_SCALES) if args.quick else (FULL, SCALES)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    start = time.perf_counter()
    results = [evaluate_model(name, sizes, scales, args.out)
               for name in args.model or quality.MODELS]
    for result in results:
        print_table(result, scales)
        print_choices(result)
    (args.out / "curvature.json").write_text(json.dumps(results, indent=1))
    save_plot(results, scales, args.out / "curvature.png")
    print(f"\nwrote {args.out / 'curvature.png'} and curvature.json in "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
