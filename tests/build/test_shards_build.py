"""Sharded builds: parts written by separate calls (or processes) equal a one-process build
bit for bit; a part resumes on its own; the store opens only after every part is committed."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
import torch

import tracinfunc as tif
from tracinfunc.store.zarr.parts import part_rows, read_parts

PROJ = tif.Projection(dim=16, seed=0)
SHARD_ROWS = 8  # rows per Zarr shard: 40 rows -> 5 shards, so 2 and 3 parts split unevenly


def batches(x, y, size=6):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def files_of(path: Path) -> dict[str, bytes]:
    """Every chunk file under rows/ and norms/ (bytes), for a bit-for-bit comparison."""
    return {str(f.relative_to(path)): f.read_bytes() for kind in ("rows", "norms")
            for f in sorted((path / kind).rglob("*")) if f.is_file() and f.name != "zarr.json"}


def build_whole(mlp_setup32, path):
    loss, ckpts, (x, y), _ = mlp_setup32
    writer = functools.partial(tif.store.ZarrWriter, path, chunk_rows=4, shard_rows=SHARD_ROWS)
    return tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, store=writer)


def build_part(mlp_setup32, path, index, count, **kwargs):
    loss, ckpts, (x, y), _ = mlp_setup32
    writer = functools.partial(tif.store.PartWriter, path, chunk_rows=4, shard_rows=SHARD_ROWS)
    return tif.build_store(kwargs.pop("loss", loss), ckpts, batches(x, y), projection=PROJ,
                           store=writer, shard=(index, count), **kwargs)


def test_part_rows_are_whole_shards_covering_every_row():
    for n_train in (1, 7, 8, 40, 41, 1000):
        for count in (1, 2, 3, 5, 9):
            ranges = [part_rows(n_train, SHARD_ROWS, i, count) for i in range(count)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n_train
            for (_, stop), (start, _) in itertools.pairwise(ranges):
                assert stop == start and (start % SHARD_ROWS == 0 or start == n_train)


@pytest.mark.parametrize("count", [2, 3])
def test_parts_built_one_after_another_equal_the_whole_build_bit_for_bit(
        mlp_setup32, tmp_path, count):
    whole = build_whole(mlp_setup32, tmp_path / "whole.zarr")
    path = tmp_path / "parts.zarr"
    for index in reversed(range(count)):  # any order
        part = build_part(mlp_setup32, path, index, count)
        assert isinstance(part, tif.store.StorePart) and part.complete
    store = tif.store.commit_store(path)
    assert store.meta == whole.meta
    assert files_of(path) == files_of(tmp_path / "whole.zarr")
    for c in range(whole.meta.n_ckpt):
        assert torch.equal(store.read_rows(c, 0, 40), whole.read_rows(c, 0, 40))


def test_a_store_with_a_missing_part_neither_commits_nor_opens(mlp_setup32, tmp_path):
    path = tmp_path / "parts.zarr"
    build_part(mlp_setup32, path, 0, 3)
    build_part(mlp_setup32, path, 2, 3)
    with pytest.raises(tif.errors.IncompleteStoreError, match=r"parts \[1\] of 3"):
        tif.store.commit_store(path)
    with pytest.raises(tif.errors.IncompleteStoreError):
        tif.open_store(path)
    build_part(mlp_setup32, path, 1, 3)
    assert tif.store.commit_store(path).meta.complete
    assert tif.open_store(path).meta.n_train == 40


class DyingDataset(torch.utils.data.Dataset):
    """(x, y) examples; reading example ``die_at`` raises once (a crash mid-part)."""

    def __init__(self, x, y, die_at=None):
        self.x, self.y, self.die_at = x, y, die_at

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i == self.die_at:
            self.die_at = None
            raise KeyboardInterrupt
        return self.x[i], self.y[i]


def test_a_killed_part_resumes_without_redoing_its_written_shards(mlp_setup32, tmp_path):
    loss, ckpts, (x, y), _ = mlp_setup32
    build_whole(mlp_setup32, tmp_path / "whole.zarr")
    path = tmp_path / "parts.zarr"
    build_part(mlp_setup32, path, 0, 2)  # rows [0, 16) of [0, 40): shards 0-1 of 5
    dataset = DyingDataset(x, y, die_at=28)  # dies in batch [24, 30), after shard [16, 24)
    loader = torch.utils.data.DataLoader(dataset, batch_size=6)
    writer = functools.partial(tif.store.PartWriter, path, chunk_rows=4, shard_rows=SHARD_ROWS)
    calls = []

    def counting_loss(params, example):
        calls.append(1)
        return loss(params, example)

    with pytest.raises(KeyboardInterrupt):
        tif.build_store(counting_loss, ckpts, loader, projection=PROJ, store=writer,
                        shard=(1, 2))
    state = read_parts(path)[1]
    progress = {key: state[key] for key in ("start", "stop", "rows_written", "complete")}
    assert progress == {"start": 16, "stop": 40, "rows_written": 24, "complete": False}
    assert state["build"]["mixed_precision"] is None  # what commit compares parts by
    with pytest.raises(tif.errors.IncompleteStoreError, match=r"parts \[1\] of 2"):
        tif.store.commit_store(path)
    calls.clear()
    tif.build_store(counting_loss, ckpts, loader, projection=PROJ, store=writer, shard=(1, 2))
    # Batches [0, 24) were skipped but for the two that prove the data is the same (the one
    # holding the part's first row, [12, 18), and the one ending at the resume point,
    # [18, 24)); [24, 30), [30, 36), [36, 40) were differentiated: 1 loss check + (2 + 3)
    # batches x 3 checkpoints. The written shards were not redone.
    assert len(calls) == 1 + (2 + 3) * 3
    tif.store.commit_store(path)
    assert files_of(path) == files_of(tmp_path / "whole.zarr")


def test_errors_name_the_fix(mlp_setup32, tmp_path):
    loss, ckpts, (x, y), _ = mlp_setup32
    with pytest.raises(tif.errors.InvalidArgumentError, match="shard must be"):
        tif.build_store(loss, ckpts, (x, y), projection=PROJ, store=tmp_path / "a.zarr",
                        shard=(2, 2))
    with pytest.raises(tif.errors.InvalidArgumentError, match="store must be its path"):
        tif.build_store(loss, ckpts, (x, y), projection=PROJ, shard=(0, 2))
    with pytest.raises(tif.errors.InvalidArgumentError, match="known, non-zero size"):
        tif.build_store(loss, ckpts, iter(batches(x, y)), projection=PROJ,
                        store=tmp_path / "b.zarr", shard=(0, 2))
    build_part(mlp_setup32, tmp_path / "c.zarr", 0, 2)
    with pytest.raises(tif.errors.StoreExistsError, match="split into 2 parts"):
        build_part(mlp_setup32, tmp_path / "c.zarr", 0, 3)
    with pytest.raises(tif.errors.StoreExistsError, match="sharded"):
        tif.build_store(loss, ckpts, (x, y), projection=PROJ, store=tmp_path / "c.zarr")
