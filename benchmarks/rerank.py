"""Retrieve, then rerank (issue 35): how much of a full curvature scan's top 10 a cheap store's
top M recovers once its candidates are ranked by the curvature, and at what CPU time.

Two settings, each scanned in full with a curvature (the reference top 10) and reranked
(``tif.rerank``: plain TracIn top ``M`` from a cheap store, then the same curvature over
those ``M`` rows only, ``top_k(..., candidates=)``):

- digits (``benchmarks/quality.py``'s split and training, the MLP): EK-FAC on the exact
  (identity-projection) store, test gradients from ``preconditioned_test_grads``; retrieval
  from a kronecker ``k=256`` store. ``M`` up to 10% of the rows.
- a small language model (``benchmarks/search.py``'s GPT-2 on docstring lines): a
  ``"projected"`` curvature on a kronecker ``k=1024`` store; retrieval from a kronecker
  ``k=256`` store, plain and with its own ``"projected"`` curvature. ``M`` = 1% and 10%.
- random rows (200,000 x 256 in memory), one query per call, ``M`` = 1%: the rank step's
  cost where the fixed cost of a call no longer dominates.

Recall is the fraction of the full scan's top-10 slots found by the rerank (mean over test
examples). Times are process CPU seconds on one thread, the full scan and the rerank
interleaved over ``--rounds`` rounds (median each), for all test examples in one call
(batched) and for one test example per call (the loop over the first ``--single`` queries).
Test gradients are prepared (preconditioned) once before timing: both sides share that cost.

    python benchmarks/rerank.py --quick     # seconds; tests/ runs it
    python benchmarks/rerank.py             # digits 1000/300 and a 4000-row LM (minutes)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality
import search

import tracinfunc as tif
from tracinfunc.curvature import classification_sampler
from tracinfunc.store.meta import CheckpointMeta, StoreMeta

TOP = 10


def cpu_time(fn):
    start = time.process_time()
    result = fn()
    return result, time.process_time() - start


def recall(found: torch.Tensor, exact: torch.Tensor) -> float:
    hits = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(found, exact, strict=True)]
    return sum(hits) / exact.numel()


def recall_in(candidates: torch.Tensor, exact: torch.Tensor) -> float:
    """Fraction of the exact top-10 slots among the candidates (what a rerank recovers)."""
    return recall(candidates, exact)


def measure(label, retriever, store, queries, curvature, fractions, *, rounds, single):
    """Rows of recall and CPU time for each ``M = fraction * n_train``."""
    n = store.meta.n_train
    exact = tif.top_k(store, queries, TOP, curvature=curvature, progress=False)[1]
    rows = []
    for fraction in fractions:
        m = max(TOP, round(fraction * n))
        result = tif.rerank(retriever, store, queries, TOP, n_candidates=m, curvature=curvature,
                            progress=False)
        times = {"full": [], "retrieve": [], "rank": []}
        for _ in range(rounds):  # interleaved, so load changes hit both alike
            times["full"].append(cpu_time(lambda: tif.top_k(
                store, queries, TOP, curvature=curvature, progress=False))[1])
            found, seconds = cpu_time(lambda m=m: tif.top_k(
                retriever.store, retriever.test_grads, m, curvature=retriever.curvature,
                progress=False))
            times["retrieve"].append(seconds)
            times["rank"].append(cpu_time(lambda found=found: tif.top_k(
                store, queries, TOP, curvature=curvature, candidates=found[1]))[1])
        median = {key: statistics.median(value) for key, value in times.items()}
        rows.append({"setting": label, "n_train": n, "M": m, "fraction": m / n,
                     "recall": recall(result.indices, exact),
                     "full_s": median["full"], "retrieve_s": median["retrieve"],
                     "rank_s": median["rank"], "rank_ratio": median["rank"] / median["full"],
                     "single": one_at_a_time(retriever, store, queries, curvature, m, single,
                                             rounds),
                     "retrieved_by": result.retrieved_by, "reranked_by": result.reranked_by})
        print(row_line(rows[-1]), flush=True)
    return rows


def one_at_a_time(retriever, store, queries, curvature, m, count, rounds) -> dict:
    """CPU seconds of the full scan and of the rank step for one test example per call."""
    cheap_rows = _rows(retriever.test_grads)
    strong_rows = _rows(queries)
    full, rank = [], []
    for _ in range(rounds):
        spent_full = spent_rank = 0.0
        for i in range(min(count, strong_rows.shape[1])):
            query = strong_rows[:, i:i + 1]
            spent_full += cpu_time(lambda q=query: tif.top_k(store, q, TOP, progress=False))[1]
            found = tif.top_k(retriever.store, cheap_rows[:, i:i + 1], m, progress=False)[1]
            spent_rank += cpu_time(lambda q=query, f=found: tif.top_k(
                store, q, TOP, candidates=f))[1]
        full.append(spent_full)
        rank.append(spent_rank)
    full_s, rank_s = statistics.median(full), statistics.median(rank)
    return {"queries": min(count, strong_rows.shape[1]), "full_s": full_s, "rank_s": rank_s,
            "rank_ratio": rank_s / full_s}


def _rows(grads) -> torch.Tensor:
    if isinstance(grads, torch.Tensor):
        return grads
    meta = grads.meta
    return torch.stack([grads.read_rows(c, 0, meta.n_train) for c in range(meta.n_ckpt)])


def row_line(row: dict) -> str:
    single = row["single"]
    return (f"| {row['setting']} | {row['n_train']} | {row['M']} ({row['fraction']:.1%}) | "
            f"{row['recall']:.3f} | {row['full_s'] * 1e3:.1f} | {row['retrieve_s'] * 1e3:.1f} | "
            f"{row['rank_s'] * 1e3:.1f} | {row['rank_ratio']:.3f} "
            f"({row['rank_ratio'] / row['fraction']:.2f} x M/n) | "
            f"{single['rank_ratio']:.3f} ({single['rank_ratio'] / row['fraction']:.2f} x M/n) |")


HEADER = ("| setting | n | M | recall@10 | full scan (ms) | retrieve (ms) | rank (ms) | "
          "rank / full, batched | rank / full, one query per call |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def digits(quick: bool, rounds: int, single: int) -> list[dict]:
    sizes = quality.QUICK if quick else quality.FULL
    make = quality.MODELS["mlp"]
    (x, y), test, _, _ = quality.load_digits(sizes)
    _, ckpts = quality.train(make, x, y, seed=0, epochs=sizes.epochs, every=sizes.every)
    loss = tif.loss_from_module(make().eval(), F.cross_entropy)
    exact = tif.Projection(kind="identity")
    strong = tif.build_store(loss, ckpts, (x, y), projection=exact, progress=False)
    curvature = tif.fit_curvature(loss, ckpts, (x, y), kind="ekfac",
                                  sampler=classification_sampler(exact=True))
    queries = tif.preconditioned_test_grads(loss, ckpts, test, curvature, projection=exact)
    cheap_p = tif.Projection(dim=64 if quick else 256, kind="kronecker", seed=0)
    cheap = tif.build_store(loss, ckpts, (x, y), projection=cheap_p, progress=False)
    cheap_test = tif.build_store(loss, ckpts, test, projection=cheap_p, progress=False)
    retriever = tif.Retriever(cheap, cheap_test)
    fractions = (0.1,) if quick else (0.05, 0.1)
    return measure("digits EK-FAC (exact store)", retriever, strong, queries, curvature,
                   fractions, rounds=rounds, single=single)


def language_model(quick: bool, rounds: int, single: int) -> list[dict]:
    cfg = ({"rows": 1000, "queries": 8, "layers": 1, "width": 32, "steps": 20, "k": 256,
            "cheap_k": 16, "fit": 200, "fractions": (0.01,)} if quick else
           {"rows": 4000, "queries": 64, "layers": 2, "width": 64, "steps": 200, "k": 1024,
            "cheap_k": 256, "fit": 1000, "fractions": (0.01, 0.1)})
    loss, checkpoint, data, held_out = trained_lm(cfg)
    build = dict(batch_size=64, progress=False)
    stores = {}
    for name, k in (("strong", cfg["k"]), ("cheap", cfg["cheap_k"])):
        projection = tif.Projection(dim=k, seed=0, kind="kronecker")
        stores[name] = (tif.build_store(loss, [checkpoint], data, projection=projection,
                                        **build),
                        tif.build_store(loss, [checkpoint], held_out, projection=projection,
                                        **build),
                        tif.fit_curvature(loss, [checkpoint], data, kind="projected",
                                          projection=projection, max_examples=cfg["fit"],
                                          batch_size=64))
    strong, strong_test, curvature = stores["strong"]
    cheap, cheap_test, cheap_curvature = stores["cheap"]
    rows = []
    for label, retriever in (("plain", tif.Retriever(cheap, cheap_test)),
                             ("with curvature", tif.Retriever(cheap, cheap_test,
                                                              curvature=cheap_curvature))):
        rows += measure(f"LM projected curvature, retrieve {label}", retriever, strong,
                        strong_test, curvature, cfg["fractions"], rounds=rounds,
                        single=single)
    return rows


def scale(quick: bool, rounds: int) -> list[dict]:
    """One query per call against a larger in-memory store of random rows (the scan's cost
    does not depend on what the rows are): where the fixed cost of a call stops mattering."""
    n, k = (20_000, 64) if quick else (200_000, 256)
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(1, n, k, generator=g)
    meta = StoreMeta(projection=tif.Projection(dim=k, seed=0), n_train=n, k=k,
                     checkpoints=(CheckpointMeta(name="c", lr=1.0, fingerprint="-"),),
                     layout=(("w", (k,)),), dtype="float32")
    store = tif.store.MemoryStore(meta, rows, rows.norm(dim=-1))
    queries = torch.randn(1, 8, k, generator=g)
    out = []
    for fraction in (0.01,):
        m = round(fraction * n)
        full, rank = [], []
        for _ in range(rounds):
            spent_full = spent_rank = 0.0
            for i in range(queries.shape[1]):
                query = queries[:, i:i + 1]
                found = torch.randperm(n, generator=g)[:m][None]
                spent_full += cpu_time(lambda q=query: tif.top_k(store, q, TOP,
                                                                 progress=False))[1]
                spent_rank += cpu_time(lambda q=query, f=found: tif.top_k(
                    store, q, TOP, candidates=f))[1]
            full.append(spent_full)
            rank.append(spent_rank)
        ratio = statistics.median(rank) / statistics.median(full)
        out.append({"setting": "random rows, one query per call", "n_train": n, "k": k,
                    "M": m, "fraction": fraction, "full_ms": statistics.median(full) / 8 * 1e3,
                    "rank_ms": statistics.median(rank) / 8 * 1e3, "rank_ratio": ratio})
        print(f"| random rows k={k}, one query per call | {n} | {m} ({fraction:.0%}) | - | "
              f"{out[-1]['full_ms']:.2f} | - | {out[-1]['rank_ms']:.2f} | - | {ratio:.3f} "
              f"({ratio / fraction:.2f} x M/n) |", flush=True)
    return out


def trained_lm(cfg: dict):
    """``benchmarks/search.py``'s GPT-2 on docstring lines: ``(loss, checkpoint, training
    lines, held-out lines)``."""
    import transformers

    texts = search.docstring_lines(cfg["rows"] + cfg["queries"])
    data, held_out = search.encode(texts[:cfg["rows"]]), search.encode(texts[cfg["rows"]:])
    config = transformers.GPT2Config(n_layer=cfg["layers"], n_embd=cfg["width"], n_head=4,
                                     vocab_size=96, n_positions=search.LENGTH, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    model.loss_type = "ForCausalLM"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(cfg["steps"]):
        rows = torch.randint(cfg["rows"], (32,), generator=g)
        ids, mask = data["input_ids"][rows], data["attention_mask"][rows]
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    model.eval()
    checkpoint = tif.Checkpoint.from_module(model, lr=3e-3, name="trained")
    return tif.causal_lm_loss(model), checkpoint, data, held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/output/rerank"))
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--single", type=int, default=None,
                        help="test examples timed one per call")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 5)
    single = args.single or (2 if args.quick else 20)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    print(HEADER)
    rows = digits(args.quick, rounds, single)
    rows += language_model(args.quick, rounds, single)
    rows += scale(args.quick, rounds)
    (args.out / "rerank.json").write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {args.out / 'rerank.json'}")


if __name__ == "__main__":
    main()
