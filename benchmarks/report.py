"""The HTML report on the quickstart (issue 35 item 4): size and time for 300 queries.

The quickstart's setting (examples/quickstart.py): scikit-learn's digits, a small MLP trained
with SGD and 10% flipped labels, a checkpoint every few epochs, a Rademacher store at
k = 512. ``tif.write_report`` then writes one page for 300 held-out digits: each query's
thumbnail, its top-10 proponents and opponents with thumbnails and labels, and the 20 rows of
highest self-influence (the 297 held-out digits and 3 training digits make the 300
queries). Targets: <= 2 MB and <= 10 s; the page's top-10 rows equal
``tif.top_k``'s.

    python benchmarks/report.py --quick   # 30 queries, fewer epochs (tests/ runs it)
    python benchmarks/report.py           # 300 queries
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import tracinfunc as tif

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from quickstart import load_digits_with_flipped_labels, train_with_checkpoints


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 queries, fewer epochs")
    parser.add_argument("--out", type=Path, default=None, help="keep the page here")
    parser.add_argument("--queries", type=int, default=None, help="queries on the page")
    args = parser.parse_args()
    n_queries, (epochs, every) = (30, (6, 2)) if args.quick else (300, (30, 6))
    n_queries = args.queries or n_queries
    train, test, flipped = load_digits_with_flipped_labels(flip_fraction=0.1, seed=0)
    model, ckpts = train_with_checkpoints(*train, epochs=epochs, every=every, lr=0.1, seed=0)
    loss = tif.loss_from_module(model, F.cross_entropy)
    spec = tif.Projection(dim=512, seed=0, kind="rademacher")
    store = tif.build_store(loss, ckpts, train, projection=spec, progress=False)
    # 297 digits are held out; the 300-query page takes 3 training digits as well.
    extra = n_queries - len(test[1])
    queries = ((test[0][:n_queries], test[1][:n_queries]) if extra <= 0 else
               (torch.cat([test[0], train[0][:extra]]), torch.cat([test[1], train[1][:extra]])))
    test_grads = tif.build_store(loss, ckpts, queries, projection=spec, progress=False)
    flipped_set = set(flipped.tolist())
    labels = [f"{int(y)}{' (flipped)' if i in flipped_set else ''}"
              for i, y in enumerate(train[1])]
    with tempfile.TemporaryDirectory() as tmp:
        path = args.out or Path(tmp) / "report.html"
        start, cpu = time.perf_counter(), time.process_time()
        tif.write_report(path, store, test_grads, k=10, train=train[0], train_labels=labels,
                         queries=queries[0], query_labels=[str(int(y)) for y in queries[1]],
                         image_shape=(8, 8), outliers=20, overwrite=True)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        page = path.read_text()
    rows = [int(r) for r in re.findall(r'<tr class="pro" data-row="(\d+)"', page)]
    _, top = tif.top_k(store, test_grads, k=10, progress=False)
    same = rows == top.flatten().tolist()
    external = re.findall(r"(?:src|href)=\"(?!data:)|https?://", page)
    print(f"{len(test_grads.read_rows(0, 0, n_queries))} queries, {store.meta.n_train} "
          f"training rows, {len(ckpts)} checkpoints")
    print("| measure | value | target |\n|---|---|---|")
    print(f"| report, {n_queries} queries: size | {len(page.encode()) / 2**20:.2f} MB | "
          "<= 2 MB |")
    print(f"| report, {n_queries} queries: time | {wall:.2f} s wall, {cpu:.2f} s CPU | <= 10 s |")
    print(f"| page top-10 rows == tif.top_k's | {same} | True |")
    print(f"| external references | {len(external)} | 0 |")
    if not same or external:
        raise SystemExit("the report differs from top_k or references outside itself")


if __name__ == "__main__":
    main()
