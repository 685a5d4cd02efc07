"""Every path-taking function takes URLs as build_store does, and nothing replaces or deletes a
store that a writer holds (issue 24 item 1, issue 25 item 2)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tracinfunc as tif
from tests.store.test_tamper import LAYOUTS, memory_store


@contextlib.contextmanager
def held_by_another_process(path: Path):
    """The one-writer lock on ``path``, held by a child process until the block ends."""
    code = ("import sys; from pathlib import Path\n"
            "from tracinfunc.store.zarr.lock import WriterLock\n"
            f"lock = WriterLock(Path({str(path)!r})); print('locked', flush=True)\n"
            "sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"  # waits for the child, no timing
        yield
    finally:
        child.stdin.close()
        child.wait()


def rows_of(store) -> torch.Tensor:
    return torch.stack([store.read_rows(c, 0, store.n_train) for c in range(store.n_ckpt)])


def test_save_store_to_a_url_writes_there_and_not_to_a_local_folder(tmp_path, monkeypatch):
    """Before: save_store(store, "memory://...") wrote a local folder ./memory:/... and
    returned a store as if it had worked."""
    monkeypatch.chdir(tmp_path)
    source = memory_store()
    url = f"memory://tracinfunc-test-{os.getpid()}/saved.zarr"
    saved = tif.save_store(source, url, progress=False, **LAYOUTS["raw-sharded"])
    assert list(tmp_path.iterdir()) == []  # nothing local
    assert str(saved.path) == url
    assert torch.equal(rows_of(tif.open_store(url)), rows_of(source))
    with pytest.raises(tif.errors.StoreExistsError):
        tif.save_store(source, url, progress=False)
    tif.remove_store(url)


def test_save_store_overwrite_of_a_url_is_refused_with_the_fix(tmp_path):
    source = memory_store()
    url = f"memory://tracinfunc-test-{os.getpid()}/over.zarr"
    tif.save_store(source, url, progress=False)
    with pytest.raises(tif.errors.InvalidArgumentError, match="overwrite=True.*URL.*remove_store"):
        tif.save_store(memory_store(seed=1), url, overwrite=True, progress=False)
    assert torch.equal(rows_of(tif.open_store(url)), rows_of(source))  # untouched
    tif.remove_store(url)


def test_save_store_overwrite_waits_for_no_writer_it_refuses(tmp_path):
    """Before: save_store(other, P, overwrite=True) swapped P under a build writing there."""
    path = tmp_path / "g.zarr"
    original = tif.save_store(memory_store(), path, progress=False)
    with held_by_another_process(path), pytest.raises(tif.errors.StoreLockedError):
        tif.save_store(memory_store(seed=1), path, overwrite=True, progress=False)
    assert torch.equal(rows_of(tif.open_store(path)), rows_of(original))
    again = tif.save_store(memory_store(seed=1), path, overwrite=True, progress=False)
    assert torch.equal(rows_of(again), rows_of(memory_store(seed=1)))


def test_remove_store_refuses_a_store_being_written(tmp_path):
    """Before: `tracinfunc build --overwrite` deleted the store of a build in progress."""
    path = tmp_path / "g.zarr"
    tif.save_store(memory_store(), path, progress=False)
    with held_by_another_process(path):
        with pytest.raises(tif.errors.StoreLockedError):
            tif.remove_store(path)
        assert path.exists()
    tif.remove_store(path)
    assert not path.exists()


def test_a_store_opened_before_an_overwrite_refuses_to_read_the_new_files(tmp_path):
    """Before (issue 25 item 7): the old object read the new files under its old metadata and
    cached checks, and scores moved with no error."""
    path = tmp_path / "g.zarr"
    tif.save_store(memory_store(), path, progress=False)
    old = tif.open_store(path)
    old.read_rows(0, 0, 4)  # checks cached, shard index read
    tif.save_store(memory_store(seed=1), path, overwrite=True, progress=False)
    with pytest.raises(tif.errors.CorruptStoreError, match="replaced.*open_store"):
        old.read_rows(0, 0, old.n_train)
    with pytest.raises(tif.errors.CorruptStoreError, match="replaced"):
        old.read_norms(1, 0, old.n_train)
    with pytest.raises(tif.errors.CorruptStoreError, match="replaced"):
        tif.score(old, old)
    fresh = tif.open_store(path)
    assert torch.equal(rows_of(fresh), rows_of(memory_store(seed=1)))
