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

Issue 33 added: a CNN with BatchNorm and dropout (``--model cnn``: conv + BN + ReLU + pool +
dropout + linear, trained in train mode, attributed in eval mode; the curvature and the stores
cover the conv and linear layers K-FAC covers); the rank-aware rule (``-rank`` rows:
``lambda_c = scale x tr(H_c) / rank(H_c)``); the per-checkpoint terms of the all-checkpoint
EK-FAC sum (``-ckpt<c>`` rows); refined EK-FAC on the Fisher of ``--refine-examples`` training
examples (``ekfac-exact-refined``: ``--refine-steps`` conjugate-gradient steps, the default
solver; ``ekfac-exact-refined-direct``: the exact solve) with its query cost
against the plain EK-FAC query (process CPU time, interleaved); kronfluence's EK-FAC at every
checkpoint and summed (its own venv, ``_kronfluence_child.py``), over the same multiples; peak RSS.

    python benchmarks/curvature.py --quick          # seconds; tests/ runs it
    python benchmarks/curvature.py --medium         # 500 train / 100 test, 30 subsets, no k sweep
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
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

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
from tracinfunc.errors import IllConditionedError

SCALES = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
QUICK_SCALES = (0.3, 1.0, 10.0)
FULL = quality.Sizes(1000, 300, 60, 24, 4, (256, 1024, 4096), 200)
MEDIUM = quality.Sizes(500, 100, 30, 24, 6, (), 200)
QUICK = quality.Sizes(100, 20, 6, 3, 1, (64,), 20)
ROOT = Path(__file__).resolve().parents[1]


def cnn() -> nn.Sequential:
    """Digits 8x8 as images: conv + BatchNorm + ReLU + pool + dropout + linear (standard
    torch modules only, so kronfluence's process can unpickle it)."""
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 8, 3, padding=1),
                         nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.1),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 10))


MODELS = {**quality.MODELS, "cnn": cnn}
# K-FAC covers conv and linear layers, not BatchNorm: every store and curvature of the CNN
# selects these (given once, as options=).
SELECT = {"cnn": ["1.weight", "1.bias", "7.weight", "7.bias"]}


def retrain(make, train_set, test_set, sizes, out: Path, tag: str, seed: int):
    """``quality.retrain`` with the margins taken in eval mode (dropout off, BatchNorm's
    running statistics), as the attribution sees the model."""
    (x, y), (x_test, y_test) = train_set, test_set

    def train_fn(indices):
        model, _ = quality.train(make, x[indices], y[indices], seed=seed, epochs=sizes.epochs,
                                 every=sizes.epochs)
        return quality.margin(model.eval(), x_test, y_test)

    path = out / (f"retrain-{tag}-eval-n{sizes.n_train}-t{sizes.n_test}-e{sizes.epochs}"
                  f"-s{seed}.zarr")
    return ev.retrain_subsets(train_fn, sizes.n_train, sizes.n_subsets, seed=0, path=path)


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


def evaluate_model(name: str, sizes: quality.Sizes, scales, out: Path, *,
                   refine_examples: int, refine_steps: int, heldout: bool = True) -> dict:
    make = MODELS[name]
    (x, y), (x_test, y_test), _, _ = quality.load_digits(sizes)
    validation = validation_split(sizes, x, sizes.n_test)
    _, ckpts = quality.train(make, x, y, seed=0, epochs=sizes.epochs, every=sizes.every)
    truth = retrain(make, (x, y), (x_test, y_test), sizes, out, name, seed=0)
    loss = tif.loss_from_module(make().eval(), F.cross_entropy)
    options = tif.GradientOptions(select=SELECT.get(name))
    sampler = classification_sampler(exact=True)
    rows, choices, costs = [], [], {}
    test = (x_test, y_test)

    def choose(label, kind, fitted):
        if not heldout:
            return
        start = time.perf_counter()
        choice = choose_damping(fitted, loss, ckpts, (x, y), validation, scales=scales)
        choices.append({"config": label, "kind": kind, "heldout": choice.scale,
                        "default": DEFAULT_SCALES[kind], "loss_change": list(choice.values),
                        "choose_s": time.perf_counter() - start})

    def measure(label, kind, k, scale, scores, seconds, checkpoints="all"):
        result = ev.lds(scores, truth.subsets, truth.outputs, n_bootstrap=sizes.n_bootstrap)
        rows.append({"config": label, "kind": kind, "k": k, "scale": scale, "lds": result.mean,
                     "low": result.low, "high": result.high, "fit_s": seconds,
                     "checkpoints": checkpoints})

    def stores(projection):
        train = tif.build_store(loss, ckpts, (x, y), projection=projection, options=options,
                                progress=False)
        tests = tif.build_store(loss, ckpts, test, projection=train.projection,
                                options=options, progress=False)
        return train, tests

    def queries_for(chosen, curvature, projection):
        return tif.preconditioned_test_grads(loss, chosen, test, curvature,
                                             projection=projection, options=options)

    exact = tif.Projection(kind="identity")
    full_space = ["dense", "kfac", "ekfac"]
    if sum(ckpts[0].params[n].numel() for n in SELECT.get(name, ckpts[0].params)) > 5000:
        full_space.remove("dense")
    # every checkpoint, and the last only (the "-last" rows): the same fits at one checkpoint
    for suffix, chosen in (("", ckpts), ("-last", ckpts[-1:])):
        which = "all" if not suffix else "last"
        train = tif.build_store(loss, chosen, (x, y), projection=exact, options=options,
                                progress=False)
        tests = tif.build_store(loss, chosen, test, projection=exact, options=options,
                                progress=False)
        measure(f"tracin-exact{suffix}", "tracin", None, None, tif.score(train, tests), 0.0,
                which)
        if not suffix:
            for c, part in enumerate(per_checkpoint(train, tests)):
                measure(f"tracin-exact-ckpt{c}", "tracin", None, None, part, 0.0, f"ckpt{c}")
        for kind in full_space:
            start = time.perf_counter()
            fitted = fit_curvature(loss, chosen, (x, y), kind=kind, sampler=sampler,
                                   damping=tif.curvature.Damping(1.0), options=options)
            seconds = time.perf_counter() - start
            ranked = fitted.mean_eigenvalues("rank")
            for rule in ("dimension", "rank"):
                label = f"{kind}-exact{suffix}" + ("-rank" if rule == "rank" else "")
                for scale in scales:
                    curvature = (_with_scale(fitted, 1.0, scale) if rule == "dimension" else
                                 dataclasses.replace(fitted, damping=tuple(
                                     scale * m for m in ranked)))
                    try:
                        queries = queries_for(chosen, curvature, exact)
                    except IllConditionedError:  # refused below the conditioning rule
                        continue
                    measure(label, kind, None, scale,
                            tif.score(train, queries, curvature=curvature), seconds, which)
                    if kind == "ekfac" and not suffix and rule == "dimension":
                        for c, part in enumerate(per_checkpoint(train, queries)):
                            measure(f"ekfac-exact-ckpt{c}", kind, None, scale, part, seconds,
                                    f"ckpt{c}")
            if not suffix:  # the held-out choice, for the all-checkpoint fits
                choose(f"{kind}-exact", kind, fitted)
            if kind == "ekfac" and not suffix and refine_steps:
                costs = refine_rows(fitted, chosen, (x, y), train, queries_for, measure,
                                    refine_examples, refine_steps, scales)
    for k in sizes.ks:
        for projection, kind in ((tif.Projection(dim=k, seed=0), "projected"),
                                 (tif.Projection(dim=k, kind="kronecker", seed=0), "kfac")):
            train_k, test_k = stores(projection)
            measure(f"tracin-{projection.kind}-{k}", "tracin", k, None,
                    tif.score(train_k, test_k), 0.0)
            start = time.perf_counter()
            fitted = fit_curvature(loss, ckpts, (x, y), kind=kind, projection=projection,
                                   sampler=sampler, damping=tif.curvature.Damping(1.0),
                                   options=options)
            seconds = time.perf_counter() - start
            for scale in scales:
                curvature = _with_scale(fitted, 1.0, scale)
                queries = test_k if kind == "projected" else queries_for(ckpts, curvature,
                                                                        projection)
                measure(f"{kind}-{projection.kind}-{k}", kind, k, scale,
                        tif.score(train_k, queries, curvature=curvature), seconds)
            choose(f"{kind}-{projection.kind}-{k}", kind, fitted)
    peer = kronfluence_rows(make, ckpts, (x, y), test, scales, measure)
    return {"model": name, "rows": rows, "choices": choices, "refine_cost": costs,
            "peer": peer, "sizes": dataclasses.asdict(sizes)}


def per_checkpoint(store, queries) -> list[torch.Tensor]:
    """``lr_c <test_c, train_c>`` per checkpoint ``[n_test, n_train]``: the terms of the sum."""
    return [lr * queries.read_rows(c, 0, queries.meta.n_train).double()
            @ store.read_rows(c, 0, store.meta.n_train).double().T
            for c, lr in enumerate(store.meta.lrs)]


def refine_rows(fitted, chosen, data, train, queries_for, measure, n_examples, steps,
                scales=()) -> dict:
    """Refined EK-FAC at the default multiple, LDS and the query cost against plain EK-FAC
    (process CPU time per test example, plain and refined interleaved twice): ``steps``
    conjugate-gradient steps (the default solver) as ``ekfac-exact-refined`` and the exact
    solve (``solver="direct"``) as ``ekfac-exact-refined-direct``, also at every multiple in
    ``scales`` (its Cholesky factor per damping: the damping of the sampled Fisher's own
    solve, not EK-FAC's)."""
    import warnings

    scale = DEFAULT_SCALES["ekfac"]
    plain = _with_scale(fitted, 1.0, scale)
    refined = {solver: plain.with_refinement(data, steps=steps, max_examples=n_examples,
                                             sampler=classification_sampler(exact=True),
                                             solver=solver) for solver in ("cg", "direct")}
    exact = tif.Projection(kind="identity")
    seconds = {"plain": 0.0, "cg": 0.0, "direct": 0.0}
    results = {}
    for _ in range(2):
        for label, curvature in (("plain", plain), *refined.items()):
            start = time.process_time()
            with warnings.catch_warnings(record=True):
                queries = queries_for(chosen, curvature, exact)
            seconds[label] += time.process_time() - start
            results[label] = queries
    for solver, name in (("cg", "ekfac-exact-refined"), ("direct", "ekfac-exact-refined-direct")):
        measure(name, "ekfac", None, scale,
                tif.score(train, results[solver], curvature=refined[solver]), 0.0)
    residuals = {solver: results[solver].meta.extra["curvature"]["residuals"]
                 for solver in refined}
    for other in scales:
        if other == scale:
            continue
        curvature = _with_scale(refined["direct"], scale, other)
        with warnings.catch_warnings(record=True):
            queries = queries_for(chosen, curvature, exact)
        measure("ekfac-exact-refined-direct", "ekfac", None, other,
                tif.score(train, queries, curvature=curvature), 0.0)
    return {"steps": steps, "examples": n_examples, "plain_s": seconds["plain"] / 2,
            "refined_s": seconds["cg"] / 2, "direct_s": seconds["direct"] / 2,
            "ratio": seconds["cg"] / max(seconds["plain"], 1e-9),
            "direct_ratio": seconds["direct"] / max(seconds["plain"], 1e-9),
            "first_residual": max(r[0] for r in residuals["cg"]),
            "final_residual": max(r[-1] for r in residuals["cg"]),
            "direct_residual": max(r[-1] for r in residuals["direct"])}


def kronfluence_rows(make, ckpts, train, test, scales, measure) -> dict:
    """kronfluence's EK-FAC at every checkpoint (its own process), per checkpoint, last and
    summed with the lrs, at its heuristic and at the same multiples of the mean eigenvalue."""
    python = os.environ.get("KRONFLUENCE_PYTHON",
                            str(ROOT / ".venv-kronfluence" / "bin" / "python"))
    if not Path(python).exists():
        return {"name": "kronfluence", "status": "unavailable",
                "reason": f"no kronfluence environment at {python} (make bench-setup)"}
    dampings = {"heuristic-0.1x": None}
    with tempfile.TemporaryDirectory(prefix="kronfluence-") as tmp:
        model = make().eval()
        torch.save(model, Path(tmp, "model.pt"))
        states = []
        for ckpt in ckpts:
            state = dict(model.state_dict())
            state.update({n: v.detach().clone() for n, v in ckpt.params.items()})
            state.update({n: v.detach().clone() for n, v in ckpt.buffers.items()})
            states.append(state)
        payload, result = Path(tmp, "payload.pt"), Path(tmp, "scores.pt")
        torch.save({"task": "classification", "model": str(Path(tmp, "model.pt")),
                    "checkpoints": states, "train": train, "test": test, "batch": 100,
                    "dampings": dampings, "scales": list(scales),
                    "threads": torch.get_num_threads()}, payload)
        done = subprocess.run([python, str(Path(__file__).with_name("_kronfluence_child.py")),
                               str(payload), str(result), str(Path(tmp, "work"))],
                              capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            return {"name": "kronfluence", "status": "failed",
                    "reason": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
        info = json.loads(next(line[7:] for line in done.stdout.splitlines()
                               if line.startswith("RESULT ")))
        per_ckpt = torch.load(result)
    kind = "kronfluence-ekfac"
    for name in per_ckpt[0]:
        scale = None if name in dampings else float(name[:-1])
        suffix = f"-{name}" if scale is None else ""
        parts = [ckpt.lr * scores[name] for ckpt, scores in zip(ckpts, per_ckpt, strict=True)]
        for c, part in enumerate(parts):
            measure(f"{kind}-ckpt{c}{suffix}", kind, None, scale, part, 0.0, f"ckpt{c}")
        measure(f"{kind}-last{suffix}", kind, None, scale, parts[-1], info["fit_s"], "last")
        measure(f"{kind}-all{suffix}", kind, None, scale, sum(parts), info["fit_s"], "all")
    return {"name": "kronfluence", "status": "ran", "version": info["version"],
            "fit_s": info["fit_s"], "peak_rss_mib": info.get("peak_rss_mib")}


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
        print(f"| {config} | " + " | ".join(f"{cells[s]['lds']:.3f}" if s in cells else "-"
                                            for s in scales) + f" | {fit:.1f} |")


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


def print_fair(result: dict) -> None:
    """Like for like: TracIn, our EK-FAC and kronfluence's per checkpoint, at the last, and
    summed over all, with the best of the same multiples; the rank rule's best beside; the
    refined query's LDS and cost."""
    rows = result["rows"]
    print(f"\n### {result['model']}: like for like, EK-FAC vs kronfluence (same checkpoints, "
          "data, multiples)\n")
    print("| checkpoints | TracIn | ours default | ours best | ours best (rank rule) | "
          "kronfluence 0.1x heuristic | kronfluence best |")
    print("|---|---:|---:|---:|---:|---:|---:|")

    def cell(row):
        if row is None:
            return "-"
        scale = "" if row["scale"] is None else f" ({row['scale']:g}x)"
        return f"{row['lds']:.3f} [{row['low']:.3f}, {row['high']:.3f}]{scale}"

    def find(config, scale="any"):
        found = [r for r in rows if r["config"] == config and (scale == "any" or
                                                               r["scale"] == scale)]
        return max(found, key=lambda r: r["lds"]) if found else None

    names = sorted({r["checkpoints"] for r in rows if r["config"].startswith("ekfac-exact")},
                   key=lambda w: (w == "all", w == "last", w))
    for which in names:
        tail = {"all": "", "last": "-last"}.get(which, f"-{which}")
        ours, tracin = f"ekfac-exact{tail}", f"tracin-exact{tail}"
        rank = find(ours + "-rank") if which in ("all", "last") else None
        print(f"| {which} | {cell(find(tracin))} | "
              f"{cell(find(ours, DEFAULT_SCALES['ekfac']))} | {cell(find(ours))} | "
              f"{cell(rank)} | {cell(find(f'kronfluence-ekfac-{which}-heuristic-0.1x'))} | "
              f"{cell(_best(rows, which))} |")
    refined = find("ekfac-exact-refined")
    cost = result.get("refine_cost") or {}
    if refined is not None:
        print(f"\nrefined EK-FAC (all checkpoints, over {cost['examples']} training examples, "
              f"the exact Fisher): {cost['steps']} CG steps (the default) LDS {cell(refined)}, "
              f"query cost {cost['ratio']:.1f}x the plain EK-FAC query (CPU "
              f"{cost['refined_s']:.2f} s vs {cost['plain_s']:.2f} s), worst relative residual "
              f"{cost['first_residual']:.3g} -> {cost['final_residual']:.3g}; the exact solve "
              f"(solver='direct') LDS "
              f"{cell(find('ekfac-exact-refined-direct', DEFAULT_SCALES['ekfac']))}, best "
              f"{cell(find('ekfac-exact-refined-direct'))}, {cost['direct_ratio']:.1f}x, "
              f"residual {cost['direct_residual']:.3g}")
    peer = result.get("peer") or {}
    rss = peer.get("peak_rss_mib")
    print(f"\npeer kronfluence: {peer.get('status')} {peer.get('version', '')}"
          f"{' (' + peer['reason'] + ')' if 'reason' in peer else ''}"
          + ("" if rss is None else f" (its process's peak RSS {rss:.0f} MiB)"))


def _best(rows, which):
    sweep = [r for r in rows if r["config"] == f"kronfluence-ekfac-{which}"
             and r["scale"] is not None]
    return max(sweep, key=lambda r: r["lds"]) if sweep else None


def save_plot(results: list[dict], scales, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        by_config: dict[str, list] = {}
        for row in result["rows"]:
            if row.get("checkpoints", "all") in ("all", "last"):
                by_config.setdefault(row["config"], []).append(row)
        for config, rows in by_config.items():
            if len(rows) == 1 and rows[0]["scale"] is not None:
                continue  # one point (the refined row): in the tables
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
    parser.add_argument("--medium", action="store_true", help="reduced sizes, no k sweep")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/output/curvature"))
    parser.add_argument("--model", choices=sorted(MODELS), action="append")
    parser.add_argument("--refine-examples", type=int, default=100,
                        help="training examples of the refinement's Fisher (default 100)")
    parser.add_argument("--refine-steps", type=int, default=5, help="CG steps (0: no row)")
    args = parser.parse_args()
    sizes, scales = ((QUICK, QUICK_SCALES) if args.quick else (MEDIUM, SCALES) if args.medium
                     else (FULL, SCALES))
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    start = time.perf_counter()
    results = [evaluate_model(name, sizes, scales, args.out,
                              refine_examples=args.refine_examples,
                              refine_steps=args.refine_steps, heldout=not args.medium)
               for name in args.model or MODELS]
    (args.out / "curvature.json").write_text(json.dumps(results, indent=1))
    for result in results:
        print_table(result, scales)
        print_choices(result)
        print_fair(result)
    (args.out / "curvature.json").write_text(json.dumps(results, indent=1))
    save_plot(results, scales, args.out / "curvature.png")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\nwrote {args.out / 'curvature.png'} and curvature.json in "
          f"{time.perf_counter() - start:.0f} s; peak RSS {peak:.0f} MiB (this process)")


if __name__ == "__main__":
    main()
