"""A query lends a local store's chunks through one pass (``ZarrStore.lend_rows``, issue 34):
each shard file is mapped in windows shared by the chunks they hold and kept open until the
pass ends. Against :meth:`ZarrStore.map_rows` (one mapping per chunk) nothing may change but
the number of mappings: the bytes lent, each lend's privacy, the checks before and after
each chunk, and what is left open after the pass."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import tracinfunc as tif
from tests.conftest import child_env
from tests.store.test_raw_value_reads import flip
from tests.store.test_tamper import N_TRAIN, memory_store
from tracinfunc.errors import CorruptStoreError, InvalidTypeError, RowRangeError
from tracinfunc.store.meta import CheckpointMeta, StoreMeta
from tracinfunc.store.zarr import local_maps

LAYOUT = {"chunk_rows": 8, "shard_rows": 32}  # 96 rows: three shards of four chunks
PIECES = [(c, start, start + 8) for start in range(0, N_TRAIN, 8) for c in range(2)]


@pytest.fixture
def saved(tmp_path):
    source = memory_store(n_ckpt=2)
    path = tmp_path / "g.zarr"
    tif.save_store(source, path, progress=False, **LAYOUT)
    return source, path


def shard_file(path, ckpt: int, shard: int):
    return path / "rows" / str(ckpt) / "c" / str(shard) / "0"


def mappings(monkeypatch) -> list[int]:
    """Lengths of the mappings local_maps makes."""
    made: list[int] = []
    real = local_maps.mmap.mmap

    def spy(fd, length, *args, **kwargs):
        made.append(length)
        return real(fd, length, *args, **kwargs)

    monkeypatch.setattr(local_maps.mmap, "mmap", spy)
    return made


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_pass_lends_every_chunk_exactly_through_one_mapping_per_window(saved, monkeypatch):
    source, path = saved
    store = tif.GradientStore.open(path)
    made = mappings(monkeypatch)
    for (ckpt, start, stop), lent in zip(PIECES, store.lend_rows(PIECES), strict=True):
        rows, release = lent
        assert torch.equal(rows, source.read_rows(ckpt, start, stop))
        release()
    assert len(made) == 3 * 2  # one window per shard file (each smaller than a window)
    made.clear()
    for start in range(0, N_TRAIN, 8):
        store.map_rows(0, start, start + 8)[1]()
    assert len(made) == N_TRAIN // 8  # map_rows: one mapping per lend, as before


def test_scores_through_a_pass_equal_the_memory_stores_bit_for_bit(saved):
    source, path = saved
    store = tif.GradientStore.open(path)
    test = torch.randn(2, 5, source.meta.k, generator=torch.Generator().manual_seed(1))
    for normalize in (False, True):
        assert torch.equal(tif.score(store, test, chunk_rows=8, normalize=normalize),
                           tif.score(source, test, chunk_rows=8, normalize=normalize))
    values, indices = tif.top_k(store, test, k=7, chunk_rows=8)
    want = tif.top_k(source, test, k=7, chunk_rows=8)
    assert torch.equal(values, want[0]) and torch.equal(indices, want[1])


def test_a_write_into_a_lend_reaches_no_other_lend_nor_the_file(saved):
    source, path = saved
    store = tif.GradientStore.open(path)
    before = shard_file(path, 0, 0).read_bytes()
    lends = list(store.lend_rows([(0, 0, 8), (0, 8, 16), (0, 0, 8), (1, 0, 8)]))
    (a, _), (b, _), (a_again, _), (other, _) = lends
    a.fill_(1e9)  # the window's private copy of chunk 0 only
    assert torch.equal(b, source.read_rows(0, 8, 16))
    assert torch.equal(a_again, source.read_rows(0, 0, 8))  # lent again: its own mapping
    assert torch.equal(other, source.read_rows(1, 0, 8))
    for _, release in lends:
        release()
    assert shard_file(path, 0, 0).read_bytes() == before
    assert torch.equal(store.read_rows(0, 0, 8), source.read_rows(0, 0, 8))


def test_a_chunk_changed_after_its_window_was_mapped_is_not_lent_from_it(saved):
    """Chunk 1 flipped on disk after the pass mapped its window (with chunk 0) and verified
    nothing of it yet: the lend sees the file's new identity, checks it as at a fresh open
    and refuses it, instead of lending the window's bytes."""
    _, path = saved
    store = tif.GradientStore.open(path)
    pieces = store.lend_rows([(0, 0, 8), (0, 8, 16)])
    _, release = next(pieces)
    release()
    flip(shard_file(path, 0, 0), 8 * 8 * 4 + 4 + 3)  # a byte of chunk 1's rows
    with pytest.raises(CorruptStoreError, match="checksum mismatch|not the file sealed"):
        next(pieces)


def test_a_shard_copied_over_by_its_own_bytes_is_lent_again_exactly(saved):
    """Same bytes, a new identity (a restore from a copy): reopened, checked, lent exactly."""
    source, path = saved
    store = tif.GradientStore.open(path)
    pieces = store.lend_rows([(0, 0, 8), (0, 8, 16), (0, 16, 24)])
    next(pieces)[1]()
    shard = shard_file(path, 0, 0)
    shutil.copyfile(shard, path / "copy")
    os.replace(path / "copy", shard)  # a new inode at the path
    for start in (8, 16):
        rows, release = next(pieces)
        assert torch.equal(rows, source.read_rows(0, start, start + 8))
        release()


def test_closing_a_pass_closes_its_files_and_drops_its_windows(saved):
    _, path = saved
    store = tif.GradientStore.open(path)
    store.read_rows(0, 0, 1)  # whatever opening costs, before counting
    before = open_fds()
    pieces = store.lend_rows(PIECES)
    lent = [next(pieces) for _ in range(6)]  # chunks 0-2 of shard 0, both checkpoints
    # Its file per checkpoint, and each window's mapping (Python's mmap keeps a duplicate).
    assert len(open_fds() - before) == 2 + 2
    pieces.close()
    assert len(open_fds() - before) == 2  # the windows, held by the views lent
    del lent
    assert open_fds() == before
    shard = str(shard_file(path, 0, 0).resolve())
    with open("/proc/self/maps") as handle:
        assert not [line for line in handle if shard in line]


@pytest.mark.parametrize(("piece", "error"), [
    ((0, -8, 0), RowRangeError),
    ((0, 96, 104), RowRangeError),
    ((2, 0, 8), RowRangeError),
    ((0, 0.0, 8), InvalidTypeError),
    ((0, 0, 8.0), InvalidTypeError),
    ((True, 0, 8), InvalidTypeError),
])
def test_bad_pieces_are_refused_as_read_rows_does(saved, piece, error):
    _, path = saved
    store = tif.GradientStore.open(path)
    with pytest.raises(error):
        store.read_rows(*piece)
    before = open_fds()
    pieces = store.lend_rows([(0, 0, 8), piece])
    next(pieces)
    with pytest.raises(error):
        next(pieces)
    assert open_fds() == before  # the generator ended: its files closed


def test_pieces_that_are_not_one_stored_chunk_are_not_lent(saved):
    _, path = saved
    store = tif.GradientStore.open(path)
    assert list(store.lend_rows([(0, 4, 12), (0, 8, 24), (0, 8, 8)])) == [None, None, None]


def test_windows_smaller_than_a_shard_lend_every_chunk_exactly(tmp_path):
    """Windows of 1 MiB (widened to whole 2 MiB spans holding a chunk) over 3.75 MiB shards of
    384 KiB chunks: chunks across 2 MiB boundaries and windows read exactly."""
    rows = torch.randn(1, 1200, 1024, generator=torch.Generator().manual_seed(0))
    meta = StoreMeta(projection=tif.Projection(dim=1024, seed=3),
                     checkpoints=(CheckpointMeta("c0", 0.1, "f0"),),
                     layout=(("w", (1024,)),), n_train=1200, k=1024)
    source = tif.store.MemoryStore(meta, rows, rows.norm(dim=-1))
    tif.save_store(source, tmp_path / "big.zarr", progress=False, chunk_rows=96,
                   shard_rows=960)
    store = tif.GradientStore.open(tmp_path / "big.zarr")
    lender = store._maps[0].lender(window_bytes=2**20)
    try:
        for start in range(0, 1200, 96):
            stop = min(start + 96, 1200)
            data, release = lender.view(start, stop)
            assert torch.equal(torch.frombuffer(data, dtype=torch.float32).view(-1, 1024),
                               source.view_rows(0, start, stop))
            release()
    finally:
        lender.close()


def test_a_shard_truncated_under_a_mapped_window_is_refused_not_a_sigbus(tmp_path):
    """The pass mapped the shard's window with its first chunk; the file is then cut inside
    that window: the next lend refuses it (its identity changed) and the process survives
    (run in a child, since a SIGBUS would end it)."""
    path = tmp_path / "g.zarr"
    rows = torch.randn(1, 3000, 300, generator=torch.Generator().manual_seed(0))
    meta = StoreMeta(projection=tif.Projection(dim=300, seed=3),
                     checkpoints=(CheckpointMeta("c0", 0.1, "f0"),),
                     layout=(("w", (300,)),), n_train=3000, k=300)
    tif.save_store(tif.store.MemoryStore(meta, rows, rows.norm(dim=-1)), path,
                   progress=False, chunk_rows=500, shard_rows=3000)
    code = textwrap.dedent(f"""
        import os, torch, tracinfunc as tif
        from tracinfunc.errors import CorruptStoreError
        z = tif.open_store({str(path)!r})
        pieces = z.lend_rows([(0, s, s + 500) for s in range(0, 3000, 500)])
        view, release = next(pieces)
        release()
        os.truncate({str(shard_file(path, 0, 0))!r}, 500 * 300 * 4 + 4 + 4096)
        try:
            next(pieces)
        except CorruptStoreError:
            print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=child_env(), timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
