"""Approximate top-k (FAISS index + exact re-rank) against the exact scan, side by side.

One run builds a synthetic Zarr store under /tmp (``--rows`` x ``--k``, float16, one
checkpoint; rows drawn from a mixture of Gaussians with varying norms, as gradients of
similar examples cluster), then measures on the same queries:

* the exact ``tif.top_k`` scan: latency per test example in a batch of ``--queries``;
* ``tif.indexed_top_k(..., index=...)`` for IVF-flat and IVF-PQ at several ``nprobe``: latency per
  test example in the same batch, and of one query alone, and recall@10 against the exact
  top-10 (the fraction of the exact top-10 rows found);
* the index build time and size;
* recall@10 with **default query settings**, before (``nprobe = nlist // 16``) and after
  ``build_index``'s calibration (the smallest ``nprobe``, then candidates, that reach recall@10
  0.95 on a sample of the store's own rows), on this store and on a **real gradient store**:
  a small GPT-2 (from a config, character tokens) trained briefly on docstring lines of the
  standard library, its per-example gradients projected with ``kind="kronecker"``, queried
  with held-out lines (needs ``transformers``; default ``nlist`` and ``m``; dot and cosine).

    python benchmarks/search.py            # 1M x 512 float16 (1 GB store), ~10 min on 2 cores
    python benchmarks/search.py --quick    # 5k x 64, seconds (tests/ runs it)
    python benchmarks/search.py --rows 100000 --nlist 256 --lm-rows 4000   # a mid-size run
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

import tracinfunc as tif
from tracinfunc.search.calibrate import default_candidates, default_rerank
from tracinfunc.store.meta import CheckpointMeta, StoreMeta

FULL = {"rows": 1_000_000, "k": 512, "clusters": 2000, "queries": 200, "nlist": 1024,
        "nprobes": [4, 8, 16, 32], "m": 64}
QUICK = {"rows": 5_000, "k": 64, "clusters": 50, "queries": 20, "nlist": 32,
         "nprobes": [2, 4, 32], "m": 8}
# The real gradient store: rows (training lines), held-out queries, GPT-2 shape, training steps.
LM_FULL = {"rows": 6000, "queries": 200, "layers": 2, "width": 64, "steps": 300, "k": 512}
LM_QUICK = {"rows": 300, "queries": 10, "layers": 1, "width": 16, "steps": 5, "k": 32}
LM_MODULES = ["json", "collections", "functools", "itertools", "pathlib", "string", "textwrap",
              "heapq", "bisect", "random", "statistics", "fractions", "decimal", "shutil",
              "csv", "os", "re", "argparse", "datetime", "logging", "subprocess", "inspect",
              "ast", "threading", "socket", "unittest", "pickle", "io", "enum", "contextlib",
              "tempfile", "difflib", "calendar", "zipfile", "tarfile", "email.message"]
LENGTH = 48  # characters (= tokens) per line


def make_store(path: Path, rows: int, k: int, clusters: int, *, seed: int = 0,
               chunk_rows: int = 64) -> tuple[tif.store.ZarrStore, torch.Tensor]:
    """A float16 Zarr store of mixture-of-Gaussians rows; returns it and the centres."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, k, generator=g)
    meta = StoreMeta(projection=tif.Projection(dim=k, seed=seed),
                     checkpoints=(CheckpointMeta("c0", 0.1, "synthetic"),),
                     layout=(("w", (k,)),), n_train=0, k=k, dtype="float16", complete=False)
    writer = tif.store.ZarrWriter(path, meta, chunk_rows=chunk_rows, overwrite=True)
    for start in range(0, rows, 65536):
        block = _mixture_rows(centres, min(65536, rows - start), g)
        writer.append(block[None], block.norm(dim=-1)[None])
    return writer.finish(), centres


def _mixture_rows(centres: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` rows near random centres, with log-normal norms (gradients differ in size)."""
    assign = torch.randint(len(centres), (n,), generator=g)
    rows = centres[assign] + 0.6 * torch.randn(n, centres.shape[1], generator=g)
    return (rows * torch.exp(0.2 * torch.randn(n, 1, generator=g))).half()


def timed(fn, repeats: int = 1):
    """``(result, best seconds of repeats)`` after one warm-up call."""
    result = fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return result, best


def recall(found: torch.Tensor, exact: torch.Tensor) -> float:
    """Mean over test examples of |found ∩ exact| / k."""
    hits = (found[:, :, None] == exact[:, None, :]).any(dim=2).sum(dim=1)
    return float(hits.double().mean() / exact.shape[1])


def measure_index(store, test, exact_indices, exact_s, index, nprobes, *, label,
                  candidates=None):
    """Recall@10 and latency of ``indexed_top_k`` per nprobe; prints one line each."""
    import faiss

    n_q = test.shape[1]
    query = test[0].numpy() * 0.1**0.5  # lr 0.1: the query side of the weighted rows
    lines = []
    for nprobe in nprobes:
        (_, idx), batch_s = timed(lambda n=nprobe: tif.indexed_top_k(
            store, test, 10, index=index, nprobe=n, n_candidates=candidates), repeats=2)
        wanted = candidates or index.candidates(10)
        _, faiss_s = timed(lambda n=nprobe, c=wanted: index.faiss_index.search(
            query, c, params=faiss.SearchParametersIVF(nprobe=n)))
        single = test[:, : min(20, n_q)]
        _, single_s = timed(
            lambda n=nprobe, s=single: [
                tif.indexed_top_k(
                    store, s[:, i : i + 1], 10, index=index, nprobe=n, n_candidates=candidates
                )
                for i in range(s.shape[1])
            ]
        )
        per_q = batch_s / n_q
        line = {"index": label, "nprobe": nprobe, "recall@10": recall(idx, exact_indices),
                "ms_per_query": 1e3 * per_q, "ms_faiss": 1e3 * faiss_s / n_q,
                "ms_single": 1e3 * single_s / single.shape[1], "speedup": exact_s / batch_s}
        lines.append(line)
        print(f"  {label:9s} nprobe={nprobe:4d} candidates={wanted:3d}: recall@10 "
              f"{line['recall@10']:.3f}, {line['ms_per_query']:.3f} ms/query in the batch "
              f"({line['speedup']:.1f}x faster than exact; FAISS search alone "
              f"{line['ms_faiss']:.3f} ms/query), {line['ms_single']:.3f} ms for one query "
              "alone", flush=True)
    return lines


def measure_defaults(store, test, exact_indices, index, *, label: str,
                     normalize: bool = False) -> list[dict]:
    """recall@10 and latency of ``indexed_top_k`` with default query settings: the fixed ones
    (``nprobe = nlist // 16``, ``2k``/``10k`` candidates) and the index's calibrated ones."""
    n_q = exact_indices.shape[0]
    fixed = {"nprobe": max(1, index.nlist // 16),
             "n_candidates": default_candidates(index.kind, default_rerank(index.kind), 10,
                                              index.n_train)}
    cal = index.calibration
    lines = []
    for setting, kwargs in (("nlist // 16", fixed), ("calibrated", {})):
        line = {"store": label, "index": index.kind, "setting": setting, "nlist": index.nlist,
                "nprobe": kwargs.get("nprobe", index.nprobe),
                "candidates": kwargs.get("n_candidates", index.candidates(10))}
        try:
            (_, idx), batch_s = timed(lambda kw=kwargs: tif.indexed_top_k(
                store, test, 10, index=index, normalize=normalize, **kw))
        except tif.errors.InvalidArgumentError:  # the lists searched hold fewer than 10 rows
            line.update({"recall@10": None, "ms_per_query": None})
            shown = "refused (the clusters searched hold fewer than 10 rows for a query)"
        else:
            line.update({"recall@10": recall(idx, exact_indices),
                         "ms_per_query": 1e3 * batch_s / n_q})
            shown = f"recall@10 {line['recall@10']:.3f}"
            if setting == "calibrated":
                shown += f" (calibration: {cal.recall:.3f} on {cal.queries} store rows)"
            shown += f", {line['ms_per_query']:.3f} ms/query"
        lines.append(line)
        print(f"  {label:18s} {index.kind:8s} nlist={index.nlist:4d} {setting:11s} "
              f"nprobe={line['nprobe']:4d} candidates={line['candidates']:4d}: {shown}",
              flush=True)
    return lines


def docstring_lines(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct docstring lines (ASCII, at least 24 characters, cut to ``LENGTH``) of
    standard-library modules and their classes' members, in a seeded random order."""
    out: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in LM_MODULES:
            module = importlib.import_module(name)
            for attr in sorted(dir(module)):
                obj = getattr(module, attr, None)
                owners = [obj] + ([getattr(obj, a, None) for a in sorted(vars(obj))]
                                  if isinstance(obj, type) else [])
                for owner in owners:
                    doc = getattr(owner, "__doc__", None)
                    for line in doc.splitlines() if isinstance(doc, str) else []:
                        line = " ".join(line.split())
                        if len(line) >= 24 and line.isascii():
                            out.append(line[:LENGTH])
    unique = list(dict.fromkeys(out))
    if len(unique) < n:
        raise SystemExit(f"only {len(unique)} docstring lines here, asked for {n}")
    order = torch.randperm(len(unique), generator=torch.Generator().manual_seed(seed))
    return [unique[i] for i in order[:n].tolist()]


def encode(texts: list[str]) -> dict[str, torch.Tensor]:
    """Character tokens: 0 pads, printable ASCII from 1; ``[n, LENGTH]``."""
    ids = torch.zeros(len(texts), LENGTH, dtype=torch.long)
    for row, text in enumerate(texts):
        ids[row, :len(text)] = torch.tensor([ord(c) - 31 for c in text])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def lm_gradient_store(cfg: dict, path: Path):
    """A GPT-2 trained briefly on docstring lines; ``(store of its training lines' projected
    gradients at path, held-out lines' gradients [1, queries, k])``."""
    import transformers

    texts = docstring_lines(cfg["rows"] + cfg["queries"])
    data, held_out = encode(texts[:cfg["rows"]]), encode(texts[cfg["rows"]:])
    config = transformers.GPT2Config(n_layer=cfg["layers"], n_embd=cfg["width"], n_head=4,
                                     vocab_size=96, n_positions=LENGTH, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    model.loss_type = "ForCausalLM"  # not told by the class name GPT2LMHeadModel
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for _ in range(cfg["steps"]):
        rows = torch.randint(cfg["rows"], (32,), generator=g)
        ids, mask = data["input_ids"][rows], data["attention_mask"][rows]
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    model.eval()
    checkpoint = tif.Checkpoint.from_module(model, lr=3e-3, name="trained")
    loss = tif.causal_lm_loss(model)
    projection = tif.Projection(dim=cfg["k"], seed=0, kind="kronecker")
    store = tif.build_store(loss, [checkpoint], data, projection=projection, batch_size=64)
    store = tif.save_store(store, path, chunk_rows=64)
    test = tif.build_store(loss, [checkpoint], held_out, projection=projection, batch_size=64)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"LM gradient store: GPT-2 {cfg['layers']}x{cfg['width']} ({n_params:,} parameters), "
          f"{cfg['steps']} AdamW steps (final loss {out.loss.item():.2f}), {cfg['rows']} "
          f"training lines x k={cfg['k']} (kronecker), {cfg['queries']} held-out lines as "
          f"queries; {time.perf_counter() - start:.1f} s", flush=True)
    return store, test.read_rows(0, 0, cfg["queries"])[None]


def _run_lm(cfg: dict, root: Path, *, kinds: list[str]) -> list[dict]:
    if importlib.util.find_spec("transformers") is None:
        print("LM gradient store: skipped (needs transformers: pip install 'tracinfunc[hf]')")
        return []
    store, test = lm_gradient_store(cfg, root / "lm.zarr")
    results = []
    for normalize in (False, True):
        (_, exact_indices), exact_s = timed(
            lambda n=normalize: tif.top_k(store, test, 10, normalize=n))
        label = f"LM {'cosine' if normalize else 'dot'}"
        print(f"  {label:18s} exact    top_k: {1e3 * exact_s / len(exact_indices):.3f} "
              "ms/query", flush=True)
        for kind in kinds:
            index = tif.build_index(store, kind=kind, normalize=normalize, overwrite=True,
                                    path=root / f"lm-{kind}-{normalize}.faiss")
            results += measure_defaults(store, test, exact_indices, index, label=label,
                                        normalize=normalize)
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5k x 64: seconds")
    parser.add_argument("--dir", default=None, help="where the store goes (default: /tmp)")
    parser.add_argument("--threads", type=int, default=None, help="torch/FAISS threads")
    parser.add_argument("--kinds", nargs="+", default=["ivf_flat", "ivf_pq"],
                        choices=["ivf_flat", "ivf_pq"])
    parser.add_argument("--nprobes", nargs="+", type=int, default=None,
                        help="clusters searched per query (default: per size)")
    parser.add_argument("--memory", action="store_true",
                        help="also compare on a MemoryStore copy (re-rank without disk reads)")
    parser.add_argument("--rows", type=int, default=None, help="synthetic store rows")
    parser.add_argument("--nlist", type=int, default=None, help="synthetic store's nlist")
    parser.add_argument("--lm-rows", type=int, default=None,
                        help="training lines in the LM gradient store (0: no LM store)")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    lm_cfg = LM_QUICK if args.quick else LM_FULL
    if args.nprobes:
        cfg = {**cfg, "nprobes": args.nprobes}
    if args.rows:
        cfg = {**cfg, "rows": args.rows}
    if args.nlist:
        cfg = {**cfg, "nlist": args.nlist, "nprobes": [n for n in cfg["nprobes"]
                                                        if n <= args.nlist]}
    if args.lm_rows is not None:
        lm_cfg = {**lm_cfg, "rows": args.lm_rows}
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="tif-search-", dir=args.dir))
    try:
        results = _run(cfg, root, kinds=args.kinds, memory=args.memory)
        return results + (_run_lm(lm_cfg, root, kinds=args.kinds) if lm_cfg["rows"] else [])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(cfg: dict, root: Path, *, kinds: list[str], memory: bool) -> list[dict]:
    print(f"store: {cfg['rows']} x {cfg['k']} float16, {cfg['clusters']} clusters, "
          f"{cfg['queries']} queries, torch threads {torch.get_num_threads()}", flush=True)
    start = time.perf_counter()
    store, centres = make_store(root / "grads.zarr", cfg["rows"], cfg["k"], cfg["clusters"])
    print(f"  written in {time.perf_counter() - start:.1f} s (inner chunks of 64 rows)",
          flush=True)
    test = _mixture_rows(centres, cfg["queries"], torch.Generator().manual_seed(1)).float()
    test = test[None]  # [1, n_test, k]
    stores = [("zarr", store)] + ([("memory", tif.to_memory(store))] if memory else [])
    results = []
    for store_kind, current in stores:
        (_, exact_indices), exact_s = timed(lambda s=current: tif.top_k(s, test, 10))
        n_q = cfg["queries"]
        _, exact_single = timed(lambda s=current: tif.top_k(s, test[:, :1], 10))
        print(f"  {store_kind} exact top_k: {1e3 * exact_s / n_q:.2f} ms/query in a batch of "
              f"{n_q} ({exact_s:.2f} s per batch); one query alone {1e3 * exact_single:.1f} ms",
              flush=True)
        results.append({"index": f"exact ({store_kind})", "ms_per_query": 1e3 * exact_s / n_q,
                        "ms_single": 1e3 * exact_single})
        for kind in kinds:
            extra = {"m": cfg["m"]} if kind == "ivf_pq" else {}
            start = time.perf_counter()
            index = tif.build_index(current, kind=kind, nlist=cfg["nlist"], overwrite=True,
                                    path=root / f"{store_kind}-{kind}.faiss", **extra)
            build_s = time.perf_counter() - start
            size = sum(f.stat().st_size for f in index.path.iterdir()) / 2**20
            print(f"  {store_kind} {kind}: nlist={cfg['nlist']}, built in {build_s:.1f} s, "
                  f"{size:.0f} MiB on disk", flush=True)
            for candidates in ([10, None] if kind == "ivf_flat" else [None]):
                results += measure_index(current, test, exact_indices, exact_s, index,
                                         cfg["nprobes"], label=f"{store_kind} {kind}",
                                         candidates=candidates)
            print("  recall@10 with default settings:", flush=True)
            results += measure_defaults(current, test, exact_indices, index,
                                        label=f"synthetic {store_kind}")
    return results


if __name__ == "__main__":
    main()
