"""A sharded build whose layout cannot be created fails at once with the real cause, and a
layout half made by a killed first part is recovered (issue 25 item 14). Before, every one of
these waited 120 s for a marker and then blamed "not a sharded store being built"."""

from __future__ import annotations

import errno
import functools

import pytest
import torch
import zarr

import tracinfunc as tif
from tests.build.test_shards_build import PROJ, SHARD_ROWS, batches, build_whole, files_of
from tracinfunc.store.zarr import part_layout as parts


@pytest.fixture(autouse=True)
def never_wait(monkeypatch):
    """Any wait for another part fails the test: every outcome here is known at once."""
    def waited(*args):
        raise AssertionError("the part waited for another part's marker")

    monkeypatch.setattr(parts, "_CREATE_WAIT_S", 0.0)
    monkeypatch.setattr(parts.time, "sleep", waited)


def _part(mlp_setup32, path, index, count=2):
    loss, ckpts, (x, y), _ = mlp_setup32
    writer = functools.partial(tif.store.PartWriter, path, chunk_rows=4, shard_rows=SHARD_ROWS)
    return tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, store=writer,
                           shard=(index, count))


def test_an_existing_directory_that_is_not_a_store_is_named_at_once(mlp_setup32, tmp_path):
    path = tmp_path / "g.zarr"
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    with pytest.raises(tif.errors.StoreExistsError,
                       match=r"g.zarr' exists and is not a tracinfunc store.*notes.txt"):
        _part(mlp_setup32, path, 0)
    assert (path / "notes.txt").read_text() == "mine"  # untouched


def test_a_zarr_group_that_is_not_a_store_is_named_at_once(mlp_setup32, tmp_path):
    path = tmp_path / "g.zarr"
    zarr.open_group(path, mode="w").attrs["mine"] = 1
    with pytest.raises(tif.errors.StoreExistsError, match="is not a tracinfunc store"):
        _part(mlp_setup32, path, 1)
    assert zarr.open_group(path, mode="r").attrs["mine"] == 1


def test_a_layout_that_cannot_be_written_raises_its_cause(mlp_setup32, tmp_path, monkeypatch):
    """A read-only file system (or a full disk) while creating the layout: the OSError names
    itself instead of a wait and a wrong diagnosis."""
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(parts, "create_layout", read_only)
    with pytest.raises(tif.errors.StoreWriteError,
                       match=r"cannot create the sharded store.*Read-only file system"):
        _part(mlp_setup32, tmp_path / "g.zarr", 0)


@pytest.mark.parametrize("killed", ["after the group", "after the arrays", "after resizing"])
def test_a_layout_half_made_by_a_killed_first_part_is_made_again(mlp_setup32, tmp_path,
                                                                  monkeypatch, killed):
    """The first part was killed between creating the layout and writing its marker; no live
    process holds it, so the next part makes it again and the build completes."""
    path = tmp_path / "g.zarr"
    loss, ckpts, (x, y), _ = mlp_setup32
    meta = tif.build_store(loss, ckpts, batches(x, y)[:1], projection=PROJ).meta.replace(
        n_train=len(x), complete=False)
    if killed == "after the group":
        zarr.open_group(path, mode="w-")
    else:
        group = parts.create_layout(path, meta, chunk_rows=4, shard_rows=SHARD_ROWS,
                                    compression=None)
        if killed == "after resizing":
            for array in parts.writable_arrays(group, "rows", meta.n_ckpt):
                array.resize((meta.n_train, *array.shape[1:]))
    for index in (1, 0):
        _part(mlp_setup32, path, index)
    whole = build_whole(mlp_setup32, tmp_path / "whole.zarr")
    store = tif.store.commit_store(path)
    assert files_of(path) == files_of(tmp_path / "whole.zarr")
    assert torch.equal(store.read_rows(0, 0, 40), whole.read_rows(0, 0, 40))


def test_a_one_process_build_in_progress_is_never_taken_for_a_half_made_layout(
        mlp_setup32, tmp_path):
    """An interrupted one-process build (rows stored, no parts marker) is kept, and named."""
    path = tmp_path / "g.zarr"
    loss, ckpts, (x, y), _ = mlp_setup32

    def dying():
        yield from batches(x, y)[:3]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tif.build_store(loss, ckpts, dying(), projection=PROJ,
                        store=functools.partial(tif.store.ZarrWriter, path, chunk_rows=4,
                                                shard_rows=SHARD_ROWS))
    stored = tif.store.read_store_meta(path).n_train
    assert stored > 0
    with pytest.raises(tif.errors.StoreExistsError, match="one-process build"):
        _part(mlp_setup32, path, 0)
    assert tif.store.read_store_meta(path).n_train == stored


def test_a_zarr_group_without_attributes_is_never_taken_for_a_half_made_layout(mlp_setup32,
                                                                                tmp_path):
    path = tmp_path / "g.zarr"
    group = zarr.open_group(path, mode="w")
    group.create_array("mine", shape=(3,), dtype="float32")[:] = 1.0
    with pytest.raises(tif.errors.StoreExistsError, match=r"not a tracinfunc store.*'mine'"):
        _part(mlp_setup32, path, 0)
    assert zarr.open_group(path, mode="r")["mine"][:].tolist() == [1.0, 1.0, 1.0]
