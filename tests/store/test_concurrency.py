"""Concurrent writers and readers of one store path (issue 16, "What to prove" 1)."""

from __future__ import annotations

import functools
import multiprocessing
import threading
import time
from pathlib import Path

import pytest
import torch

import tracinfunc as tif


def build_waiting(path: Path, ready: Path, go: Path) -> None:
    """A build (in a forked process) whose data waits, after its first shard, for ``go``."""

    def batches():
        for i, batch in enumerate(data(seed=1)):
            yield batch
            if i == 1:  # the first shard (8 rows) is on disk
                ready.touch()
                while not go.exists():
                    time.sleep(0.02)

    writer = functools.partial(tif.store.ZarrWriter, path, chunk_rows=4, shard_rows=8)
    tif.build_store(loss, checkpoints(), batches(), projection=tif.Projection(dim=8),
                    store=writer, progress=False)


def loss(params, batch):
    x, y = batch
    return ((x @ params["w"].T).squeeze(-1) - y) ** 2


def checkpoints():
    generator = torch.Generator().manual_seed(0)
    return [tif.Checkpoint({"w": torch.randn(1, 5, generator=generator)}, lr=0.1 * (i + 1),
                           name=f"c{i}") for i in range(2)]


def data(seed: int, n: int = 24, b: int = 4):
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 5, generator=generator), torch.randn(n, generator=generator)
    return [(x[i : i + b], y[i : i + b]) for i in range(0, n, b)]


def wait_for(path: Path, process) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert process.is_alive(), process.exitcode
        assert time.monotonic() < deadline, "the writer never got ready"
        time.sleep(0.02)


def test_one_writer_wins_readers_see_incomplete_and_many_readers_agree(tmp_path):
    path, ready, go = tmp_path / "g.zarr", tmp_path / "ready", tmp_path / "go"
    # fork: the child has torch imported already (a fresh interpreter costs seconds)
    writer = multiprocessing.get_context("fork").Process(target=build_waiting,
                                                         args=(path, ready, go))
    writer.start()
    try:
        wait_for(ready, writer)
        # A second builder, with other data, is refused while the first one writes.
        with pytest.raises(tif.errors.StoreLockedError, match=f"process {writer.pid}.*g.zarr"):
            tif.build_store(loss, checkpoints(), data(seed=2), projection=tif.Projection(dim=8),
                            store=path, progress=False)
        # A reader sees an incomplete store, never partial rows.
        with pytest.raises(tif.errors.IncompleteStoreError):
            tif.open_store(path)
    finally:
        go.touch()
        writer.join(timeout=120)
    assert writer.exitcode == 0
    expected = tif.build_store(loss, checkpoints(), data(seed=1), projection=tif.Projection(dim=8))
    store = tif.open_store(path)
    rows = torch.stack([store.read_rows(c, 0, 24) for c in range(2)])
    assert torch.equal(rows, torch.stack([expected.read_rows(c, 0, 24) for c in range(2)]))
    assert not (tmp_path / ".g.zarr.lock").exists()  # released when it finished

    reference = tif.self_influence(expected)
    results: list[torch.Tensor] = []

    def read() -> None:
        results.append(tif.self_influence(tif.open_store(path)))

    threads = [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(torch.equal(r, reference) for r in results)


def test_a_build_that_raised_does_not_lock_out_its_own_process(tmp_path):
    path = tmp_path / "g.zarr"
    batches = data(seed=1)

    def failing():
        yield from batches[:3]
        raise RuntimeError("data loader died")

    writer = tif.store.ZarrWriter  # default shard size: nothing committed before the failure
    with pytest.raises(RuntimeError, match="loader died") as caught:
        tif.build_store(loss, checkpoints(), failing(), projection=tif.Projection(dim=8),
                        store=path, progress=False)
    # The traceback (still held here) keeps the failed writer alive; a resume takes over.
    assert caught.value is not None and writer is tif.store.ZarrWriter
    store = tif.build_store(loss, checkpoints(), batches, projection=tif.Projection(dim=8),
                            store=path, progress=False)
    assert store.n_train == 24
