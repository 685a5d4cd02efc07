"""Stores on S3, against moto's S3-compatible server on 127.0.0.1 (never a network service):
build, open, score, resume, sharded builds, CLI info --verify, and corruption detection."""

from __future__ import annotations

import functools
import json

import boto3
import pytest
import torch

import tracinfunc as tif
from tests.test_cli import SPEC, cli_here
from tests.test_shards_build import PROJ, SHARD_ROWS, DyingDataset, batches


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
    name = "grads-" + request.node.name.lower().replace("_", "-")[:40].strip("-")
    s3_server.create_bucket(Bucket=name)
    return name


def tiny(path, cls=tif.ZarrWriter):
    return functools.partial(cls, path, chunk_rows=4, shard_rows=SHARD_ROWS)


def all_rows(store):
    return torch.stack([store.read_rows(c, 0, store.meta.n_train)
                        for c in range(store.meta.n_ckpt)])


def test_round_trip_open_and_score_equal_a_local_store(mlp_setup32, tmp_path, bucket):
    loss, ckpts, (x, y), test = mlp_setup32
    url = f"s3://{bucket}/grads.zarr"
    local = tif.build_store(loss, ckpts, batches(x, y), projection=PROJ,
                            store=tiny(tmp_path / "local.zarr"))
    remote = tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, store=tiny(url))
    opened = tif.open_store(url)
    assert opened.path == url and opened.meta == local.meta and not opened.raw_reads
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
    with pytest.raises(tif.IncompleteStoreError, match="24 rows written"):
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
                        store=tiny(url, tif.PartWriter), shard=(index, 2))
    whole = tif.build_store(loss, ckpts, batches(x, y), projection=PROJ,
                            store=tiny(tmp_path / "whole.zarr"))
    assert torch.equal(all_rows(tif.commit_store(url)), all_rows(whole))


def test_corrupted_and_missing_objects_are_reported(mlp_setup32, bucket, s3_server):
    loss, ckpts, (x, y), _ = mlp_setup32
    url = f"s3://{bucket}/grads.zarr"
    tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, store=tiny(url))
    key = "grads.zarr/rows/1/c/2/0"  # the shard of rows [16, 24) of checkpoint 1
    data = bytearray(s3_server.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[10] ^= 0x40
    s3_server.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    store = tif.open_store(url)
    store.read_rows(1, 0, 16)  # other shards still read
    with pytest.raises(tif.CorruptStoreError, match=r"'epoch-1'.*rows \[16, 24\)"):
        store.read_rows(1, 16, 24)
    with pytest.raises(tif.CorruptStoreError):
        tif.verify_store(store)
    s3_server.delete_object(Bucket=bucket, Key="grads.zarr/rows/0/c/3/0")
    with pytest.raises(tif.CorruptStoreError, match="missing"):
        tif.open_store(url).read_rows(0, 20, 30)
    result = cli_here("info", url, "--verify", cwd=".")
    assert result.returncode == 1 and "damaged" in result.stderr


def test_one_writer_per_store_url(mlp_setup32, bucket, s3_server):
    """Issue 16 on object storage: a second writer of one URL is refused, never interleaved."""
    loss, ckpts, (x, y), _ = mlp_setup32
    url = f"s3://{bucket}/locked.zarr"
    meta = tif.build_store(loss, ckpts, (x, y), projection=PROJ).meta.replace(
        n_train=0, complete=False)
    first = tif.ZarrWriter(url, meta)
    assert s3_server.head_object(Bucket=bucket, Key=".locked.zarr.lock")
    with pytest.raises(tif.StoreLockedError, match=r"is writing to 's3://.*locked.zarr'.*"
                                                   r"delete the lock object"):
        _other_process_writer(url, meta)
    rows = torch.zeros(meta.n_ckpt, 3, meta.k)
    first.append(rows, rows.norm(dim=-1))
    first.finish()
    with pytest.raises(s3_server.exceptions.ClientError):
        s3_server.head_object(Bucket=bucket, Key=".locked.zarr.lock")  # released


def _other_process_writer(url, meta):
    """A writer as another process would make it (this process's own takeover bypassed)."""
    from tracinfunc.store import lock

    held = dict(lock._HELD)
    lock._HELD.clear()
    try:
        return tif.ZarrWriter(url, meta)
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
    with pytest.raises(tif.CorruptStoreError, match="does not match its checksum"):
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

    assert np.array_equal(np.load(tmp_path / "remote.npy"), np.load(tmp_path / "local.npy"))


@pytest.mark.parametrize("dtype", ["int8", "sign"])
def test_a_quantised_store_on_s3_reads_like_a_local_one(mlp_setup32, tmp_path, bucket,
                                                       s3_server, dtype):
    loss, ckpts, (x, y), _ = mlp_setup32
    url = f"s3://{bucket}/{dtype}.zarr"  # the bucket's name is the same for both dtypes
    local = tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, dtype=dtype,
                            store=tiny(tmp_path / "local.zarr"))
    tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, dtype=dtype, store=tiny(url))
    opened = tif.open_store(url)
    assert opened.meta == local.meta and opened.meta.quantization == dtype
    assert torch.equal(all_rows(opened), all_rows(local))
    assert torch.equal(opened.read_codes(2, 3, 29)[0], local.read_codes(2, 3, 29)[0])
    tif.verify_store(opened)
    s3_server.delete_object(Bucket=bucket, Key=f"{dtype}.zarr/scales/0/c/1")  # rows [8, 16)
    with pytest.raises(tif.CorruptStoreError, match=r"'epoch-0'.*missing"):
        tif.open_store(url).read_rows(0, 10, 12)
