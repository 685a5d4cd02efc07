"""Hostile pass on build_store(..., store=...) targets (0.2.0). Tests marked HELD guard
behaviour that held; the others fail now and assert what a demanding user expects."""

from __future__ import annotations

import functools
import os

import pytest
import torch

import tracinfunc as tif
from tracinfunc.errors import TracInFuncError

from ._tiny import build, files, query_grads

# ---------------------------------------------------------------- failures (fail now)


def test_a_file_url_target_is_written_where_it_points(tmp_path, monkeypatch):
    """store='file:///abs/u.zarr' (an fsspec URL). Observed: a directory literally named
    'file:' is created in the working directory, holding tmp/.../u.zarr; the URL's own path is
    never written. Expected: the store at /abs/u.zarr (or a refusal), nothing else created."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    target = tmp_path / "u.zarr"
    try:
        build(store="file://" + str(target))
    except TracInFuncError:
        pass
    else:
        assert (target / "zarr.json").exists()
    assert os.listdir(cwd) == []


def test_a_tilde_target_is_not_a_literal_tilde_directory(tmp_path, monkeypatch):
    """store='~/g.zarr'. Observed: a directory literally named '~' is made in the working
    directory (a later `rm -rf ~` cleans the wrong thing). Expected: expanded to $HOME, or
    refused naming the path."""
    home = tmp_path / "home"
    home.mkdir()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    try:
        build(store="~/g.zarr")
    except TracInFuncError:
        pass
    else:
        assert (home / "g.zarr" / "zarr.json").exists()
    assert not (cwd / "~").exists()


@pytest.mark.parametrize("inside", ["sub.zarr", "norms/x.zarr", "rows/0/y.zarr"])
def test_a_store_is_never_built_inside_another_store(tmp_path, inside):
    """Observed: build_store(store='g.zarr/sub.zarr') writes a whole store inside a finished
    one (which still opens); a later save_store(..., overwrite=True) or remove_store of g.zarr
    then deletes the nested store without a word. Expected: refused, naming the enclosing
    store; nothing written inside it."""
    outer = tmp_path / "g.zarr"
    build(store=str(outer))
    before = files(outer)
    with pytest.raises(TracInFuncError, match="inside|within|g.zarr"):
        build(store=str(outer / inside))
    assert files(outer) == before


@pytest.mark.parametrize("kind", ["memory", "pinned"])
def test_an_in_memory_target_with_shard_writes_nothing_to_disk(tmp_path, monkeypatch, kind):
    """store='memory', shard=(0, 2). Observed: a Zarr part layout is created in a directory
    named 'memory' (or 'pinned') in the working directory, returned as StorePart. Expected:
    refused (a sharded build needs a store on disk), nothing created."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TracInFuncError, match="shard"):
        build(store=kind, shard=(0, 2))
    assert os.listdir(tmp_path) == []


def test_a_user_factory_with_shard_is_refused_clearly(tmp_path):
    """A user factory (lambda) with shard=. Observed: raw TypeError 'ZarrWriter.__init__()
    takes 3 positional arguments but 4 were given' from inside the build. Expected: the
    library's error saying shard= needs a path or a partial of ZarrWriter/PartWriter."""
    with pytest.raises(TracInFuncError, match="shard"):
        build(
            store=lambda *a, **kw: tif.store.ZarrWriter(str(tmp_path / "p.zarr"), *a, **kw),
            shard=(0, 2),
        )


def test_overwrite_through_a_symlink_to_a_store_is_the_librarys_error(tmp_path):
    """ZarrWriter(link, overwrite=True) where link -> a store. Observed: raw OSError 'Cannot
    call rmtree on a symbolic link'. Expected: the store replaced (the link kept), or a clear
    refusal; the old store intact either way."""
    real = tmp_path / "g.zarr"
    build(store=str(real))
    os.symlink(real, tmp_path / "link.zarr")
    before = files(real)
    try:
        build(
            store=functools.partial(
                tif.store.ZarrWriter, str(tmp_path / "link.zarr"), overwrite=True
            ),
            projection=tif.Projection(dim=8, seed=9),
        )
    except TracInFuncError:
        assert files(real) == before
    else:
        assert tif.GradientStore.open(tmp_path / "link.zarr").meta.projection.seed == 9


def test_a_refused_target_leaves_no_file_inside_a_store_or_beside_the_target(tmp_path):
    """build_store(store='g.zarr/zarr.json') is refused (StoreExistsError) but leaves
    '.zarr.json.lock' INSIDE the sealed store; refused foreign/empty directories leave
    '.<name>.lock' beside them (in the user's directory). Expected: a refusal writes nothing."""
    store = tmp_path / "g.zarr"
    build(store=str(store))
    empty = tmp_path / "empty"
    empty.mkdir()
    before = files(store)
    listing = sorted(os.listdir(tmp_path))
    for target in (store / "zarr.json", empty):
        with pytest.raises(tif.errors.StoreExistsError):
            build(store=str(target))
    assert files(store) == before
    assert sorted(os.listdir(tmp_path)) == listing


# ---------------------------------------------------------------- HELD (regression guards)


def test_held_store_targets_round_trip(tmp_path, one_thread):
    # batch_size=10 (the data's own batches): an in-memory build otherwise merges small
    # batches into larger calls, equal to a Zarr build only up to float rounding
    # the same pieces (chunk_rows=) and threads (one_thread) for every store kind: equal
    # bit for bit (docs/concepts/stores.md, "Same pieces, same bits")
    ref = tif.score(build(batch_size=10), query_grads(), chunk_rows=40)
    targets = [
        "memory",
        "pinned",
        tif.store.PinnedStore,
        tif.store.MemoryStore,
        str(tmp_path / "a.zarr"),
        tmp_path / "b.zarr",
        functools.partial(tif.store.ZarrWriter, str(tmp_path / "c.zarr")),
        functools.partial(
            functools.partial(tif.store.ZarrWriter, str(tmp_path / "d.zarr")), compression="zstd"
        ),
        lambda meta, **kw: tif.store.ZarrWriter(str(tmp_path / "e.zarr"), meta, **kw),
    ]
    for target in targets:
        assert torch.equal(tif.score(build(store=target, batch_size=10), query_grads(),
                                     chunk_rows=40), ref)


def test_held_nested_partial_is_split_like_a_path(tmp_path):
    part = build(
        store=functools.partial(functools.partial(tif.store.ZarrWriter, str(tmp_path / "p.zarr"))),
        shard=(0, 2),
    )
    assert isinstance(part, tif.store.StorePart) and (part.start, part.stop) == (0, 20)


def test_held_foreign_targets_are_refused_untouched(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".bashrc").write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    afile = tmp_path / "afile"
    afile.write_text("x")
    store = tmp_path / "g.zarr"
    build(store=str(store))
    snapshot = {p: files(p) for p in (foreign, home, empty, store)}
    for target in (foreign, home, empty, afile, store / "rows"):
        for s in (
            str(target),
            functools.partial(tif.store.ZarrWriter, str(target), overwrite=True),
        ):
            with pytest.raises(tif.errors.StoreExistsError):
                build(store=s)
    assert afile.read_text() == "x"
    assert {p: files(p) for p in snapshot} == snapshot


def test_held_rerun_on_a_finished_store(tmp_path):
    p = str(tmp_path / "f.zarr")
    build(store=p)
    before = files(p)
    assert build(store=p).meta == tif.GradientStore.open(p).meta
    for kw in (
        dict(projection=tif.Projection(dim=8, seed=3)),
        dict(dtype=torch.float16),
        dict(dtype="int8"),
        dict(options=tif.GradientOptions(select=tif.last_layers(1))),
    ):
        with pytest.raises(tif.errors.StoreExistsError):
            build(store=p, **kw)
    assert files(p) == before
