"""Parts of a sharded build check their data and take a lock, as one process does
(issue 25 item 4)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch

import tracinfunc as tif
from tests.build.test_shards_build import PROJ, SHARD_ROWS, batches


def _writer(path):
    return functools.partial(tif.store.PartWriter, path, chunk_rows=4, shard_rows=SHARD_ROWS)


def test_a_part_resumed_over_other_data_is_refused(mlp_setup32, tmp_path):
    """Before: a part killed and resumed over a different dataset of the same size merged."""
    loss, ckpts, (x, y), _ = mlp_setup32
    path = tmp_path / "g.zarr"
    data = batches(x, y, size=4)
    whole = tif.build_store(loss, ckpts, data, projection=PROJ)
    # Part 1 of 2 (rows [16, 40)) wrote two shards, then its process was killed.
    part = _writer(path)(whole.meta.replace(complete=False), (1, 2))
    assert part.rows_written == 16
    rows = torch.stack([whole.read_rows(c, 16, 32) for c in range(whole.n_ckpt)])
    part.append(rows, rows.norm(dim=-1))
    assert part.rows_written == 32
    del part  # killed: never finished
    other = batches(x.flip(0), y.flip(0), size=4)
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="does not match the store"):
        tif.build_store(loss, ckpts, other, projection=PROJ, store=_writer(path), shard=(1, 2))
    resumed = tif.build_store(loss, ckpts, data, projection=PROJ, store=_writer(path),
                              shard=(1, 2))
    assert resumed.complete


def test_two_copies_of_one_part_never_write_at_once(mlp_setup32, tmp_path):
    """Before: a requeued task beside the still-running first copy both wrote the part."""
    path = tmp_path / "g.zarr"
    loss, ckpts, (x, y), _ = mlp_setup32
    tif.build_store(loss, ckpts, batches(x, y)[:1], projection=PROJ,
                    store=functools.partial(tif.store.ZarrWriter, tmp_path / "m.zarr"))
    meta = tif.store.read_store_meta(tmp_path / "m.zarr").replace(n_train=40, complete=False)
    code = ("import sys, json; import tracinfunc as tif; from tracinfunc.store.meta import "
            "StoreMeta\n"
            f"meta = StoreMeta.from_dict(json.loads({json.dumps(meta.to_dict())!r}))\n"
            f"w = tif.store.PartWriter({str(path)!r}, meta, (0, 2), chunk_rows=4, "
            f"shard_rows={SHARD_ROWS}); print('writing', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
        with pytest.raises(tif.errors.StoreLockedError):
            tif.store.PartWriter(path, meta, (0, 2), chunk_rows=4, shard_rows=SHARD_ROWS)
        other = tif.store.PartWriter(path, meta, (1, 2), chunk_rows=4, shard_rows=SHARD_ROWS)
        assert other.rows_written == other.start  # the other part is free
    finally:
        child.stdin.close()
        child.wait()
