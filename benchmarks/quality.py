"""Attribution quality on digits: LDS against retrained models and mislabel detection (issue 17).

Every projection kind at k in {64, 256, 1024} beside exact TracIn (``kind="identity"``), with the
last checkpoint or all of them, inner products or cosine (``normalize``), for multinomial
logistic regression and a 64-32-10 MLP:

    python benchmarks/quality.py            # 1000 train / 300 test, 100 subsets (~15 min, 2 cores)
    python benchmarks/quality.py --quick    # tiny sizes, k=64 (seconds; tests/ runs it)
    python benchmarks/quality.py --model logreg   # one model only

Prints a markdown table per model and writes ``--out``/quality.png (LDS against k) and
quality.json. Retraining results are kept in Zarr groups under ``--out``, so an interrupted run
resumes. To measure a new way of building stores (per-checkpoint projections, a quantised
store), add one ``Config`` to ``EXTRA_CONFIGS``.

Storage (item 4): the training stores of exact TracIn and of rademacher at the largest k are
also stored as int8, sign (1 bit), float16 and bfloat16 (test gradients stay float32); a
second table compares each with its float32 row: LDS, score error, flip detection (from the
stored exact norms, and from the dequantised rows' own norms) and bytes per row.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
import tracinfunc.evaluate as ev

KINDS = ("rademacher", "sjlt", "kronecker")


@dataclass(frozen=True)
class Config:
    """One way of computing scores: a row of the table."""

    name: str
    kind: str = "identity"
    k: int | None = None  # None: no projection (exact TracIn)
    checkpoints: str = "all"  # "all" or "last"
    normalize: bool = False
    projection_options: Mapping = field(default_factory=dict)  # more Projection(...) keywords
    build_options: Mapping = field(default_factory=dict)  # more build_store(...) keywords
    storage: str | None = None  # the training stores' dtype (a STORAGE key); None: float32

    def store_key(self) -> str:
        """Configs differing only in ``normalize`` share their stores."""
        return json.dumps([self.kind, self.k, self.checkpoints, dict(self.projection_options),
                           {key: str(v) for key, v in self.build_options.items()},
                           self.storage])

    def float32_key(self) -> tuple[str, bool]:
        """What identifies this config's float32 counterpart (the same but ``storage``)."""
        return replace(self, storage=None).store_key(), self.normalize


# Issue 17 item 3 (the kronecker split from each weight's shape; one projection per checkpoint
# instead of one shared by all) is in variant_configs, item 4 (quantised storage) in
# storage_configs.
EXTRA_CONFIGS: list[Config] = []
STORAGE = {"int8": "int8", "sign": "sign", "float16": torch.float16,
           "bfloat16": torch.bfloat16}


def variant_configs(ks: tuple[int, ...]) -> list[Config]:
    """Item 3's variants at every ``k``: the kronecker split from each weight's shape (the
    default is the near-square split), per-checkpoint projections."""
    return [
        *(Config(f"kronecker-{k}-shape-all", "kronecker", k,
                 projection_options={"split": "shape"}) for k in ks),
        *(Config(f"{kind}-{k}-per-ckpt-all", kind, k,
                 projection_options={"per_checkpoint": True}) for kind in KINDS for k in ks),
    ]


def storage_configs(ks: tuple[int, ...]) -> list[Config]:
    """Item 4's rows: exact TracIn and rademacher at the largest ``k``, all checkpoints, with
    the training stores kept in every ``STORAGE`` dtype (scores accumulate in float32)."""
    k = max(ks)
    return [row for storage in STORAGE for row in (
        Config(f"exact-{storage}-all", storage=storage),
        Config(f"rademacher-{k}-{storage}-all", "rademacher", k, storage=storage))]


def configs(ks: tuple[int, ...]) -> list[Config]:
    rows = []
    for checkpoints in ("last", "all"):
        for normalize in (False, True):
            tag = f"{checkpoints}{'-cos' if normalize else ''}"
            rows.append(Config(f"exact-{tag}", checkpoints=checkpoints, normalize=normalize))
            rows += [Config(f"{kind}-{k}-{tag}", kind, k, checkpoints, normalize)
                     for kind in KINDS for k in ks]
    return rows + variant_configs(ks) + storage_configs(ks) + EXTRA_CONFIGS


@dataclass(frozen=True)
class Sizes:
    n_train: int
    n_test: int
    n_subsets: int
    epochs: int
    every: int
    ks: tuple[int, ...]
    n_bootstrap: int


FULL = Sizes(1000, 300, 100, 24, 4, (64, 256, 1024), 500)
QUICK = Sizes(100, 20, 6, 3, 1, (64,), 20)
MODELS = {
    "logreg": lambda: nn.Linear(64, 10),  # multinomial logistic regression
    "mlp": lambda: nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)),
}
LR = 0.3
BATCH = 100


def load_digits(sizes: Sizes):
    """Train/test tensors and a copy of the train labels with 10% flipped (always wrong)."""
    from sklearn.datasets import load_digits as sk_digits

    digits = sk_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=g)
    train = order[:sizes.n_train]
    test = order[sizes.n_train:sizes.n_train + sizes.n_test]
    flipped = torch.randperm(sizes.n_train, generator=g)[: sizes.n_train // 10]
    y_noisy = y[train].clone()
    y_noisy[flipped] = (y_noisy[flipped] + torch.randint(1, 10, (len(flipped),), generator=g)) % 10
    return (x[train], y[train]), (x[test], y[test]), y_noisy, flipped


def train(make, x, y, *, seed: int, epochs: int, every: int):
    """Minibatch SGD from a seeded init; a Checkpoint every ``every`` epochs."""
    torch.manual_seed(seed)
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    order = torch.Generator().manual_seed(seed)
    checkpoints = []
    for epoch in range(1, epochs + 1):
        for batch in torch.randperm(len(x), generator=order).split(BATCH):
            optimizer.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
        if epoch % every == 0:
            checkpoints.append(tif.Checkpoint.from_module(model, lr=LR, name=f"epoch-{epoch}"))
    return model, checkpoints


@torch.no_grad()
def margin(model, x, y) -> torch.Tensor:
    """Correct-class margin ``logit_y - logsumexp(other logits)``, ``[n]`` (TRAK's output)."""
    logits = model(x)
    correct = logits.gather(1, y[:, None]).squeeze(1)
    others = logits.scatter(1, y[:, None], float("-inf"))
    return correct - others.logsumexp(1)


def retrain(make, train_set, test_set, sizes: Sizes, out: Path, tag: str, seed: int):
    """The ground truth: a model per subset (init and order from ``seed``), its test margins."""
    (x, y), (x_test, y_test) = train_set, test_set

    def train_fn(indices):
        model, _ = train(make, x[indices], y[indices], seed=seed, epochs=sizes.epochs,
                         every=sizes.epochs)
        return margin(model, x_test, y_test)

    path = out / (f"retrain-{tag}-n{sizes.n_train}-t{sizes.n_test}-e{sizes.epochs}"
                  f"-s{seed}.zarr")
    return ev.retrain_subsets(train_fn, sizes.n_train, sizes.n_subsets, seed=0, path=path)


def scores_for(config: Config, make, ckpts, data, cache: dict):
    """``(scores [n_test, n_train], self-influence on noisy labels [n_train], build seconds)``."""
    key = config.store_key()
    if key not in cache:
        clean, noisy = ckpts
        pick = (lambda c: c) if config.checkpoints == "all" else (lambda c: c[-1:])
        projection = tif.Projection(dim=config.k, kind=config.kind, seed=0,
                                    **config.projection_options)
        loss = tif.loss_from_module(make(), F.cross_entropy)
        opts = {"progress": False, **config.build_options}
        stored = opts if config.storage is None else {**opts, "dtype": STORAGE[config.storage]}
        start = time.perf_counter()
        store = tif.build_store(loss, pick(clean), data["train"], projection=projection,
                                **stored)
        seconds = time.perf_counter() - start
        tests = tif.build_store(loss, pick(clean), data["test"], projection=store.projection,
                                **opts)
        noisy_store = tif.build_store(loss, pick(noisy), data["noisy"], projection=projection,
                                      **stored)
        cache[key] = (store, tests, {"influence": tif.self_influence(noisy_store),
                                     "rows_influence": rows_self_influence(noisy_store),
                                     "row_bytes": row_bytes(store.meta)}, seconds)
    store, tests, extra, seconds = cache[key]
    return tif.score(store, tests, normalize=config.normalize), extra, seconds


def rows_self_influence(store) -> torch.Tensor:
    """``sum_c lr_c * ||row_c||^2`` from the rows as read (dequantised), not the stored norms
    (which are those of the rows before quantisation): ``[n_train]``."""
    return sum(lr * store.read_rows(c, 0, store.n_train).square().sum(1)
               for c, lr in enumerate(store.meta.lrs))


def row_bytes(meta) -> int:
    """Bytes one stored row takes per checkpoint: values (or codes), scale, norm."""
    width = {None: meta.k, "int8": meta.k, "sign": -(-meta.k // 8)}[meta.quantization]
    itemsize = 1 if meta.quantization else meta.torch_dtype.itemsize
    return width * itemsize + (4 if meta.quantization else 0) + 4


def evaluate_model(name: str, sizes: Sizes, out: Path) -> dict:
    make = MODELS[name]
    (x, y), (x_test, y_test), y_noisy, flipped = load_digits(sizes)
    model, clean = train(make, x, y, seed=0, epochs=sizes.epochs, every=sizes.every)
    _, noisy = train(make, x, y_noisy, seed=0, epochs=sizes.epochs, every=sizes.every)
    accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    truth = retrain(make, (x, y), (x_test, y_test), sizes, out, name, seed=0)
    again = retrain(make, (x, y), (x_test, y_test), sizes, out, name, seed=1)
    ceiling = ev.spearman(again.outputs, truth.outputs).nanmean().item()
    data = {"train": (x, y), "test": (x_test, y_test), "noisy": (x, y_noisy)}
    cache, rows, exact, float32 = {}, [], {}, {}
    for config in configs(sizes.ks):
        scores, extra, seconds = scores_for(config, make, (clean, noisy), data, cache)
        result = ev.lds(scores, truth.subsets, truth.outputs, n_bootstrap=sizes.n_bootstrap)
        reference = exact.setdefault((config.checkpoints, config.normalize), scores)
        flips = ev.mislabel_curve(extra["influence"], flipped)
        row = {**asdict(config), "projection_options": dict(config.projection_options),
               "build_options": {k: str(v) for k, v in config.build_options.items()},
               "lds": result.mean, "low": result.low, "high": result.high,
               "score_error": ((scores - reference).norm() / reference.norm()).item(),
               "flip_auc": flips.auc, "flips_at_10": flips.found_at(0.1),
               "row_bytes": extra["row_bytes"], "build_s": seconds}
        if config.storage is None:
            float32.setdefault(config.float32_key(), (scores, row))
        else:  # against the same config stored in float32 (computed earlier)
            base_scores, base = float32[config.float32_key()]
            row["vs_float32"] = {
                "lds": base["lds"], "flip_auc": base["flip_auc"], "row_bytes": base["row_bytes"],
                "score_error": ((scores - base_scores).norm() / base_scores.norm()).item(),
                "rows_flip_auc": ev.mislabel_curve(extra["rows_influence"], flipped).auc}
        rows.append(row)
    return {"model": name, "accuracy": accuracy, "ceiling": ceiling, "rows": rows}


def print_table(result: dict, sizes: Sizes) -> None:
    print(f"\n### {result['model']} (test accuracy {result['accuracy']:.3f}; retraining "
          f"ceiling, seed-to-seed Spearman: {result['ceiling']:.3f})\n")
    print("| config | kind | k | checkpoints | normalize | LDS | 95% CI | score error vs exact "
          "| flip AUC | flips found @10% | build (s) |")
    print("| --- | --- | ---: | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for row in result["rows"]:
        # self-influence is 1 for every row under cosine, so flips are shown unnormalised only
        flips = ("—", "—") if row["normalize"] else (f"{row['flip_auc']:.3f}",
                                                    f"{row['flips_at_10']:.2f}")
        print(f"| {row['name']} | {row['kind']} | {row['k'] or 'p'} | {row['checkpoints']} | "
              f"{'cosine' if row['normalize'] else 'dot'} | {row['lds']:.3f} | "
              f"[{row['low']:.3f}, {row['high']:.3f}] | {row['score_error']:.3f} | {flips[0]} | "
              f"{flips[1]} | {row['build_s']:.2f} |")


def print_storage_table(result: dict) -> None:
    print(f"\n#### {result['model']}: storage of the training stores against float32 (test "
          "gradients float32, float32 accumulation)\n")
    print("| config | storage | bytes/row/ckpt | LDS | float32 LDS | score error vs float32 | "
          "flip AUC (stored norms) | flip AUC (dequantised rows) | float32 flip AUC |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in (r for r in result["rows"] if r["storage"] is not None):
        base = row["vs_float32"]
        print(f"| {row['name']} | {row['storage']} | {row['row_bytes']} (float32 "
              f"{base['row_bytes']}) | {row['lds']:.3f} | {base['lds']:.3f} | "
              f"{base['score_error']:.4f} | {row['flip_auc']:.3f} | {base['rows_flip_auc']:.3f} | "
              f"{base['flip_auc']:.3f} |")


def save_plot(results: list[dict], ks: tuple[int, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.8), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        rows = [r for r in result["rows"] if not r["normalize"] and not r["projection_options"]
                and not r["build_options"] and r["storage"] is None]
        for checkpoints, style in (("all", "-"), ("last", ":")):
            for i, kind in enumerate(KINDS):
                lds = [next(r["lds"] for r in rows if (r["kind"], r["k"], r["checkpoints"])
                            == (kind, k, checkpoints)) for k in ks]
                ax.plot(ks, lds, style, marker="o", color=f"C{i}",
                        label=f"{kind}, {checkpoints} ckpts")
            exact = next(r["lds"] for r in rows if r["kind"] == "identity"
                         and r["checkpoints"] == checkpoints)
            ax.axhline(exact, color="black", linestyle=style, label=f"exact, {checkpoints} ckpts")
        ax.axhline(result["ceiling"], color="grey", linestyle="--", label="retraining ceiling")
        ax.set(xscale="log", xlabel="k", ylabel="LDS", title=result["model"])
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.tight_layout(rect=(0, 0.14, 1, 1))  # room below the panels: the legend hides no point
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, k=64 (seconds)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/output/quality"))
    parser.add_argument("--model", choices=sorted(MODELS), action="append",
                        help="only this model (repeatable; default: all)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    # Every op here is tiny: extra threads only add synchronisation (measured 4.6x slower
    # wall time training with 2 threads than with 1 on the shared 2-core machine).
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    print(f"digits: {sizes.n_train} train / {sizes.n_test} test, {sizes.n_subsets} subsets of "
          f"50%, {sizes.epochs} epochs of SGD (lr {LR}, batch {BATCH}), checkpoints every "
          f"{sizes.every} epochs, {sizes.n_bootstrap} bootstrap resamples")
    results = [evaluate_model(name, sizes, args.out) for name in args.model or MODELS]
    for result in results:
        print_table(result, sizes)
        print_storage_table(result)
    (args.out / "quality.json").write_text(json.dumps(results, indent=1))
    save_plot(results, sizes.ks, args.out / "quality.png")
    print(f"\nwrote {args.out / 'quality.png'} and quality.json in "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
