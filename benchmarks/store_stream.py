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

A second table (issue 34) puts warm queries over a ZarrStore (``--dtypes``, float32 by
default) beside a numpy memmap + matmul of the same bytes (a raw file, cast to float32 per
piece) and bergson's ``Attributor`` over an index of the same bytes, run in its own
environment (``$BERGSON_PYTHON``, ``_bergson_query_child.py``; one child per trial):
1 thread, interleaved trials, medians of process CPU time and wall; the peak RSS of a fresh
process that runs only that case (``--rss-case``). Ours: ``score`` and ``top_k`` over an
open store (mapped chunks, crc verified once), ``score`` through the copying reads (the
path before issue 34) and the first ``score`` after opening (every crc verified). Before
the trials both files are evicted and read back (``reread``), so neither is timed over a page
cache shaped by how it was written.

    python benchmarks/store_stream.py            # 200k x 1024 (800 MB float32), under /tmp
    python benchmarks/store_stream.py --rows 50000 --k 4096   # issue 34's query shape
    python benchmarks/store_stream.py --quick    # 20k x 1024
    BERGSON_PYTHON=.venv-bergson/bin/python python benchmarks/store_stream.py --memmap-only \
        --rows 50000 --k 4096 --repeats 5 --dtypes float32 float16   # issue 34's table
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


def reread(*paths: Path) -> None:
    """Evict ``paths`` (files or folders) and read them back in order: the page cache then
    holds them as a read fills it, whichever way they were written. (A file written in one
    large ``tofile``, as the memmap baseline's, is cached in 2 MiB folios that a mapping maps
    with one page-table entry each; a store written chunk by chunk is not, until re-read.)"""
    for path in paths:
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
        for file in files:
            evict_file(file)
        for file in files:
            with open(file, "rb", buffering=0) as handle:
                while handle.read(16 * 2**20):
                    pass


def evict_file(file: Path) -> None:
    fd = os.open(file, os.O_RDONLY)
    os.fsync(fd)
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
                        help="only the query table against a numpy memmap + matmul and bergson")
    parser.add_argument("--dtypes", nargs="+", default=["float32"],
                        help="store dtypes of the query table (float32 float16 bfloat16)")
    parser.add_argument("--rss-case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_case:
        rss_case(args.rss_case)
        return
    n_rows = 20_000 if args.quick else args.rows
    workdir = Path(tempfile.mkdtemp(prefix="tif-store-bench-", dir=args.dir))
    try:
        if args.memmap_only:
            memory = make_store(n_rows, args.k)
            test = torch.randn(1, args.n_test, args.k)
            for name in args.dtypes:
                source = memory if name == "float32" else _cast(memory, getattr(torch, name))
                store = tif.save_store(source, workdir / f"{name}.zarr")
                chunk = score_module._chunk_rows(store, None, memory.meta, args.n_test)
                against_memmap(memory, store.path, test, chunk, workdir, args.repeats,
                               bergson=not args.quick, rss=not args.quick)
        else:
            run(n_rows, args.k, args.n_test, args.repeats, workdir, quick=args.quick)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(n_rows: int, k: int, n_test: int, repeats: int, workdir: Path, *,
        quick: bool = False) -> None:
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
    against_memmap(memory, zarrs["float32"].path, test, chunk, workdir, repeats,
                   bergson=not quick, rss=not quick)


def against_memmap(memory, path: Path, test: torch.Tensor, chunk: int, workdir: Path,
                   repeats: int, *, top: int = 10, bergson: bool = True,
                   rss: bool = True) -> None:
    """Warm queries against a numpy memmap + matmul of the same bytes (and bergson's
    ``Attributor`` in its own environment), 1 thread, interleaved, medians of process CPU
    time and wall; peak RSS of each in a process of its own."""
    import numpy as np

    store = tif.GradientStore.open(path)
    n_rows, k, dtype = memory.n_train, memory.meta.k, store.dtype
    raw = workdir / f"rows.{store.meta.dtype}"
    memory.view_rows(0, 0, n_rows).to(dtype).view(torch.int16 if dtype.itemsize == 2 else
                                                     dtype).numpy().tofile(raw)
    test_file = workdir / "test.f32"
    test[0].numpy().tofile(test_file)
    spec = {"raw": str(raw), "n": n_rows, "k": k, "dtype": store.meta.dtype, "chunk": chunk,
            "store": str(path), "test": str(test_file), "top": top}
    cases = _query_cases(spec)
    bergson_python = os.environ.get("BERGSON_PYTHON", "")
    if bergson and bergson_python and Path(bergson_python).is_file():
        index = workdir / f"bergson-{store.meta.dtype}"
        command = [bergson_python, str(Path(__file__).with_name("_bergson_query_child.py")),
                   str(raw), str(n_rows), str(k), np.dtype(store.meta.dtype).name,
                   str(test_file), str(index), str(top)]
        shared: dict = {}  # one child run per trial gives both cases
        cases["bergson Attributor + search (first)"] = _Child(command, "first", shared)
        cases["bergson search again (same Attributor)"] = _Child(command, "later", shared)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU time of one thread, as the issue measured
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in cases}
    reread(raw, Path(path))  # both cached as reads leave them (see reread)
    for fn in cases.values():
        fn()  # warm: page cache, first verification of the kept store
    for _ in range(max(3, repeats)):
        for label, fn in cases.items():
            times[label].append(fn())
    torch.set_num_threads(threads)
    base = [statistics.median(c for c, _ in times["numpy memmap + matmul"]),
            statistics.median(w for _, w in times["numpy memmap + matmul"])]
    print(f"\nwarm, {n_rows} x k={k} {store.meta.dtype}, {test.shape[1]} test rows, top {top}; "
          "1 thread; medians of interleaved trials; RSS: peak of a process running only that")
    print(f"{'what':<44} {'CPU s':>7} {'ratio':>6} {'wall s':>7} {'ratio':>6} {'RSS MiB':>8}")
    for label, values in times.items():
        cpu = statistics.median(c for c, _ in values)
        wall = statistics.median(w for _, w in values)
        peak = (cases[label].rss() if hasattr(cases[label], "rss") else
                _case_rss(label, spec) if rss else float("nan"))
        print(f"{label:<44} {cpu:7.3f} {cpu / base[0]:5.2f}x {wall:7.3f} {wall / base[1]:5.2f}x "
              f"{peak:8.0f}")
    if rss:
        print(f"{'(python + torch + tracinfunc, nothing run)':<44} {'':>7} {'':>6} {'':>7} "
              f"{'':>6} {_case_rss('', spec):8.0f}")


def _query_cases(spec: dict) -> dict:
    """The timed cases over ``spec`` (paths and sizes): each returns (CPU s, wall s)."""
    return {label: _timed(fn) for label, fn in _query_fns(spec).items()}


def _query_fns(spec: dict) -> dict:
    import numpy as np

    n, k, chunk, top = spec["n"], spec["k"], spec["chunk"], spec["top"]
    test = torch.from_numpy(np.fromfile(spec["test"], dtype=np.float32).reshape(-1, k))[None]
    kept = tif.GradientStore.open(spec["store"])
    copying = tif.GradientStore.open(spec["store"])
    object.__setattr__(copying, "_maps", [None] * copying.n_ckpt)  # the reads before issue 34

    def memmap_matmul() -> torch.Tensor:
        dtype = np.dtype(spec["dtype"]) if spec["dtype"] != "bfloat16" else np.int16
        rows = torch.from_numpy(np.memmap(spec["raw"], dtype=dtype, mode="c", shape=(n, k)))
        rows = rows.view(torch.bfloat16) if spec["dtype"] == "bfloat16" else rows
        out = torch.empty(test.shape[1], n)
        for begin in range(0, n, chunk):  # [n_test, k] @ [k, rows], rows cast as they come
            out[:, begin : begin + chunk] = test[0] @ rows[begin : begin + chunk].float().T
        return out

    return {
        "numpy memmap + matmul": memmap_matmul,
        "numpy memmap + matmul + torch.topk": lambda: memmap_matmul().topk(top, dim=1),
        "tif.score, open store (crc verified once)": lambda: tif.score(kept, test),
        "tif.score, copying reads (before)": lambda: tif.score(copying, test),
        "tif.score, first pass after open": lambda: tif.score(
            tif.GradientStore.open(spec["store"]), test),
        f"tif.top_k k={top}, open store": lambda: tif.top_k(kept, test, k=top),
    }


def _timed(fn):
    def run() -> tuple[float, float]:
        start, wall = time.process_time(), time.perf_counter()
        fn()
        return time.process_time() - start, time.perf_counter() - wall
    return run


class _Child:
    """bergson in its own environment: one child process per trial (imports not timed)."""

    def __init__(self, command: list[str], key: str, shared: dict) -> None:
        self._command, self._key, self._shared = command, key, shared

    def __call__(self) -> tuple[float, float]:
        if self._key == "first":  # the "later" case reads the same run's second search
            self._shared.update(_child_result(self._command))
        return self._shared[self._key], self._shared[self._key + "_wall"]

    def rss(self) -> float:
        return self._shared["rss_mib"]


def _child_result(command: list[str]) -> dict:
    import json
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{command[1]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _case_rss(label: str, spec: dict) -> float:
    """Peak RSS (MiB) of a fresh process that runs case ``label`` once ('' = nothing)."""
    import json
    import subprocess
    import sys

    command = [sys.executable, __file__, "--rss-case", json.dumps({"label": label, **spec})]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"--rss-case {label!r} failed:\n{done.stderr[-4000:]}")
    return float(done.stdout.split()[-1])


def rss_case(argument: str) -> None:
    import json

    spec = json.loads(argument)
    torch.set_num_threads(1)
    if spec["label"]:
        _query_fns(spec)[spec["label"]]()
    print(peak_rss_mib())


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM): unlike ``ru_maxrss``, which an exec'd child inherits
    from its parent's peak at fork, it counts this process only."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cast(store: tif.store.MemoryStore, dtype: torch.dtype) -> tif.store.MemoryStore:
    rows = store.view_rows(0, 0, store.n_train)[None].to(dtype)
    norms = store.read_norms(0, 0, store.n_train)[None]
    return tif.store.MemoryStore(store.meta.replace(dtype=str(dtype).split(".")[1]), rows, norms)


if __name__ == "__main__":
    main()
