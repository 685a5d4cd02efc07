"""Curvature-aware TracIn on a small language model: LDS on test-sequence loss (issue 26, item 4).

A 2-layer Llama built from a config (no download; every projection and the untied output head
are ``nn.Linear``, so K-FAC and kronfluence cover the same layers), a character tokenizer, and
docstring lines of standard-library modules (text that ships with Python, as
``examples/language_model.py``): ``n_train`` training sequences, ``n_test`` held-out test
sequences. Adam at a constant learning rate, a checkpoint every ``every`` epochs.

Ground truth: the same training (same init, same batch order rule) on ``n_subsets`` random
half-subsets, each model's log-likelihood of every test sequence (minus its mean next-token
cross-entropy). LDS (``tracinfunc.evaluate.lds``) of:

- plain TracIn ``sum_c lr_c g_test,c . g_train,c`` over all checkpoints and the last only,
  on the parameters K-FAC covers (every Linear weight: embeddings and norms excluded), and
  over all parameters;
- each curvature kind of ``tif.fit_curvature`` (``"kfac"``, ``"ekfac"`` in full space,
  ``"projected"`` at each ``k``, ``"dense"`` when the model is small enough), fitted once,
  ``lambda_c = scale x`` each checkpoint's mean eigenvalue over ``SCALES``, and at the default
  (``Damping()``: the kind's measured scale);
- kronfluence's EK-FAC (when ``.venv-kronfluence`` exists, ``make bench-setup``; its own
  process, ``_kronfluence_child.py``) at the last checkpoint, on the same model and sequences,
  at its default ``damping_factor`` (1e-8) and its heuristic (``None``: 0.1 x mean eigenvalue).

    python benchmarks/quality_lm.py --quick    # tiny model, few subsets (seconds; tests/ runs it)
    python benchmarks/quality_lm.py            # 256 train / 64 test, 100 subsets (~20 min, 2 cores)

Prints the LDS table (differences and ratios against TracIn on the same checkpoints), writes
``--out``/quality_lm.json and quality_lm.png (LDS against damping, one line per kind).
Retraining results are kept in a Zarr group under ``--out``, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import language_model  # noqa: E402  (the example's text and tokenizer)

import tracinfunc as tif  # noqa: E402
import tracinfunc.evaluate as ev  # noqa: E402
from tracinfunc.curvature import DEFAULT_SCALES, Damping, fit_curvature  # noqa: E402
from tracinfunc.curvature.damping import RANK_DEFAULT_SCALES  # noqa: E402
from tracinfunc.errors import IllConditionedError  # noqa: E402

SCALES = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
LR = 3e-3
BATCH = 16
DENSE_LIMIT = 5000  # parameters: dense fits and inverts a [p, p] float64 matrix per checkpoint


@dataclass(frozen=True)
class Sizes:
    n_train: int
    n_test: int
    n_subsets: int
    epochs: int
    every: int
    length: int  # characters per sequence
    width: int  # hidden size (intermediate: 2x)
    ks: tuple[int, ...]  # "projected" at each k
    scales: tuple[float, ...]
    n_bootstrap: int
    ceiling: bool  # retrain every subset with a second seed: the seed-to-seed Spearman
    arch: str = "llama"  # one of ARCHS
    refine: bool = True  # the refined EK-FAC row (CG steps: the slowest query)
    picks: tuple[str, ...] = ("all", "last")  # the checkpoints scored: all, and the last only
    refine_examples: int = 32  # the refined rows' Fisher: the first this many training sequences
    refine_fisher: str = "sampled"  # the refined rows' Fisher: drawn labels, or "expected"
    refine_steps: int = 3  # the refined rows' conjugate-gradient steps at most
    refine_solvers: tuple[str, ...] = ()  # () : cg and direct (sampled), cg (expected)
    refine_batch: int | None = None  # the refinement data in batches of this many sequences
    refine_batches_per_step: int | None = None  # the Neumann solver's batches per product
    refine_step_size: float | None = None  # the Neumann solver's step (None: chosen)


FULL = Sizes(256, 64, 100, 12, 3, 32, 32, (1024,), SCALES, 200, True)
QUICK = Sizes(40, 8, 6, 2, 1, 16, 8, (64,), (0.3, 3.0), 20, False)
# A reduced run for a shared 2-core machine (issue 33's measurements): minutes, not an hour.
MEDIUM = Sizes(96, 24, 24, 6, 2, 24, 16, (256,), (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0), 200,
               False)


ARCHS = ("llama", "gpt-neo")  # --model: the transformers class each is built from


def model_config(sizes: Sizes) -> dict:
    """The model's config keywords (the kronfluence child builds the same): a 2-layer Llama
    (RoPE, RMSNorm, SwiGLU), or a GPT-2-style 2-layer GPT-Neo (learned positions, LayerNorm,
    GELU, global attention; GPT-2 itself is made of ``Conv1D``, which K-FAC does not cover)."""
    if sizes.arch == "gpt-neo":
        return {"vocab_size": 96, "hidden_size": sizes.width, "num_layers": 2,
                "num_heads": 4, "attention_types": [[["global"], 2]],
                "intermediate_size": 2 * sizes.width, "max_position_embeddings": sizes.length,
                "activation_function": "gelu_new", "embed_dropout": 0.0,
                "attention_dropout": 0.0, "resid_dropout": 0.0, "tie_word_embeddings": False,
                "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None}
    return {"vocab_size": 96, "hidden_size": sizes.width, "intermediate_size": 2 * sizes.width,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
            "max_position_embeddings": sizes.length, "tie_word_embeddings": False,
            "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None}


def make_model(sizes: Sizes, seed: int):
    import transformers

    torch.manual_seed(seed)
    config, causal_lm = ((transformers.GPTNeoConfig, transformers.GPTNeoForCausalLM)
                         if sizes.arch == "gpt-neo" else
                         (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = causal_lm._from_config(config(**model_config(sizes)),
                                       attn_implementation="eager" if sizes.arch == "gpt-neo"
                                       else "sdpa")
    return model


def load_text(sizes: Sizes):
    """``(train batch, test batch)``: ``{"input_ids", "attention_mask": [n, length]}``."""
    texts = language_model.snippets(sizes.length, sizes.n_train + sizes.n_test)
    if len(texts) < sizes.n_train + sizes.n_test:
        raise SystemExit(f"only {len(texts)} docstring lines on this Python; lower the sizes")
    data = language_model.Chars().encode(texts, sizes.length)
    train = {key: value[:sizes.n_train] for key, value in data.items()}
    test = {key: value[sizes.n_train:] for key, value in data.items()}
    return train, test


def sequence_losses(model, batch) -> torch.Tensor:
    """Mean next-token cross-entropy per sequence over non-padding targets, ``[n]``."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    scored = batch["attention_mask"][:, 1:] == 1
    targets = batch["input_ids"][:, 1:].masked_fill(~scored, -100)
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(),
                                ignore_index=-100, reduction="none").view(scored.shape)
    return per_token.sum(1) / scored.sum(1).clamp_min(1)


def train(sizes: Sizes, data, indices: torch.Tensor | None, *, seed: int, every: int):
    """Adam (constant lr) from a seeded init over ``data[indices]``, shuffled each epoch from
    ``seed``; a Checkpoint every ``every`` epochs."""
    model = make_model(sizes, seed)
    rows = torch.arange(len(data["input_ids"])) if indices is None else indices
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    order = torch.Generator().manual_seed(seed)
    checkpoints = []
    for epoch in range(1, sizes.epochs + 1):
        model.train()
        for batch in rows[torch.randperm(len(rows), generator=order)].split(BATCH):
            optimizer.zero_grad()
            sequence_losses(model, {k: v[batch] for k, v in data.items()}).mean().backward()
            optimizer.step()
        if epoch % every == 0:
            checkpoints.append(tif.Checkpoint.from_module(model, lr=LR, name=f"epoch-{epoch}"))
    return model.eval(), checkpoints


def retrain(sizes: Sizes, train_set, test_set, out: Path, seed: int):
    """The ground truth: a model per half-subset, each test sequence's log-likelihood."""
    def train_fn(indices):
        model, _ = train(sizes, train_set, indices, seed=seed, every=sizes.epochs)
        with torch.no_grad():
            return -sequence_losses(model, test_set)

    tag = "" if sizes.arch == "llama" else f"-{sizes.arch}"
    path = out / (f"retrain-lm{tag}-n{sizes.n_train}-t{sizes.n_test}-e{sizes.epochs}-w{sizes.width}"
                  f"-L{sizes.length}-s{seed}.zarr")
    return ev.retrain_subsets(train_fn, sizes.n_train, sizes.n_subsets, seed=0, path=path)


def linear_weights(model) -> list[str]:
    """Every ``nn.Linear`` weight: what K-FAC (and kronfluence) cover."""
    return [f"{name}.weight" for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)]


def with_scale(curvature, scale: float):
    """The same estimates, ``lambda_c`` rescaled from 1x to ``scale`` x the mean eigenvalue."""
    return dataclasses.replace(curvature, damping=tuple(d * scale for d in curvature.damping))


def evaluate(sizes: Sizes, out: Path) -> dict:
    train_set, test_set = load_text(sizes)
    model, ckpts = train(sizes, train_set, None, seed=0, every=sizes.every)
    with torch.no_grad():
        test_loss = sequence_losses(model, test_set).mean().item()
        train_loss = sequence_losses(model, train_set).mean().item()
    start = time.perf_counter()
    truth = retrain(sizes, train_set, test_set, out, seed=0)
    retrain_s = time.perf_counter() - start
    ceiling = None
    if sizes.ceiling:
        again = retrain(sizes, train_set, test_set, out, seed=1)
        ceiling = ev.spearman(again.outputs, truth.outputs).nanmean().item()
    loss = tif.causal_lm_loss(model)
    select = linear_weights(model)
    n_selected = sum(ckpts[0].params[name].numel() for name in select)
    n_all = sum(v.numel() for v in ckpts[0].params.values())
    rows: list[dict] = []

    def measure(config, kind, checkpoints, k, scale, scores, fit_s=0.0, default=False):
        result = ev.lds(scores, truth.subsets, truth.outputs, n_bootstrap=sizes.n_bootstrap)
        rows.append({"config": config, "kind": kind, "checkpoints": checkpoints, "k": k,
                     "scale": scale, "default": default, "lds": result.mean, "low": result.low,
                     "high": result.high, "fit_s": fit_s})

    picks = {which: chosen for which, chosen in (("all", ckpts), ("last", ckpts[-1:]))
             if which in sizes.picks}
    costs: dict = {}
    defaults: dict = {}  # EK-FAC at its default damping, per pick: also over the k-store
    options = tif.GradientOptions(select=select)
    # The exact training stores go to disk and are scored chunk by chunk: held in RAM they
    # were most of this benchmark's 1.8-2.0 GB peak (issue 33).
    scratch = Path(tempfile.mkdtemp(prefix="exact-stores-", dir=out))
    for which, chosen in picks.items():
        exact = tif.Projection(kind="identity")
        store = tif.build_store(loss, chosen, train_set, projection=exact, options=options,
                                progress=False, store=str(scratch / f"train-{which}.zarr"))
        tests = tif.build_store(loss, chosen, test_set, projection=exact, options=options,
                                progress=False)
        measure(f"tracin-{which}", "tracin", which, None, None, tif.score(store, tests))
        if which == "all":
            for c, part in enumerate(per_checkpoint(store, tests)):
                measure(f"tracin-ckpt{c}", "tracin", f"ckpt{c}", None, None, part)
        if which == "all":
            every_param = tif.build_store(loss, chosen, train_set, projection=exact,
                                          progress=False,
                                          store=str(scratch / "train-every-param.zarr"))
            every_test = tif.build_store(loss, chosen, test_set, projection=exact,
                                         progress=False)
            measure("tracin-all-params", "tracin", which, None, None,
                    tif.score(every_param, every_test))
        kinds = ["kfac", "ekfac"] + (["dense"] if n_selected <= DENSE_LIMIT else [])
        for kind in kinds:
            start = time.perf_counter()
            fitted = fit_curvature(loss, chosen, train_set, kind=kind, options=options,
                                   damping=Damping(1.0), batch_size=BATCH)
            fit_s = time.perf_counter() - start
            rank_rows(loss, chosen, test_set, store, fitted, options, measure, which,
                      sizes.scales, fit_s)
            for scale in sorted({*sizes.scales, DEFAULT_SCALES[kind]}):
                curvature = with_scale(fitted, scale)
                try:
                    queries = tif.preconditioned_test_grads(loss, chosen, test_set, curvature,
                                                            projection=exact, options=options)
                except IllConditionedError:  # refused below the conditioning rule
                    continue
                measure(f"{kind}-{which}", kind, which, None, scale,
                        tif.score(store, queries, curvature=curvature), fit_s,
                        default=scale == DEFAULT_SCALES[kind])
                if kind == "ekfac" and scale == DEFAULT_SCALES[kind]:
                    defaults[which] = curvature
                if kind == "ekfac" and scale == DEFAULT_SCALES[kind] and sizes.refine:
                    refined_row(loss, chosen, train_set, test_set, store, curvature, options,
                                measure, which, costs, sizes)
                if which == "all" and kind == "ekfac":  # the terms, beside kronfluence's
                    for c, part in enumerate(per_checkpoint(store, queries)):
                        measure(f"{kind}-ckpt{c}", kind, f"ckpt{c}", None, scale, part, fit_s,
                                default=scale == DEFAULT_SCALES[kind])
        for k in sizes.ks:
            projection = tif.Projection(dim=k, seed=0)
            store_k = tif.build_store(loss, chosen, train_set, projection=projection,
                                      options=options, progress=False)
            tests_k = tif.build_store(loss, chosen, test_set, projection=store_k.projection,
                                      options=options, progress=False)
            measure(f"tracin-{which}-k{k}", "tracin", which, k, None, tif.score(store_k, tests_k))
            # EK-FAC queries projected to k: the exact store need not be held (issue 33)
            queries_k = tif.preconditioned_test_grads(loss, chosen, test_set, defaults[which],
                                                      projection=store_k.projection,
                                                      options=options)
            measure(f"ekfac-{which}-k{k}", "ekfac-k-store", which, k, None,
                    tif.score(store_k, queries_k, curvature=defaults[which]))
            start = time.perf_counter()
            fitted = fit_curvature(loss, chosen, train_set, kind="projected", options=options,
                                   projection=store_k.projection, damping=Damping(1.0),
                                   batch_size=BATCH)
            fit_s = time.perf_counter() - start
            for scale in sorted({*sizes.scales, DEFAULT_SCALES["projected"]}):
                measure(f"projected-{which}-k{k}", "projected", which, k, scale,
                        tif.score(store_k, tests_k, curvature=with_scale(fitted, scale)), fit_s,
                        default=scale == DEFAULT_SCALES["projected"])
    shutil.rmtree(scratch, ignore_errors=True)
    peers = [kronfluence_rows(sizes, ckpts, train_set, test_set, measure), BERGSON]
    return {"sizes": dataclasses.asdict(sizes), "rows": rows, "peers": peers,
            "train_loss": train_loss, "test_loss": test_loss, "ceiling": ceiling,
            "n_selected": n_selected, "n_params": n_all, "n_checkpoints": len(ckpts),
            "retrain_s": retrain_s, "dense": n_selected <= DENSE_LIMIT, "refine_cost": costs}


def rank_rows(loss, chosen, test_set, store, fitted, options, measure, which, scales,
              fit_s) -> None:
    """The rank rule's sweep (``-rank`` rows): ``lambda_c = scale x tr(H_c) / rank(H_c)``,
    marked default at the kind's ``RANK_DEFAULT_SCALES``."""
    exact, kind = tif.Projection(kind="identity"), fitted.kind
    ranked = fitted.mean_eigenvalues("rank")
    for scale in sorted({*scales, RANK_DEFAULT_SCALES[kind]}):
        curvature = dataclasses.replace(fitted, damping=tuple(scale * m for m in ranked))
        try:
            queries = tif.preconditioned_test_grads(loss, chosen, test_set, curvature,
                                                    projection=exact, options=options)
        except IllConditionedError:
            continue
        measure(f"{kind}-{which}-rank", f"{kind}-rank", which, None, scale,
                tif.score(store, queries, curvature=curvature), fit_s,
                default=scale == RANK_DEFAULT_SCALES[kind])


def refined_row(loss, chosen, train_set, test_set, store, curvature, options, measure, which,
                costs, sizes) -> None:
    """EK-FAC refined on the Fisher of ``sizes.refine_examples`` training sequences: by
    ``sizes.refine_steps`` conjugate-gradient steps (``ekfac-<which>-refined``, the default
    solver) and by the exact solve (``-refined-direct``), or with ``refine_fisher="expected"``
    by conjugate gradient on the expected Fisher (``-refined-expected``; it has no direct
    solve), each also at every multiple in ``sizes.scales`` (the kept Fisher shared; the
    direct solve's factor per damping); their LDS and the query cost against the plain EK-FAC
    query (CPU time), at the default multiple."""
    exact = tif.Projection(kind="identity")
    seconds, examples, steps = {}, sizes.refine_examples, sizes.refine_steps
    base_suffix = "refined" if sizes.refine_fisher == "sampled" else "refined-expected"
    chosen_solvers = sizes.refine_solvers or (("cg", "direct") if sizes.refine_fisher
                                               == "sampled" else ("cg",))
    solvers = [(solver, base_suffix if solver == "cg" else f"{base_suffix}-{solver}")
               for solver in chosen_solvers]
    data = train_set
    if sizes.refine_batch is not None:  # the Neumann solver draws batches: split the data
        n = len(train_set["input_ids"])
        data = [{key: value[i:i + sizes.refine_batch] for key, value in train_set.items()}
                for i in range(0, n, sizes.refine_batch)]
    for solver, suffix in solvers:
        neumann = ({"batches_per_step": sizes.refine_batches_per_step,
                    "step_size": sizes.refine_step_size} if solver == "neumann" else {})
        refined = curvature.with_refinement(data, steps=steps, max_examples=examples,
                                            solver=solver, fisher=sizes.refine_fisher,
                                            **neumann)
        for label, value in (("plain", curvature), (solver, refined)):
            start = time.process_time()
            with warnings.catch_warnings(record=True):
                queries = tif.preconditioned_test_grads(loss, chosen, test_set, value,
                                                        projection=exact, options=options)
            seconds[label] = time.process_time() - start
        mark = queries.meta.extra["curvature"]
        measure(f"ekfac-{which}-{suffix}", f"ekfac-{suffix}", which, None,
                DEFAULT_SCALES["ekfac"], tif.score(store, queries, curvature=refined))
        if which == "all":  # the terms of the refined sum, beside EK-FAC's and kronfluence's
            for c, part in enumerate(per_checkpoint(store, queries)):
                measure(f"ekfac-ckpt{c}-{suffix}", f"ekfac-{suffix}", f"ckpt{c}", None,
                        DEFAULT_SCALES["ekfac"], part)
        costs.setdefault(which, {"steps": steps, "examples": examples,
                                 "fisher": sizes.refine_fisher})
        costs[which][solver] = {
            "ratio": seconds[solver] / max(seconds["plain"], 1e-9),
            "refined": seconds[solver], "plain": seconds["plain"],
            "solvers": mark["solvers"],
            "residual": [max(r[0] for r in mark["residuals"]),
                         max(r[-1] for r in mark["residuals"])]}
        base = DEFAULT_SCALES["ekfac"]
        for scale in sizes.scales:  # the damping swept (the kept Fisher shared)
            if scale == base:
                continue
            other = dataclasses.replace(refined, damping=tuple(d * scale / base
                                                               for d in refined.damping))
            try:
                with warnings.catch_warnings(record=True):
                    queries = tif.preconditioned_test_grads(loss, chosen, test_set, other,
                                                            projection=exact, options=options)
            except IllConditionedError:  # refused below the conditioning rule
                continue
            measure(f"ekfac-{which}-{suffix}", f"ekfac-{suffix}", which, None, scale,
                    tif.score(store, queries, curvature=other))
            if which == "all":
                for c, part in enumerate(per_checkpoint(store, queries)):
                    measure(f"ekfac-ckpt{c}-{suffix}", f"ekfac-{suffix}", f"ckpt{c}", None,
                            scale, part)


def kronfluence_python() -> str:
    """kronfluence's own environment (``make bench-setup``), or ``$KRONFLUENCE_PYTHON``."""
    return os.environ.get("KRONFLUENCE_PYTHON", str(ROOT / ".venv-kronfluence" / "bin" / "python"))


# bergson 2.5.1 installs beside this (make bench-setup) and has EK-FAC, but only inside its
# hessian_pipeline: a model and tokenizer loaded by name with from_pretrained, data through HF
# datasets, gradients collected and scored by its distributed workers. This benchmark's model
# has a character tokenizer and in-memory batches; not wired through that pipeline yet.
BERGSON = {"name": "bergson", "status": "not run",
           "reason": "its EK-FAC runs only through its hessian_pipeline (a model and HF "
                     "tokenizer loaded by name, data from HF datasets); this benchmark's "
                     "character-tokenised in-memory Llama is not wired through it yet"}


def kronfluence_rows(sizes, ckpts, train_set, test_set, measure) -> dict:
    """kronfluence's EK-FAC at every checkpoint, in its own process: per-checkpoint rows, the
    last checkpoint, and the lr-weighted sum over all (as tracinfunc sums), each at its two
    named dampings and at the benchmark's multiples of the mean eigenvalue (the same sweep)."""
    python = kronfluence_python()
    if not Path(python).exists():
        return {"name": "kronfluence", "status": "unavailable",
                "reason": f"no kronfluence environment at {python} (make bench-setup, or set "
                          "KRONFLUENCE_PYTHON)"}
    dampings = {"default-1e-8": 1e-8, "heuristic-0.1x": None}
    states = [{name: value.detach().cpu() for name, value in ckpt.params.items()}
              for ckpt in ckpts]
    with tempfile.TemporaryDirectory(prefix="kronfluence-") as tmp:
        payload, result = Path(tmp, "payload.pt"), Path(tmp, "scores.pt")
        torch.save({"config": model_config(sizes), "arch": sizes.arch, "checkpoints": states,
                    "train": train_set, "test": test_set, "batch": BATCH,
                    "dampings": dampings, "scales": list(sizes.scales),
                    "threads": torch.get_num_threads()}, payload)
        done = subprocess.run([python, str(Path(__file__).with_name("_kronfluence_child.py")),
                               str(payload), str(result), str(Path(tmp, "work"))],
                              capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            return {"name": "kronfluence", "status": "failed",
                    "reason": done.stderr.strip().splitlines()[-1][:300] if done.stderr else
                    f"exit {done.returncode}"}
        info = json.loads(next(line[7:] for line in done.stdout.splitlines()
                               if line.startswith("RESULT ")))
        per_ckpt = torch.load(result)
    for name in per_ckpt[0]:
        scale = None if name in dampings else float(name[:-1])
        kind = "kronfluence-ekfac"
        parts = [ckpt.lr * scores[name] for ckpt, scores in zip(ckpts, per_ckpt, strict=True)]
        for c, part in enumerate(parts):
            measure(f"kronfluence-ekfac-ckpt{c}-{name}" if scale is None else
                    f"kronfluence-ekfac-ckpt{c}", kind, f"ckpt{c}", None, scale, part)
        for which, total in (("last", parts[-1]), ("all", sum(parts))):
            measure(f"kronfluence-ekfac-{which}-{name}" if scale is None else
                    f"kronfluence-ekfac-{which}", kind, which, None, scale, total,
                    info["fit_s"])
    return {"name": "kronfluence", "status": "ran", "version": info["version"],
            "fit_s": info["fit_s"], "score_s": info["score_s"],
            "peak_rss_mib": info.get("peak_rss_mib")}


def per_checkpoint(store, queries) -> list[torch.Tensor]:
    """``lr_c <test_c, train_c>`` per checkpoint ``[n_test, n_train]``: the terms of the sum
    (the training rows read 64 at a time, never the whole store in float64)."""
    n, step = store.meta.n_train, 64
    return [lr * torch.cat([queries.read_rows(c, 0, queries.meta.n_train).double()
                            @ store.read_rows(c, start, min(n, start + step)).double().T
                            for start in range(0, n, step)], dim=1)
            for c, lr in enumerate(store.meta.lrs)]


def default_rows(result: dict) -> list[dict]:
    """One row per config: plain TracIn, or a curvature at its kind's default damping."""
    return [r for r in result["rows"] if r["scale"] is None or r["default"]]


def reference(result: dict, row: dict) -> dict:
    """The plain TracIn row a row is compared with: same checkpoints and store (k). Under
    ``--all-only`` there is no ``tracin-last`` (kronfluence still runs at the last checkpoint):
    the last checkpoint's term of the sum stands in (the same ranking, scaled by its lr)."""
    names = [f"tracin-{row['checkpoints']}" + (f"-k{row['k']}" if row["k"] else "")]
    if row["checkpoints"] == "last" and not row["k"]:
        names.append(f"tracin-ckpt{result['n_checkpoints'] - 1}")
    for name in names:
        for r in result["rows"]:
            if r["config"] == name:
                return r
    raise KeyError(f"no plain TracIn row {names} for {row['config']!r}")


def print_tables(result: dict) -> None:
    sizes = result["sizes"]
    print(f"\n### Language model: LDS on test-sequence log-likelihood ({sizes['n_train']} train "
          f"/ {sizes['n_test']} test sequences of {sizes['length']} characters, "
          f"{sizes['n_subsets']} half-subsets)\n")
    ceiling = "-" if result["ceiling"] is None else f"{result['ceiling']:.3f}"
    name = {"llama": "Llama", "gpt-neo": "GPT-Neo"}[sizes.get("arch", "llama")]
    print(f"2-layer {name}, width {sizes['width']}, {result['n_params']:,} parameters "
          f"({result['n_selected']:,} in Linear weights, the scored selection); "
          f"{result['n_checkpoints']} checkpoints; train loss {result['train_loss']:.3f}, test "
          f"loss {result['test_loss']:.3f}; retraining ceiling (seed-to-seed Spearman) "
          f"{ceiling}\n")
    print("| config | kind | checkpoints | k | damping | LDS | 95% CI | vs TracIn | ratio "
          "| fit (s) |")
    print("|---|---|---|---:|---|---:|---|---:|---:|---:|")
    for row in default_rows(result):
        base = reference(result, row)
        damping = ("-" if row["scale"] is None else f"{row['scale']:g}x mean eig (default)")
        if row["kind"] == "kronfluence-ekfac":
            damping = row["config"].split(f"-{row['checkpoints']}-", 1)[1]
        delta, ratio = row["lds"] - base["lds"], row["lds"] / base["lds"]
        print(f"| {row['config']} | {row['kind']} | {row['checkpoints']} | {row['k'] or 'p'} | "
              f"{damping} | {row['lds']:.3f} | [{row['low']:.3f}, {row['high']:.3f}] | "
              f"{delta:+.3f} | {ratio:.2f} | {row['fit_s']:.1f} |")
    scales = sizes["scales"]
    print("\n#### LDS against damping (lambda_c = scale x mean eigenvalue of each checkpoint)\n")
    print("| config | " + " | ".join(f"{s:g}x" for s in scales) + " | best - TracIn |")
    print("|---|" + "---:|" * (len(scales) + 1))
    sweeps: dict[str, dict] = {}
    for row in result["rows"]:
        if row["scale"] is not None:
            sweeps.setdefault(row["config"], {})[row["scale"]] = row
    for config, cells in sweeps.items():
        base = reference(result, next(iter(cells.values())))
        best = max(cell["lds"] for cell in cells.values())
        print(f"| {config} | " + " | ".join(f"{cells[s]['lds']:.3f}" if s in cells else "-"
                                            for s in scales)
              + f" | {best - base['lds']:+.3f} |")
    print_fair(result)
    for which, cost in result.get("refine_cost", {}).items():
        fisher = cost.get("fisher", "sampled")
        for solver, how in (("cg", f"{cost['steps']} CG steps"), ("direct", "exact solve"),
                            ("neumann", f"{cost['steps']} Neumann steps")):
            if solver not in cost:  # the expected Fisher: conjugate gradient only
                continue
            got = cost[solver]
            print(f"\nrefined EK-FAC ({which}, {how}: {'/'.join(sorted(set(got['solvers'])))}, "
                  f"{fisher} Fisher over {cost['examples']} sequences): query cost "
                  f"{got['ratio']:.1f}x the plain EK-FAC query (CPU {got['refined']:.1f} s vs "
                  f"{got['plain']:.1f} s); "
                  f"worst relative residual {got['residual'][0]:.3g} -> {got['residual'][1]:.3g}")
    for peer in result["peers"]:
        if peer["status"] != "ran":
            print(f"\npeer {peer['name']}: {peer['status']} ({peer['reason']})")
        else:
            rss = peer.get("peak_rss_mib")
            print(f"\npeer {peer['name']} {peer['version']}: ran (EK-FAC fit "
                  f"{peer['fit_s']:.1f} s" + ("" if rss is None else f", peak RSS {rss:.0f} MiB")
                  + ")")
    if not result["dense"]:
        print(f"\ndense: not run ({result['n_selected']:,} parameters > {DENSE_LIMIT:,}: a "
              "[p, p] float64 inverse per checkpoint)")


def print_fair(result: dict) -> None:
    """Like for like: per checkpoint, the last, and the sum over all, tracinfunc's EK-FAC and
    kronfluence's at the same checkpoints, data and damping sweep (best multiple, and each at
    its default: ours ``DEFAULT_SCALES``, kronfluence's 0.1x heuristic)."""
    rows = result["rows"]
    picks = sorted({r["checkpoints"] for r in rows if r["kind"] == "kronfluence-ekfac"},
                   key=lambda w: (w == "all", w == "last", w))
    if not picks:
        return
    print("\n#### Like for like: EK-FAC, tracinfunc vs kronfluence (same checkpoints, data, "
          "damping sweep)\n")
    suffix = ("refined-expected" if any(r["config"].endswith("-refined-expected") for r in rows)
              else "refined")  # CG on the expected Fisher, or on the sampled one
    print(f"| checkpoints | TracIn | ours default | ours best (multiple) | ours {suffix} (CG, "
          f"default) | ours {suffix} best (multiple) | kronfluence 0.1x heuristic | "
          "kronfluence best (multiple) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")

    def best(kind, which):
        sweep = [r for r in rows if r["kind"] == kind and r["checkpoints"] == which
                 and r["scale"] is not None]
        top = max(sweep, key=lambda r: r["lds"]) if sweep else None
        return "-" if top is None else f"{top['lds']:.3f} ({top['scale']:g}x)"

    def one(config, *, default=None):
        found = [r for r in rows if r["config"] == config
                 and (default is None or r["default"] == default)]
        return f"{found[0]['lds']:.3f}" if found else "-"

    for which in picks:
        ours = f"ekfac-{which}"
        print(f"| {which} | {one(f'tracin-{which}')} | {one(ours, default=True)} | "
              f"{best('ekfac', which)} | {one(f'{ours}-{suffix}')} | "
              f"{best(f'ekfac-{suffix}', which)} | "
              f"{one(f'kronfluence-ekfac-{which}-heuristic-0.1x')} | "
              f"{best('kronfluence-ekfac', which)} |")


def save_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    sweeps: dict[str, list] = {}
    flat = []
    for row in result["rows"]:
        (flat if row["scale"] is None else sweeps.setdefault(row["config"], [])).append(row)
    kinds = sorted({row["kind"] for row in result["rows"] if row["scale"] is not None})
    for config, rows in sweeps.items():
        color = f"C{kinds.index(rows[0]['kind'])}"
        style = "-" if rows[0]["checkpoints"] == "all" else "--"
        ax.plot([r["scale"] for r in rows], [r["lds"] for r in rows], style, marker="o",
                color=color, label=config)
        default = next((r for r in rows if r["default"]), None)
        if default is not None:
            ax.plot(default["scale"], default["lds"], marker="*", markersize=14, color=color)
    for row in flat:
        style = "-" if row["checkpoints"] == "all" else "--"
        color = "black" if row["kind"] == "tracin" else "firebrick"
        if row["kind"] != "tracin":  # a peer (last checkpoint): one style per damping
            style = ":" if row["config"].endswith("1e-8") else "-."
        ax.axhline(row["lds"], color=color, linestyle=style, linewidth=1,
                   alpha=1.0 if row["config"] in ("tracin-all", "tracin-last") else 0.5,
                   label=row["config"])
    ax.set_xscale("log")
    ax.set_xlabel("damping: multiple of each checkpoint's mean eigenvalue (star: default)")
    ax.set_ylabel("LDS (test-sequence log-likelihood)")
    sizes = result["sizes"]
    name = {"llama": "Llama", "gpt-neo": "GPT-Neo"}[sizes.get("arch", "llama")]
    ax.set_title(f"2-layer {name}, {sizes['n_train']} train / {sizes['n_test']} test sequences, "
                 f"{sizes['n_subsets']} subsets")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check(result: dict) -> None:
    """What every run must give: finite LDS for every kind (a quick run's assertions)."""
    bad = [r["config"] for r in result["rows"] if not math.isfinite(r["lds"])]
    if bad:
        raise SystemExit(f"non-finite LDS in {bad}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--medium", action="store_true", help="reduced sizes (minutes)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/output/quality_lm"))
    parser.add_argument("--subsets", type=int, help="retrained half-subsets (default: 100)")
    parser.add_argument("--no-ceiling", action="store_true",
                        help="skip the second-seed retraining (halves the retraining time)")
    parser.add_argument("--model", choices=ARCHS, default="llama",
                        help="the 2-layer LM: llama (default) or gpt-neo (GPT-2-style)")
    parser.add_argument("--scales", type=float, nargs="+",
                        help="the damping multiples swept (default: the size's)")
    parser.add_argument("--no-refine", action="store_true", help="skip the refined EK-FAC row")
    parser.add_argument("--refine-examples", type=int, default=32,
                        help="training sequences of the refined rows' Fisher (default 32)")
    parser.add_argument("--refine-fisher", choices=("sampled", "expected"), default="sampled",
                        help="the refined rows' Fisher: labels drawn (default), or their "
                             "expectation computed exactly (conjugate gradient only)")
    parser.add_argument("--refine-steps", type=int, default=3,
                        help="the refined rows' conjugate-gradient steps at most (default 3)")
    parser.add_argument("--refine-solvers", nargs="+", choices=("cg", "direct", "neumann"),
                        help="the refined rows' solvers (default: cg and direct; cg for the "
                             "expected Fisher)")
    parser.add_argument("--refine-batch", type=int,
                        help="the refinement data in batches of this many sequences")
    parser.add_argument("--refine-batches-per-step", type=int,
                        help="the Neumann solver's batches per product (default: all)")
    parser.add_argument("--refine-step-size", type=float,
                        help="the Neumann solver's step size (default: chosen)")
    parser.add_argument("--all-only", action="store_true",
                        help="score all checkpoints only (skip the last-checkpoint rows)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else MEDIUM if args.medium else FULL
    if args.subsets is not None:
        sizes = dataclasses.replace(sizes, n_subsets=args.subsets)
    if args.no_ceiling:
        sizes = dataclasses.replace(sizes, ceiling=False)
    if args.scales:
        sizes = dataclasses.replace(sizes, scales=tuple(sorted(args.scales)))
    sizes = dataclasses.replace(sizes, arch=args.model, refine=not args.no_refine,
                                refine_examples=args.refine_examples,
                                refine_fisher=args.refine_fisher,
                                refine_steps=args.refine_steps,
                                refine_solvers=tuple(args.refine_solvers or ()),
                                refine_batch=args.refine_batch,
                                refine_batches_per_step=args.refine_batches_per_step,
                                refine_step_size=args.refine_step_size,
                                picks=("all",) if args.all_only else ("all", "last"))
    torch.set_num_threads(1)  # tiny ops: extra threads only add synchronisation
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = evaluate(sizes, args.out)
    check(result)
    print_tables(result)
    (args.out / "quality_lm.json").write_text(json.dumps(result, indent=1))
    save_plot(result, args.out / "quality_lm.png")
    print(f"\nwrote {args.out / 'quality_lm.png'} and quality_lm.json in "
          f"{time.perf_counter() - start:.0f} s (retraining {result['retrain_s']:.0f} s); peak "
          f"RSS {peak_rss_mib():.0f} MiB (this process)")


def peak_rss_mib() -> float:
    """This process's peak resident set size, MiB (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    main()
