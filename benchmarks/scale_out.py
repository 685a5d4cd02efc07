"""Scale-out figures, measured side by side in one run.

1. **Sharded build speed-up**: one MLP whose per-example gradients dominate the build,
   built by one process (1 thread, and all threads) and by ``--procs`` processes of 1 thread
   each, every one a ``build_store(..., shard=(i, n))`` part of one Zarr store, then
   ``commit_store``. Times exclude interpreter start-up and a warm-up on two batches (each
   child times its own part; the parallel time is last end - first start). The committed
   store is checked bit-identical to the one-process store.
2. **S3 score throughput**: ``tif.score`` over a store on a local S3-compatible server
   (moto, 127.0.0.1) against fetching the same shard objects with plain ranged GETs
   (boto3, 8 in flight) into memory: ratio = GET time / score time (1.0 = at the ceiling),
   medians of interleaved passes after one warm-up pass each.

    python benchmarks/scale_out.py            # 4096 examples, 8192 x 1024 rows on S3
    python benchmarks/scale_out.py --quick
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tracinfunc as tif  # noqa: E402

PROJ = tif.Projection(dim=1024, kind="sjlt", nnz=1, seed=0)


def problem(n: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                          nn.Linear(512, 10)).eval()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.1, name="c0")]
    batches = [(x[i : i + 64], y[i : i + 64]) for i in range(0, n, 64)]
    return loss, ckpts, batches


def child_build(args) -> None:
    """One build (or one part of it); prints {"start", "end"} wall-clock times."""
    torch.set_num_threads(args.threads)
    loss, ckpts, batches = problem(args.n)
    tif.build_store(loss, ckpts, batches[:2], projection=PROJ)  # warm-up, not timed
    shard = None if args.shard is None else tuple(int(v) for v in args.shard.split("/"))
    store = functools.partial(tif.store.PartWriter if shard else tif.store.ZarrWriter, args.out,
                              chunk_rows=128, shard_rows=256)
    start = time.time()
    tif.build_store(loss, ckpts, batches, projection=PROJ, store=store, shard=shard,
                    progress=False)
    print(json.dumps({"start": start, "end": time.time()}))


def run_children(commands: list[list[str]]) -> float:
    procs = [subprocess.Popen([sys.executable, __file__, *c], stdout=subprocess.PIPE, text=True)
             for c in commands]
    times = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"child failed: {proc.args}")
        times.append(json.loads(out.strip().splitlines()[-1]))
    return max(t["end"] for t in times) - min(t["start"] for t in times)


def bench_build(n: int, procs: int, tmp: Path) -> None:
    cores = os.cpu_count() or 1
    base = ["--child", "build", "--n", str(n)]
    one_1 = run_children([[*base, "--threads", "1", "--out", str(tmp / "one1.zarr")]])
    one_all = run_children([[*base, "--threads", str(cores), "--out", str(tmp / "oneN.zarr")]])
    parts = run_children([[*base, "--threads", "1", "--out", str(tmp / "parts.zarr"),
                           "--shard", f"{i}/{procs}"] for i in range(procs)])
    store = tif.store.commit_store(tmp / "parts.zarr")
    whole = tif.GradientStore.open(tmp / "one1.zarr")
    same = all(torch.equal(store.read_rows(c, 0, n), whole.read_rows(c, 0, n))
               for c in range(store.meta.n_ckpt))
    print(f"build, {n} examples, MLP 256-512-512-10, sjlt k={PROJ.dim}, {cores} cores")
    print(f"  1 process, 1 thread        {one_1:7.2f} s")
    print(f"  1 process, {cores} threads       {one_all:7.2f} s")
    print(f"  {procs} processes x 1 thread   {parts:7.2f} s   speed-up {one_1 / parts:.2f}x over "
          f"1 thread, {one_all / parts:.2f}x over {cores} threads (target >= 1.7x); "
          f"bit-identical: {same}")


def bench_s3(rows: int, k: int, repeats: int) -> None:
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_ENDPOINT_URL=endpoint, AWS_DEFAULT_REGION="us-east-1")
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="bench")
    try:
        from tracinfunc.build.loop import new_store_meta

        meta = new_store_meta(
            [("c0", 1.0, "f")], tif.projection.canonical_layout({"w": (k,)}),
            tif.Projection(dim=None, kind="identity"), torch.float32, None)
        # ~8 shard objects (--quick: 4096 rows -> 512-row chunks, one per shard)
        chunk = min(1024, rows // 8)
        writer = tif.store.ZarrWriter("s3://bench/grads.zarr", meta, chunk_rows=chunk,
                                      shard_rows=chunk * max(1, rows // 8 // chunk))
        g = torch.Generator().manual_seed(0)
        for start in range(0, rows, 4096):
            block = torch.randn(1, min(4096, rows - start), k, generator=g)
            writer.append(block, block.norm(dim=-1))
        store = writer.finish()
        test = torch.randn(1, 16, k, generator=g)
        tif.score(store, test, device="cpu")  # warm-up (connections, thread pools)
        keys = [o["Key"] for o in client.list_objects_v2(Bucket="bench",
                                                         Prefix="grads.zarr/rows/")["Contents"]
                if not o["Key"].endswith("zarr.json")]
        sizes = {key: client.head_object(Bucket="bench", Key=key)["ContentLength"]
                 for key in keys}

        def fetch(key: str) -> int:
            body = client.get_object(Bucket="bench", Key=key,
                                     Range=f"bytes=0-{sizes[key] - 1}")["Body"].read()
            return len(body)

        opened = tif.GradientStore.open("s3://bench/grads.zarr")  # metadata: not part of the pass
        with mock.patch("tracinfunc.store.zarr.store.object_store_for_reads", lambda url: None):
            through_s3fs = tif.GradientStore.open("s3://bench/grads.zarr")  # as without obstore
        for store in (opened, through_s3fs):  # shard indices are read once, then cached
            tif.score(store, test, device="cpu")
        times: dict[str, list[float]] = {"get": [], "obstore": [], "s3fs": []}
        with ThreadPoolExecutor(8) as pool:
            for _ in range(repeats):  # interleaved, so drift in the machine's load hits all
                start = time.perf_counter()
                fetched = sum(pool.map(fetch, keys))
                times["get"].append(time.perf_counter() - start)
                for name, store in (("obstore", opened), ("s3fs", through_s3fs)):
                    start = time.perf_counter()
                    tif.score(store, test, device="cpu")
                    times[name].append(time.perf_counter() - start)
        get_s = statistics.median(times["get"])
        mb = fetched / 2**20
        print(f"S3 (moto on 127.0.0.1), {rows} x {k} float32, {len(keys)} shard objects, "
              f"{mb:.0f} MiB, median of {repeats} interleaved passes")
        print(f"  ranged GETs, 8 in flight          {get_s:7.3f} s  {mb / get_s:7.1f} MiB/s")
        for name in ("obstore", "s3fs"):
            score_s = statistics.median(times[name])
            print(f"  tif.score, raw reads via {name:8s} {score_s:7.3f} s  "
                  f"{mb / score_s:7.1f} MiB/s   ratio {get_s / score_s:.2f} (target >= 0.8)")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out")
    parser.add_argument("--shard")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("build", "s3"), help="run one of the two figures")
    args = parser.parse_args()
    if args.child == "build":
        return child_build(args)
    if args.quick:  # seconds of work (tests/ runs it); the ratios need the full sizes
        args.n, args.rows, args.repeats = 256, 4096, 3
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "build"):
            bench_build(args.n, args.procs, Path(tmp))
        if args.only in (None, "s3"):
            bench_s3(args.rows, 1024, args.repeats)
    return None


if __name__ == "__main__":
    main()
