"""Commit compares the parts with each other (issue 25 item 4, the part left open): a whole
part built from other data, or with other build options (mixed_precision), is never sealed
into the store. Each part records its build options and a fingerprint of the inputs it saw
(rows before its first row, and through its last) in its marker; commit compares them."""

from __future__ import annotations

import functools
import shutil

import pytest
import torch

import tracinfunc as tif
from tests.build.test_shards_build import (
    PROJ,
    SHARD_ROWS,
    DyingDataset,
    batches,
    build_whole,
    files_of,
)
from tracinfunc.store.zarr.parts import read_parts


def _part(mlp_setup32, path, index, count, *, data=None, **kwargs):
    loss, ckpts, (x, y), _ = mlp_setup32
    writer = functools.partial(tif.store.PartWriter, path, chunk_rows=4, shard_rows=SHARD_ROWS)
    return tif.build_store(loss, ckpts, data or batches(x, y), projection=PROJ, store=writer,
                           shard=(index, count), **kwargs)


def test_a_part_built_with_mixed_precision_is_not_committed(mlp_setup32, tmp_path):
    path = tmp_path / "g.zarr"
    _part(mlp_setup32, path, 0, 2)
    _part(mlp_setup32, path, 1, 2,
          options=tif.GradientOptions(mixed_precision=torch.bfloat16))
    with pytest.raises(tif.errors.IncompatibleGradientsError,
                       match=r"part 1 of 2 .*mixed_precision 'bfloat16'.*None \(part 0\)"):
        tif.store.commit_store(path)
    with pytest.raises(tif.errors.IncompleteStoreError):
        tif.open_store(path)  # nothing sealed
    # The fix the error names: drop part 1's progress and run it again like the others.
    shutil.rmtree(path / "parts" / "1")
    _part(mlp_setup32, path, 1, 2)
    build_whole(mlp_setup32, tmp_path / "whole.zarr")
    tif.store.commit_store(path)
    assert files_of(path) == files_of(tmp_path / "whole.zarr")


@pytest.mark.parametrize("other", [0, 1, 2], ids=["first", "middle", "last"])
def test_a_whole_part_built_from_other_data_is_not_committed(mlp_setup32, tmp_path, other):
    """The data of the same size (a shuffled copy): each part alone looks fine, and before,
    the three were sealed into one store holding two datasets."""
    _, _, (x, y), _ = mlp_setup32
    path = tmp_path / "g.zarr"
    shuffled = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    for index in range(3):
        data = batches(x[shuffled], y[shuffled]) if index == other else None
        _part(mlp_setup32, path, index, 3, data=data)
    with pytest.raises(tif.errors.IncompatibleGradientsError,
                       match=r"parts .* saw different data"):
        tif.store.commit_store(path)


def test_parts_of_the_same_data_in_other_batches_commit(mlp_setup32, tmp_path):
    """The fingerprint is of the examples, not of how they are batched."""
    _, _, (x, y), _ = mlp_setup32
    path = tmp_path / "g.zarr"
    _part(mlp_setup32, path, 0, 3, data=batches(x, y, size=3))
    _part(mlp_setup32, path, 1, 3, data=batches(x, y, size=7))
    _part(mlp_setup32, path, 2, 3)
    states = read_parts(path)
    assert all(s["inputs"]["through"] for s in states)
    assert tif.store.commit_store(path).meta.complete


def test_a_part_resumed_with_other_options_is_refused_at_once(mlp_setup32, tmp_path):
    _, _, (x, y), _ = mlp_setup32
    path = tmp_path / "g.zarr"

    loader = torch.utils.data.DataLoader(DyingDataset(x, y, die_at=30), batch_size=6)
    with pytest.raises(KeyboardInterrupt):
        _part(mlp_setup32, path, 1, 2, data=loader)
    assert read_parts(path)[1]["rows_written"] > read_parts(path)[1]["start"]
    with pytest.raises(tif.errors.IncompatibleGradientsError,
                       match=r"part 1 .* started with mixed_precision None but now with "
                             r"'float16'"):
        _part(mlp_setup32, path, 1, 2,
              options=tif.GradientOptions(mixed_precision=torch.float16))
    assert _part(mlp_setup32, path, 1, 2).complete


def test_cli_commit_names_a_part_built_with_mixed_precision(tmp_path):
    from tests.cli.test_cli import SPEC, cli_here

    args = ("--spec", f"{SPEC}:make", "--out", "grads.zarr", "--projection", "rademacher:32:7",
            "--quiet")
    assert cli_here("build", *args, "--shard", "0/2", cwd=tmp_path).returncode == 0
    assert cli_here("build", *args, "--shard", "1/2", "--mixed-precision", "bf16",
                    cwd=tmp_path).returncode == 0
    commit = cli_here("commit", "grads.zarr", cwd=tmp_path)
    assert commit.returncode == 1
    assert "part 1 of 2" in commit.stderr and "mixed_precision 'bfloat16'" in commit.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.txt").write_text("x")
    mine = ("--spec", f"{SPEC}:make", "--out", "mine", "--projection", "rademacher:32:7")
    refused = cli_here("build", *mine, "--quiet", "--shard", "0/2", cwd=tmp_path)
    assert refused.returncode == 1 and "'a.txt'" in refused.stderr, refused.stderr


def test_a_finished_part_run_again_over_other_data_is_refused(mlp_setup32, tmp_path):
    """Example 8 replaced: the batches that prove the stored rows ([0, 6) and [12, 18)) do
    not hold it, the part's fingerprint does."""
    _, _, (x, y), _ = mlp_setup32
    path = tmp_path / "g.zarr"
    _part(mlp_setup32, path, 0, 2)  # rows [0, 16)
    recorded = read_parts(path)[0]
    x2 = x.clone()
    x2[8] = x[30]
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="written from other data"):
        _part(mlp_setup32, path, 0, 2, data=batches(x2, y))
    assert read_parts(path)[0] == recorded
    assert _part(mlp_setup32, path, 0, 2).complete  # the same data: nothing to do
