"""Local raw reads verify a chunk's crc32c once per shard-file identity (issue 34), and a file
changed underneath a store that already verified it is verified again and caught."""

from __future__ import annotations

import os

import pytest
import torch

import tracinfunc as tif
from tests.store.test_tamper import memory_store
from tracinfunc.store.zarr import raw_layout

LAYOUT = {"chunk_rows": 8, "shard_rows": 32}


@pytest.fixture
def store(tmp_path):
    source = memory_store(n_ckpt=1)
    tif.save_store(source, tmp_path / "g.zarr", progress=False, **LAYOUT)
    opened = tif.GradientStore.open(tmp_path / "g.zarr")
    assert opened.raw_reads
    return source, opened, tmp_path / "g.zarr" / "rows" / "0" / "c" / "0" / "0"


def counted_verifies(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = raw_layout.RawLayout.verify

    def verify(self, data, stored_crc, chunk_start, where):
        calls.append(chunk_start)
        return real(self, data, stored_crc, chunk_start, where)

    monkeypatch.setattr(raw_layout.RawLayout, "verify", verify)
    return calls


def test_a_chunk_is_verified_on_its_first_read_only(store, monkeypatch):
    source, opened, _ = store
    calls = counted_verifies(monkeypatch)
    first = opened.read_rows(0, 0, 32)
    assert sorted(calls) == [0, 8, 16, 24]
    again = opened.read_rows(0, 0, 32)
    assert sorted(calls) == [0, 8, 16, 24]  # not again: the file did not change
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(first, source.read_rows(0, 0, 32), rtol=0, atol=0)


def flip_first_chunk(shard) -> None:
    """One flipped byte in the first chunk's rows, the modification time put back."""
    before = os.stat(shard)
    with open(shard, "r+b") as handle:
        value = handle.read(1)
        handle.seek(0)
        handle.write(bytes([value[0] ^ 0xFF]))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(shard).st_size == before.st_size


def test_a_chunk_flipped_after_it_was_verified_is_caught(store):
    _, opened, shard = store
    opened.read_rows(0, 0, 32)  # verified
    flip_first_chunk(shard)  # same size and mtime; the status-change time moves
    with pytest.raises(tif.errors.CorruptStoreError, match="checksum mismatch|not the file sealed"):
        opened.read_rows(0, 0, 8)


def test_a_shard_truncated_after_it_was_verified_is_caught(store):
    _, opened, shard = store
    opened.read_rows(0, 0, 32)
    size = os.stat(shard).st_size
    with open(shard, "r+b") as handle:
        handle.truncate(size - 100)
    with pytest.raises(tif.errors.CorruptStoreError):
        opened.read_rows(0, 0, 32)


def test_a_file_changed_during_a_read_is_verified(store, monkeypatch):
    """The file changes between the identity check and the data read: the chunks read are
    verified although they were verified before."""
    _, opened, shard = store
    opened.read_rows(0, 0, 32)
    from tracinfunc.store.zarr import local_reads

    real = local_reads._preadv

    def preadv_after_an_edit(fd, buffers, offset, path, chunk_start):
        flip_first_chunk(shard)
        monkeypatch.setattr(local_reads, "_preadv", real)
        return real(fd, buffers, offset, path, chunk_start)

    monkeypatch.setattr(local_reads, "_preadv", preadv_after_an_edit)
    with pytest.raises(tif.errors.CorruptStoreError, match="checksum mismatch"):
        opened.read_rows(0, 0, 32)
