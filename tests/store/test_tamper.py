"""Damaged or edited Zarr stores (issue 16): every fault is caught at open or at the first read.

Each store is written in every layout the writer offers (raw or zstd, one chunk per shard or
several), then damaged on disk the way a power loss, a bad copy or a hand edit would, and
opened, scored and verified. The error must be a CorruptStoreError naming the file.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

import tracinfunc as tif
from tracinfunc.store.meta import CheckpointMeta, StoreMeta

N_TRAIN, K = 96, 8
LAYOUTS = {
    "raw-sharded": {"chunk_rows": 8, "shard_rows": 32},
    "raw-unsharded": {"chunk_rows": 8, "shard_rows": 8},
    "zstd-sharded": {"chunk_rows": 8, "shard_rows": 32, "compression": "zstd"},
}


def memory_store(n_ckpt: int = 3, seed: int = 0) -> tif.store.MemoryStore:
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(n_ckpt, N_TRAIN, K, generator=generator)
    meta = StoreMeta(
        projection=tif.Projection(dim=K, seed=3),
        checkpoints=tuple(CheckpointMeta(f"c{i}", 0.1 * (i + 1), f"f{i}") for i in range(n_ckpt)),
        layout=(("w", (4, 5)),), n_train=N_TRAIN, k=K,
    )
    return tif.store.MemoryStore(meta, rows, rows.norm(dim=-1))


@pytest.fixture(params=sorted(LAYOUTS))
def saved(request, tmp_path):
    source = memory_store()
    path = tmp_path / "g.zarr"
    tif.save_store(source, path, progress=False, **LAYOUTS[request.param])
    return source, path


def attrs_path(path):
    return path / "zarr.json"


def edit_meta(path, change) -> None:
    document = json.loads(attrs_path(path).read_text())
    change(document["attributes"]["tracinfunc"])
    attrs_path(path).write_text(json.dumps(document))


def first_shard(path, kind: str, ckpt: int = 0, shard: int = 0):
    return path / kind / str(ckpt) / "c" / str(shard) / ("0" if kind == "rows" else "")


def shard_file(path, kind, ckpt=0, shard=0):
    base = path / kind / str(ckpt) / "c" / str(shard)
    return base / "0" if kind == "rows" else base


def read_everything(path):
    """Open, score (self-influence reads rows and norms) and verify: the ways a user reads."""
    store = tif.open_store(path)
    tif.self_influence(store)
    tif.verify_store(store, progress=False)
    return store


def assert_caught(path, *names: str):
    with pytest.raises(tif.errors.CorruptStoreError) as caught:
        read_everything(path)
    message = str(caught.value)
    assert any(name in message for name in names), message


def test_an_undamaged_store_reads_back_bit_identical(saved):
    source, path = saved
    store = read_everything(path)
    for c in range(source.n_ckpt):
        assert torch.equal(store.read_rows(c, 0, N_TRAIN), source.read_rows(c, 0, N_TRAIN))
        assert torch.equal(store.read_norms(c, 0, N_TRAIN), source.read_norms(c, 0, N_TRAIN))


@pytest.mark.parametrize("kind", ["rows", "norms"])
@pytest.mark.parametrize("size", ["empty", "half", "deleted"])
def test_truncated_or_deleted_shard_files_are_caught(saved, kind, size):
    _, path = saved
    target = shard_file(path, kind, ckpt=1, shard=2)
    if size == "deleted":
        target.unlink()
    else:
        os.truncate(target, 0 if size == "empty" else target.stat().st_size // 2)
    assert_caught(path, str(target.relative_to(path)), str(target))


@pytest.mark.parametrize("lr", [10.0, -0.1, math.nan, math.inf, 0.0])
def test_an_edited_lr_is_caught_at_open(saved, lr):
    _, path = saved

    def change(meta):
        meta["checkpoints"][1]["lr"] = lr

    edit_meta(path, change)
    with pytest.raises(tif.errors.CorruptStoreError, match="zarr.json"):
        tif.open_store(path)


@pytest.mark.parametrize("edit", [
    "seed", "order", "count", "n_train", "k", "dtype", "complete-no", "version-0",
    "version-neg", "version-true", "fingerprint",
])
def test_edited_metadata_is_caught_at_open(saved, edit):
    _, path = saved
    changes = {
        "seed": lambda m: m["projection"].__setitem__("seed", 4),
        "order": lambda m: m["checkpoints"].reverse(),
        "count": lambda m: m["checkpoints"].pop(),
        "n_train": lambda m: m.__setitem__("n_train", N_TRAIN - 8),
        "k": lambda m: m.__setitem__("k", K // 2),
        "dtype": lambda m: m.__setitem__("dtype", "float16"),
        "complete-no": lambda m: m.__setitem__("complete", "no"),
        "version-0": lambda m: m.__setitem__("format_version", 0),
        "version-neg": lambda m: m.__setitem__("format_version", -5),
        "version-true": lambda m: m.__setitem__("format_version", True),
        "fingerprint": lambda m: m.__setitem__("dataset_fingerprint", "other"),
    }
    edit_meta(path, changes[edit])
    with pytest.raises(tif.errors.CorruptStoreError, match="zarr.json"):
        tif.open_store(path)
    with pytest.raises(tif.errors.CorruptStoreError):
        tif.store.read_store_meta(path)


def test_malformed_json_names_the_file(saved):
    _, path = saved
    attrs_path(path).write_text(attrs_path(path).read_text()[:-20])
    with pytest.raises(tif.errors.CorruptStoreError, match="zarr.json"):
        tif.open_store(path)
    array_json = path / "rows" / "1" / "zarr.json"
    shutil.copy(path.parent / "g.zarr" / "zarr.json", path / "z.bak")  # any other file
    array_json.write_text("{not json")
    with pytest.raises(tif.errors.CorruptStoreError):
        tif.open_store(path)


def test_an_edited_array_endianness_is_caught(saved):
    _, path = saved
    array_json = path / "rows" / "0" / "zarr.json"
    text = array_json.read_text()
    assert '"little"' in text
    array_json.write_text(text.replace('"little"', '"big"'))
    assert_caught(path, "rows/0")


def test_swapped_shard_files_are_caught(saved):
    _, path = saved
    a, b = shard_file(path, "rows", 0, 0), shard_file(path, "rows", 0, 1)
    a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
    a.write_bytes(b_bytes)
    b.write_bytes(a_bytes)
    assert_caught(path, "rows/0")


@pytest.mark.parametrize("kind", ["rows", "norms"])
def test_swapped_checkpoint_directories_are_caught(saved, kind):
    _, path = saved
    a, b, tmp = path / kind / "0", path / kind / "1", path / kind / "x"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    assert_caught(path, f"{kind}/0", f"{kind}/1")


def test_a_shard_index_pointing_past_the_file_is_caught(saved):
    _, path = saved
    target = shard_file(path, "rows", 0, 1)
    data = bytearray(target.read_bytes())
    index_start = len(data) - (16 * 4 + 4) if len(data) > 100 else len(data) - 20
    data[index_start : index_start + 8] = (len(data) * 4).to_bytes(8, "little")
    target.write_bytes(bytes(data))
    assert_caught(path, "rows/0")


def test_a_zarr_v2_or_pickle_array_is_refused_unread(saved):
    _, path = saved
    array = path / "norms" / "2"
    (array / "zarr.json").unlink()
    (array / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [N_TRAIN], "chunks": [N_TRAIN], "dtype": "|O",
        "compressor": {"id": "pickle"}, "fill_value": None, "filters": None, "order": "C",
    }))
    assert_caught(path, "norms/2")


def test_metadata_without_its_checksum_is_refused(saved):
    _, path = saved
    edit_meta(path, lambda m: m.pop("integrity"))
    with pytest.raises(tif.errors.CorruptStoreError, match="checksum"):
        tif.open_store(path)
