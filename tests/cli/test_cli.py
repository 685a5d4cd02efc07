"""The command line end to end, in subprocesses, on a tiny spec."""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tracinfunc as tif
import tracinfunc.store.zarr.paths as store_paths
from tracinfunc.batches import rebatch
from tracinfunc.cli import main
from tracinfunc.cli.spec import load_spec

SPEC = str(Path(__file__).resolve().parents[1] / "data" / "tiny_spec.py")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The real command, end to end, in a subprocess."""
    return subprocess.run([sys.executable, "-m", "tracinfunc", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


def cli_here(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``tracinfunc.cli.main`` in this process (no torch import per call) for error paths."""
    stdout, stderr = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = main(list(args))
            except SystemExit as exit_:  # argparse's usage errors
                code = exit_.code
    finally:
        os.chdir(previous)
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


def _tiny_spec() -> tif.cli.Spec:
    return load_spec(f"{SPEC}:make")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    result = cli("build", "--spec", f"{SPEC}:make", "--out", "grads.zarr",
                 "--projection", "rademacher:32:7", "--batch-size", "10", "--quiet", cwd=root)
    assert result.returncode == 0, result.stderr
    return root


def test_build_writes_a_store_the_api_reopens(built):
    store = tif.open_store(str(built / "grads.zarr"))
    assert store.shape == (2, 24, 32)
    assert store.projection == tif.Projection(dim=32, seed=7)
    assert [c.name for c in store.meta.checkpoints] == ["start", "later"]


def test_info_describes_and_verifies(built):
    result = cli("info", "grads.zarr", "--verify", cwd=built)
    assert result.returncode == 0, result.stderr
    assert "n_ckpt=2 n_train=24 k=32" in result.stdout
    assert "complete    True" in result.stdout and "matched its checksum" in result.stdout


def test_score_top_k_json_matches_the_api(built):
    result = cli("score", "grads.zarr", "--spec", f"{SPEC}:make", "--top-k", "3",
                 "--output", "top.json", cwd=built)
    assert result.returncode == 0, result.stderr
    saved = json.loads((built / "top.json").read_text())
    spec = _tiny_spec()
    store = tif.open_store(str(built / "grads.zarr"))
    test = tif.build_store(spec.loss, spec.checkpoints, spec.test["test"],
                           projection=store.projection)
    values, indices = tif.top_k(store, test, k=3)
    assert saved["indices"] == indices.tolist()
    np.testing.assert_allclose(saved["values"], values.numpy(), rtol=1e-6)


def test_score_contrast_is_the_difference_of_two_scores_and_is_recorded(built):
    result = cli("score", "grads.zarr", "--spec", f"{SPEC}:make", "--contrast", "control",
                 "--contrast-weight", "0.5", "--output", "contrast.json", cwd=built)
    assert result.returncode == 0, result.stderr
    assert "minus 0.5 x mean of control 'control' (4 rows)" in result.stdout
    saved = json.loads((built / "contrast.json").read_text())
    assert saved["contrast"] == {"control": "control", "weight": 0.5,
                                 "description": "minus 0.5 x mean of control 'control' (4 rows)"}
    spec = _tiny_spec()
    store = tif.open_store(str(built / "grads.zarr"))
    grads = {name: tif.build_store(spec.loss, spec.checkpoints, spec.test[name],
                                   projection=store.projection) for name in ("test", "control")}
    expected = (tif.score(store, grads["test"])
                - 0.5 * tif.score(store, grads["control"]).mean(0, keepdim=True))
    np.testing.assert_allclose(saved["scores"], expected.numpy(), rtol=1e-5, atol=1e-7)
    missing = cli_here("score", "grads.zarr", "--spec", f"{SPEC}:make", "--contrast", "nope",
                       "--output", "x.json", cwd=built)
    assert missing.returncode != 0 and "no test set 'nope'" in missing.stderr
    no_spec = cli_here("score", "grads.zarr", "--test-store", "grads.zarr", "--contrast",
                       "control", "--output", "x.json", cwd=built)
    assert no_spec.returncode != 0 and "--contrast NAME names a test set" in no_spec.stderr
    nan = cli_here("score", "grads.zarr", "--spec", f"{SPEC}:make", "--contrast", "control",
                   "--contrast-weight", "nan", "--output", "x.json", cwd=built)
    assert nan.returncode != 0 and "weight must be a finite real number" in nan.stderr
    assert not (built / "x.json").exists()


def test_score_full_matrix_csv_and_self_influence_npy(built):
    assert cli("score", "grads.zarr", "--spec", f"{SPEC}:make", "--normalize",
               "--output", "scores.csv", cwd=built).returncode == 0
    rows = list(csv.reader((built / "scores.csv").open()))
    assert rows[0][:2] == ["test_index", "train_0"] and len(rows) == 1 + 6 and len(rows[1]) == 25
    assert all(-2 <= float(v) <= 2 for row in rows[1:] for v in row[1:])  # sum of 2 lr*cosines
    result = cli("self-influence", "grads.zarr", "--output", "si.npy", cwd=built)
    assert result.returncode == 0, result.stderr
    store = tif.open_store(str(built / "grads.zarr"))
    np.testing.assert_allclose(np.load(built / "si.npy"), tif.self_influence(store).numpy())


def test_missing_spec_function_is_one_clear_line(built):
    result = cli_here("score", "grads.zarr", "--spec", f"{SPEC}:nope", "--output", "x.json",
                      cwd=built)
    assert result.returncode == 1
    assert result.stderr.startswith("tracinfunc: error: --spec:")
    assert "no function 'nope'" in result.stderr and "make" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    wrong = cli_here("score", "grads.zarr", "--spec", f"{SPEC}:not_a_spec", "--output",
                     "x.json", cwd=built)
    assert wrong.returncode == 1 and "returned int" in wrong.stderr


def test_wrong_store_path_is_reported(built):
    result = cli_here("info", "missing.zarr", cwd=built)
    assert result.returncode == 1 and "missing.zarr" in result.stderr
    assert "Traceback" not in result.stderr


def test_store_with_another_projection_is_refused(built):
    other = cli("build", "--spec", f"{SPEC}:make", "--out", "other.zarr",
                "--projection", "rademacher:32:8", "--quiet", cwd=built)
    assert other.returncode == 0, other.stderr
    result = cli("score", "grads.zarr", "--test-store", "other.zarr", "--output", "s.json",
                 cwd=built)
    assert result.returncode == 1
    assert "seed=8" in result.stderr and "projection=store.projection" in result.stderr


def test_unwritable_output_directory_is_reported(built):
    # /proc refuses new files even to root, unlike a chmod-ed directory.
    result = cli_here("self-influence", "grads.zarr", "--output", "/proc/si.json", cwd=built)
    assert result.returncode == 1 and "not writable" in result.stderr


def test_missing_output_directory_and_existing_output_are_reported(built, tmp_path):
    result = cli_here("self-influence", "grads.zarr", "--output", str(tmp_path / "no" / "si.json"),
                 cwd=built)
    assert result.returncode == 1 and "does not exist" in result.stderr
    (built / "taken.json").write_text("keep me")
    result = cli_here("self-influence", "grads.zarr", "--output", "taken.json", cwd=built)
    assert result.returncode == 1 and "--overwrite" in result.stderr
    assert (built / "taken.json").read_text() == "keep me"


def test_existing_store_is_never_overwritten_by_build(built):
    before = tif.open_store(str(built / "grads.zarr")).read_rows(0, 0, 24)
    result = cli_here("build", "--spec", f"{SPEC}:make", "--out", "grads.zarr", cwd=built)
    assert result.returncode == 1 and "--overwrite" in result.stderr
    after = tif.open_store(str(built / "grads.zarr")).read_rows(0, 0, 24)
    assert torch.equal(before, after)


def test_usage_errors_exit_2(built):
    result = cli_here("build", "--spec", f"{SPEC}:make", "--out", "x.zarr",
                      "--projection", "bogus:1", cwd=built)
    assert result.returncode == 2 and "kind must be one of" in result.stderr


def test_build_and_score_from_state_dict_files_with_learning_rates(built):
    spec = _tiny_spec()
    for checkpoint, name in zip(spec.checkpoints, ("a.pt", "b.pt"), strict=True):
        torch.save(dict(checkpoint.params), built / name)
    files = ["--checkpoints", "a.pt@0.1", "b.pt@0.05"]
    result = cli("build", "--spec", f"{SPEC}:make", *files, "--out", "files.zarr",
                 "--projection", "sjlt:64:3:2", cwd=built)
    assert result.returncode == 0, result.stderr
    from_files = tif.open_store(str(built / "files.zarr"))
    assert [(c.name, c.lr) for c in from_files.meta.checkpoints] == [("a", 0.1), ("b", 0.05)]
    expected = tif.build_store(spec.loss, spec.checkpoints, spec.train,
                               projection=tif.Projection(dim=64, seed=3, kind="sjlt", nnz=2))
    for c in range(2):
        assert torch.equal(from_files.read_rows(c, 0, 24), expected.read_rows(c, 0, 24))
    scored = cli("score", "files.zarr", "--spec", f"{SPEC}:make", *files, "--output", "f.npy",
                 cwd=built)
    assert scored.returncode == 0, scored.stderr
    test = tif.build_store(spec.loss, spec.checkpoints, spec.test["test"],
                           projection=from_files.projection)
    np.testing.assert_allclose(np.load(built / "f.npy"), tif.score(expected, test).numpy(),
                               rtol=1e-6)


def test_progress_is_silent_when_stderr_is_not_a_terminal(built):
    result = cli("build", "--spec", f"{SPEC}:make", "--out", "piped.zarr", cwd=built)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("wrote ")


def test_resume_of_a_finished_store_says_it_is_complete(built):
    result = cli_here("build", "--spec", f"{SPEC}:make", "--out", "grads.zarr", "--resume",
                 "--projection", "rademacher:32:7", cwd=built)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "grads.zarr" in result.stderr


def test_memory_options_reach_build_and_score_follows_the_stores_layers(built):
    spec = _tiny_spec()
    result = cli_here("build", "--spec", f"{SPEC}:make", "--out", "last.zarr", "--quiet",
                      "--projection", "sjlt:16:2", "--layers", "2.*", "--checkpointing",
                      "--offload", "--mixed-precision", "bf16", "--memory-budget", "1MiB",
                      cwd=built)
    assert result.returncode == 0, result.stderr
    store = tif.open_store(str(built / "last.zarr"))
    assert [name for name, _ in store.meta.layout] == ["2.bias", "2.weight"]
    expected = tif.build_store(
        spec.loss,
        spec.checkpoints,
        spec.train,
        options=tif.GradientOptions(
            select=["2.*"],
            stages=tif.model_stages(spec.model, torch.nn.functional.cross_entropy),
            offload=True,
            mixed_precision=torch.bfloat16,
        ),
        projection=tif.Projection(dim=16, seed=2, kind="sjlt"),
    )
    for c in range(2):
        torch.testing.assert_close(store.read_rows(c, 0, 24), expected.read_rows(c, 0, 24))
    # score builds test gradients for the store's own parameters without being told
    scored = cli_here("score", "last.zarr", "--spec", f"{SPEC}:make", "--output", "l.npy",
                      cwd=built)
    assert scored.returncode == 0, scored.stderr
    test = tif.build_store(
        spec.loss,
        spec.checkpoints,
        spec.test["test"],
        options=tif.GradientOptions(select=["2.*"]),
        projection=store.projection,
    )
    np.testing.assert_allclose(np.load(built / "l.npy"), tif.score(store, test).numpy(),
                               rtol=1e-5)


def test_conflicting_gradient_flags_are_one_line_errors(built):
    both = cli_here("build", "--spec", f"{SPEC}:make", "--out", "x.zarr", "--layers", "2.*",
                    "--last-layers", "1", cwd=built)
    assert both.returncode == 1 and "--layers or --last-layers" in both.stderr
    offload = cli_here("build", "--spec", f"{SPEC}:make", "--out", "x.zarr", "--offload",
                       cwd=built)
    assert offload.returncode == 1 and "add --checkpointing" in offload.stderr
    size = cli_here("build", "--spec", f"{SPEC}:make", "--out", "x.zarr", "--memory-budget",
                    "lots", cwd=built)
    assert size.returncode == 2 and "2GB" in size.stderr
    zero = cli_here("build", "--spec", f"{SPEC}:make", "--out", "x.zarr", "--memory-budget",
                    "0", cwd=built)
    assert zero.returncode == 2 and "positive size" in zero.stderr
    assert not (built / "x.zarr").exists()


def _interrupted_build(path: Path, projection: tif.Projection | None = None) -> None:
    """Leave an incomplete store at ``path``: 16 of 24 rows committed (shards of 8 rows),
    made as ``build --projection rademacher:32:7 --batch-size 10`` would have made them
    (with ``projection`` given: as ``--projection`` of that projection would)."""
    projection = projection or tif.Projection(dim=32, seed=7)
    spec = _tiny_spec()

    def batches():
        for i, batch in enumerate(rebatch(spec.train, 10)):
            if i == 2:
                raise RuntimeError("killed")
            yield batch

    with pytest.raises(RuntimeError, match="killed"):
        tif.build_store(spec.loss, spec.checkpoints, batches(), batch_size=10,
                        projection=projection, progress=False,
                        store=functools.partial(tif.store.ZarrWriter, path, chunk_rows=8,
                                                shard_rows=8))


@pytest.mark.parametrize("name", ["memory", "pinned", "zarr"])
def test_build_out_is_always_a_zarr_directory(built, name):
    result = cli_here("build", "--spec", f"{SPEC}:make", "--out", name, "--quiet",
                      "--projection", "rademacher:32:7", "--batch-size", "10", cwd=built)
    assert result.returncode == 0, result.stderr
    store = tif.open_store(str(built / name))
    reference = tif.open_store(str(built / "grads.zarr"))
    assert torch.equal(store.read_rows(1, 0, 24), reference.read_rows(1, 0, 24))


def test_build_checks_out_before_loading_the_spec(built, tmp_path):
    # The spec does not exist: every error below must come from --out, checked first.
    def build(out, *flags):
        return cli_here("build", "--spec", "no_such_spec.py:make", "--out", out, *flags,
                        cwd=built)

    missing = build(str(tmp_path / "no" / "g.zarr"))
    assert missing.returncode == 1 and "tracinfunc build" in missing.stderr
    assert "does not exist" in missing.stderr and "no_such_spec" not in missing.stderr
    unwritable = build("/proc/g.zarr")  # /proc refuses new files even to root
    assert unwritable.returncode == 1 and "not writable" in unwritable.stderr
    finished = build("grads.zarr")
    assert finished.returncode == 1 and "'grads.zarr'" in finished.stderr
    assert "finished store" in finished.stderr and "--overwrite" in finished.stderr
    _interrupted_build(tmp_path / "half.zarr")
    half = build(str(tmp_path / "half.zarr"))
    assert half.returncode == 1 and "incomplete" in half.stderr and "--resume" in half.stderr
    (tmp_path / "notes").mkdir()
    other = build(str(tmp_path / "notes"), "--overwrite")
    assert other.returncode == 1 and "not a tracinfunc store" in other.stderr
    both = build(str(tmp_path / "half.zarr"), "--resume", "--overwrite")
    assert both.returncode == 2
    for result in (missing, unwritable, finished, half, other):
        assert result.stderr.startswith("tracinfunc: error: tracinfunc build: ")
        assert len(result.stderr.strip().splitlines()) == 1


def test_build_overwrite_replaces_a_finished_store(built):
    first = cli_here("build", "--spec", f"{SPEC}:make", "--out", "replaced.zarr", "--quiet",
                     "--projection", "rademacher:16:1", cwd=built)
    assert first.returncode == 0, first.stderr
    again = cli_here("build", "--spec", f"{SPEC}:make", "--out", "replaced.zarr", "--quiet",
                     "--projection", "rademacher:32:7", "--overwrite", cwd=built)
    assert again.returncode == 0, again.stderr
    store = tif.open_store(str(built / "replaced.zarr"))
    assert store.projection == tif.Projection(dim=32, seed=7)


def test_info_describes_an_incomplete_store_and_build_resumes_it(built, tmp_path):
    _interrupted_build(tmp_path / "half.zarr")
    result = cli_here("info", "half.zarr", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "complete    False" in result.stdout and "16 rows written" in result.stdout
    assert "tracinfunc build" in result.stdout and "--resume" in result.stdout
    verify = cli_here("info", "half.zarr", "--verify", cwd=tmp_path)
    assert verify.returncode == 1 and "--resume" in verify.stderr
    assert "incomplete" in verify.stderr and "Traceback" not in verify.stderr
    resumed = cli_here("build", "--spec", f"{SPEC}:make", "--out", "half.zarr", "--resume",
                       "--quiet", "--projection", "rademacher:32:7", "--batch-size", "10",
                       cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    store = tif.open_store(str(tmp_path / "half.zarr"))
    reference = tif.open_store(str(built / "grads.zarr"))
    for c in range(2):
        assert torch.equal(store.read_rows(c, 0, 24), reference.read_rows(c, 0, 24))


def test_info_verify_reads_the_norms_too(built, tmp_path):
    shutil.copytree(built / "grads.zarr", tmp_path / "bad.zarr")
    (shard,) = [f for f in (tmp_path / "bad.zarr" / "norms" / "1").rglob("*")
                if f.is_file() and f.name != "zarr.json"]
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF  # one flipped bit pattern in the first norm: its crc32c no longer matches
    shard.write_bytes(bytes(data))
    result = cli_here("info", "bad.zarr", "--verify", cwd=tmp_path)
    assert result.returncode == 1 and "norms" in result.stderr
    assert "'later'" in result.stderr


def test_info_verify_shows_progress_unless_quiet(built, monkeypatch):
    calls = []

    class Bar:
        def __init__(self, progress, *, total, desc, unit):
            calls.append({"progress": progress, "total": total, "done": 0})

        def update(self, n=1):
            calls[-1]["done"] += n

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(store_paths, "progress_bar", Bar)  # info --verify is verify_store
    assert cli_here("info", "grads.zarr", "--verify", cwd=built).returncode == 0
    assert cli_here("--quiet", "info", "grads.zarr", "--verify", cwd=built).returncode == 0
    assert [c["progress"] for c in calls] == [None, False]  # None: a terminal only
    assert all(c["done"] == c["total"] == 2 * 24 for c in calls)


@pytest.mark.parametrize("flag", ["--top-k", "--batch-size", "--chunk-size", "--last-layers"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_non_positive_counts_are_usage_errors(built, flag, value):
    if flag == "--top-k":
        args = ["score", "grads.zarr", "--spec", f"{SPEC}:make", "--output", "n.json"]
    else:
        args = ["build", "--spec", f"{SPEC}:make", "--out", "n.zarr"]
    result = cli_here(*args, flag, value, cwd=built)
    assert result.returncode == 2
    assert flag in result.stderr and f"positive integer, got {value!r}" in result.stderr
    assert not (built / "n.json").exists() and not (built / "n.zarr").exists()


def test_quiet_and_debug_are_accepted_before_the_command(built):
    from tracinfunc.cli.commands import _parser

    parse = _parser().parse_args
    assert parse(["--quiet", "info", "x"]).quiet and parse(["info", "x", "--quiet"]).quiet
    assert not parse(["info", "x"]).quiet and not parse(["info", "x"]).debug
    assert parse(["--debug", "--quiet", "info", "x"]).debug
    with pytest.raises(FileNotFoundError):  # --debug: the exception itself, not one line
        cli_here("--debug", "info", "missing.zarr", cwd=built)
    quiet = cli_here("--quiet", "info", "grads.zarr", cwd=built)
    assert quiet.returncode == 0 and "n_train=24" in quiet.stdout


def test_zarr_output_reads_back(built):
    import zarr

    spec = _tiny_spec()
    store = tif.open_store(str(built / "grads.zarr"))
    test = tif.build_store(spec.loss, spec.checkpoints, spec.test["test"],
                           projection=store.projection)
    result = cli_here("score", "grads.zarr", "--spec", f"{SPEC}:make", "--top-k", "4",
                      "--output", "top.zarr", "--quiet", cwd=built)
    assert result.returncode == 0, result.stderr
    values, indices = tif.top_k(store, test, k=4)
    saved = zarr.open_group(str(built / "top.zarr"), mode="r")
    assert np.array_equal(saved["indices"][:], indices.numpy())
    np.testing.assert_allclose(saved["values"][:], values.numpy(), rtol=1e-6)
    # --overwrite replaces a .zarr output (a directory) with the full matrix
    result = cli_here("score", "grads.zarr", "--spec", f"{SPEC}:make", "--overwrite",
                      "--output", "top.zarr", "--quiet", cwd=built)
    assert result.returncode == 0, result.stderr
    saved = zarr.open_group(str(built / "top.zarr"), mode="r")
    assert sorted(saved.array_keys()) == ["scores"]
    np.testing.assert_allclose(saved["scores"][:], tif.score(store, test).numpy(), rtol=1e-6)
    assert cli_here("self-influence", "grads.zarr", "--output", "si.zarr",
                    cwd=built).returncode == 0
    saved = zarr.open_group(str(built / "si.zarr"), mode="r")
    np.testing.assert_allclose(saved["self_influence"][:], tif.self_influence(store).numpy())


def test_identity_dim_is_checked_not_ignored(built):
    """Issue 16: '--projection identity:5' silently ignored 5."""
    result = cli_here("build", "--spec", f"{SPEC}:make", "--out", "id5.zarr",
                      "--projection", "identity:5", "--quiet", cwd=built)
    assert result.returncode == 1
    assert "kind='identity' keeps all p=" in result.stderr and "dim=5" in result.stderr
    assert not (built / "id5.zarr" / "zarr.json").exists()


@pytest.mark.parametrize("size", ["infGB", "nanMB", "1e400"])
def test_memory_budget_that_is_not_a_size_is_a_usage_error(built, size):
    """Issue 16: '--memory-budget infGB' raised a bare OverflowError."""
    result = cli_here("build", "--spec", f"{SPEC}:make", "--out", "mb.zarr",
                      "--memory-budget", size, cwd=built)
    assert result.returncode == 2
    assert f"expected a positive size such as 2GB, 512MiB or 1000000, got {size!r}" in (
        result.stderr)


def test_build_records_a_dataset_fingerprint(built):
    result = cli_here("build", "--spec", f"{SPEC}:make", "--out", "fp.zarr", "--quiet",
                      "--projection", "rademacher:32:7", "--dataset-fingerprint", "digits-v2",
                      cwd=built)
    assert result.returncode == 0, result.stderr
    assert tif.open_store(built / "fp.zarr").meta.dataset_fingerprint == "digits-v2"


@pytest.mark.parametrize("dtype", ["int8", "sign"])
def test_build_dtype_quantises_and_info_says_so(tmp_path, dtype):
    result = cli_here("build", "--spec", f"{SPEC}:make", "--out", "q.zarr", "--projection",
                      "rademacher:32:7", "--dtype", dtype, "--quiet", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    store = tif.open_store(str(tmp_path / "q.zarr"))
    assert store.meta.quantization == dtype and store.dtype == torch.float32
    info = cli_here("info", "q.zarr", "--verify", cwd=tmp_path)
    assert info.returncode == 0, info.stderr
    assert f"k=32 float32 (stored as {dtype})" in info.stdout
    assert "matched its checksum" in info.stdout


def test_build_refuses_an_unknown_dtype_listing_the_choices(tmp_path):
    result = cli_here("build", "--spec", f"{SPEC}:make", "--out", "q.zarr", "--dtype", "int4",
                      cwd=tmp_path)
    assert result.returncode == 2
    assert "invalid choice: 'int4'" in result.stderr and "'sign'" in result.stderr
