"""Norms and scales (one value per row) of a local, uncompressed ZarrStore are read from their
shard files directly, as rows are (issue 34: every query reads a checkpoint's norms whole,
and zarr's codec pipeline took ~30 ms for 50,000 of them, a tenth of a warm query).

Values equal what zarr itself decodes, for any range; a damaged or changed file is caught as
on the rows' raw path; compressed stores keep zarr's path."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import zarr

import tracinfunc as tif
from tests.store.test_tamper import N_TRAIN, memory_store
from tests.store.test_verified_once import counted_verifies
from tracinfunc.errors import CorruptStoreError

LAYOUT = {"chunk_rows": 8, "shard_rows": 32}
RANGES = [(0, N_TRAIN), (0, 1), (3, 5), (7, 9), (8, 16), (5, 37), (31, 33),
          (N_TRAIN - 1, N_TRAIN), (10, 10)]


@pytest.fixture
def saved(tmp_path):
    source = memory_store(n_ckpt=2)
    path = tmp_path / "g.zarr"
    tif.save_store(source, path, progress=False, **LAYOUT)
    return source, path


def zarr_values(path, name: str, ckpt: int, start: int, stop: int) -> torch.Tensor:
    return torch.from_numpy(np.asarray(zarr.open_array(path / name / str(ckpt), mode="r")
                                       [start:stop]))


def no_zarr_reads(monkeypatch) -> list:
    """Fail the test if a norms or scales array is read through zarr."""
    calls: list = []
    real = zarr.Array.__getitem__

    def getitem(self, selection):
        if self.path.startswith(("norms", "scales")):
            calls.append(self.path)
        return real(self, selection)

    monkeypatch.setattr(zarr.Array, "__getitem__", getitem)
    return calls


@pytest.mark.parametrize(("start", "stop"), RANGES)
def test_norms_are_read_raw_and_equal_zarrs(saved, monkeypatch, start, stop):
    source, path = saved
    store = tif.GradientStore.open(path)
    calls = no_zarr_reads(monkeypatch)
    for ckpt in range(2):
        got = store.read_norms(ckpt, start, stop)
        monkeypatch.undo()
        want = zarr_values(path, "norms", ckpt, start, stop)
        calls = calls + no_zarr_reads(monkeypatch)
        assert got.dtype == want.dtype == torch.float32 and got.shape == (stop - start,)
        assert torch.equal(got, want)
        assert torch.equal(got, source.read_norms(ckpt, start, stop))
    assert calls == []


@pytest.mark.parametrize("quantization", ["int8", "sign"])
def test_scales_of_a_quantised_store_are_read_raw_and_equal_zarrs(tmp_path, monkeypatch,
                                                                   quantization):
    path = tmp_path / "q.zarr"
    tif.save_store(memory_store(n_ckpt=1), path, dtype=quantization, progress=False, **LAYOUT)
    store = tif.GradientStore.open(path)
    calls = no_zarr_reads(monkeypatch)
    got = [store.read_codes(0, start, stop)[1] for start, stop in RANGES]
    assert calls == []
    monkeypatch.undo()
    for (start, stop), values in zip(RANGES, got, strict=True):
        assert torch.equal(values, zarr_values(path, "scales", 0, start, stop))


def test_a_compressed_store_keeps_zarrs_path(tmp_path):
    path = tmp_path / "z.zarr"
    source = memory_store(n_ckpt=1)
    tif.save_store(source, path, compression="zstd", progress=False, **LAYOUT)
    store = tif.GradientStore.open(path)
    assert torch.equal(store.read_norms(0, 5, 37), source.read_norms(0, 5, 37))


def norms_shard(path, ckpt: int = 0, shard: int = 0):
    return path / "norms" / str(ckpt) / "c" / str(shard)


def flip(file, at: int = 0) -> None:
    """One flipped byte at ``at``, the modification time put back."""
    before = os.stat(file)
    with open(file, "r+b") as handle:
        handle.seek(at)
        value = handle.read(1)
        handle.seek(at)
        handle.write(bytes([value[0] ^ 0xFF]))
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_flipped_norm_is_caught_and_named_as_a_norm(saved):
    _, path = saved
    flip(norms_shard(path))
    store = tif.GradientStore.open(path)
    with pytest.raises(CorruptStoreError, match="the norms of rows"):
        store.read_norms(0, 0, N_TRAIN)
    assert torch.isfinite(store.read_norms(1, 0, N_TRAIN)).all()  # the other checkpoint


def test_a_norm_flipped_after_a_verified_read_is_caught(saved, monkeypatch):
    _, path = saved
    store = tif.GradientStore.open(path)
    store.read_norms(0, 0, N_TRAIN)  # verified
    calls = counted_verifies(monkeypatch)
    store.read_norms(0, 0, N_TRAIN)
    assert calls == []  # verified once while the file keeps its identity
    flip(norms_shard(path))  # (a small file: its sealed tail hash covers it too)
    with pytest.raises(CorruptStoreError, match="the norms of rows"):
        store.read_norms(0, 0, N_TRAIN)


def test_a_truncated_or_missing_norms_file_is_caught(saved):
    _, path = saved
    store = tif.GradientStore.open(path)
    shard = norms_shard(path, shard=1)
    os.truncate(shard, os.stat(shard).st_size // 2)
    with pytest.raises(CorruptStoreError, match="norms"):
        store.read_norms(0, 0, N_TRAIN)
    assert store.read_norms(0, 0, 32).shape == (32,)  # the first shard is intact
    shard.unlink()
    with pytest.raises(CorruptStoreError, match="missing"):
        store.read_norms(0, 32, 33)


def test_scores_and_normalized_scores_equal_the_memory_stores(saved):
    source, path = saved
    store = tif.GradientStore.open(path)
    test = torch.randn(2, 3, source.meta.k, generator=torch.Generator().manual_seed(1))
    for normalize in (False, True):
        assert torch.equal(tif.score(store, test, normalize=normalize, progress=False),
                           tif.score(source, test, normalize=normalize, progress=False))
