"""Streaming throughput of a full ``score`` pass over each store kind, against the ceiling.

One run measures, side by side on the same synthetic store (``--rows`` x ``--k``, 1
checkpoint, Gaussian rows):

* the ceilings: reading the store's shard files into one preallocated buffer with
  ``readinto`` (warm: page cache; cold: evicted with ``posix_fadvise(DONTNEED)``), and the
  matmul alone (``[n_test, k] @ [k, rows]`` over in-memory float32 chunks of the same size);
* ``tif.score`` over MemoryStore, PinnedStore and ZarrStore (float32, float16, bfloat16),
  warm and cold, and over zarr's own read path for comparison;
* bfloat16 on the CPU: multiplied in bfloat16 (the default) against upcast to float32.

A pass ideally takes max(read time, matmul time) when reading overlaps compute, so the ratio
reported is ``max(readinto time, matmul time) / score time`` (1.0 = at the ceiling).

A second table (issue 34) puts a warm ``score`` pass over the float32 ZarrStore beside a
numpy memmap + matmul of the same rows (a raw file), in process CPU time, interleaved,
medians: the first pass after opening (every chunk's crc32c verified) and later passes
(verified once per shard-file identity, :mod:`tracinfunc.store.zarr.local_reads`).

    python benchmarks/store_stream.py            # 200k x 1024 (800 MB float32), under /tmp
    python benchmarks/store_stream.py --rows 50000 --k 4096   # issue 34's query shape
    python benchmarks/store_stream.py --quick    # 20k x 1024
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

import tracinfunc as tif
from tracinfunc.store.meta import CheckpointMeta, StoreMeta

score_module = importlib.import_module("tracinfunc.query.chunks")


def make_store(n_rows: int, k: int, seed: int = 0) -> tif.store.MemoryStore:
    meta = StoreMeta(projection=tif.Projection(dim=k, seed=seed),
                     checkpoints=(CheckpointMeta("c0", 1.0, "synthetic"),),
                     layout=(("w", (k,)),), n_train=0, k=k, complete=False)
    writer = tif.store.MemoryWriter(meta)
    g = torch.Generator().manual_seed(seed)
    for start in range(0, n_rows, 16384):
        rows = torch.randn(1, min(16384, n_rows - start), k, generator=g)
        writer.append(rows, rows.norm(dim=-1))
    return writer.finish()


def files_of(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name != "zarr.json"
                  and "rows" in p.parts)


def evict(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            os.fsync(fd)  # dirty (just written) pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def readinto_buffer(path: Path) -> memoryview:
    """One buffer for the largest shard file, allocated and touched before any timing."""
    return memoryview(bytearray(max(f.stat().st_size for f in files_of(path))))


def readinto_seconds(path: Path, view: memoryview) -> float:
    """The read ceiling: every rows shard file into one preallocated buffer."""
    files = files_of(path)
    start = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as handle:
            handle.readinto(view[: file.stat().st_size])
    return time.perf_counter() - start


def matmul_seconds(store: tif.store.MemoryStore, test: torch.Tensor, chunk: int) -> float:
    rows = store.view_rows(0, 0, store.n_train)
    out = torch.empty(test.shape[1], chunk)
    start = time.perf_counter()
    for begin in range(0, store.n_train, chunk):
        block = rows[begin : begin + chunk]
        torch.mm(test[0], block.T, out=out[:, : block.shape[0]])
    return time.perf_counter() - start


def score_seconds(store, test: torch.Tensor) -> float:
    start = time.perf_counter()
    tif.score(store, test, device="cpu")
    return time.perf_counter() - start


def best(fn, repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n-test", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--quick", action="store_true", help="20k rows")
    parser.add_argument("--memmap-only", action="store_true",
                        help="only the table against a numpy memmap + matmul")
    args = parser.parse_args()
    n_rows = 20_000 if args.quick else args.rows
    workdir = Path(tempfile.mkdtemp(prefix="tif-store-bench-", dir=args.dir))
    try:
        if args.memmap_only:
            memory = make_store(n_rows, args.k)
            store = tif.save_store(memory, workdir / "float32.zarr")
            test = torch.randn(1, args.n_test, args.k)
            chunk = score_module._chunk_rows(store, None, memory.meta, args.n_test)
            against_memmap(memory, store.path, test, chunk, workdir, args.repeats)
        else:
            run(n_rows, args.k, args.n_test, args.repeats, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(n_rows: int, k: int, n_test: int, repeats: int, workdir: Path) -> None:
    print(f"store: {n_rows} rows x k={k}, 1 checkpoint; {n_test} test rows; "
          f"torch threads {torch.get_num_threads()}; best of {repeats} (warm)")
    memory = make_store(n_rows, k)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        pinned = tif.to_pinned(memory)
    test = torch.randn(1, n_test, k)
    zarrs = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        name = str(dtype).split(".")[1]
        source = memory if dtype == torch.float32 else _cast(memory, dtype)
        zarrs[name] = tif.save_store(source, workdir / f"{name}.zarr")
    chunk = score_module._chunk_rows(zarrs["float32"], None, memory.meta, n_test)
    t_mm = best(lambda: matmul_seconds(memory, test, chunk), repeats)
    rows = []

    def report(label, seconds, nbytes, t_read, ceiling=True):
        ratio = max(t_read, t_mm) / seconds if ceiling else float("nan")
        rows.append((label, seconds, nbytes / seconds / 1e9, ratio))

    f32_bytes = n_rows * k * 4
    report("matmul alone (float32, in memory)", t_mm, f32_bytes, 0, False)
    report("score MemoryStore float32", best(lambda: score_seconds(memory, test), repeats),
           f32_bytes, 0.0)
    report("score PinnedStore float32" + ("" if pinned.pinned else " (not pinned: no CUDA)"),
           best(lambda: score_seconds(pinned, test), repeats), f32_bytes, 0.0)
    for name, store in zarrs.items():
        nbytes = n_rows * k * store.dtype.itemsize
        view = readinto_buffer(store.path)
        t_read_warm = best(lambda s=store, v=view: readinto_seconds(s.path, v), repeats)
        report(f"readinto ceiling {name} warm", t_read_warm, nbytes, 0, False)
        report(f"score ZarrStore {name} warm",
               best(lambda store=store: score_seconds(store, test), repeats), nbytes,
               t_read_warm)
        evict(store.path)
        t_read_cold = readinto_seconds(store.path, view)
        report(f"readinto ceiling {name} cold", t_read_cold, nbytes, 0, False)
        evict(store.path)
        report(f"score ZarrStore {name} cold", score_seconds(store, test), nbytes, t_read_cold)
        if name == "float32":
            slow = tif.GradientStore.open(store.path)
            object.__setattr__(slow, "_readers", [None])  # force zarr's own read path
            report("score ZarrStore float32 warm, zarr's read path",
                   best(lambda slow=slow: score_seconds(slow, test), repeats), nbytes,
                   t_read_warm)
        if name == "bfloat16":
            score_module._CPU_BF16_MATMUL = False
            report("score ZarrStore bfloat16 warm, upcast to float32 (not default)",
                   best(lambda store=store: score_seconds(store, test), repeats), nbytes,
                   t_read_warm)
            score_module._CPU_BF16_MATMUL = True
    print(f"{'what':<62} {'seconds':>8} {'GB/s':>7} {'vs ceiling':>10}")
    for label, seconds, rate, ratio in rows:
        print(f"{label:<62} {seconds:8.3f} {rate:7.2f} {ratio:10.2f}")
    bf16 = dict((r[0], r[1]) for r in rows)
    fast = bf16["score ZarrStore bfloat16 warm"]
    slow = bf16["score ZarrStore bfloat16 warm, upcast to float32 (not default)"]
    print(f"bfloat16 matmul on the CPU vs upcast to float32: {slow / fast:.2f}x faster")
    against_memmap(memory, zarrs["float32"].path, test, chunk, workdir, repeats)


def against_memmap(memory, path: Path, test: torch.Tensor, chunk: int, workdir: Path,
                   repeats: int) -> None:
    """Warm ``score`` passes against a numpy memmap + matmul, process CPU time, medians."""
    import numpy as np

    n_rows, k = memory.n_train, memory.meta.k
    raw = workdir / "rows.f32"
    memory.view_rows(0, 0, n_rows).numpy().tofile(raw)

    def memmap_matmul() -> None:
        rows = torch.from_numpy(np.memmap(raw, dtype=np.float32, mode="c", shape=(n_rows, k)))
        for begin in range(0, n_rows, chunk):
            test[0] @ rows[begin : begin + chunk].T

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU time of one thread, as the issue measured
    kept = tif.GradientStore.open(path)
    cases = {"numpy memmap + matmul": memmap_matmul,
             "score, first pass after open": lambda: score_seconds(
                 tif.GradientStore.open(path), test),
             "score, later passes (crc verified once)": lambda: score_seconds(kept, test)}
    times: dict[str, list[float]] = {label: [] for label in cases}
    for fn in cases.values():
        fn()  # warm: page cache, first verification of `kept`
    for _ in range(max(3, repeats)):
        for label, fn in cases.items():
            start = time.process_time()
            fn()
            times[label].append(time.process_time() - start)
    torch.set_num_threads(threads)
    base = statistics.median(times["numpy memmap + matmul"])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\nwarm, {n_rows} x k={k}, {test.shape[1]} test rows; 1 thread, process CPU time, "
          f"medians; peak RSS of the whole run {rss:.0f} MiB")
    for label, values in times.items():
        seconds = statistics.median(values)
        print(f"{label:<44} {seconds:8.3f} s  {seconds / base:5.2f}x")


def _cast(store: tif.store.MemoryStore, dtype: torch.dtype) -> tif.store.MemoryStore:
    rows = store.view_rows(0, 0, store.n_train)[None].to(dtype)
    norms = store.read_norms(0, 0, store.n_train)[None]
    return tif.store.MemoryStore(store.meta.replace(dtype=str(dtype).split(".")[1]), rows, norms)


if __name__ == "__main__":
    main()
