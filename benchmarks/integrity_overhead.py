"""What the integrity checks of issue 16 cost: sealing at finish, checks at open and first read.

Side by side in one run, on one store: writing it (ZarrWriter, fsync included) vs sealing it
(manifest + digest), opening it, and reading every row through the checked raw path vs the
same ShardReader with no FileGuard. Prints ratios.

    PYTHONPATH=. python benchmarks/integrity_overhead.py [--rows 65536] [--k 256] [--ckpts 4]
    PYTHONPATH=. python benchmarks/integrity_overhead.py --quick    # seconds (tests/ runs it)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import tracinfunc as tif
from tracinfunc.store.meta import CheckpointMeta, StoreMeta
from tracinfunc.store.zarr.integrity import seal
from tracinfunc.store.zarr.local_reads import ShardReader


def _best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--k", type=int, default=256)
    parser.add_argument("--ckpts", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="8192 x 64, 2 checkpoints")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.k, args.ckpts = 8192, 64, 2
    rows = torch.randn(args.ckpts, args.rows, args.k)
    meta = StoreMeta(projection=tif.Projection(dim=args.k),
                     checkpoints=tuple(CheckpointMeta(f"c{i}", 0.1, f"f{i}")
                                       for i in range(args.ckpts)),
                     layout=(("w", (args.k,)),), n_train=args.rows, k=args.k)
    source = tif.store.MemoryStore(meta, rows, rows.norm(dim=-1))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "g.zarr"
        start = time.perf_counter()
        store = tif.save_store(source, path, progress=False, shard_rows=8192, chunk_rows=1024)
        write = time.perf_counter() - start
        sealing = _best(lambda: seal(path, store.meta.to_dict()))
        opening = _best(lambda: tif.GradientStore.open(path))
        buffer = torch.empty(args.rows, args.k)
        view = memoryview(buffer.view(torch.uint8).numpy()).cast("B")

        def checked() -> None:  # a fresh store: every shard's tail is checked again
            fresh = tif.GradientStore.open(path)
            for c in range(args.ckpts):
                fresh.read_rows(c, 0, args.rows, out=buffer)

        def unchecked() -> None:
            fresh = tif.GradientStore.open(path)
            for c in range(args.ckpts):
                ShardReader.for_array(fresh._rows[c]).read_into(0, args.rows, view)

        read_checked, read_unchecked = _best(checked), _best(unchecked)
    size = rows.numel() * 4 / 2**20
    print(f"store {args.ckpts} x {args.rows} x {args.k} float32 = {size:.0f} MiB")
    print(f"save_store (write + fsync + seal) {write:.3f} s; seal alone {sealing:.4f} s "
          f"= {sealing / write:.1%} of the write")
    print(f"GradientStore.open {opening * 1e3:.1f} ms")
    print(f"read all rows: checked {read_checked:.3f} s, unchecked {read_unchecked:.3f} s, "
          f"ratio {read_checked / read_unchecked:.3f}")


if __name__ == "__main__":
    main()
