"""An index sees its store's row order, not only its norms (issue 31, finding 10).

Format 3 bound an index by the metadata and every row norm to 1e-4: two examples whose norms
agree to 1.3e-7 (cosine 0.45 between them) swapped in a rebuilt store passed, and cosine
``indexed_top_k`` returned the wrong rows. Format 4 also records a seeded sketch of every row.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import tracinfunc as tif
from tests.search.test_search import _clustered, _meta, _test_grads

faiss = pytest.importorskip("faiss")

LRS = (0.5, 0.2)
ROW_A, ROW_B = 17, 203  # the two swapped examples


def _twins(n=300, k=16, seed=0) -> torch.Tensor:
    """``[n_ckpt, n, k]`` rows where row ROW_B has row ROW_A's norm (to 1.3e-7) at every checkpoint
    but points elsewhere (cosine 0.45)."""
    rows = _clustered(n, k, len(LRS), seed)
    g = torch.Generator().manual_seed(seed + 1)
    for c in range(len(LRS)):
        a = rows[c, ROW_A]
        other = torch.randn(k, generator=g, dtype=a.dtype)
        other -= (other @ a) / (a @ a) * a
        b = 0.45 * a / a.norm() + (1 - 0.45**2) ** 0.5 * other / other.norm()
        rows[c, ROW_B] = b * a.norm() * (1 + 1.3e-7)
    return rows


def _memory(rows: torch.Tensor) -> tif.store.MemoryStore:
    return tif.store.MemoryStore(_meta(rows.shape[1], rows.shape[2], LRS), rows,
                                 rows.norm(dim=-1))


def _swapped(rows: torch.Tensor) -> torch.Tensor:
    out = rows.clone()
    out[:, [ROW_A, ROW_B]] = rows[:, [ROW_B, ROW_A]]
    return out


@pytest.mark.parametrize("normalize", [True, False])
def test_two_rows_with_equal_norms_swapped_are_refused_naming_them(tmp_path, normalize):
    rows = _twins()
    store = tif.save_store(_memory(rows), tmp_path / "grads.zarr", chunk_rows=16)
    index = tif.build_index(store, nlist=4, normalize=normalize)
    rebuilt = tif.save_store(_memory(_swapped(rows)), store.path, chunk_rows=16,
                             overwrite=True)
    assert rebuilt.meta == store.meta
    pattern = rf"rows \[{ROW_A}, {ROW_B}\] differ from the rows the index was built from"
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="load_index: .*" + pattern):
        tif.load_index(index.path, rebuilt)
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="indexed_top_k: .*" + pattern):
        tif.indexed_top_k(rebuilt, _test_grads(), 5, index=index, normalize=normalize)


def test_rows_moved_by_float32_rounding_are_accepted():
    rows = _twins()
    index = tif.build_index(_memory(rows), nlist=4, normalize=True)
    g = torch.Generator().manual_seed(3)
    as32 = rows.to(torch.float32)
    spacing = torch.nextafter(as32, torch.full_like(as32, float("inf"))) - as32
    steps = torch.randint(-4, 5, rows.shape, generator=g).to(torch.float32)
    nudged = (as32 + steps * spacing).to(rows.dtype)  # 4 ulps: more than a thread count moves
    _, found = tif.indexed_top_k(_memory(nudged), _test_grads(), 5, index=index,
                                 normalize=True, nprobe=4)
    assert torch.equal(found, tif.top_k(_memory(nudged), _test_grads(), 5, normalize=True)[1])


def test_another_seed_dtype_or_data_of_the_same_shape_is_refused(tmp_path):
    rows = _twins()
    store = tif.save_store(_memory(rows), tmp_path / "grads.zarr")
    index = tif.build_index(store, nlist=4)
    meta = store.meta
    others = {
        "projection seed": replace(meta, projection=tif.Projection(dim=16, seed=1)),
        "dtype": replace(meta, dtype="float32"),
        "selection": replace(meta, layout=(("v", (4, 16)),)),
    }
    for what, other_meta in others.items():
        like = rows.to(other_meta.torch_dtype)
        other = tif.store.MemoryStore(other_meta, like, like.norm(dim=-1))
        with pytest.raises(tif.errors.IncompatibleGradientsError,
                           match="metadata fingerprint"):
            tif.load_index(index.path, other)
        assert what
    data = _clustered(300, 16, 2, 7)
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="row norms differ"):
        tif.load_index(index.path, tif.store.MemoryStore(meta, data, data.norm(dim=-1)))


def _sketch_bytes(path):
    return (path / "sketch.npy").read_bytes()


@pytest.mark.parametrize("damage", ["edit", "truncate"])
def test_a_crafted_sketch_file_is_refused_as_corrupt(tmp_path, damage):
    store = tif.save_store(_memory(_twins()), tmp_path / "grads.zarr")
    index = tif.build_index(store, nlist=4)
    sketch = index.path / "sketch.npy"
    data = bytearray(sketch.read_bytes())
    if damage == "edit":
        data[-3] ^= 0xFF
    else:
        del data[len(data) // 2:]
    sketch.write_bytes(bytes(data))
    with pytest.raises(tif.errors.CorruptStoreError, match="sketch.npy in .* is not the file"):
        tif.load_index(index.path, store)


def test_a_sketch_of_another_shape_with_matching_checksums_is_refused(tmp_path):
    from tracinfunc.search.files import _checksum, _file_digest
    store = tif.save_store(_memory(_twins()), tmp_path / "grads.zarr")
    index = tif.build_index(store, nlist=4)
    np.save(index.path / "sketch.npy", np.zeros((299, 8), np.float32))
    meta = json.loads((index.path / "meta.json").read_text())
    meta.pop("checksum")
    meta["files"]["sketch.npy"] = list(_file_digest(index.path / "sketch.npy"))
    meta["checksum"] = _checksum(meta)
    (index.path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(tif.errors.CorruptStoreError, match=r"sketch.npy .*\[300, 8\] float32"):
        tif.load_index(index.path, store)


def test_format_4_is_written_and_format_3_still_loads_with_norms_only(tmp_path):
    from tracinfunc.search.files import _checksum
    rows = _twins()
    store = tif.save_store(_memory(rows), tmp_path / "grads.zarr")
    index = tif.build_index(store, nlist=4)
    meta = json.loads((index.path / "meta.json").read_text())
    assert meta["format_version"] == 4 and set(meta["files"]) == {
        "index.faiss", "norms.npy", "sketch.npy"}
    # The same index as format 3 wrote it: no sketch.
    (index.path / "sketch.npy").unlink()
    meta.pop("checksum")
    del meta["files"]["sketch.npy"], meta["sketch"]
    meta["format_version"] = 3
    meta["checksum"] = _checksum(meta)
    (index.path / "meta.json").write_text(json.dumps(meta))
    old = tif.load_index(index.path, store)
    assert old.sketch is None
    rebuilt = tif.save_store(_memory(_swapped(rows)), tmp_path / "swapped.zarr")
    tif.load_index(index.path, rebuilt)  # format 3's documented limit: norms only


def test_rows_to_check_takes_every_row_a_permutation_could_move_within_the_budget():
    from tracinfunc.search.binding import rows_to_check
    norms = np.linspace(1.0, 2.0, 1000, dtype=np.float32)[None].repeat(2, 0)  # 1e-3 apart
    norms[:, 500] = norms[:, 100] * (1 + 1e-6)  # rows 100 and 500 could trade places
    norms[0, 700] = norms[0, 300]  # equal at one checkpoint only: the norms tell them apart
    rows = rows_to_check(norms, seed=0)
    assert {100, 500} <= set(rows.tolist()) and 300 not in rows and 700 not in rows
    assert len(rows) == 2 + 64 and np.array_equal(rows, rows_to_check(norms, seed=0))
    chunked = rows_to_check(norms, seed=0, chunk_rows=16)  # whole chunks: read anyway
    assert {96, 111, 496, 511} <= set(chunked.tolist()) and len(chunked) % 16 == 0
    flat = np.ones((1, 1000), np.float32)  # every row ambiguous: a seeded sample of chunks
    limited = rows_to_check(flat, seed=0, chunk_rows=10, budget_rows=200)
    assert 200 <= len(limited) <= 200 + 80 and len(np.unique(limited // 10)) <= 28


def test_a_format_4_index_without_its_sketch_is_corrupt(tmp_path):
    from tracinfunc.search.files import _checksum
    store = tif.save_store(_memory(_twins()), tmp_path / "grads.zarr")
    index = tif.build_index(store, nlist=4)
    meta = json.loads((index.path / "meta.json").read_text())
    meta.pop("checksum")
    del meta["files"]["sketch.npy"]
    meta["checksum"] = _checksum(meta)  # only the entry is gone: format 4 needs it
    (index.path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(tif.errors.CorruptStoreError, match="does not match its checksum"):
        tif.load_index(index.path, store)
    tif.build_index(store, nlist=4, overwrite=True)
    (index.path / "sketch.npy").unlink()
    with pytest.raises(tif.errors.CorruptStoreError, match=r"sketch.npy .*\(missing"):
        tif.load_index(index.path, store)
