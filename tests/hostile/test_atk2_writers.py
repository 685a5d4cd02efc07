"""atk2 outside pass, surface 1: writers aimed at other artefacts, two writers at once.

Failing tests (found by the pass) first; tests marked HELD guard attacks that held."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tracinfunc as tif
from tests.conftest import child_env
from tracinfunc.errors import ForeignArtifactError, StoreExistsError

from ._atk2 import data, model_ckpts, tree_hash

REPO = Path(__file__).resolve().parents[2]

_WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from hostile._atk2 import model_ckpts, data
    import tracinfunc as tif
    me, start, path = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    m, loss, ck = model_ckpts(); X, Y = data(seed=1 + me)
    c = tif.fit_curvature(loss, ck, (X, Y), projection=tif.Projection(dim=16, seed=0))
    while time.time() < start:
        time.sleep(0.001)
    try:
        tif.save_curvature(c, path, overwrite=True)
        print("OK")
    except Exception as e:
        print(type(e).__name__, str(e).replace(chr(10), " "))
    """
)


@pytest.mark.slow
def test_two_save_curvature_at_once_are_told_about_each_other(tmp_path):
    """Three processes save a curvature to one new path at once (overwrite=True).

    Expected: each either succeeds or is refused as a concurrent writer (StoreLockedError,
    as save_store does), and the curvature left is loadable. Observed: the loser is told the
    path 'is not a saved curvature (a directory holding files tracinfunc did not write)'
    (ForeignArtifactError), or gets zarr's raw FileExistsError "Cannot create '' with mode 'w-'"."""
    script = tmp_path / "w.py"
    script.write_text(_WRITER.format(tests=str(REPO / "tests")))
    env = child_env()
    bad = []
    for attempt in range(3):
        target = tmp_path / f"c{attempt}.zarr"
        start = time.time() + 8
        procs = [
            subprocess.Popen([sys.executable, str(script), str(me), str(start), str(target)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            for me in range(3)
        ]
        outs = [p.communicate(timeout=120)[0].strip().splitlines()[-1] for p in procs]
        for o in outs:
            if not (o == "OK" or o.startswith("StoreLockedError")):
                bad.append(o[:200])
        tif.load_curvature(target)
        if bad:
            break
    assert not bad, bad


def test_a_refused_build_store_leaves_no_lock_file_behind(tmp_path):
    """build_store(store='top.json') where top.json is a user's file: refused, but a
    '.top.json.lock' file is left in the user's directory (a successful build leaves none)."""
    _m, loss, ck = model_ckpts()
    X, Y = data()
    (tmp_path / "top.json").write_text('{"mine": 1}')
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(StoreExistsError):
        tif.build_store(loss, ck, (X, Y), projection=tif.Projection(dim=16, seed=0),
                        store=str(tmp_path / "top.json"))
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("where", ["home", "cwd", "parent"])
def test_remove_store_refusal_names_the_function(tmp_path, monkeypatch, where):
    """The guard's error 'names the function' (stores.md); remove_store's says 'tracinfunc:'
    and 'no gradient store is ever written over it' although nothing was to be written."""
    _m, loss, ck = model_ckpts()
    X, Y = data()
    tif.build_store(loss, ck, (X, Y), projection=tif.Projection(dim=16, seed=0),
                    store=str(tmp_path / "s.zarr"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    target = {"home": str(tmp_path), "cwd": ".", "parent": str(tmp_path)}[where]
    before = tree_hash(tmp_path)
    with pytest.raises(ForeignArtifactError) as e:
        tif.remove_store(target)
    assert tree_hash(tmp_path) == before
    assert "remove_store" in str(e.value)
    assert "written over" not in str(e.value)


# ---------------------------------------------------------------- HELD (regression guards)


def test_held_topexamples_save_over_a_hard_link_into_a_store_keeps_the_store(tmp_path):
    """HELD: a hard link to s.zarr/zarr.json, saved over with overwrite=True: replaced by
    rename, the store's own zarr.json is untouched."""
    _m, loss, ck = model_ckpts()
    X, Y = data()
    s = tif.build_store(loss, ck, (X, Y), projection=tif.Projection(dim=16, seed=0),
                        store=str(tmp_path / "s.zarr"))
    os.link(tmp_path / "s.zarr" / "zarr.json", tmp_path / "hard.json")
    before = tree_hash(tmp_path / "s.zarr")
    v, i = tif.top_k(s, s, 3)
    tif.select.TopExamples(v, i, [str(j) for j in range(40)]).save(tmp_path / "hard.json",
                                                                    overwrite=True)
    assert tree_hash(tmp_path / "s.zarr") == before
    tif.GradientStore.open(str(tmp_path / "s.zarr"))


def test_held_an_open_reader_is_refused_after_its_store_is_overwritten(tmp_path):
    """HELD: a ZarrStore open while save_store(overwrite=True) swaps in an int8 copy: the old
    handle refuses to read (CorruptStoreError), never reads codes under the old metadata."""
    _m, loss, ck = model_ckpts()
    X, Y = data()
    p = str(tmp_path / "s.zarr")
    s = tif.build_store(loss, ck, (X, Y), projection=tif.Projection(dim=16, seed=0), store=p)
    r = tif.GradientStore.open(p)
    tif.save_store(tif.to_memory(s), p, dtype="int8", overwrite=True)
    with pytest.raises(tif.errors.CorruptStoreError, match="replaced"):
        r.read_rows(0, 0, 4)


def test_remove_store_through_a_symlink_is_the_library_error(tmp_path):
    """stores.md: 'Paths are resolved first, so a symlink counts as where it points'.
    remove_store(link -> s.zarr) raises shutil's raw 'OSError: Cannot call rmtree on a
    symbolic link' (nothing lost). Expected: either the store behind the link is removed as
    documented, or the library's error naming remove_store, the link, its target and the fix."""
    _m, loss, ck = model_ckpts()
    X, Y = data()
    tif.build_store(loss, ck, (X, Y), projection=tif.Projection(dim=16, seed=0),
                    store=str(tmp_path / "s.zarr"))
    os.symlink(tmp_path / "s.zarr", tmp_path / "lnk")
    try:
        tif.remove_store(str(tmp_path / "lnk"))
    except tif.errors.TracInFuncError as e:
        assert "remove_store" in str(e) and "lnk" in str(e)
    else:
        assert not (tmp_path / "s.zarr").exists()
