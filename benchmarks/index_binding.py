"""What binding an index to its rows' order costs at load: format 4 (norms + sketch) vs norms only.

One Zarr store, one index. Side by side in one run, interleaved: ``load_index`` (which checks
the metadata, every norm and, from format 4, the sketch of the rows a permutation could move
unseen by the norms) vs the same load with the sketch check left out (format 3's binding).
Process CPU time, best of the repeats; rows are Gaussian, so nearly every row's norm is within
1e-4 of another's at one checkpoint: the worst case, which reads up to 64 MiB of rows.

    PYTHONPATH=. python benchmarks/index_binding.py [--rows 262144] [--k 256] [--ckpts 1]
    PYTHONPATH=. python benchmarks/index_binding.py --quick    # seconds (tests/ runs it)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import tracinfunc as tif
from tracinfunc.search.binding import norms_mismatch, rows_to_check, sketch_check, store_norms
from tracinfunc.store.meta import CheckpointMeta, StoreMeta


def _cpu(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=262144)
    parser.add_argument("--k", type=int, default=256)
    parser.add_argument("--ckpts", type=int, default=1)
    parser.add_argument("--chunk-rows", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="8192 x 64")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.k, args.repeat = 8192, 64, 2
    rows = torch.randn(args.ckpts, args.rows, args.k, generator=torch.Generator().manual_seed(0))
    meta = StoreMeta(projection=tif.Projection(dim=args.k),
                     checkpoints=tuple(CheckpointMeta(f"c{i}", 0.1, f"f{i}")
                                       for i in range(args.ckpts)),
                     layout=(("w", (args.k,)),), n_train=args.rows, k=args.k, dtype="float16")
    source = tif.store.MemoryStore(meta, rows.half(), rows.half().float().norm(dim=-1))
    with tempfile.TemporaryDirectory() as tmp:
        store = tif.save_store(source, Path(tmp) / "g.zarr", progress=False,
                               chunk_rows=args.chunk_rows)
        index = tif.build_index(store, nlist=16, target_recall=None)
        checked = rows_to_check(index.norms, index.sketch_seed, args.chunk_rows,
                                64 * 2**20 // (args.ckpts * args.k * 2))

        def load() -> None:
            tif.load_index(index.path, tif.open_store(store.path))

        def norms_check() -> None:  # format 3's binding, on a fresh store object
            assert norms_mismatch(index.norms, store_norms(tif.open_store(store.path))) is None

        def sketch_check_only() -> None:  # what format 4 adds
            assert sketch_check(tif.open_store(store.path), index.norms, index.sketch,
                                index.sketch_seed, False) is None

        times = {"load_index (format 4, total)": [], "norms check (format 3)": [],
                 "sketch check (format 4 adds)": []}
        for _ in range(args.repeat):
            times["load_index (format 4, total)"].append(_cpu(load))
            times["norms check (format 3)"].append(_cpu(norms_check))
            times["sketch check (format 4 adds)"].append(_cpu(sketch_check_only))
    best = {name: min(values) for name, values in times.items()}
    print(f"store {args.rows} x {args.k} float16, {args.ckpts} checkpoint(s), chunks of "
          f"{args.chunk_rows} rows; sketch compared for {len(checked)} rows "
          f"({100 * len(checked) / args.rows:.1f}%)")
    print(f"| step | process CPU s (best of {args.repeat}) |")
    print("|---|---|")
    for name, value in best.items():
        print(f"| {name} | {value:.3f} |")


if __name__ == "__main__":
    main()
