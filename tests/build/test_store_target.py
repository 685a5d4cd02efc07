"""How ``store=`` is decoded does not depend on how a writer factory is wrapped.

Under torchrun a store on disk is split into one part per rank. Whether ``store=`` writes to
disk used to be recognised for ``functools.partial(PartWriter, ...)`` only: a
``partial(ZarrWriter, ...)`` made every rank build the whole store. Here two ranks of a fake
process group run one after the other in this process.
"""

from __future__ import annotations

import functools

import pytest

import tracinfunc as tif
import tracinfunc.build.torch as build_module
from tests.build.test_shards_build import PROJ, SHARD_ROWS, batches, files_of
from tracinfunc.store.writer import writes_to_disk


def _fake_rank(monkeypatch, rank: int, world: int) -> None:
    monkeypatch.setattr(build_module, "is_distributed", lambda: True)
    monkeypatch.setattr(build_module, "rank_shard", lambda: (rank, world))
    monkeypatch.setattr(build_module, "rank_zero_first", lambda make: make())
    # No barrier in one process: the last rank commits, as rank 0 would after the barrier.
    monkeypatch.setattr(build_module, "commit_after_barrier",
                        lambda path: tif.store.commit_store(path) if rank == world - 1 else path)


def _counting(loss, seen):
    def counted(params, example):
        seen.append(1)
        return loss(params, example)
    return counted


_TARGETS = {
    "partial(PartWriter)": lambda p: functools.partial(tif.store.PartWriter, p, chunk_rows=4,
                                                       shard_rows=SHARD_ROWS),
    "partial(ZarrWriter)": lambda p: functools.partial(tif.store.ZarrWriter, p, chunk_rows=4,
                                                       shard_rows=SHARD_ROWS),
    "partial(partial(ZarrWriter))": lambda p: functools.partial(
        functools.partial(tif.store.ZarrWriter, chunk_rows=4), p, shard_rows=SHARD_ROWS),
    "partial(ZarrWriter, path=)": lambda p: functools.partial(
        tif.store.ZarrWriter, path=p, chunk_rows=4, shard_rows=SHARD_ROWS),
}


@pytest.mark.parametrize("spelling", sorted(_TARGETS))
def test_every_spelling_of_a_disk_writer_is_split_between_ranks(mlp_setup32, tmp_path,
                                                                  monkeypatch, spelling):
    loss, ckpts, (x, y), _ = mlp_setup32
    path = tmp_path / "grads.zarr"
    target = _TARGETS[spelling](str(path))
    assert writes_to_disk(target)
    per_rank = []
    for rank in range(2):
        seen: list[int] = []
        with monkeypatch.context() as patch:
            _fake_rank(patch, rank, 2)
            tif.build_store(_counting(loss, seen), ckpts, batches(x, y), projection=PROJ,
                            store=target)
        per_rank.append(len(seen))
    n_ckpt = len(ckpts)
    # Each rank differentiated only its own rows (plus the first batch's loss check).
    assert all(count < n_ckpt * len(x) for count in per_rank), per_rank
    whole = tif.build_store(loss, ckpts, batches(x, y), projection=PROJ,
                            store=functools.partial(tif.store.ZarrWriter, tmp_path / "w.zarr",
                                                    chunk_rows=4, shard_rows=SHARD_ROWS))
    split = tif.GradientStore.open(path)
    assert split.meta.n_train == whole.meta.n_train == len(x)
    assert files_of(path) == files_of(tmp_path / "w.zarr")


def test_user_factories_and_memory_targets_are_built_whole(tmp_path):
    assert not writes_to_disk(None)
    assert not writes_to_disk("memory")
    assert not writes_to_disk("pinned")
    assert not writes_to_disk(lambda meta: tif.store.MemoryWriter(meta))
    assert not writes_to_disk(functools.partial(tif.store.MemoryWriter))
    assert writes_to_disk(tmp_path / "grads.zarr")


def test_a_split_build_refuses_to_overwrite(mlp_setup32, tmp_path):
    loss, ckpts, (x, y), _ = mlp_setup32
    target = functools.partial(tif.store.ZarrWriter, tmp_path / "g.zarr", overwrite=True)
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match="build_store: a build split into parts .* cannot overwrite"):
        tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, store=target,
                        shard=(0, 2))
    assert not (tmp_path / "g.zarr").exists()
