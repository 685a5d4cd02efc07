"""torchrun builds and scoring (gloo on CPU), the CLI's --shard and commit, and the exact
merge of partial top-k results."""

from __future__ import annotations

import functools
import itertools
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tracinfunc as tif
from tests.build.test_shards_build import PROJ, SHARD_ROWS, batches, files_of
from tests.cli.test_cli import SPEC, cli_here
from tests.conftest import child_env
from tracinfunc.build.loop import new_store_meta

ROOT = Path(__file__).resolve().parents[2]

# Run by every torchrun rank: a sharded build (rank 0 commits after a barrier), then each rank
# scans its own rows and gathers the top-k on every rank.
_WORKER = """
import functools, sys, torch
import torch.distributed as dist
import torch.nn.functional as F
import tracinfunc as tif
from tests.conftest import make_checkpoints, make_data, make_mlp
from tests.build.test_shards_build import PROJ, SHARD_ROWS, batches
out = sys.argv[1]
dist.init_process_group("gloo")
model = make_mlp(dtype=torch.float32).eval()
loss = tif.loss_from_module(model, F.cross_entropy)
x, y = make_data(40, dtype=torch.float32, seed=1)
writer = functools.partial(tif.store.PartWriter, out + "/grads.zarr", chunk_rows=4,
                           shard_rows=SHARD_ROWS)
store = tif.build_store(loss, make_checkpoints(model), batches(x, y), projection=PROJ,
                        store=writer)
assert store.meta.complete and store.meta.n_train == 40
test = tif.build_store(loss, make_checkpoints(model), make_data(7, dtype=torch.float32, seed=3),
                       projection=PROJ)
rows = tif.distributed.rank_rows(40)
values, indices = tif.top_k(store, test, k=5, rows=rows)
assert indices.min() >= rows[0] and indices.max() < rows[1]
values, indices = tif.distributed.gather_top_k(values, indices, 5)
torch.save((values, indices), f"{out}/top_k-{dist.get_rank()}.pt")
# Every rank past its last collective before any tears gloo down: without it, a CI run saw
# rank 0 abort ("terminate called without an active exception") in the teardown.
dist.barrier()
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env() -> dict[str, str]:
    """This checkout's tracinfunc in subprocesses, one thread each (2 shared cores)."""
    return child_env(OMP_NUM_THREADS="1")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracinfunc", *args], capture_output=True,
                          text=True, cwd=cwd, env=env(), timeout=120)


def torchrun(n: int, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env(),
                          timeout=120)


@pytest.mark.parametrize("n", [2, 3])
def test_torchrun_build_equals_one_process_and_gathered_top_k_equals_one_scan(
        mlp_setup32, tmp_path, n):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    result = torchrun(n, str(script), str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    loss, ckpts, (x, y), test = mlp_setup32
    whole = tif.build_store(loss, ckpts, batches(x, y), projection=PROJ, store=functools.partial(
        tif.store.ZarrWriter, tmp_path / "whole.zarr", chunk_rows=4, shard_rows=SHARD_ROWS))
    assert files_of(tmp_path / "grads.zarr") == files_of(tmp_path / "whole.zarr")
    expected = tif.top_k(whole, tif.build_store(loss, ckpts, test, projection=PROJ), k=5)
    for rank in range(n):
        values, indices = torch.load(tmp_path / f"top_k-{rank}.pt")
        assert torch.equal(indices, expected[1]) and torch.equal(values, expected[0])


def test_torchrun_cli_build_equals_a_one_process_cli_build(tmp_path):
    one = cli("build", "--spec", f"{SPEC}:make", "--out", "one.zarr", "--projection",
              "rademacher:32:7", "--batch-size", "5", "--quiet", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    two = torchrun(2, "-m", "tracinfunc", "build", "--spec", f"{SPEC}:make", "--out",
                   "two.zarr", "--projection", "rademacher:32:7", "--batch-size", "5",
                   "--quiet", cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    # Rows and norms bit for bit; the files differ only in their layout (parts get about
    # four shards each by default, so that both ranks have rows to compute).
    two_store, one_store = (
        tif.open_store(tmp_path / "two.zarr"),
        tif.open_store(tmp_path / "one.zarr"),
    )
    assert two_store.meta == one_store.meta
    n = one_store.meta.n_train
    for c in range(one_store.meta.n_ckpt):
        assert torch.equal(two_store.read_rows(c, 0, n), one_store.read_rows(c, 0, n))
        assert torch.equal(two_store.read_norms(c, 0, n), one_store.read_norms(c, 0, n))


def test_cli_shards_then_commit(tmp_path):
    args = ("--spec", f"{SPEC}:make", "--out", "grads.zarr", "--projection", "rademacher:32:7",
            "--quiet")
    first = cli_here("build", *args, "--shard", "1/2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "tracinfunc commit grads.zarr" in first.stdout
    early = cli_here("commit", "grads.zarr", cwd=tmp_path)
    assert early.returncode == 1 and "parts [0] of 2" in early.stderr
    info = cli_here("info", "grads.zarr", cwd=tmp_path)
    assert "sharded build: parts [1] of 2 done" in info.stdout, info.stderr
    assert cli_here("info", "grads.zarr", "--verify", cwd=tmp_path).returncode == 1
    assert cli_here("build", *args, "--shard", "0/2", cwd=tmp_path).returncode == 0
    done = cli_here("commit", "grads.zarr", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert cli_here("info", "grads.zarr", "--verify", cwd=tmp_path).returncode == 0
    bad = cli_here("build", *args, "--shard", "2/2", cwd=tmp_path)
    assert bad.returncode == 2 and "0 <= I < N" in bad.stderr


def brute_top_k(scores: torch.Tensor, k: int, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Python sort of every row: best score first, equal scores by lower row index."""
    values, indices = [], []
    for row in scores.tolist():
        order = sorted(range(len(row)), key=lambda j: (-row[j] if largest else row[j], j))[:k]
        values.append([row[j] for j in order])
        indices.append(order)
    return torch.tensor(values, dtype=scores.dtype), torch.tensor(indices)


@pytest.mark.parametrize("largest", [True, False])
def test_merged_top_k_of_row_ranges_equals_one_scan_with_ties(largest):
    torch.manual_seed(0)
    # Few distinct values: many ties, straddling every split and chunk boundary.
    train = torch.randint(-2, 3, (2, 37, 4)).double()
    test = torch.randint(-2, 3, (2, 5, 4)).double()
    store = _memory_store(train)
    expected = brute_top_k(tif.score(store, test), 9, largest)
    one = tif.top_k(store, test, 9, largest=largest, chunk_rows=5)
    assert torch.equal(one[1], expected[1]) and torch.equal(one[0], expected[0])
    for splits in ([0, 37], [0, 11, 37], [0, 3, 20, 30, 37]):
        parts = [tif.top_k(store, test, min(9, b - a), largest=largest, rows=(a, b),
                           chunk_rows=4) for a, b in itertools.pairwise(splits)]
        merged = tif.distributed.merge_top_k(parts, 9, largest=largest)
        assert torch.equal(merged[1], expected[1]) and torch.equal(merged[0], expected[0])


def test_row_ranges_of_score_and_self_influence_are_slices_of_the_whole():
    torch.manual_seed(1)
    train, test = torch.randn(2, 23, 4).double(), torch.randn(2, 3, 4).double()
    store = _memory_store(train)
    assert torch.equal(tif.score(store, test, rows=(5, 17)), tif.score(store, test)[:, 5:17])
    assert torch.equal(tif.self_influence(store, rows=(5, 17)), tif.self_influence(store)[5:17])
    with pytest.raises(tif.errors.RowRangeError, match="rows must be"):
        tif.score(store, test, rows=(17, 5))


def _memory_store(train: torch.Tensor) -> tif.GradientStore:
    """A float64 MemoryStore of ``train`` [n_ckpt, n_train, k] with lrs 0.5, 0.25."""
    meta = new_store_meta([("a", 0.5, "f"), ("b", 0.25, "g")],
                          tif.projection.canonical_layout({"w": (train.shape[2],)}),
                          tif.Projection(dim=None, kind="identity"), torch.float64, None)
    writer = tif.store.MemoryWriter(meta)
    writer.append(train, train.norm(dim=-1))
    return writer.finish()
