"""A ZarrWriter given one of chunk_rows / shard_rows picks the other to fit (issue 25,
"benchmarks that cannot rot": scale_out.py --quick died on a chunk/shard mismatch)."""

from __future__ import annotations

import pytest
import torch
import zarr

import tracinfunc as tif
from tracinfunc.store.meta import CheckpointMeta, StoreMeta


def _meta(k: int = 1024) -> StoreMeta:
    return StoreMeta(projection=tif.Projection(dim=k), checkpoints=(CheckpointMeta("c", 1.0, "f"),),
                     layout=(("w", (k,)),), n_train=0, k=k, complete=False)


def _write(path, rows: int = 1536, **sizes) -> tif.store.ZarrStore:
    writer = tif.store.ZarrWriter(path, _meta(), **sizes)
    block = torch.randn(1, rows, 1024, generator=torch.Generator().manual_seed(0))
    writer.append(block, block.norm(dim=-1))
    store = writer.finish()
    assert torch.equal(store.read_rows(0, 0, rows), block[0])
    return store


@pytest.mark.parametrize(("sizes", "chunk", "shard"), [
    ({"shard_rows": 512}, 512, 512),      # default chunks (1024 rows of 4 KiB) would not fit
    ({"shard_rows": 1536}, 768, 1536),    # the largest divisor up to the default chunk
    ({"chunk_rows": 1024}, 1024, None),   # shards: a multiple of the chunks
])
def test_one_size_given_picks_the_other_to_fit(tmp_path, sizes, chunk, shard):
    _write(tmp_path / "g.zarr", **sizes)
    rows = zarr.open_group(tmp_path / "g.zarr", mode="r")["rows/0"]
    assert rows.chunks[0] == chunk and rows.shards[0] % chunk == 0
    assert shard is None or rows.shards[0] == shard


def test_both_given_and_not_fitting_say_what_would(tmp_path):
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match="shard_rows=512; pass e.g. shard_rows=1024, or give only one"):
        tif.store.ZarrWriter(tmp_path / "g.zarr", _meta(), chunk_rows=1024, shard_rows=512)
