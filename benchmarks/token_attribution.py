"""Per-token attribution on a small LM (issue 35 item 3): a planted canary, and the cost.

A 2-layer GPT-2 built from a config (no download) is trained briefly on documents drawn from a
random Markov chain over 64 tokens (each token has 4 likely successors). An 8-token canary
(tokens drawn at random, so its transitions are unlikely under the chain) is planted at a
random place in 3 of the 200 training documents. The trigger query is a fresh Markov context
followed by the canary, its loss on the canary tokens only (``completion_labels``).

(a) Per seed: is a canary document the top-1 proponent (``tif.top_k`` on a kronecker store),
and how many of the canary's 8 tokens are among that document's 8 highest-scoring tokens
(``tif.token_scores``)? Targets: top-1 in >= 90% of 20 seeds, >= 6 of 8 tokens.

(b) Cost: per-token scoring of the top-100 candidates against re-scoring them per example
(their projected gradients at every checkpoint, ``tif.build_store``, then ``tif.score``),
process CPU time, interleaved, median of the repeats. Target: <= 1.5x.

    python benchmarks/token_attribution.py --quick   # 2 seeds (tests/ runs it)
    python benchmarks/token_attribution.py           # 20 seeds (~5 min on 2 cores)
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import tracinfunc as tif

VOCAB, LENGTH, N_TRAIN, CANARY, PLANTED = 64, 32, 200, 8, 3


def markov_chain(g: torch.Generator) -> torch.Tensor:
    """``[V, V]`` transition probabilities: 4 likely successors per token, a little noise."""
    probs = torch.full((VOCAB, VOCAB), 0.02 / VOCAB)
    for token in range(VOCAB):
        probs[token, torch.randperm(VOCAB, generator=g)[:4]] += 0.245
    return probs / probs.sum(1, keepdim=True)


def sample(chain: torch.Tensor, n: int, length: int, g: torch.Generator) -> torch.Tensor:
    ids = torch.empty(n, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(1, length):
        ids[:, t] = torch.multinomial(chain[ids[:, t - 1]], 1, generator=g)[:, 0]
    return ids


def make_data(seed: int):
    g = torch.Generator().manual_seed(seed)
    chain = markov_chain(g)
    docs = sample(chain, N_TRAIN, LENGTH, g)
    canary = torch.randint(0, VOCAB, (CANARY,), generator=g)
    planted = torch.randperm(N_TRAIN, generator=g)[:PLANTED]
    starts = torch.randint(1, LENGTH - CANARY, (PLANTED,), generator=g)
    for row, start in zip(planted.tolist(), starts.tolist(), strict=True):
        docs[row, start:start + CANARY] = canary
    context = sample(chain, 1, LENGTH - CANARY, g)[0]
    query = torch.cat([context, canary])[None]
    labels = tif.completion_labels(query, LENGTH - CANARY)
    return docs, planted, starts, {"input_ids": query, "labels": labels}


def train(docs: torch.Tensor, seed: int, epochs: int):
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB,
                                     n_positions=LENGTH, bos_token_id=0, eos_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    checkpoints = []
    for epoch in range(epochs):
        model.train()
        for batch in torch.randperm(N_TRAIN).split(16):
            logits = model(docs[batch]).logits[:, :-1]
            loss = F.cross_entropy(logits.flatten(0, 1), docs[batch][:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        if epoch >= epochs - 2:
            checkpoints.append(tif.Checkpoint.from_module(model.eval(), lr=0.5))
    return model.eval(), checkpoints


def one_seed(seed: int, epochs: int) -> dict:
    docs, planted, starts, query = make_data(seed)
    model, ckpts = train(docs, seed, epochs)
    loss = tif.causal_lm_loss(model)
    spec = tif.Projection(dim=1024, kind="kronecker", seed=seed)
    store = tif.build_store(loss, ckpts, {"input_ids": docs}, projection=spec, progress=False)
    test = tif.build_store(loss, ckpts, query, projection=spec, progress=False)
    _, rows = tif.top_k(store, test, k=100, progress=False)
    top = int(rows[0, 0])
    hit = top in planted.tolist()
    found = 0
    if hit:
        scores = tif.token_scores(store, test, loss, ckpts, {"input_ids": docs[top:top + 1]},
                                  rows=[top])
        start = int(starts[planted.tolist().index(top)])
        best = set(scores.values[0, 0].topk(CANARY).indices.tolist())
        found = len(best & set(range(start, start + CANARY)))
    return {"seed": seed, "top1": hit, "test_ids": query["input_ids"],
            "canary_tokens_in_top8": found, "store": store, "test": test, "loss": loss,
            "ckpts": ckpts, "docs": docs, "rows": rows[0]}


def cost(run: dict, repeats: int) -> dict:
    """CPU seconds of per-token scoring vs re-scoring the top-100 candidates, interleaved."""
    chosen = {"input_ids": run["docs"][run["rows"]]}
    spec = run["store"].projection

    def rescore():
        rows = tif.build_store(run["loss"], run["ckpts"], chosen, projection=spec,
                               progress=False)
        return tif.score(rows, run["test"], progress=False)

    def per_token():
        return tif.token_scores(run["store"], run["test"], run["loss"], run["ckpts"], chosen)

    rescore(), per_token()  # warm-up: one-time costs of torch.func are not what is compared
    times = {"rescore": [], "per_token": []}
    for _ in range(repeats):
        for name, fn in (("rescore", rescore), ("per_token", per_token)):
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {**medians, "ratio": medians["per_token"] / medians["rescore"]}


SYLLABLES = [c + v for c in "bdgklmnprstvz" for v in "aeiou"][:VOCAB]


def write_page(run: dict, path: Path) -> None:
    """The canary query's report: its top-5 documents with every token coloured."""
    rows = run["rows"][:5]
    chosen = {"input_ids": run["docs"][rows]}
    scores = tif.token_scores(run["store"], run["test"], run["loss"], run["ckpts"], chosen,
                              rows=rows)
    tif.write_report(path, run["store"], run["test"], k=5, train={"input_ids": run["docs"]},
                     queries={"input_ids": run["test_ids"]}, tokens={0: scores},
                     decode=lambda t: SYLLABLES[t] + " ", outliers=3, overwrite=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 seeds, fewer repeats")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--report", type=Path, default=None,
                        help="also write seed 0's HTML report (top-5 documents' tokens)")
    args = parser.parse_args()
    n_seeds = args.seeds or (2 if args.quick else 20)
    torch.set_num_threads(1)
    runs = [one_seed(seed, epochs=6) for seed in range(n_seeds)]
    for run in runs:
        print(f"seed {run['seed']:>2}: canary top-1 {run['top1']}, canary tokens among the "
              f"document's 8 best: {run['canary_tokens_in_top8']}/8")
    top1 = sum(run["top1"] for run in runs) / n_seeds
    tokens = [run["canary_tokens_in_top8"] for run in runs if run["top1"]]
    six = sum(found >= 6 for found in tokens) / max(len(tokens), 1)
    timing = cost(runs[0], repeats=3 if args.quick else 7)
    if args.report is not None:
        write_page(runs[0], args.report)
    print("| measure | value | target |\n|---|---|---|")
    print(f"| canary document top-1 proponent | {top1:.0%} of {n_seeds} seeds | >= 90% |")
    print(f"| >= 6 of 8 canary tokens among the document's 8 best (top-1 seeds) | {six:.0%} "
          f"(mean {statistics.mean(tokens) if tokens else 0:.2f}/8) | 100% |")
    print(f"| per-token / re-score CPU time, top-100 candidates | {timing['ratio']:.2f}x "
          f"({timing['per_token']:.3f} s / {timing['rescore']:.3f} s) | <= 1.5x |")


if __name__ == "__main__":
    main()
