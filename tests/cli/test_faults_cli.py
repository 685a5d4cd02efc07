"""Command-line faults of issue 25: item 3 (--output inside a store or an index) and item 15
(--checkpoints errors and names with @, crafted names printed raw by info, dtype names)."""

from __future__ import annotations

import re

import pytest
import torch

import tracinfunc as tif
from tests.cli.test_cli import SPEC, _tiny_spec, cli_here


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults_cli")
    result = cli_here("build", "--spec", f"{SPEC}:make", "--out", "grads.zarr",
                      "--projection", "rademacher:16:7", "--quiet", cwd=root)
    assert result.returncode == 0, result.stderr
    return root


def _files(path):
    return {p.relative_to(path).as_posix(): p.read_bytes()
            for p in sorted(path.rglob("*")) if p.is_file()}


# ---- item 3: --output never inside a store or an index ----------------------------------------

@pytest.mark.parametrize("output", ["grads.zarr/zarr.json", "grads.zarr/rows/0/si.npy",
                                    "grads.zarr", "grads.zarr.faiss/meta.json"])
def test_output_inside_a_store_or_index_is_refused(built, output):
    store = tif.open_store(built / "grads.zarr")
    if not (built / "grads.zarr.faiss").exists():
        tif.build_index(store, nlist=1)
    before = {name: _files(built / name) for name in ("grads.zarr", "grads.zarr.faiss")}
    result = cli_here("self-influence", "grads.zarr", "--output", output, "--overwrite",
                      cwd=built)
    assert result.returncode == 1
    assert re.search("(is or lies inside|is) the (gradient store|search index)", result.stderr)
    assert "Choose" in result.stderr
    assert {name: _files(built / name) for name in before} == before
    tif.verify_store(tif.open_store(built / "grads.zarr"))
    tif.load_index(built / "grads.zarr.faiss", store)


# ---- item 15: --checkpoints -----------------------------------------------------------------

def test_a_file_that_is_not_a_state_dict_is_one_clear_line(built):
    (built / "notes.txt").write_text("root:x:0:0:root:/root:/bin/bash\n")
    result = cli_here("build", "--spec", f"{SPEC}:make", "--checkpoints", "notes.txt@0.1",
                      "--out", "notes.zarr", cwd=built)
    assert result.returncode == 1
    assert "'notes.txt' is not a state dict saved with torch.save" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_a_missing_checkpoint_file_says_so(built):
    result = cli_here("build", "--spec", f"{SPEC}:make", "--checkpoints", "nope.pt@0.1",
                      "--out", "nope.zarr", cwd=built)
    assert result.returncode == 1 and "no file 'nope.pt'" in result.stderr


def test_checkpoint_file_names_may_contain_at(built):
    spec = _tiny_spec()
    for checkpoint, name in zip(spec.checkpoints, ("run@v2.pt", "run@v3.pt"), strict=True):
        torch.save(dict(checkpoint.params), built / name)
    result = cli_here("build", "--spec", f"{SPEC}:make", "--checkpoints", "run@v2.pt@0.1",
                      "run@v3.pt", "--out", "at.zarr", "--quiet", cwd=built)
    assert result.returncode == 0, result.stderr
    meta = tif.open_store(built / "at.zarr").meta
    assert [(c.name, c.lr) for c in meta.checkpoints] == [("run@v2", 0.1), ("run@v3", 1.0)]


def test_checkpoint_of_another_model_names_the_parameter_and_shapes(built):
    torch.save({"0.weight": torch.zeros(64, 5), "0.bias": torch.zeros(64),
                "2.weight": torch.zeros(3, 64), "2.bias": torch.zeros(3)}, built / "wide.pt")
    result = cli_here("build", "--spec", f"{SPEC}:make", "--checkpoints", "wide.pt",
                      "--out", "wide.zarr", cwd=built)
    assert result.returncode == 1
    assert "parameter '0.weight' has shape [64, 5] in the loaded weights but [6, 5]" in (
        result.stderr)


# ---- item 15: info escapes crafted names -------------------------------------------------------

def test_info_prints_crafted_checkpoint_names_escaped(built):
    spec = _tiny_spec()
    evil = "\x1b]0;owned\x07\x1b[2Jepoch\n1"
    checkpoints = [tif.Checkpoint(dict(c.params), lr=c.lr, name=evil + str(i))
                   for i, c in enumerate(spec.checkpoints)]
    tif.build_store(spec.loss, checkpoints, spec.train, projection=tif.Projection(dim=8),
                    store=str(built / "evil.zarr"))
    result = cli_here("info", "evil.zarr", cwd=built)
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert "checkpoint  \\x1b]0;owned\\x07\\x1b[2Jepoch\\n10  lr=0.1" in result.stdout


# ---- item 15: dtype names ---------------------------------------------------------------------

@pytest.mark.parametrize(("name", "dtype"), [("float32", torch.float32),
                                             ("float16", torch.float16),
                                             ("bfloat16", torch.bfloat16)])
def test_build_store_takes_float_dtype_names_as_it_takes_int8(name, dtype):
    spec = _tiny_spec()
    store = tif.build_store(spec.loss, spec.checkpoints, spec.train,
                            projection=tif.Projection(dim=8), dtype=name)
    expected = tif.build_store(spec.loss, spec.checkpoints, spec.train,
                               projection=tif.Projection(dim=8), dtype=dtype)
    assert store.meta == expected.meta
    assert torch.equal(store.read_rows(0, 0, 24), expected.read_rows(0, 0, 24))
