"""Queries over a local, uncompressed ZarrStore multiply mapped chunks in place (issue 34);
a file changed, truncated or unmappable underneath never lets wrong bytes into scores."""

from __future__ import annotations

import os

import pytest
import torch

import tracinfunc as tif
from tests.store.test_tamper import memory_store
from tests.store.test_verified_once import flip_first_chunk
from tracinfunc.store.meta import CheckpointMeta, StoreMeta
from tracinfunc.store.zarr import local_maps
from tracinfunc.store.zarr.store import ZarrStore

LAYOUT = {"chunk_rows": 8, "shard_rows": 32}  # 96 rows: three shards of four chunks
# Queries lend stored chunks when they are the pieces multiplied: by default only chunks of
# 256 rows or more (or the whole store), smaller ones are read into pieces of the usual size.
LENT = {"chunk_rows": LAYOUT["chunk_rows"]}


@pytest.fixture
def store(tmp_path):
    source = memory_store(n_ckpt=2)
    tif.save_store(source, tmp_path / "g.zarr", progress=False, **LAYOUT)
    opened = tif.GradientStore.open(tmp_path / "g.zarr")
    assert opened.mapped_chunk_rows == 8
    return source, opened, tmp_path / "g.zarr" / "rows" / "0" / "c" / "0" / "0"


def reference(source, test):
    """sum_c lr_c <train_c, test_c> in float64, explicit matrices."""
    rows = source.view_rows  # [n_ckpt, n_train, k] as views
    lrs = [c.lr for c in source.meta.checkpoints]
    return sum(lr * test[c].double() @ rows(c, 0, source.n_train).double().T
               for c, lr in enumerate(lrs))


def lent(monkeypatch) -> list[tuple[int, int, int]]:
    """The pieces lent (by ``map_rows`` or a query's ``lend_rows``)."""
    calls: list[tuple[int, int, int]] = []
    real = ZarrStore._lend

    def spy(self, view, method, ckpt, start, stop):
        got = real(self, view, method, ckpt, start, stop)
        if got is not None:
            calls.append((ckpt, start, stop))
        return got

    monkeypatch.setattr(ZarrStore, "_lend", spy)
    return calls


def test_score_and_top_k_multiply_mapped_chunks_exactly(store, monkeypatch):
    source, opened, _ = store
    calls = lent(monkeypatch)
    test = torch.randn(2, 3, source.meta.k, generator=torch.Generator().manual_seed(1))
    expected = reference(source, test)
    for _ in range(2):  # first pass verifies the crc32c, the second trusts it
        torch.testing.assert_close(tif.score(opened, test, **LENT).double(), expected,
                                   rtol=1e-5, atol=1e-5)
    values, indices = tif.top_k(opened, test, k=5, **LENT)
    torch.testing.assert_close(indices, expected.argsort(dim=1, descending=True)[:, :5])
    torch.testing.assert_close(values.double(), expected.gather(1, indices), rtol=1e-5,
                               atol=1e-5)
    assert len(calls) == 3 * 2 * 12  # every chunk of both checkpoints, lent, each pass


def test_a_chunk_changed_after_it_was_verified_is_verified_again(store):
    source, opened, shard = store
    test = torch.randn(2, 3, source.meta.k)
    tif.score(opened, test, **LENT)  # mapped and verified
    flip_first_chunk(shard)  # same size and mtime; ctime moves: mapped again, verified
    with pytest.raises(tif.errors.CorruptStoreError, match="checksum mismatch|not the file sealed"):
        tif.score(opened, test, **LENT)


def test_a_file_changed_while_its_chunk_is_multiplied_is_refused(store, monkeypatch):
    source, opened, shard = store
    test = torch.randn(2, 3, source.meta.k)
    tif.score(opened, test, **LENT)
    real = local_maps.ChunkLender.view  # what a query lends through
    changed = []

    def view_then_change(self, start, stop):
        got = real(self, start, stop)
        if start == 0 and not changed:  # lent (verified), then written to in place
            flip_first_chunk(shard)
            changed.append(True)
        return got

    monkeypatch.setattr(local_maps.ChunkLender, "view", view_then_change)
    with pytest.raises(tif.errors.CorruptStoreError, match="changed while the chunk"):
        tif.score(opened, test, **LENT)
    # The next query maps the changed file again and verifies it: the flipped byte shows.
    with pytest.raises(tif.errors.CorruptStoreError, match="checksum mismatch|not the file sealed"):
        tif.top_k(opened, test, k=3, **LENT)


def test_a_truncated_shard_is_refused(store):
    source, opened, shard = store
    test = torch.randn(2, 3, source.meta.k)
    tif.score(opened, test, **LENT)
    with open(shard, "r+b") as handle:
        handle.truncate(os.stat(shard).st_size - 100)
    with pytest.raises(tif.errors.CorruptStoreError):
        tif.score(opened, test, **LENT)


def test_a_shard_cut_before_its_index_is_refused(store):
    """The rows of the last chunks cut out, the index (with a valid crc) put back at the end:
    the index points past the end of the file."""
    source, opened, shard = store
    test = torch.randn(2, 3, source.meta.k)
    tif.score(opened, test, **LENT)
    data = shard.read_bytes()
    index = data[-(4 * 16 + 4):]
    shard.write_bytes(data[: len(data) // 2] + index)
    with pytest.raises(tif.errors.CorruptStoreError, match="truncated|missing"):
        tif.score(opened, test, **LENT)


def test_a_file_system_without_mmap_reads_instead(store, monkeypatch):
    source, opened, _ = store

    def no_mmap(*args, **kwargs):
        raise OSError(19, "No such device")  # ENODEV: what mmap gives where it cannot map

    monkeypatch.setattr(local_maps.mmap, "mmap", no_mmap)
    calls = lent(monkeypatch)
    test = torch.randn(2, 3, source.meta.k)
    torch.testing.assert_close(tif.score(opened, test, **LENT).double(), reference(source, test),
                               rtol=1e-5, atol=1e-5)
    assert calls == []  # read, not lent


def test_pages_used_are_let_go(store):
    """Each lend is its own mapping, unmapped once its view is dropped: after a query no page
    of a shard file stays mapped (the page cache keeps them), and a write into one lend
    reaches neither the file nor the next lend."""
    source, opened, shard = store
    tif.score(opened, torch.randn(2, 3, source.meta.k), **LENT)
    with open("/proc/self/maps") as handle:
        assert not [line for line in handle if str(shard.resolve()) in line]
    view, release = opened.map_rows(0, 0, 8)
    first = view.clone()
    view.add_(1.0)
    release()
    again, release = opened.map_rows(0, 0, 8)
    release()
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_chunks_past_the_first_2_mib_of_a_shard_are_lent_exactly(tmp_path):
    """Lends map 2 MiB-aligned spans of the file around their chunk: chunks at every offset
    (across 2 MiB boundaries, the shard's last one ending short of one) read exactly."""
    rows = torch.randn(1, 1200, 1024, generator=torch.Generator().manual_seed(0))
    meta = StoreMeta(projection=tif.Projection(dim=1024, seed=3),
                     checkpoints=(CheckpointMeta("c0", 0.1, "f0"),),
                     layout=(("w", (1024,)),), n_train=1200, k=1024)
    source = tif.store.MemoryStore(meta, rows, rows.norm(dim=-1))
    tif.save_store(source, tmp_path / "big.zarr", progress=False, chunk_rows=96,
                   shard_rows=960)  # 3.75 MiB + 960 KiB: 2 MiB crossed, a short last shard
    opened = tif.GradientStore.open(tmp_path / "big.zarr")
    assert opened.mapped_chunk_rows == 96
    for start in range(0, 1200, 96):
        stop = min(start + 96, 1200)
        view, release = opened.map_rows(0, start, stop)
        assert torch.equal(view, source.view_rows(0, start, stop))
        release()
    test = torch.randn(1, 3, 1024, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(tif.score(opened, test, chunk_rows=96).double(),
                               reference(source, test), rtol=1e-5, atol=1e-4)


def test_a_warm_pass_asks_for_no_read_ahead(store, monkeypatch):
    """Read-ahead (``POSIX_FADV_WILLNEED``) is asked for only where a probe finds bytes not
    cached: a pass over a store just written and read asks for none."""
    source, opened, shard = store
    probe = os.open(shard, os.O_RDONLY)
    try:
        os.preadv(probe, [bytearray(1)], 0, getattr(os, "RWF_NOWAIT", -1))
    except (OSError, ValueError, AttributeError):
        pytest.skip("this file system has no reads that fail rather than wait")
    finally:
        os.close(probe)
    test = torch.randn(2, 3, source.meta.k)
    tif.score(opened, test, **LENT)  # every page read once: cached
    opened = tif.GradientStore.open(shard.parents[4])  # a new pass from the first byte
    asked: list[int] = []
    real = os.posix_fadvise
    monkeypatch.setattr(local_maps.os, "posix_fadvise",
                        lambda fd, offset, length, advice: asked.append(advice)
                        or real(fd, offset, length, advice))
    tif.score(opened, test, **LENT)
    assert os.POSIX_FADV_WILLNEED not in asked


def test_only_chunks_of_a_usual_piece_are_lent_by_default(tmp_path, monkeypatch):
    """Chunks of 256 rows or more are the pieces a default query multiplies, lent in place;
    smaller ones are read into pieces of the usual size, so the scores are those of the
    memory copy, bit for bit (not one small matmul per chunk)."""
    rows = torch.randn(1, 600, 8, generator=torch.Generator().manual_seed(0))
    meta = StoreMeta(projection=tif.Projection(dim=8, seed=3),
                     checkpoints=(CheckpointMeta("c0", 0.1, "f0"),),
                     layout=(("w", (8,)),), n_train=600, k=8)
    source = tif.store.MemoryStore(meta, rows, rows.norm(dim=-1))
    test = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(2))
    calls = lent(monkeypatch)
    for chunk_rows, lends in ((256, 3), (8, 0)):
        opened = tif.save_store(source, tmp_path / f"{chunk_rows}.zarr", progress=False,
                                chunk_rows=chunk_rows, shard_rows=4 * chunk_rows)
        calls.clear()
        blocks = [block.shape[1] for _, block in tif.score_chunks(opened, test)]
        assert len(calls) == lends and min(blocks[:-1] or blocks) >= 256
        assert torch.equal(tif.score(opened, test), tif.score(source, test))


def test_a_read_error_names_its_caller_and_its_fix_once(store):
    """A damaged chunk under ``score``: the message starts with ``score:``, names no inner
    method and gives the fix once (it nested ``ZarrStore.map_rows: ... score: ...``)."""
    source, opened, shard = store
    flip_first_chunk(shard)
    with pytest.raises(tif.errors.CorruptStoreError) as info:
        tif.score(opened, torch.randn(2, 3, source.meta.k), **LENT)
    message = str(info.value)
    assert message.startswith("score: checkpoint ") and "ZarrStore" not in message
    assert message.lower().count("rebuild") == 1 and message.count("score:") == 1
