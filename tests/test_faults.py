"""Faults around writes (issue 16): overwriting in place, results over stores, lost writes."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import torch

import tracinfunc as tif
from tests.test_tamper import LAYOUTS, N_TRAIN, memory_store
from tracinfunc.cli import main


def rows_of(store) -> torch.Tensor:
    return torch.stack([store.read_rows(c, 0, store.n_train) for c in range(store.n_ckpt)])


def run_cli(*args: str, cwd: Path) -> tuple[int, str]:
    stderr = io.StringIO()
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            try:
                code = main(list(args))
            except SystemExit as exit_:
                code = exit_.code
    finally:
        os.chdir(previous)
    return code, stderr.getvalue()


@pytest.mark.parametrize("how", ["to_zarr", "save_store", "save_store-zstd"])
def test_overwriting_a_store_with_itself_keeps_its_rows(tmp_path, how):
    source = memory_store()
    store = tif.save_store(source, tmp_path / "g.zarr", progress=False, **LAYOUTS["raw-sharded"])
    if how == "to_zarr":
        again = store.to_zarr(store.path, overwrite=True, progress=False)
    else:
        options = {"compression": "zstd"} if how.endswith("zstd") else {}
        again = tif.save_store(store, store.path, overwrite=True, progress=False, **options)
    assert again.path == store.path
    assert torch.equal(rows_of(tif.open_store(store.path)), rows_of(source))
    tif.verify_store(again, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zarr"]  # no temporaries left


def test_overwrite_refuses_a_directory_that_is_not_a_store(tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "thesis.tex").write_text("years of work")
    with pytest.raises(tif.StoreExistsError, match="not a tracinfunc store"):
        tif.save_store(memory_store(), target, overwrite=True, progress=False)
    assert (target / "thesis.tex").read_text() == "years of work"


@pytest.fixture
def store_dir(tmp_path):
    tif.save_store(memory_store(), tmp_path / "g.zarr", progress=False)
    return tmp_path


@pytest.mark.parametrize("command", ["self-influence", "score"])
def test_cli_output_over_its_own_input_store_is_refused(store_dir, command):
    extra = ["--test-store", "g.zarr"] if command == "score" else []
    code, stderr = run_cli(command, "g.zarr", *extra, "--output", "g.zarr", "--overwrite",
                           cwd=store_dir)
    assert code != 0 and "gradient store" in stderr, stderr
    assert torch.equal(rows_of(tif.open_store(store_dir / "g.zarr")), rows_of(memory_store()))


def test_cli_overwrite_refuses_a_directory_it_did_not_write(store_dir):
    other = store_dir / "notes.zarr"
    other.mkdir()
    (other / "keep.txt").write_text("keep")
    code, stderr = run_cli("self-influence", "g.zarr", "--output", "notes.zarr", "--overwrite",
                           cwd=store_dir)
    assert code != 0 and "not a result" in stderr, stderr
    assert (other / "keep.txt").read_text() == "keep"
    # a result directory the CLI wrote itself is still replaced
    assert run_cli("self-influence", "g.zarr", "--output", "si.zarr", cwd=store_dir)[0] == 0
    code, stderr = run_cli("self-influence", "g.zarr", "--output", "si.zarr", "--overwrite",
                           cwd=store_dir)
    assert code == 0, stderr
    attrs = json.loads((store_dir / "si.zarr" / "zarr.json").read_text())["attributes"]
    assert attrs.get("tracinfunc_results") is True


def test_an_empty_shard_in_a_finished_store_fails_verify_in_the_cli(store_dir):
    """Finding 1 end to end: `info --verify` exited 0 on a store with an emptied norms shard."""
    os.truncate(store_dir / "g.zarr" / "norms" / "0" / "c" / "0", 0)
    code, stderr = run_cli("info", "g.zarr", "--verify", cwd=store_dir)
    assert code != 0 and "norms/0/c/0" in stderr, stderr


def test_self_influence_is_exact_after_a_round_trip(store_dir):
    store = tif.open_store(store_dir / "g.zarr")
    rows = rows_of(memory_store()).double()
    lrs = torch.tensor(store.meta.lrs, dtype=torch.float64)
    expected = torch.einsum("c,cnk->n", lrs, rows * rows)
    torch.testing.assert_close(tif.self_influence(store).double(), expected, rtol=1e-5,
                               atol=1e-6)
    assert expected.shape == (N_TRAIN,)
