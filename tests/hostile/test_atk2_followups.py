"""Follow-ups to the atk2 outside pass: the chosen behaviours, pinned (fixC)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import tracinfunc as tif
from tests.conftest import child_env
from tracinfunc.errors import IncompatibleGradientsError, StoreExistsError, StoreLockedError

from ._atk2 import data, model_ckpts


def _store(path):
    _m, loss, ck = model_ckpts()
    X, Y = data()
    return tif.build_store(loss, ck, (X, Y), projection=tif.Projection(dim=16, seed=0),
                           store=str(path))


def test_remove_store_through_a_symlink_removes_the_store_and_the_link(tmp_path):
    _store(tmp_path / "s.zarr")
    os.symlink(tmp_path / "s.zarr", tmp_path / "lnk")
    tif.remove_store(str(tmp_path / "lnk"))
    assert os.listdir(tmp_path) == []  # no store, no dangling link, no lock file


REPO = Path(__file__).resolve().parents[2]
_HOLD = (
    "import sys, pathlib\n"
    "from tracinfunc.store.zarr.lock import WriterLock\n"
    "lock = WriterLock(pathlib.Path(sys.argv[1]))\n"
    "pathlib.Path(sys.argv[2]).write_text('1')\n"
    "sys.stdin.readline()\n"
    "lock.release()\n"
)


def test_save_curvature_while_another_process_holds_the_lock_is_refused(tmp_path):
    _m, loss, ck = model_ckpts()
    X, Y = data()
    c = tif.fit_curvature(loss, ck, (X, Y), projection=tif.Projection(dim=16, seed=0))
    tif.save_curvature(c, tmp_path / "c.zarr")
    before = (tmp_path / "c.zarr" / "zarr.json").read_bytes()
    # A second process holding the path's writer lock, as a save in progress does.
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path / "c.zarr"), str(tmp_path / "held")],
        stdin=subprocess.PIPE, env=child_env())
    try:
        while not (tmp_path / "held").exists() and holder.poll() is None:
            time.sleep(0.01)
        with pytest.raises(StoreLockedError, match="save_curvature"):
            tif.save_curvature(c, tmp_path / "c.zarr", overwrite=True)
    finally:
        holder.communicate(b"\n", timeout=60)
    assert (tmp_path / "c.zarr" / "zarr.json").read_bytes() == before
    tif.load_curvature(tmp_path / "c.zarr")
    again = tif.save_curvature(c, tmp_path / "c.zarr", overwrite=True)  # lock given back
    assert tif.load_curvature(again).digest == c.digest
    assert sorted(os.listdir(tmp_path)) == ["c.zarr", "held"]  # no scratch, no lock file


def test_a_store_is_never_written_over_a_plain_file_even_with_overwrite(tmp_path):
    (tmp_path / "f").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(StoreExistsError, match="is a file"):
            _store_over(tmp_path / "f", overwrite)
    assert sorted(os.listdir(tmp_path)) == ["f"] and (tmp_path / "f").read_text() == "mine"


def _store_over(path, overwrite):
    m = tif.to_memory(_store(path.parent / "src.zarr"))
    tif.remove_store(path.parent / "src.zarr")
    tif.save_store(m, path, overwrite=overwrite)


def test_topexamples_json_writes_infinite_scores_as_null(tmp_path):
    t = tif.select.TopExamples(torch.tensor([[float("inf"), 2.0, float("-inf")]]),
                               torch.tensor([[1, 2, 3]]), [f"ex{j}" for j in range(10)])
    t.save(tmp_path / "t.json")
    t.save(tmp_path / "t.csv")
    assert [r["score"] for r in json.loads((tmp_path / "t.json").read_text())] == [None, 2.0,
                                                                                   None]
    assert "inf" in (tmp_path / "t.csv").read_text()


pytest.importorskip("faiss")


def test_the_candidate_check_allows_rounding_and_names_a_replaced_candidate():
    _m, loss, ck = model_ckpts()
    X, Y = data(n=300)
    s = tif.to_memory(tif.build_store(loss, ck, (X, Y), projection=tif.Projection(dim=16, seed=0)))
    t = tif.build_store(loss, ck, (X[:4] + 0.1, Y[:4]), projection=s.projection)
    rows = torch.stack([s.read_rows(c, 0, 300) for c in range(2)])
    norms = torch.stack([s.read_norms(c, 0, 300) for c in range(2)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idx = tif.build_index(s, nlist=4)
    # rounding (1e-6 relative): the same rows, accepted by load and by every query
    noisy = rows * (1 + 1e-6 * torch.randn(rows.shape, generator=torch.Generator().manual_seed(0)))
    near = tif.store.MemoryStore(s.meta, noisy, norms)
    assert torch.equal(tif.indexed_top_k(near, t, 5, index=idx, n_candidates=300)[1],
                       tif.top_k(s, t, 5)[1])
    # the best candidate of test 0, replaced at equal norm: named by the query that reads it
    best = int(tif.top_k(s, t, 1)[1][0, 0])
    swapped = rows.clone()
    swapped[:, best] = swapped[:, best].flip(-1)
    other = tif.store.MemoryStore(s.meta, swapped, norms)
    with pytest.raises(IncompatibleGradientsError, match=f"candidate rows \\[.*{best}"):
        tif.indexed_top_k(other, t, 5, index=idx, n_candidates=300, normalize=False)
