"""bergson's ``Attributor`` over the rows of ``store_stream.py``'s query table, in bergson's
own environment (``make bench-setup``; ``$BERGSON_PYTHON``). Imports no tracinfunc.

Usage: ``_bergson_query_child.py RAW N K DTYPE TEST INDEX_DIR TOP``: ``RAW`` is the rows as
one raw little-endian file ``[N, K]`` (what bergson's index stores as ``gradients.bin``),
hard-linked into ``INDEX_DIR`` beside an ``info.json`` and an unprojected
``GradientProcessor`` (``projection_dim=None``: the rows are taken as they are). ``TEST``
holds the ``[n_test, K]`` float32 queries. One thread; prints ``RESULT {json}``: process
CPU seconds of ``Attributor(...)`` + ``search(q, TOP)`` (the first search after opening the
index) and of a second ``search`` on the same object, and this process's peak RSS.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
from bergson.gradients import GradientProcessor
from bergson.query.attributor import Attributor


def make_index(raw: Path, n: int, k: int, dtype: str, index: Path) -> None:
    if (index / "info.json").exists():
        return
    index.mkdir(parents=True, exist_ok=True)
    os.link(raw, index / "gradients.bin")
    (index / "info.json").write_text(json.dumps({
        "attribute_tokens": False, "num_items": n, "num_grads": n, "grad_sizes": {"w": k},
        "base_dtype": dtype}))
    GradientProcessor(projection_dim=None).save(index)


def main() -> None:
    raw, n, k, dtype, test_path, index, top = sys.argv[1:8]
    n, k, top = int(n), int(k), int(top)
    torch.set_num_threads(1)
    make_index(Path(raw), n, k, dtype, Path(index))
    test = torch.from_numpy(np.fromfile(test_path, dtype=np.float32).reshape(-1, k))
    start, wall = time.process_time(), time.perf_counter()
    attributor = Attributor(index, device="cpu", dtype=torch.float32)
    attributor.search({"w": test}, top)
    first, first_wall = time.process_time() - start, time.perf_counter() - wall
    start, wall = time.process_time(), time.perf_counter()
    attributor.search({"w": test}, top)
    later, later_wall = time.process_time() - start, time.perf_counter() - wall
    # VmHWM: ru_maxrss of an exec'd child starts from its parent's peak at fork.
    status = Path("/proc/self/status").read_text().splitlines()
    rss = next((int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:")),
               resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print("RESULT " + json.dumps({"first": first, "later": later, "first_wall": first_wall,
                                  "later_wall": later_wall, "rss_mib": rss}))


if __name__ == "__main__":
    main()
