"""ZarrStore on disk: reopening, immutability, integrity, resuming an interrupted build."""

from __future__ import annotations

import functools
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zarr

import tracinfunc as tif
from tests.conftest import child_env
from tests.store.test_store import all_norms, all_rows

PROJ = tif.Projection(dim=16, seed=0)
ROOT = Path(__file__).resolve().parents[2]


def tiny(path, **options):
    return functools.partial(tif.store.ZarrWriter, path, chunk_rows=4, shard_rows=8, **options)


def batches(x, y, size=6):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


@pytest.fixture
def built(mlp_setup32, tmp_path):
    loss, ckpts, train, _ = mlp_setup32
    return tif.build_store(loss, ckpts, batches(*train), projection=PROJ,
                           store=tiny(tmp_path / "g.zarr"))


def run_python(code: str) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_plain_path_builds_a_zarr_store_that_reopens_equal(mlp_setup32, tmp_path):
    loss, ckpts, train, _ = mlp_setup32
    store = tif.build_store(loss, ckpts, train, projection=PROJ, store=str(tmp_path / "p.zarr"))
    assert isinstance(store, tif.store.ZarrStore) and store.raw_reads
    again = tif.open_store(tmp_path / "p.zarr")
    assert again.meta == store.meta and torch.equal(all_rows(again), all_rows(store))


def test_reopen_in_another_process(built):
    digest = hash(all_rows(built).numpy().tobytes())
    result = run_python(
        "import tracinfunc as tif, torch\n"
        f"s = tif.open_store({str(built.path)!r})\n"
        "rows = torch.stack([s.read_rows(c, 0, s.n_train) for c in range(s.n_ckpt)])\n"
        "print(s.n_train, s.meta.checkpoints[2].name, tif.self_influence(s).sum().item())\n"
        "import sys; sys.stdout.write(rows.numpy().tobytes().hex())\n"
    )
    assert result.returncode == 0, result.stderr
    header, hex_rows = result.stdout.split("\n", 1)
    assert header.split()[:2] == ["40", "epoch-2"]
    assert float(header.split()[2]) == pytest.approx(tif.self_influence(built).sum().item())
    assert hash(bytes.fromhex(hex_rows)) == digest


def test_metadata_is_plain_json_with_everything_the_issue_lists(built):
    attrs = zarr.open_group(built.path, mode="r").attrs["tracinfunc"]
    for key in ("format_version", "projection", "checkpoints", "layout", "dtype", "n_train",
                "library_version", "complete", "dataset_fingerprint"):
        assert key in attrs
    assert attrs["complete"] is True and attrs["checkpoints"][1]["lr"] == 0.1


def test_finished_store_cannot_be_written(built, mlp_setup32):
    with pytest.raises(ValueError, match="read-only"):
        built._rows[0][0:1] = 0.0
    # Same metadata: a re-run, which writes nothing and gives the store back.
    writer = tif.store.ZarrWriter(built.path, built.meta.replace(n_train=0, complete=False))
    assert writer.rows_written == built.n_train
    with pytest.raises(tif.errors.StoreExistsError, match="data has more"):
        writer.append(torch.zeros(built.n_ckpt, 1, built.k), torch.zeros(built.n_ckpt, 1))
    assert writer.finish().meta == built.meta
    with pytest.raises(tif.errors.StoreExistsError, match="finished store already exists"):
        tif.store.ZarrWriter(built.path, built.meta.replace(n_train=0, complete=False, k=3))
    loss, ckpts, train, _ = mlp_setup32
    with pytest.raises(tif.errors.StoreExistsError, match="overwrite=True"):
        tif.build_store(loss, ckpts, train, projection=tif.Projection(dim=16, seed=5),
                        store=built.path)
    again = tif.build_store(loss, ckpts, (train[0][:5], train[1][:5]), projection=PROJ,
                            store=tiny(built.path, overwrite=True))
    assert again.n_train == 5


def test_something_else_at_the_path_is_refused(mlp_setup32, tmp_path):
    loss, ckpts, train, _ = mlp_setup32
    zarr.open_group(tmp_path / "other.zarr", mode="w")
    with pytest.raises(tif.errors.StoreExistsError, match="not a tracinfunc store"):
        tif.build_store(loss, ckpts, train, projection=PROJ, store=tmp_path / "other.zarr")
    with pytest.raises(TypeError, match="needs a path"):
        tif.build_store(loss, ckpts, train, projection=PROJ, store=tif.store.ZarrStore)
    with pytest.raises(FileNotFoundError, match="no zarr store"):
        tif.open_store(tmp_path / "missing.zarr")


def test_edited_metadata_or_arrays_are_reported_at_open(built):
    group = zarr.open_group(built.path, mode="r+")
    group["norms/1"].resize((7,))
    # Resizing rewrites norms/1/zarr.json and drops a shard: caught by the sealed manifest.
    with pytest.raises(tif.errors.CorruptStoreError, match=r"norms/1/zarr.json"):
        tif.open_store(built.path)
    attrs = dict(group.attrs["tracinfunc"])
    group.attrs["tracinfunc"] = {**attrs, "dtype": "int8"}
    with pytest.raises(tif.errors.CorruptStoreError, match="storage dtype 'int8'"):
        tif.open_store(built.path)


def test_shards_shrink_so_writer_buffers_stay_bounded(built):
    from tracinfunc.store.zarr.layout import WRITER_BUFFER_BYTES, default_rows

    row_bytes = 4096 * 4
    few, many = (built.meta.replace(k=4096, checkpoints=built.meta.checkpoints[:1] * n)
                 for n in (1, 40))
    assert default_rows(few, None, None)[1] * row_bytes == 256 * 2**20
    chunk, shard = default_rows(many, None, None)
    assert 40 * shard * row_bytes <= WRITER_BUFFER_BYTES and shard % chunk == 0


def _chunk_file(store, ckpt=1, shard=1):
    return store.path / "rows" / str(ckpt) / "c" / str(shard) / "0"


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_flipped_byte_is_reported_with_checkpoint_and_rows(mlp_setup32, tmp_path,
                                                             compression):
    loss, ckpts, train, test = mlp_setup32
    store = tif.build_store(loss, ckpts, batches(*train), projection=PROJ,
                            store=tiny(tmp_path / "g.zarr", compression=compression))
    path = _chunk_file(store)
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))
    reopened = tif.open_store(store.path)
    assert reopened.read_rows(1, 0, 8).shape == (8, 16)  # shard 0 is intact
    with pytest.raises(
        tif.errors.CorruptStoreError, match=r"checkpoint 'epoch-1' \(index 1\), rows"
    ):
        reopened.read_rows(1, 0, 16)
    with pytest.raises(tif.errors.CorruptStoreError, match="epoch-1"):
        tif.score(reopened, tif.build_store(loss, ckpts, test, projection=PROJ))


def test_a_missing_shard_file_is_reported(built):
    _chunk_file(built, ckpt=2, shard=3).unlink()
    with pytest.raises(
        tif.errors.CorruptStoreError, match=r"'epoch-2' \(index 2\), rows \[20, 30\)"
    ):
        built.read_rows(2, 20, 30)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_all_zero_chunks_are_written_and_read_back(mlp_setup32, tmp_path, compression):
    # zarr skips all-zero chunks unless told on every open; a skipped chunk would later read
    # as damage (raw path) or hide real damage (zarr's path). Rows 8-11 fill one inner chunk.
    meta = tif.build_store(*mlp_setup32[:3], projection=PROJ).meta
    path = tmp_path / "z.zarr"
    rows = torch.randn(3, 20, 16)
    rows[:, 8:12] = 0
    norms = rows.norm(dim=-1)
    norms[:, 8:16] = 0  # a whole norms chunk (one per shard of 8 rows)
    writer = tif.store.ZarrWriter(path, meta.replace(n_train=0, complete=False), chunk_rows=4,
                            shard_rows=8, compression=compression)
    writer.append(rows[:, :10], norms[:, :10])  # the zero chunk straddles two appends
    writer.append(rows[:, 10:], norms[:, 10:])
    store = writer.finish()
    assert store.raw_reads == (compression is None)
    assert torch.equal(all_rows(tif.open_store(path)), rows)
    assert torch.equal(all_norms(store), norms)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_missing_files_on_every_read_path_are_reported(mlp_setup32, tmp_path, compression):
    loss, ckpts, train, _ = mlp_setup32
    store = tif.build_store(loss, ckpts, batches(*train), projection=PROJ,
                            store=tiny(tmp_path / "g.zarr", compression=compression))
    _chunk_file(store, ckpt=0, shard=2).unlink()
    (store.path / "norms" / "1" / "c" / "3").unlink()
    reopened = tif.open_store(store.path)
    with pytest.raises(
        tif.errors.CorruptStoreError, match=r"'epoch-0' \(index 0\), rows \[0, 40\)"
    ):
        reopened.read_rows(0, 0, 40)
    with pytest.raises(
        tif.errors.CorruptStoreError, match=r"self_influence: checkpoint 'epoch-1'.*missing"
    ):
        tif.self_influence(reopened)
    assert reopened.read_rows(0, 0, 16).shape == (16, 16)  # the rest stays readable


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_storage_scores_within_tolerance(mlp_setup32, tmp_path, dtype):
    loss, ckpts, train, test = mlp_setup32
    test_store = tif.build_store(loss, ckpts, test, projection=PROJ)
    full = tif.score(tif.build_store(loss, ckpts, train, projection=PROJ), test_store)
    half = tif.build_store(loss, ckpts, train, projection=PROJ, dtype=dtype,
                           store=tiny(tmp_path / "h.zarr"))
    reopened = tif.open_store(half.path)
    assert reopened.dtype == dtype and reopened.meta.dtype == str(dtype).split(".")[1]
    got = tif.score(reopened, test_store)
    assert got.dtype == torch.float32
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-3
    assert (got - full).norm() / full.norm() < tolerance
    memory = tif.build_store(loss, ckpts, train, projection=PROJ, dtype=dtype)
    assert torch.equal(all_rows(reopened), all_rows(memory))


def test_bfloat16_cpu_matmul_matches_the_float32_upcast(mlp_setup32, monkeypatch):
    score_module = importlib.import_module("tracinfunc.query.chunks")

    loss, ckpts, train, test = mlp_setup32
    store = tif.build_store(loss, ckpts, train, projection=PROJ, dtype=torch.bfloat16)
    test_store = tif.build_store(loss, ckpts, test, projection=PROJ)
    upcast = tif.score(store, test_store, device="cpu")  # the default
    monkeypatch.setattr(score_module, "_CPU_BF16_MATMUL", True)
    fast = tif.score(store, test_store, device="cpu")
    assert not torch.equal(fast, upcast)  # really two different paths
    assert (fast - upcast).norm() / upcast.norm() < 1e-2


def test_a_test_rows_bfloat16_scores_do_not_depend_on_the_rows_scored_with_it(mlp_setup32):
    """Issue 16: with the bf16 matmul, a test row's top-10 changed with n_test (<= 128)."""
    loss, ckpts, train, test = mlp_setup32
    store = tif.build_store(loss, ckpts, train, projection=PROJ, dtype=torch.bfloat16)
    many = tif.build_store(loss, ckpts, test, projection=PROJ)
    one = torch.stack([many.read_rows(c, 0, 1) for c in range(many.n_ckpt)])  # [n_ckpt, 1, k]
    rows = torch.stack([many.read_rows(c, 0, many.n_train) for c in range(many.n_ckpt)])
    rows = rows.repeat(1, 200 // rows.shape[1] + 1, 1)[:, :200]  # over the old 128-row switch
    alone = tif.score(store, one, device="cpu")[0]
    together = tif.score(store, rows, device="cpu")[0]
    torch.testing.assert_close(alone, together, rtol=1e-6, atol=1e-7)
    k = min(10, store.n_train)
    assert torch.equal(tif.top_k(store, one, k=k, device="cpu")[1][0],
                       tif.top_k(store, rows, k=k, device="cpu")[1][0])


def test_open_refuses_an_incomplete_store(mlp_setup32, tmp_path):
    loss, ckpts, train, _ = mlp_setup32
    meta = tif.build_store(loss, ckpts, train, projection=PROJ).meta
    writer = tif.store.ZarrWriter(tmp_path / "i.zarr", meta.replace(n_train=0, complete=False),
                            chunk_rows=4, shard_rows=8)
    writer.append(torch.zeros(3, 10, 16), torch.zeros(3, 10))
    with pytest.raises(tif.errors.IncompleteStoreError, match="8 rows written.*Resume it"):
        tif.open_store(tmp_path / "i.zarr")


def test_resume_with_other_arguments_is_refused(mlp_setup32, tmp_path):
    loss, ckpts, train, _ = mlp_setup32
    meta = tif.build_store(loss, ckpts, train, projection=PROJ).meta
    writer = tif.store.ZarrWriter(tmp_path / "i.zarr", meta.replace(n_train=0, complete=False),
                            chunk_rows=4, shard_rows=8)
    writer.append(torch.zeros(3, 10, 16), torch.zeros(3, 10))
    for change, what in (({"dtype": torch.float16}, "storage dtype"),
                         ({"projection": tif.Projection(dim=16, seed=1)}, "projection")):
        options = {"projection": PROJ, **change}
        with pytest.raises(tif.errors.IncompatibleGradientsError, match=f"cannot resume.*{what}"):
            tif.build_store(loss, ckpts, train, store=tmp_path / "i.zarr", **options)
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="checkpoints"):
        tif.build_store(loss, ckpts[:2], train, projection=PROJ, store=tmp_path / "i.zarr")


_CHILD = """
import os, signal, functools
import torch.nn.functional as F
import tracinfunc as tif
from tests.conftest import make_checkpoints, make_data, make_mlp
import torch
model = make_mlp(dtype=torch.float32).eval()
loss = tif.loss_from_module(model, F.cross_entropy)
x, y = make_data(40, dtype=torch.float32, seed=1)
def data():
    for i, start in enumerate(range(0, 40, 6)):
        if i == 6:  # 36 rows appended, 32 (4 shards of 8) committed: die the hard way
            os.kill(os.getpid(), signal.SIGKILL)
        yield x[start : start + 6], y[start : start + 6]
tif.build_store(loss, make_checkpoints(model), data(), projection=tif.Projection(dim=16, seed=0),
                store=functools.partial(tif.store.ZarrWriter, {path!r}, chunk_rows=4, shard_rows=8))
"""


def test_resume_after_sigkill_equals_an_uninterrupted_build(mlp_setup32, tmp_path):
    loss, ckpts, (x, y), _ = mlp_setup32
    path = tmp_path / "killed.zarr"
    result = run_python(_CHILD.format(path=str(path)))
    assert result.returncode == -9, result.stderr
    with pytest.raises(tif.errors.IncompleteStoreError, match="32 rows written"):
        tif.open_store(path)
    calls = []

    def counting_loss(params, example):
        calls.append(1)
        return loss(params, example)

    resumed = tif.build_store(counting_loss, ckpts, batches(x, y), projection=PROJ,
                              store=tiny(path))
    # Batch 0 was recomputed to check the data against the stored rows, batches 1-4 (rows
    # 6-29) were skipped; batch 5 (rows 30-35, straddling the resume point 32) and batch 6
    # were differentiated: 1 loss check + 3 batches x 3 checkpoints.
    assert len(calls) == 1 + 3 * 3
    uninterrupted = tif.build_store(loss, ckpts, batches(x, y), projection=PROJ,
                                    store=tiny(tmp_path / "whole.zarr"))
    assert resumed.meta == uninterrupted.meta and resumed.meta.complete
    assert torch.equal(all_rows(resumed), all_rows(uninterrupted))
    assert torch.equal(all_norms(resumed), all_norms(uninterrupted))


def test_resume_with_less_data_than_stored_is_refused(mlp_setup32, tmp_path):
    loss, ckpts, train, _ = mlp_setup32
    full = tif.build_store(loss, ckpts, train, projection=PROJ)
    writer = tif.store.ZarrWriter(tmp_path / "i.zarr", full.meta.replace(n_train=0, complete=False),
                            chunk_rows=4, shard_rows=8)
    # The real rows: a resume first checks that the data gives the rows stored for it.
    writer.append(all_rows(full)[:, :17], all_norms(full)[:, :17])
    with pytest.raises(
        tif.errors.EmptyDataError, match="already holds 16 rows but data has only 5"
    ):
        tif.build_store(loss, ckpts, (train[0][:5], train[1][:5]), projection=PROJ,
                        store=tmp_path / "i.zarr")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streaming_to_cuda_equals_cpu(built, mlp_setup32, dtype, tmp_path):
    loss, ckpts, train, test = mlp_setup32
    zarr_store = tif.build_store(loss, ckpts, train, projection=PROJ, dtype=dtype,
                                 store=tiny(tmp_path / "c.zarr"))
    test_store = tif.build_store(loss, ckpts, test, projection=PROJ)
    expected = tif.score(tif.to_memory(zarr_store), test_store, device="cpu")
    for store in (zarr_store, tif.to_pinned(zarr_store), tif.to_memory(zarr_store)):
        got = tif.score(store, test_store, device="cuda", chunk_rows=8)
        assert got.device.type == "cuda"
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-2, atol=1e-3)
