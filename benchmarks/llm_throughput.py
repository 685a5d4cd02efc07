"""Projected per-example gradients of GPT-2 models against the floor: one batched fwd+bwd.

Each configuration runs in its own process (peak RSS is its own), with 1 thread, and times
CPU seconds, interleaved: floor, method, floor, method, ... (medians). The floor is one
training step's forward+backward of the same model on the same batch (weight gradients
included). Each row also counts the operations one call dispatches (``ops``, beside the
floor's): on a GPU each is a kernel launch, so a call of many small ones is bound by the
host however fast the device. Parameter sets: ``matched`` (the transformer blocks' Conv1D
weights, bergson's default) and ``all``. Methods:

- ``kronecker``: ``projected_grads(kind="kronecker")``, the batched factorised path (one
  backward of the batch's summed loss, weights frozen);
- ``kronecker vmapped``: the same rows by the per-example (vmapped) backward (before);
- ``sjlt``: materialised per-example gradients, sparse projection;
- ``+adam factored``: kronecker with Adam (LESS) preconditioning, second moment in
  Adafactor form (stays factorised) except on embedding tables, which keep the exact diagonal
  (``as_factored()``'s default); ``+adam factored all``: every matrix factored
  (``as_factored(exact=[])``, the form before issue 34); ``+adam exact``: the exact diagonal
  (generic path). With ``--trained`` the state is the training run's AdamW state, else a
  fresh Adam after two steps;
- ``identity``: exact rows (``kind="identity"``, no projection; no agreement computed);
- ``bergson exact``: bergson's collector with ``projection_dim=0`` (no projection);
- ``bergson`` (when ``.venv-bergson`` exists, ``make bench-setup``; ``benchmarks/
  _bergson_child.py``): per-module projection ``p x p`` (p=16 on the small model, 9 on
  GPT-2 small's shape), weights frozen; ``all`` is every module bergson supports.

On the small model each method's scores are compared with exact TracIn (dense per-example
gradients, exact diagonal Adam where preconditioned): Pearson r and top-10 overlap. With
``--trained STEPS`` the model is first trained (AdamW, lr 1e-3, batches of 8) on sequences of
a seeded sparse Markov chain over the vocabulary (each token has 8 likely successors), and
every batch, timed or compared, is drawn from that chain: agreement on a trained model, not
only at random initialisation.

    python benchmarks/llm_throughput.py                  # 4 layers x 128, ~5 minutes
    python benchmarks/llm_throughput.py --models small gpt2
    python benchmarks/llm_throughput.py --quick          # seconds, in process (a test runs it)
    python benchmarks/llm_throughput.py --trained 300 --methods kronecker sjlt   # trained
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

METHODS = [("kronecker", None), ("kronecker vmapped", None), ("kronecker vectors", None),
           ("sjlt", None),
           ("kronecker", "adam factored"), ("kronecker", "adam exact"),
           ("kronecker", "adam factored all"), ("identity", None)]


def build(size: str, quick: bool, tokens: int = 64):
    import torch
    import transformers

    if quick:
        config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                         n_positions=32)
    elif size == "small":
        config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=2048,
                                         n_positions=max(128, tokens))
    else:  # GPT-2 small's shape, ~124M parameters
        config = transformers.GPT2Config(n_positions=1024)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    return model.eval(), config


def token_batches(config, n: int, batch: int, tokens: int, seed: int, markov: bool = False):
    """``n`` batches ``{"input_ids": [batch, tokens]}``: uniform random tokens, or (``markov``)
    walks of :func:`markov_chain`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if not markov:
        return [{"input_ids": torch.randint(0, config.vocab_size, (batch, tokens), generator=g)}
                for _ in range(n)]
    chain = markov_chain(config.vocab_size)
    out = []
    for _ in range(n):
        ids = torch.empty(batch, tokens, dtype=torch.long)
        ids[:, 0] = torch.randint(0, config.vocab_size, (batch,), generator=g)
        for t in range(1, tokens):
            ids[:, t] = torch.multinomial(chain[ids[:, t - 1]], 1, generator=g).squeeze(1)
        out.append({"input_ids": ids})
    return out


def markov_chain(vocab: int):
    """``[vocab, vocab]`` transition probabilities: 8 successors per token (seeded), with
    geometric weights, plus a little mass everywhere."""
    import torch

    g = torch.Generator().manual_seed(7)
    chain = torch.full((vocab, vocab), 1e-3 / vocab)
    successors = torch.stack([torch.randperm(vocab, generator=g)[:8] for _ in range(vocab)])
    chain.scatter_(1, successors, (0.5 ** torch.arange(8.0)).expand(vocab, 8).contiguous())
    return chain / chain.sum(dim=1, keepdim=True)


def train(model, config, cfg: dict):
    """``cfg["trained"]`` AdamW steps on Markov-chain batches of 8 (``--trained``): the
    next-token loss of the first and of the last batch, and the optimizer."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = token_batches(config, cfg["trained"], 8, cfg["tokens"], seed=11, markov=True)
    model.train()
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        losses.append(floor_step(model, batch))
        optimizer.step()
    model.eval()
    model.zero_grad(set_to_none=True)
    return (losses[0], losses[-1]), optimizer


def matched_names(model) -> list[str]:
    return [name for name, _ in model.named_parameters()
            if name.startswith("transformer.h.") and ".c_" in name and name.endswith("weight")]


def adam_state(model, batches, optimizer=None):
    """The training run's optimizer state, or (``None``) Adam after two steps (lr small, so
    the weights barely move), as a Preconditioner."""
    import torch

    import tracinfunc as tif

    if optimizer is not None:
        return tif.Preconditioner.from_optimizer(optimizer, model, kind="adam")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    for batch in batches[:2]:
        optimizer.zero_grad()
        floor_step(model, batch)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return tif.Preconditioner.from_optimizer(optimizer, model, kind="adam")


def floor_step(model, batch) -> float:
    import torch.nn.functional as F

    ids = batch["input_ids"]
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return float(loss)


def functional_loss(model):
    """A hand-written loss, the way the docs show users writing one (``--functional-loss``):
    the model's own ``outputs.loss`` through ``torch.func.functional_call``."""
    from torch.func import functional_call

    def loss(params, example):
        ids = example["input_ids"][None]
        return functional_call(model, params, (), {"input_ids": ids, "labels": ids}).loss

    return loss


def method_fn(model, method: str, precondition: str | None, names, state, k: int,
              functional: bool = False):
    import tracinfunc as tif
    from tracinfunc.grads.factorized import factorized_projected_grads

    loss = functional_loss(model) if functional else tif.causal_lm_loss(model)
    kind = method if method in ("sjlt", "identity") else "kronecker"
    vectors = "kronecker" if method == "kronecker vectors" else "dense"  # biases side by side
    spec = tif.Projection(dim=None if kind == "identity" else k, kind=kind, vectors=vectors)
    if method == "kronecker vmapped":
        return factorized_projected_grads(loss, spec, select=names, batched=False)
    chosen = state
    if precondition == "adam factored":
        chosen = state.as_factored()  # embedding tables keep the exact diagonal
    elif precondition == "adam factored all":
        chosen = state.as_factored(exact=[])
    return tif.projected_grads(
        loss, spec, options=tif.GradientOptions(select=names), precondition=chosen
    )


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def dispatched_ops(fn) -> int:
    """Operations ``fn()`` dispatches to kernels (autograd's backward included): on a GPU each
    is at least one launch, so a call of many small ones is bound by the host."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Count():
            fn()
    return Count.n


def run_config(cfg: dict) -> dict:
    """One configuration in this process: timings, peak RSS, agreement."""
    model, config = build(cfg["model"], cfg["quick"], cfg["tokens"])
    markov = bool(cfg.get("trained"))
    losses, optimizer = train(model, config, cfg) if markov else (None, None)
    batches = token_batches(config, 3, cfg["batch"], cfg["tokens"], seed=1, markov=markov)
    names = matched_names(model) if cfg["params"] == "matched" else None
    state = adam_state(model, batches, optimizer) if cfg["precondition"] else None
    params = {name: value.detach() for name, value in model.named_parameters()}  # no copy
    fn = method_fn(model, cfg["method"], cfg["precondition"], names, state, cfg["k"],
                   cfg.get("functional", False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row_bytes = fn(params, batches[0])[0].nbytes  # warm-up: plan, projection blocks,
        # first-batch check; the rows are freed before the RSS is read
    tool = [cpu_seconds(lambda b=b: fn(params, b)) for b in batches]
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before any floor
    floor = []
    for r in range(cfg["repeats"]):
        batch = batches[r % len(batches)]
        model.zero_grad(set_to_none=True)
        floor.append(cpu_seconds(lambda b=batch: floor_step(model, b)))
        model.zero_grad(set_to_none=True)
        tool.append(cpu_seconds(lambda b=batch: fn(params, b)))
    floor.append(cpu_seconds(lambda: floor_step(model, batches[0])))
    model.zero_grad(set_to_none=True)
    ops = dispatched_ops(lambda: fn(params, batches[0]))
    floor_ops = dispatched_ops(lambda: floor_step(model, batches[0]))
    model.zero_grad(set_to_none=True)
    result = {"tool_s": statistics.median(tool), "floor_s": statistics.median(floor),
              "rss_mib": rss_mib, "tokens": cfg["batch"] * cfg["tokens"],
              "ops": ops, "floor_ops": floor_ops,
              "row_bytes": row_bytes}  # identity: every parameter
    if losses is not None:
        result["train_loss"] = losses  # first and last training batch
    if cfg["agreement"]:
        result.update(agreement(model, config, fn, cfg, names, state, params))
    return result


def agreement(model, config, fn, cfg, names, state, params) -> dict:
    """Pearson r and top-10 overlap of the method's scores with exact TracIn."""
    import torch

    import tracinfunc as tif

    n_train, n_test = (16, 4) if cfg["quick"] else (64, 16)
    markov = bool(cfg.get("trained"))
    train = token_batches(config, 1, n_train, cfg["tokens"], seed=2, markov=markov)[0]
    test = token_batches(config, 1, n_test, cfg["tokens"], seed=3, markov=markov)[0]
    loss = tif.causal_lm_loss(model)
    dense = tif.per_sample_grads(loss, options=tif.GradientOptions(select=names, chunk_size=8))
    g_train, g_test = dense(params, train), dense(params, test)
    extra = {}
    if cfg["precondition"] in ("adam factored", "adam factored all"):  # no projection
        form = state.as_factored(exact=[] if cfg["precondition"].endswith("all") else None)
        extra["r_factored_vs_exact"] = pearson(
            dense_scores(preconditioned(g_train, form), g_test),
            dense_scores(preconditioned(g_train, state), g_test))
    if cfg["precondition"]:
        g_train = preconditioned(g_train, state)
    exact = dense_scores(g_train, g_test)  # [n_test, n_train]
    plain = method_fn(model, cfg["method"], None, names, None, cfg["k"],
                      cfg.get("functional", False))
    rows_train = torch.cat([fn(params, {"input_ids": train["input_ids"][i:i + 8]})
                            for i in range(0, n_train, 8)])
    approx = plain(params, test) @ rows_train.T
    top = min(10, n_train)
    overlap = [len(set(exact[i].topk(top).indices.tolist())
                   & set(approx[i].topk(top).indices.tolist())) / top for i in range(n_test)]
    return {"r": pearson(exact, approx), "top10": statistics.mean(overlap), **extra}


def preconditioned(grads: dict, state) -> dict:
    import torch

    n = next(iter(grads.values())).shape[0]
    return {name: torch.stack([state.apply({name: g[i]})[name] for i in range(n)])
            for name, g in grads.items()}


def dense_scores(g_train: dict, g_test: dict):
    import torch

    flat = [torch.cat([g[name].flatten(1) for name in sorted(g)], dim=1)
            for g in (g_train, g_test)]
    return flat[1] @ flat[0].T  # [n_test, n_train]


def pearson(a, b) -> float:
    import torch

    return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])


def child_main(cfg: dict) -> None:
    import torch

    torch.set_num_threads(1)
    result = run_config(cfg)
    print("RESULT " + json.dumps(result))


def spawn(cfg: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--child", json.dumps(cfg)]
    if cfg["method"].startswith("bergson"):
        command = [bergson_python(), str(Path(__file__).with_name("_bergson_child.py")),
                   json.dumps(cfg)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"configuration {cfg} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["small"], choices=["small", "gpt2"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--methods", nargs="+", help="only these, e.g. kronecker bergson "
                        "'kronecker+adam factored' (default: all)")
    parser.add_argument("--params", nargs="+", default=["matched", "all"])
    parser.add_argument("--trained", type=int, default=0, metavar="STEPS",
                        help="train the model this many steps on Markov-chain text first")
    parser.add_argument("--functional-loss", action="store_true",
                        help="also a row per method with a hand-written functional_call loss")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return []
    if args.quick:  # a tiny model, in this process, two configurations: a smoke test
        args.models, args.batch, args.tokens, args.k, args.repeats = ["small"], 4, 16, 64, 1
        args.trained = 2  # the training path runs too (two steps)
    rows = []
    for cfg in configurations(args):
        rows.append({**cfg, **(run_config(cfg) if args.quick else spawn(cfg))})
        print_row(rows[-1], flush=True)
    return rows


def configurations(args) -> list[dict]:
    methods = ([("kronecker", None), ("kronecker vectors", None), ("kronecker", "adam factored"),
                ("identity", None)] if args.quick else METHODS)
    if not args.quick and Path(bergson_python()).exists():
        methods = [("bergson", None), ("bergson exact", None), *methods]
    if args.methods:
        methods = [(m, p) for m, p in methods if _label(m, p) in args.methods]
    forms = [False, True] if args.functional_loss or args.quick else [False]
    return [{"model": size, "params": params, "method": method,
             "precondition": precondition, "batch": args.batch, "tokens": args.tokens,
             "k": args.k, "repeats": args.repeats, "quick": args.quick,
             "trained": args.trained, "functional": functional,
             "agreement": size == "small" and method not in ("identity", "bergson exact"),
             "p": 0 if method == "bergson exact" else 16 if size == "small" else 9}
            for size in args.models for params in args.params[:1 if args.quick else None]
            for method, precondition in methods
            for functional in forms
            if not (functional and (method.startswith("bergson") or method == "identity"
                                    or (args.quick and precondition)))]


def _label(method: str, precondition: str | None) -> str:
    return method + (f"+{precondition}" if precondition else "")


def bergson_python() -> str:
    """bergson's own environment (``make bench-setup``), or ``$BERGSON_PYTHON``."""
    root = Path(__file__).resolve().parent.parent
    return os.environ.get("BERGSON_PYTHON", str(root / ".venv-bergson" / "bin" / "python"))


def print_row(row: dict, flush: bool = False) -> None:
    label = _label(row["method"], row["precondition"]) + (
        " (functional)" if row.get("functional") else "")
    agree = (f"r {row['r']:.3f}  top-10 {row['top10']:.2f}" if "r" in row else "")
    if "r_factored_vs_exact" in row:
        agree += f"  (factored vs exact Adam, unprojected: r {row['r_factored_vs_exact']:.3f})"
    model = row["model"] + (f" trained {row['trained']} (loss {row['train_loss'][0]:.2f} -> "
                            f"{row['train_loss'][1]:.2f})" if row.get("trained") else "")
    print(f"{model:<6} {row['params']:<8} {label:<28} "
          f"x floor {row['tool_s'] / row['floor_s']:5.2f}  "
          f"tokens/s {row['tokens'] / row['tool_s']:8.0f}  RSS {row['rss_mib']:6.0f} MiB  "
          f"bytes/example {row.get('row_bytes', 4 * row['k'])}  "
          + (f"ops {row['ops']} (floor {row['floor_ops']})  " if "ops" in row else "")
          + agree, flush=flush)


if __name__ == "__main__":
    main()
