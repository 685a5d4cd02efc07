"""Approximate top-k (FAISS index + exact re-rank) against the exact scan, side by side.

One run builds a synthetic Zarr store under /tmp (``--rows`` x ``--k``, float16, one
checkpoint; rows drawn from a mixture of Gaussians with varying norms, as gradients of
similar examples cluster), then measures on the same queries:

* the exact ``tif.top_k`` scan: latency per test example in a batch of ``--queries``;
* ``tif.indexed_top_k(..., index=...)`` for IVF-flat and IVF-PQ at several ``nprobe``: latency per
  test example in the same batch, and of one query alone, and recall@10 against the exact
  top-10 (the fraction of the exact top-10 rows found);
* the index build time and size.

    python benchmarks/search.py            # 1M x 512 float16 (1 GB store), ~10 min on 2 cores
    python benchmarks/search.py --quick    # 5k x 64, seconds (tests/ runs it)
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

import tracinfunc as tif
from tracinfunc.store.meta import CheckpointMeta, StoreMeta

FULL = {"rows": 1_000_000, "k": 512, "clusters": 2000, "queries": 200, "nlist": 1024,
        "nprobes": [4, 8, 16, 32], "m": 64}
QUICK = {"rows": 5_000, "k": 64, "clusters": 50, "queries": 20, "nlist": 32,
         "nprobes": [2, 4, 32], "m": 8}


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
            store, test, 10, index=index, nprobe=n, candidates=candidates), repeats=2)
        wanted = candidates or (100 if index.kind == "ivf_pq" else 20)
        _, faiss_s = timed(lambda n=nprobe, c=wanted: index.faiss_index.search(
            query, c, params=faiss.SearchParametersIVF(nprobe=n)))
        single = test[:, : min(20, n_q)]
        _, single_s = timed(
            lambda n=nprobe, s=single: [
                tif.indexed_top_k(
                    store, s[:, i : i + 1], 10, index=index, nprobe=n, candidates=candidates
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
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.nprobes:
        cfg = {**cfg, "nprobes": args.nprobes}
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="tif-search-", dir=args.dir))
    try:
        return _run(cfg, root, kinds=args.kinds, memory=args.memory)
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
    return results


if __name__ == "__main__":
    main()
