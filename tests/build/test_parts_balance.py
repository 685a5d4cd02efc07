"""Parts of a sharded build share the work even when the default layout is one shard
(issue 24 item 5: part 0 of 2 got no rows and part 1 did everything)."""

from __future__ import annotations

import functools

import torch

import tracinfunc as tif
from tests.build.test_shards_build import PROJ, batches


def test_default_layout_splits_the_rows_between_the_parts(mlp_setup32, tmp_path):
    loss, ckpts, (x, y), _ = mlp_setup32
    path = tmp_path / "g.zarr"
    parts = [tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, store=str(path),
                             shard=(i, 2)) for i in range(2)]
    sizes = [part.stop - part.start for part in parts]
    assert sizes[0] > 0 and sizes[1] > 0 and sum(sizes) == 40, sizes
    assert abs(sizes[0] - sizes[1]) <= 10  # balanced within a shard or so
    store = tif.store.commit_store(path)
    whole = tif.build_store(loss, ckpts, batches(x, y), projection=PROJ,
                            store=functools.partial(tif.store.ZarrWriter, tmp_path / "w.zarr"))
    for c in range(whole.n_ckpt):
        assert torch.equal(store.read_rows(c, 0, 40), whole.read_rows(c, 0, 40))
