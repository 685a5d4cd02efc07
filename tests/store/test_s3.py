"""Stores on S3, against moto's S3-compatible server on 127.0.0.1 (never a network service):
build, open, score, resume, sharded builds, CLI info --verify, and corruption detection."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import sys

import boto3
import pytest
import torch

import tracinfunc as tif
from tests.build.test_shards_build import PROJ, SHARD_ROWS, DyingDataset, batches
from tests.cli.test_cli import SPEC, cli_here
from tracinfunc.build.loop import new_store_meta


@pytest.fixture(scope="session")
def s3_server():
    """A local S3 endpoint; credentials and endpoint come from the usual environment."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
    patch = pytest.MonkeyPatch()
    for name, value in env.items():
        patch.setenv(name, value)
    yield boto3.client("s3", endpoint_url=endpoint)
    patch.undo()
    server.stop()


@pytest.fixture
def bucket(s3_server, request):
    # One bucket per test and parameter (S3 bucket names: 3-63 of [a-z0-9-]).
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())
    digest = hashlib.blake2b(request.node.name.encode(), digest_size=4).hexdigest()
    name = f"grads-{slug[:40].strip('-')}-{digest}"
    s3_server.create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["obstore", "s3fs"])
def read_path(request, monkeypatch):
    """Raw row reads go through obstore when it is installed, else through zarr's s3fs store;
    both are run."""
    if request.param == "s3fs":
        monkeypatch.setattr("tracinfunc.store.zarr.store.object_store_for_reads", lambda url: None)
    return request.param


def byte_store_of(store) -> str:
    """Which client a ZarrStore's raw reads use."""
    return type(store._readers[0]._store).__name__


def tiny(path, cls=tif.store.ZarrWriter):
    return functools.partial(cls, path, chunk_rows=4, shard_rows=SHARD_ROWS)


def all_rows(store):
    return torch.stack([store.read_rows(c, 0, store.meta.n_train)
                        for c in range(store.meta.n_ckpt)])


def test_round_trip_open_and_score_equal_a_local_store(mlp_setup32, tmp_path, bucket,
                                                       read_path):
    loss, ckpts, (x, y), test = mlp_setup32
    url = f"s3://{bucket}/grads.zarr"
    local = tif.build_store(loss, ckpts, batches(x, y), projection=PROJ,
                            store=tiny(tmp_path / "local.zarr"))
    remote = tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, store=tiny(url))
    opened = tif.open_store(url)
    assert opened.path == url and opened.meta == local.meta and opened.raw_reads
    assert byte_store_of(opened) == {"obstore": "ObjectStore", "s3fs": "FsspecStore"}[read_path]
    assert torch.equal(all_rows(opened), all_rows(local))
    test_grads = tif.build_store(loss, ckpts, test, projection=PROJ)
    assert torch.equal(tif.score(opened, test_grads), tif.score(local, test_grads))
    assert torch.equal(tif.self_influence(remote), tif.self_influence(local))
    tif.verify_store(opened)
    # Re-running the same build returns the finished store (issue 16: idempotent re-runs).
    again = tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, store=url)
    assert torch.equal(all_rows(again), all_rows(local))


def test_an_interrupted_build_resumes_on_s3(mlp_setup32, tmp_path, bucket):
    loss, ckpts, (x, y), _ = mlp_setup32
    url = f"s3://{bucket}/grads.zarr"
    loader = torch.utils.data.DataLoader(DyingDataset(x, y, die_at=28), batch_size=6)
    with pytest.raises(KeyboardInterrupt):
        tif.build_store(loss, ckpts, loader, projection=PROJ, store=tiny(url))
    with pytest.raises(tif.errors.IncompleteStoreError, match="24 rows written"):
        tif.open_store(url)
    resumed = tif.build_store(loss, ckpts, loader, projection=PROJ, store=tiny(url))
    whole = tif.build_store(loss, ckpts, batches(x, y), projection=PROJ,
                            store=tiny(tmp_path / "whole.zarr"))
    assert resumed.meta == whole.meta and torch.equal(all_rows(resumed), all_rows(whole))


def test_sharded_build_on_s3_commits_to_the_one_process_store(mlp_setup32, tmp_path, bucket):
    loss, ckpts, (x, y), _ = mlp_setup32
    url = f"s3://{bucket}/grads.zarr"
    for index in (1, 0):
        tif.build_store(loss, ckpts, batches(x, y), projection=PROJ,
                        store=tiny(url, tif.store.PartWriter), shard=(index, 2))
    whole = tif.build_store(loss, ckpts, batches(x, y), projection=PROJ,
                            store=tiny(tmp_path / "whole.zarr"))
    assert torch.equal(all_rows(tif.store.commit_store(url)), all_rows(whole))


def test_corrupted_and_missing_objects_are_reported(mlp_setup32, bucket, s3_server, read_path):
    loss, ckpts, (x, y), _ = mlp_setup32
    url = f"s3://{bucket}/grads.zarr"
    tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, store=tiny(url))
    key = "grads.zarr/rows/1/c/2/0"  # the shard of rows [16, 24) of checkpoint 1
    data = bytearray(s3_server.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[10] ^= 0x40
    s3_server.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    store = tif.open_store(url)
    store.read_rows(1, 0, 16)  # other shards still read
    with pytest.raises(tif.errors.CorruptStoreError, match=r"'epoch-1'.*rows \[16, 24\)"):
        store.read_rows(1, 16, 24)
    with pytest.raises(tif.errors.CorruptStoreError):
        tif.verify_store(store)
    s3_server.delete_object(Bucket=bucket, Key="grads.zarr/rows/0/c/3/0")
    with pytest.raises(tif.errors.CorruptStoreError, match="missing"):
        tif.open_store(url).read_rows(0, 20, 30)
    result = cli_here("info", url, "--verify", cwd=".")
    assert result.returncode == 1 and "damaged" in result.stderr


def test_raw_reads_of_any_row_range_equal_zarrs_own_decoding(bucket, s3_server, read_path):
    """Ranges that start and end inside chunks, span shards and objects, and a truncated
    object (its index is gone: reported, not read as zeros)."""
    meta = new_store_meta(
        [("c0", 1.0, "f")], tif.projection.canonical_layout({"w": (24,)}),
        tif.Projection(dim=None, kind="identity"), torch.float32, None)
    writer = tif.store.ZarrWriter(f"s3://{bucket}/g.zarr", meta, chunk_rows=4, shard_rows=12)
    rows = torch.randn(1, 50, 24, generator=torch.Generator().manual_seed(0))
    writer.append(rows, rows.norm(dim=-1))
    store = writer.finish()
    store = tif.open_store(f"s3://{bucket}/g.zarr")
    for start, stop in [(0, 50), (1, 3), (3, 29), (11, 13), (12, 24), (47, 50), (5, 5)]:
        assert torch.equal(store.read_rows(0, start, stop), rows[0, start:stop])
        assert torch.equal(torch.from_numpy(store._rows[0][start:stop]), rows[0, start:stop])
    key = "g.zarr/rows/0/c/1/0"  # rows [12, 24)
    body = s3_server.get_object(Bucket=bucket, Key=key)["Body"].read()
    s3_server.put_object(Bucket=bucket, Key=key, Body=body[:-30])
    with pytest.raises(tif.errors.CorruptStoreError, match=r"rows \[10, 14\).*rows/0/c/1/0"):
        tif.open_store(f"s3://{bucket}/g.zarr").read_rows(0, 10, 14)


def test_reads_fall_back_to_s3fs_without_obstore(monkeypatch):
    from tracinfunc.store.zarr.object_reads import object_store_for_reads

    monkeypatch.setitem(sys.modules, "obstore.store", None)  # import fails as if not installed
    assert object_store_for_reads("s3://bucket/grads.zarr") is None
    assert object_store_for_reads("memory://grads.zarr") is None


def test_one_writer_per_store_url(mlp_setup32, bucket, s3_server):
    """Issue 16 on object storage: a second writer of one URL is refused, never interleaved."""
    loss, ckpts, (x, y), _ = mlp_setup32
    url = f"s3://{bucket}/locked.zarr"
    meta = tif.build_store(loss, ckpts, (x, y), projection=PROJ).meta.replace(
        n_train=0, complete=False)
    first = tif.store.ZarrWriter(url, meta)
    assert s3_server.head_object(Bucket=bucket, Key=".locked.zarr.lock")
    with pytest.raises(tif.errors.StoreLockedError, match=r"is writing to 's3://.*locked.zarr'.*"
                                                   r"delete the lock object"):
        _other_process_writer(url, meta)
    rows = torch.zeros(meta.n_ckpt, 3, meta.k)
    first.append(rows, rows.norm(dim=-1))
    first.finish()
    with pytest.raises(s3_server.exceptions.ClientError):
        s3_server.head_object(Bucket=bucket, Key=".locked.zarr.lock")  # released


def _other_process_writer(url, meta):
    """A writer as another process would make it (this process's own takeover bypassed)."""
    from tracinfunc.store.zarr import lock

    held = dict(lock._HELD)
    lock._HELD.clear()
    try:
        return tif.store.ZarrWriter(url, meta)
    finally:
        lock._HELD.update(held)


def test_edited_metadata_on_s3_is_refused(mlp_setup32, bucket, s3_server):
    """Issue 16 on object storage: the metadata scoring depends on carries a checksum."""
    loss, ckpts, (x, y), _ = mlp_setup32
    url = f"s3://{bucket}/grads.zarr"
    tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, store=tiny(url))
    key = "grads.zarr/zarr.json"
    document = json.loads(s3_server.get_object(Bucket=bucket, Key=key)["Body"].read())
    document["attributes"]["tracinfunc"]["checkpoints"][0]["lr"] = 10.0
    s3_server.put_object(Bucket=bucket, Key=key, Body=json.dumps(document).encode())
    with pytest.raises(tif.errors.CorruptStoreError, match="does not match its checksum"):
        tif.open_store(url)


def test_cli_builds_verifies_and_scores_a_store_on_s3(bucket, tmp_path):
    url = f"s3://{bucket}/grads.zarr"
    args = ("--spec", f"{SPEC}:make", "--projection", "rademacher:32:7", "--quiet")
    built = cli_here("build", *args, "--out", url, cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    info = cli_here("info", url, "--verify", cwd=tmp_path)
    assert info.returncode == 0 and "n_train=24" in info.stdout, info.stderr
    assert cli_here("build", *args, "--out", "local.zarr", cwd=tmp_path).returncode == 0
    for store, output in ((url, "remote.npy"), ("local.zarr", "local.npy")):
        result = cli_here("score", store, "--spec", f"{SPEC}:make", "--output", output,
                          cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    import numpy as np

    # to rounding: S3 chunks are read into pieces, local ones lent, and BLAS sums by shape
    # (docs/concepts/stores.md, "Same pieces, same bits")
    np.testing.assert_allclose(np.load(tmp_path / "remote.npy"), np.load(tmp_path / "local.npy"),
                               rtol=1e-6, atol=1e-7)


def test_a_dropped_writer_frees_its_lock_even_when_collected_on_fsspecs_loop_thread(
        bucket, s3_server):
    """The garbage collector may run a dropped lock's __del__ on fsspec's event-loop thread;
    a blocking delete there waited on itself forever (a whole test run hung)."""
    import asyncio
    import gc
    import time

    from tracinfunc.store.zarr.lock import RemoteLock
    from tracinfunc.store.zarr.urls import filesystem

    url = f"s3://{bucket}/dropped.zarr"
    held = [RemoteLock(url)]
    assert s3_server.head_object(Bucket=bucket, Key=".dropped.zarr.lock")

    async def drop_on_the_loop_thread():
        held.clear()
        gc.collect()

    fs, _ = filesystem(url)
    asyncio.run_coroutine_threadsafe(drop_on_the_loop_thread(), fs.loop).result(timeout=20)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the delete was scheduled, not waited for
        listed = s3_server.list_objects_v2(Bucket=bucket, Prefix=".dropped").get("Contents", [])
        if not listed:
            break
        time.sleep(0.05)
    assert not listed
    RemoteLock(url).release()  # free for the next writer


@pytest.mark.parametrize("dtype", ["int8", "sign"])
def test_a_quantised_store_on_s3_reads_like_a_local_one(mlp_setup32, tmp_path, bucket,
                                                       s3_server, dtype):
    loss, ckpts, (x, y), _ = mlp_setup32
    url = f"s3://{bucket}/{dtype}.zarr"
    local = tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, dtype=dtype,
                            store=tiny(tmp_path / "local.zarr"))
    tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, dtype=dtype, store=tiny(url))
    opened = tif.open_store(url)
    assert opened.meta == local.meta and opened.meta.quantization == dtype
    assert torch.equal(all_rows(opened), all_rows(local))
    assert torch.equal(opened.read_codes(2, 3, 29)[0], local.read_codes(2, 3, 29)[0])
    tif.verify_store(opened)
    s3_server.delete_object(Bucket=bucket, Key=f"{dtype}.zarr/scales/0/c/1")  # rows [8, 16)
    with pytest.raises(tif.errors.CorruptStoreError, match=r"'epoch-0'.*missing"):
        tif.open_store(url).read_rows(0, 10, 12)


def _swap(s3_server, bucket, first, second):
    bodies = [s3_server.get_object(Bucket=bucket, Key=key)["Body"].read()
              for key in (first, second)]
    assert bodies[0] != bodies[1]
    for key, body in zip((second, first), bodies, strict=True):
        s3_server.put_object(Bucket=bucket, Key=key, Body=body)


def _scores(url, loss, ckpts, test):
    test_grads = tif.build_store(loss, ckpts, test, projection=PROJ)
    return tif.score(tif.open_store(url), test_grads)


def test_edited_array_metadata_on_s3_is_refused(mlp_setup32, bucket, s3_server):
    """Issue 25 item 8: 'rows/0/zarr.json' edited to big-endian gave NaN scores on S3 (the
    local seal refuses it): array metadata objects are checked against the sealed manifest."""
    loss, ckpts, (x, y), test = mlp_setup32
    url = f"s3://{bucket}/grads.zarr"
    tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, store=tiny(url))
    key = "grads.zarr/rows/0/zarr.json"
    document = json.loads(s3_server.get_object(Bucket=bucket, Key=key)["Body"].read())
    inner = document["codecs"][0]["configuration"]["codecs"]
    assert inner[0]["name"] == "bytes"
    inner[0]["configuration"] = {"endian": "big"}
    s3_server.put_object(Bucket=bucket, Key=key, Body=json.dumps(document).encode())
    with pytest.raises(tif.errors.CorruptStoreError,
                       match=r"rows/0/zarr.json' differs from the object the store was sealed"):
        _scores(url, loss, ckpts, test)


@pytest.mark.parametrize("kind", ["rows", "norms"])
def test_swapped_shard_objects_on_s3_are_refused(mlp_setup32, bucket, s3_server, read_path,
                                                 kind):
    """Issue 25 item 8: swapping the shard objects c/0/0 and c/1/0 changed scores on S3 (the
    local seal refuses it): each object's size and tail are bound to its key by the seal."""
    loss, ckpts, (x, y), test = mlp_setup32
    url = f"s3://{bucket}/grads.zarr"
    tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, store=tiny(url))
    before = _scores(url, loss, ckpts, test)
    name = {"rows": "rows/0/c/{}/0", "norms": "norms/0/c/{}"}[kind]
    _swap(s3_server, bucket, *(f"grads.zarr/{name.format(i)}" for i in (0, 1)))
    store = tif.open_store(url)
    read = {"rows": store.read_rows, "norms": store.read_norms}[kind]
    read(0, 16, 40)  # the shards not swapped still read
    with pytest.raises(tif.errors.CorruptStoreError,
                       match=rf"{name.format(0)}' is not the object sealed at this position"):
        read(0, 0, 8)
    with pytest.raises(tif.errors.CorruptStoreError, match="sealed at this position"):
        tif.verify_store(tif.open_store(url))
    _swap(s3_server, bucket, *(f"grads.zarr/{name.format(i)}" for i in (0, 1)))  # put back
    assert torch.equal(_scores(url, loss, ckpts, test), before)


def test_a_sharded_store_on_s3_is_sealed_with_its_objects(mlp_setup32, bucket, s3_server):
    loss, ckpts, (x, y), _ = mlp_setup32
    url = f"s3://{bucket}/grads.zarr"
    for index in (0, 1):
        tif.build_store(loss, ckpts, batches(x, y), projection=PROJ,
                        store=tiny(url, tif.store.PartWriter), shard=(index, 2))
    files = tif.store.commit_store(url)._group.attrs["tracinfunc"]["integrity"]["files"]
    assert "rows/0/c/0/0" in files and "rows/0/zarr.json" in files
    _swap(s3_server, bucket, "grads.zarr/rows/1/c/0/0", "grads.zarr/rows/1/c/2/0")
    with pytest.raises(tif.errors.CorruptStoreError, match="sealed at this position"):
        tif.open_store(url).read_rows(1, 0, 40)


def test_a_store_sealed_without_an_object_manifest_needs_the_opt_in(mlp_setup32, bucket,
                                                                    s3_server):
    """Stores written to S3 before manifests carry a metadata checksum only: their placement
    cannot be checked, so they open only with allow_unsealed=True (and a warning-free read)."""
    from tracinfunc.store.zarr.integrity import digest

    loss, ckpts, (x, y), _ = mlp_setup32
    url = f"s3://{bucket}/grads.zarr"
    built = tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, store=tiny(url))
    key = "grads.zarr/zarr.json"
    document = json.loads(s3_server.get_object(Bucket=bucket, Key=key)["Body"].read())
    meta = document["attributes"]["tracinfunc"]
    meta["integrity"] = {"algorithm": "sha256", "digest": digest(meta, {}), "files": {}}
    s3_server.put_object(Bucket=bucket, Key=key, Body=json.dumps(document).encode())
    with pytest.raises(tif.errors.CorruptStoreError, match="allow_unsealed=True"):
        tif.open_store(url)
    opened = tif.open_store(url, allow_unsealed=True)
    assert torch.equal(all_rows(opened), all_rows(built))


def test_a_sharded_build_on_s3_names_a_stale_creation_lock(mlp_setup32, bucket, s3_server,
                                                           monkeypatch):
    """Issue 25 item 14 on object storage: a creator killed while making the layout leaves its
    lock object; the next part names it (after the wait, here made zero) instead of blaming
    the path."""
    from tracinfunc.store.zarr import part_layout

    monkeypatch.setattr(part_layout, "_CREATE_WAIT_S", 0.0)
    s3_server.put_object(Bucket=bucket, Key=".grads.zarr.create.lock", Body=b"{}")
    loss, ckpts, (x, y), _ = mlp_setup32
    with pytest.raises(tif.errors.StoreLockedError, match=r"grads.zarr.create.lock"):
        tif.build_store(loss, ckpts, batches(x, y), projection=PROJ,
                        store=tiny(f"s3://{bucket}/grads.zarr", tif.store.PartWriter),
                        shard=(0, 2))
