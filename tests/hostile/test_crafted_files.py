"""Crafted files (HOSTILE.md class 6; issue 31's unclear errors): metadata nested 200,000 deep,
a store resealed to claim 10**12 rows, FAISS files that match a resealed checksum. Each gives
CorruptStoreError naming the file (or MemoryBudgetError with the sizes), never a raw
RecursionError, FAISS RuntimeError or an allocator failure.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import tracinfunc as tif
from tests.search.test_search import _store
from tracinfunc import _devices, _jsonfile
from tracinfunc.errors import CorruptStoreError, MemoryBudgetError
from tracinfunc.store.zarr.integrity import seal

LRS = (0.5, 0.2)
DEEP = "[" * 200_000 + "]" * 200_000


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("crafted")
    store = tif.save_store(_store(n=300, seed=0, lrs=LRS), root / "base.zarr", chunk_rows=16)
    return root, store


def _copy(saved, name):
    root, store = saved
    target = root / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(store.path, target)
    return target


def test_deep_store_metadata_is_a_corrupt_store_naming_the_file(saved):
    path = _copy(saved, "deep.zarr")
    (path / "zarr.json").write_text(DEEP)
    with pytest.raises(CorruptStoreError, match=r"deep.zarr/zarr.json' is nested deeper"):
        tif.open_store(path)
    with pytest.raises(CorruptStoreError, match="nested deeper"):
        tif.store.read_store_meta(path)


def test_deep_metadata_of_every_other_artefact_is_a_corrupt_store(tmp_path):
    (tmp_path / "c.zarr").mkdir()
    (tmp_path / "c.zarr" / "zarr.json").write_text(DEEP)
    with pytest.raises(CorruptStoreError, match="c.zarr/zarr.json' is nested deeper"):
        tif.load_curvature(tmp_path / "c.zarr")
    (tmp_path / "run.zarr").mkdir()
    (tmp_path / "run.zarr" / "zarr.json").write_text(DEEP)
    with pytest.raises(CorruptStoreError, match="run.zarr/zarr.json' is nested deeper"):
        tif.evaluate.load_retrain(tmp_path / "run.zarr")
    # 65 levels: parsed by json, refused by the depth limit (no metadata nests that deep)
    (tmp_path / "c.zarr" / "zarr.json").write_text("[" * 65 + "]" * 65)
    with pytest.raises(CorruptStoreError, match="more than 64 levels"):
        tif.load_curvature(tmp_path / "c.zarr")


def test_oversized_metadata_is_refused_before_parsing(tmp_path, monkeypatch):
    monkeypatch.setattr(_jsonfile, "MAX_JSON_BYTES", 100)
    (tmp_path / "meta.json").write_text(json.dumps({"x": "y" * 200}))
    with pytest.raises(CorruptStoreError, match="meta.json' is 2.. bytes, more than the 100"):
        _jsonfile.read_json(tmp_path / "meta.json")


def test_the_guard_reads_crafted_metadata_without_crashing(tmp_path):
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "zarr.json").write_text(DEEP)
    (tmp_path / "odd" / "manifest.json").write_text(DEEP)
    top = tif.TopExamples(torch.ones(1, 1), torch.tensor([[0]]), ["a"])
    assert top.save(tmp_path / "odd" / "top.json").is_file()  # not an artefact: writable


def _claim_rows(path, n_train, *, arrays):
    """Edit the metadata (and the arrays' shapes) to claim n_train rows, then reseal it as
    a forger would (the seal has no secret)."""
    root = json.loads((path / "zarr.json").read_text())
    attrs = root["attributes"]["tracinfunc"]
    attrs["n_train"] = n_train
    if arrays:
        for name in ("rows/0", "rows/1", "norms/0", "norms/1"):
            meta = json.loads((path / name / "zarr.json").read_text())
            meta["shape"][0] = n_train
            (path / name / "zarr.json").write_text(json.dumps(meta))
    body = {key: value for key, value in attrs.items() if key != "integrity"}
    root["attributes"]["tracinfunc"] = seal(path, body)
    (path / "zarr.json").write_text(json.dumps(root))


def test_a_store_resealed_to_claim_10_12_rows_is_refused_at_open(saved):
    path = _copy(saved, "huge.zarr")
    _claim_rows(path, 10**12, arrays=False)
    with pytest.raises(CorruptStoreError, match=r"metadata says \(1000000000000, 16\)"):
        tif.open_store(path)
    path = _copy(saved, "huge_arrays.zarr")
    _claim_rows(path, 10**12, arrays=True)
    with pytest.raises(CorruptStoreError, match="declares 1000000000000 rows of 128 bytes in "
                                                "rows/0, but its shard files hold"):
        tif.self_influence(tif.open_store(path))


def test_a_resealed_store_that_holds_its_rows_still_opens(saved):
    path = _copy(saved, "same.zarr")
    _claim_rows(path, 300, arrays=True)
    assert tif.open_store(path).n_train == 300


def test_check_allocation_refuses_what_the_machine_cannot_hold(monkeypatch):
    monkeypatch.setattr(_devices, "physical_bytes", lambda: 2**30)
    with pytest.raises(MemoryBudgetError, match="self_influence's result needs 7450.58 GiB of "
                                                "host memory but this machine has 1.00 GiB"):
        _devices.check_allocation("cpu", 8 * 10**12, what="self_influence's result",
                                  fix="score a row range at a time.")
    _devices.check_allocation("cpu", 2**29, what="x", fix="y")


# ---- FAISS files behind a resealed meta.json -------------------------------------------------

faiss = pytest.importorskip("faiss")


@pytest.fixture(scope="module")
def index(saved):
    return tif.build_index(saved[1], nlist=4)


def _ivf(d, metric, rows, seed=0):
    x = np.random.default_rng(seed).random((300, d), dtype=np.float32)
    quantizer = faiss.IndexFlatIP(d) if metric == faiss.METRIC_INNER_PRODUCT else \
        faiss.IndexFlatL2(d)
    ivf = faiss.IndexIVFFlat(quantizer, d, 4, metric)
    ivf.train(x)
    ivf.add(x[:rows])
    return faiss.serialize_index(ivf).tobytes()


def _crafted_faiss(index, saved, name, data):
    from tracinfunc.search.files import _checksum, _file_digest
    target = saved[0] / f"{name}.faiss"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(index.path, target)
    (target / "index.faiss").write_bytes(data)
    meta = json.loads((target / "meta.json").read_text())
    meta.pop("checksum")
    meta["files"]["index.faiss"] = list(_file_digest(target / "index.faiss"))
    meta["checksum"] = _checksum(meta)
    (target / "meta.json").write_text(json.dumps(meta))
    return target


def _flat(d):
    flat = faiss.IndexFlatIP(d)
    flat.add(np.zeros((300, d), dtype=np.float32))
    return faiss.serialize_index(flat).tobytes()


@pytest.mark.parametrize(("attack", "message"), [
    ("truncated", "FAISS cannot read"), ("random", "starts with"), ("empty", "starts with b''"),
    ("header then random", "FAISS cannot read"), ("IndexFlat", "starts with b'IxFI'"),
    ("wrong dimension", "dimension 33"), ("L2 metric", r"metric 1\)"),
    ("10 of 300 rows", "holds 10 rows"),
])
def test_crafted_faiss_files_are_corrupt_stores_naming_the_file(saved, index, attack, message):
    raw = (index.path / "index.faiss").read_bytes()
    d = saved[1].n_ckpt * saved[1].k
    data = {"truncated": lambda: raw[: len(raw) // 2],
            "random": lambda: np.random.default_rng(0).bytes(5000),
            "empty": lambda: b"",
            "header then random": lambda: raw[:4] + b"\xff" * 5000,
            "IndexFlat": lambda: _flat(d),
            "wrong dimension": lambda: _ivf(d + 1, faiss.METRIC_INNER_PRODUCT, 300),
            "L2 metric": lambda: _ivf(d, faiss.METRIC_L2, 300),
            "10 of 300 rows": lambda: _ivf(d, faiss.METRIC_INNER_PRODUCT, 10)}[attack]()
    path = _crafted_faiss(index, saved, attack.replace(" ", "_"), data)
    with pytest.raises(CorruptStoreError, match=message) as caught:
        tif.load_index(path, saved[1])
    assert "index.faiss" in str(caught.value) and "build_index" in str(caught.value)


def test_deep_index_metadata_is_a_corrupt_store_naming_the_file(saved, index):
    target = saved[0] / "deep.faiss"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(index.path, target)
    (target / "meta.json").write_text(DEEP)
    with pytest.raises(CorruptStoreError, match="deep.faiss/meta.json' is nested deeper"):
        tif.load_index(target, saved[1])


def test_deep_array_metadata_of_an_incomplete_store_is_refused_on_resume(tmp_path):
    memory = _store(n=40, seed=0, lrs=LRS)
    meta = memory.meta.replace(n_train=0, complete=False)
    writer = tif.store.ZarrWriter(tmp_path / "i.zarr", meta, chunk_rows=8, shard_rows=8)
    writer.append(memory.read_rows(0, 0, 16)[None].expand(2, -1, -1).contiguous(),
                  torch.ones(2, 16))
    del writer
    (tmp_path / "i.zarr" / "rows" / "0" / "zarr.json").write_text(DEEP)
    with pytest.raises(CorruptStoreError, match="rows/ in .*nested deeper"):
        tif.store.ZarrWriter(tmp_path / "i.zarr", meta, chunk_rows=8, shard_rows=8)


def test_a_copy_into_memory_larger_than_the_machine_is_refused_before_allocating(
        saved, monkeypatch):
    monkeypatch.setattr(_devices, "physical_bytes", lambda: 1000)
    with pytest.raises(MemoryBudgetError, match="to_memory: a copy of 300 rows needs"):
        tif.to_memory(saved[1])
    with pytest.raises(MemoryBudgetError, match="to_pinned: a copy of 300 rows needs"):
        tif.to_pinned(saved[1])


def test_self_influence_of_a_store_claiming_10_12_rows_is_refused_before_allocating(saved):
    """An unsealed store, or one of the user's, can claim any size: the result's allocation
    is checked against the machine, with the sizes and the fix."""
    store = saved[1]

    class Claims:
        meta = store.meta.replace(n_train=10**12)

        def read_rows(self, ckpt, start, stop, *, out=None):
            raise AssertionError("nothing may be read before the size is checked")

        read_norms = read_rows

    with pytest.raises(MemoryBudgetError, match=r"the \[1000000000000\] self-influence needs "
                                                r"7450.58 GiB of host memory"):
        tif.self_influence(Claims())
