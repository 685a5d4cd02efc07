"""Search indexes never delete what they did not write, and never answer for other data.

Issue 25 items 1 (overwrite deleted stores and user directories; ENOSPC deleted the old
index), 10 (index files unchecked, a rebuilt store searched with a stale index) and 15 (an
index of an S3 store silently not saved), and issue 24's FAISS warnings on small stores.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

import tracinfunc as tif
from tests.search.test_search import _store, _test_grads

faiss = pytest.importorskip("faiss")

LRS = (0.5, 0.2)  # stores on disk hold positive learning rates


def _saved(tmp_path, name="grads.zarr", seed=0, n=300):
    return tif.save_store(_store(n=n, seed=seed, lrs=LRS), tmp_path / name, chunk_rows=16)


def _files(path):
    return {p.relative_to(path).as_posix(): p.read_bytes()
            for p in sorted(path.rglob("*")) if p.is_file()}


# ---- item 1: overwrite replaces only an index, by rename --------------------------------------

def test_overwrite_never_deletes_the_store_itself(tmp_path):
    store = _saved(tmp_path)
    before = _files(store.path)
    with pytest.raises(tif.errors.ForeignArtifactError, match="is the gradient store"):
        tif.build_index(store, path=store.path, overwrite=True, nlist=4)
    assert _files(store.path) == before
    tif.verify_store(tif.open_store(store.path))


def test_an_index_path_inside_a_store_is_refused(tmp_path):
    store = _saved(tmp_path)
    before = _files(store.path)
    with pytest.raises(tif.errors.ForeignArtifactError, match="inside the gradient store"):
        tif.build_index(store, path=store.path / "rows" / "index", nlist=4)
    assert _files(store.path) == before


def test_overwrite_never_deletes_a_directory_that_is_not_an_index(tmp_path):
    store = _saved(tmp_path)
    mine = tmp_path / "results"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    with pytest.raises(tif.errors.StoreExistsError, match="not a search index"):
        tif.build_index(store, path=mine, overwrite=True, nlist=4)
    assert (mine / "thesis.tex").read_text() == "years of work"
    # Another store is not an index either.
    other = _saved(tmp_path, "other.zarr", seed=3)
    with pytest.raises(tif.errors.ForeignArtifactError, match="is the gradient store"):
        tif.build_index(store, path=other.path, overwrite=True, nlist=4)
    tif.verify_store(tif.open_store(other.path))


def test_overwrite_replaces_an_index_and_leaves_nothing_beside_it(tmp_path):
    store = _saved(tmp_path)
    first = tif.build_index(store, nlist=2)
    second = tif.build_index(store, nlist=3, overwrite=True)
    assert second.path == first.path
    assert tif.load_index(first.path, store).nlist == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grads.zarr", "grads.zarr.faiss"]


def test_a_full_disk_keeps_the_old_index_and_says_so(tmp_path, monkeypatch):
    store = _saved(tmp_path)
    old = tif.build_index(store, nlist=2)
    before = _files(old.path)

    def disk_full(index, name):  # what faiss does on ENOSPC: a partial file, then an error
        with open(name, "wb") as file:
            file.write(b"IwFl" + b"\0" * 100)
        raise RuntimeError("Error in faiss::FileIOWriter: fwrite: No space left on device")

    monkeypatch.setattr(faiss, "write_index", disk_full)
    with pytest.raises(tif.errors.StoreWriteError,
                       match="saving the index .* failed .*No space left.*previous index there "
                             "is unchanged"):
        tif.build_index(store, nlist=3, overwrite=True)
    assert _files(old.path) == before
    assert tif.load_index(old.path, store).nlist == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grads.zarr", "grads.zarr.faiss"]


# ---- item 10: index files checked and bound to the store --------------------------------------

def test_another_stores_index_file_swapped_in_is_refused(tmp_path):
    store, other = _saved(tmp_path, "a.zarr"), _saved(tmp_path, "b.zarr", seed=7)
    ours, theirs = tif.build_index(store, nlist=4), tif.build_index(other, nlist=4)
    shutil.copyfile(theirs.path / "index.faiss", ours.path / "index.faiss")
    with pytest.raises(tif.errors.CorruptStoreError, match="index.faiss .* is not the file saved"):
        tif.load_index(ours.path, store)
    # Its meta.json too, but not its norms: the checksums still tell.
    shutil.copyfile(theirs.path / "meta.json", ours.path / "meta.json")
    with pytest.raises(tif.errors.CorruptStoreError, match="norms.npy .* is not the file saved"):
        tif.load_index(ours.path, store)
    # Every file of the other index: the store's row norms tell them apart.
    shutil.copyfile(theirs.path / "norms.npy", ours.path / "norms.npy")
    with pytest.raises(tif.errors.CorruptStoreError, match="sketch.npy .* is not the file saved"):
        tif.load_index(ours.path, store)
    shutil.copyfile(theirs.path / "sketch.npy", ours.path / "sketch.npy")
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="other rows"):
        tif.load_index(ours.path, store)


def test_every_byte_flip_in_the_index_file_is_refused(tmp_path):
    store = _saved(tmp_path)
    index = tif.build_index(store, nlist=4)
    data = (index.path / "index.faiss").read_bytes()
    for offset in torch.linspace(0, len(data) - 1, 24).long().tolist():
        flipped = bytearray(data)
        flipped[offset] ^= 0x01
        (index.path / "index.faiss").write_bytes(bytes(flipped))
        with pytest.raises(tif.errors.CorruptStoreError, match="SHA-256 differs"):
            tif.load_index(index.path, store)
    (index.path / "index.faiss").write_bytes(data)
    assert tif.load_index(index.path, store).fingerprint == index.fingerprint


def test_an_edited_meta_json_is_refused(tmp_path):
    store = _saved(tmp_path)
    index = tif.build_index(store, nlist=4)
    meta_path = index.path / "meta.json"
    saved = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**saved, "normalize": True}))
    with pytest.raises(tif.errors.CorruptStoreError, match="does not match its checksum"):
        tif.load_index(index.path, store)
    unchecked = {k: v for k, v in saved.items() if k not in ("checksum", "files")}
    meta_path.write_text(json.dumps(unchecked))  # as saved before checksums
    with pytest.raises(tif.errors.CorruptStoreError, match="no checksums.*overwrite=True"):
        tif.load_index(index.path, store)
    tif.build_index(store, nlist=4, overwrite=True)  # an old index is still replaceable
    tif.load_index(index.path, store)


def test_an_index_kept_in_memory_refuses_its_store_rebuilt_with_other_data(tmp_path):
    store = _saved(tmp_path)
    index = tif.build_index(store, nlist=4)
    test = _test_grads()
    tif.indexed_top_k(store, test, 5, index=index)
    rebuilt = tif.save_store(_store(seed=9, lrs=LRS), store.path, chunk_rows=16,
                             overwrite=True)
    assert rebuilt.meta == store.meta  # same metadata: only the rows differ
    with pytest.raises(
        tif.errors.IncompatibleGradientsError, match="indexed_top_k: .*was the store rebuilt"
    ):
        tif.indexed_top_k(rebuilt, test, 5, index=index)
    # In memory too: a store of other rows under the same metadata.
    memory_index = tif.build_index(_store(lrs=LRS), nlist=4)
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="was the store rebuilt"):
        tif.indexed_top_k(_store(seed=9, lrs=LRS), test, 5, index=memory_index)


# ---- issue 24: no FAISS warnings on small stores ------------------------------------------------

@pytest.mark.parametrize("n", [1, 20, 77, 100, 300, 1000])
def test_default_settings_print_no_faiss_warning(n, capfd):
    store = _store(n=n, k=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tif.build_index(store)
        if n >= 256:
            tif.build_index(store, kind="ivf_pq", m=4)
    assert "WARNING" not in capfd.readouterr().err


def test_explicit_settings_below_faiss_advice_warn_in_python(capfd):
    store = _store(n=300, k=8)
    with pytest.warns(UserWarning, match="nlist=150 .* lower nlist"):
        tif.build_index(store, nlist=150)
    assert "WARNING clustering" not in capfd.readouterr().err


# ---- item 15: an index of an S3 store is saved or refused, never silently dropped -------------

def test_an_index_of_a_url_store_without_a_local_path_is_refused(tmp_path, monkeypatch):
    store = _store(lrs=LRS)

    class AtUrl:  # a store whose path is a URL, as a ZarrStore opened from S3
        meta = store.meta
        path = "s3://bucket/grads.zarr"
        read_rows, read_norms = store.read_rows, store.read_norms

    with pytest.raises(tif.errors.InvalidArgumentError, match="s3://bucket/grads.zarr.*path="):
        tif.build_index(AtUrl(), nlist=4)
    with pytest.raises(tif.errors.InvalidArgumentError, match="is a URL"):
        tif.build_index(AtUrl(), nlist=4, path="s3://bucket/grads.zarr.faiss")
    index = tif.build_index(AtUrl(), nlist=4, path=tmp_path / "local.faiss")
    assert tif.load_index(index.path, AtUrl()).fingerprint == index.fingerprint

