"""atk51b: hostile tests of ``tracinfunc build --projection KIND[:DIM[:SEED[:NNZ]]][,FIELD=VALUE...]``.

The grammar (whitespace, case, empty values, ``=`` in values, unicode, huge numbers), its
interplay with ``--resume``, ``--overwrite``, ``--shard``/``commit``, ``info``, and the
commands that read a store built with ``vectors=kronecker`` or ``per_checkpoint=true``
(``score``, ``self-influence``, ``select``, ``report``) against the Python API.
Everything runs in process (``cli_here``): a build of the tiny spec takes a fraction of a second.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import tracinfunc as tif
from tests.cli.test_cli import SPEC, _tiny_spec, cli_here
from tests.cli.test_cli import _interrupted_build as _interrupted
from tests.cli.test_cli_less import _record
from tracinfunc.cli.commands import _projection

MAKE = f"{SPEC}:make"
KRON = tif.Projection(dim=36, seed=4, kind="kronecker", per_checkpoint=True)
KRON_TEXT = "kronecker:36:4,per_checkpoint=true"


def _build(cwd: Path, out: str, text: str, *flags: str):
    return cli_here("build", "--spec", MAKE, "--out", out, "--quiet", "--projection", text,
                    *flags, cwd=cwd)


def _api_store(projection: tif.Projection, data=None, checkpoints=None, **kwargs):
    spec = _tiny_spec()
    return tif.build_store(spec.loss, checkpoints or spec.checkpoints,
                           spec.train if data is None else data, projection=projection,
                           progress=False, **kwargs)


def _same_rows(path: Path, expected, *, exact: bool = True) -> None:
    store = tif.open_store(str(path))
    assert store.projection == expected.projection
    n = expected.meta.n_train
    assert store.meta.n_train == n
    for c in range(expected.meta.n_ckpt):
        got, want = store.read_rows(c, 0, n), expected.read_rows(c, 0, n)
        if exact:
            assert torch.equal(got, want), c
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _is_usage_error(result, tmp_path: Path, *, allowed=()) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tracinfunc build: error: argument --projection: "), last
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(allowed)


# --- grammar -------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("rademacher: 64", tif.Projection(dim=64)),           # int() strips blanks around numbers
    ("rademacher:64:0\t", tif.Projection(dim=64)),
    ("rademacher:+64", tif.Projection(dim=64)),
    ("rademacher:1_024", tif.Projection(dim=1024)),
    ("rademacher:\uff15\uff11\uff12", tif.Projection(dim=512)),  # fullwidth digits 512
    ("kronecker:64 ,vectors=kronecker", tif.Projection(dim=64, kind="kronecker",
                                                       vectors="kronecker")),
    ("rademacher:64:9223372036854775807", tif.Projection(dim=64, seed=2**63 - 1)),
    ("kronecker:64:0:1,per_checkpoint=false,vectors=dense,split=square",
     tif.Projection(dim=64, kind="kronecker")),
    ("identity,per_checkpoint=true", tif.Projection(kind="identity", per_checkpoint=True)),
])
def test_held_lenient_spellings_parse_to_the_value_they_spell(text, expected):
    assert _projection(text) == expected


@pytest.mark.parametrize("text", [
    "", " rademacher:64", "Kronecker:64", "RADEMACHER:64",
    "rademacher:0x10", "rademacher:1e3", "rademacher:64.0", "rademacher:-5",
    "rademacher:64:-1", "rademacher:64:9223372036854775808", "rademacher:2147483648",
    "rademacher:" + "9" * 5000, "rademacher::3", "rademacher:64:0:",
    "rademacher:64\x00", "rademacher:NaN", "rademacher:inf",
    ",vectors=kronecker", "kronecker:64,,vectors=kronecker", ",kronecker:64",
    "kronecker:64, vectors=kronecker", "kronecker:64,vectors =kronecker",
    "kronecker:64,vectors= kronecker", "kronecker:64,vectors=Kronecker",
    "kronecker:64,VECTORS=kronecker", "kronecker:64,vectors=kron\u00e9cker",
    "kronecker:64,vectors=kronecker=x", "kronecker:64,=kronecker", "kronecker:64,=",
    "kronecker:64,vectors=", "kronecker:64,split=", "kronecker:64,split=Shape",
    "kronecker:64;vectors=kronecker", "kronecker:64:vectors=kronecker:split=shape",
    "kronecker:64,per_checkpoint=True", "kronecker:64,per_checkpoint=TRUE",
    "kronecker:64,per_checkpoint=", "kronecker:64,per_checkpoint=1",
    "kronecker:64,per_checkpoint=true ", "kronecker:64,per_checkpoint=false,per_checkpoint=true",
    "rademacher:64:0,seed=1", "rademacher:64,nnz=1", "rademacher:64,kind=sjlt",
    "rademacher:64,checkpoint=start", "kronecker:64:0:2", "sjlt:64:0:0", "sjlt:64:0:65",
    "identity:0", "rademacher:64,per_checkpoint=true,vectors=kronecker",
    "kronecker:64,vectors=kronecker," + "x" * 10000,
])
def test_held_malformed_projection_is_a_usage_error_writing_nothing(tmp_path, text):
    result = _build(tmp_path, "x.zarr", text)
    _is_usage_error(result, tmp_path)


def test_held_equals_form_builds_and_a_shell_split_value_is_refused(tmp_path):
    result = cli_here("build", "--spec", MAKE, "--out", "e.zarr", "--quiet",
                      "--projection=kronecker:36:4,vectors=kronecker,split=shape", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert tif.open_store(str(tmp_path / "e.zarr")).projection == tif.Projection(
        dim=36, seed=4, kind="kronecker", vectors="kronecker", split="shape")
    # `--projection kronecker:36, vectors=kronecker` unquoted: the shell makes two words.
    split = cli_here("build", "--spec", MAKE, "--out", "s.zarr", "--projection", "kronecker:36,",
                     "vectors=kronecker", cwd=tmp_path)
    assert split.returncode == 2 and "got ''" in split.stderr, split.stderr
    empty = cli_here("build", "--spec", MAKE, "--out", "s.zarr", "--projection=", cwd=tmp_path)
    assert empty.returncode == 2 and "argument --projection" in empty.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.zarr"]


def test_held_projection_is_a_build_option_only(tmp_path):
    assert _build(tmp_path, "p.zarr", "rademacher:8:0").returncode == 0
    for command in (["score", "p.zarr", "--spec", MAKE, "--output", "s.npy"],
                    ["self-influence", "p.zarr", "--output", "s.npy"]):
        result = cli_here(*command, "--projection", "rademacher:8:1", cwd=tmp_path)
        assert result.returncode == 2 and "--projection" in result.stderr, result.stderr
    assert not (tmp_path / "s.npy").exists()


# FINDING (fixed, session 51): a projection refused by Projection's own checks
# (vectors=kronecker with rademacher, nnz with kronecker) tells the command-line user the Python
# fix 'use Projection(dim=..., kind=...)' instead of the --projection spelling
# (kronecker:DIM,vectors=kronecker)
def test_finding_projection_errors_give_the_fix_in_python_words(tmp_path):
    for text in ("rademacher:64,vectors=kronecker", "kronecker:64:0:2", "Kronecker:64"):
        result = _build(tmp_path, "x.zarr", text)
        assert result.returncode == 2
        assert "Projection(" not in result.stderr, result.stderr


# --- overwrite -----------------------------------------------------------------------------


def test_held_malformed_projection_with_overwrite_keeps_the_store(tmp_path):
    assert _build(tmp_path, "o.zarr", "rademacher:16:2").returncode == 0
    before = tif.open_store(str(tmp_path / "o.zarr")).read_rows(1, 0, 24)
    for text in ("kronecker:16,vectors=bad", "rademacher:16,per_checkpoint=True", ""):
        result = _build(tmp_path, "o.zarr", text, "--overwrite")
        _is_usage_error(result, tmp_path, allowed=["o.zarr"])
    identity = _build(tmp_path, "o.zarr", "identity:50", "--overwrite")  # p is 57
    assert identity.returncode == 1 and "p=57" in identity.stderr, identity.stderr
    store = tif.open_store(str(tmp_path / "o.zarr"))
    assert store.projection == tif.Projection(dim=16, seed=2)
    assert torch.equal(store.read_rows(1, 0, 24), before)


# FINDING (fixed, session 51): --projection with a dim the parser accepts but every projector
# refuses (> 2**24, e.g. rademacher:2147483647) is found only on batch 0, after --overwrite has
# deleted the finished store: the store is replaced by an empty incomplete one (0 rows) and a
# lock file
def test_finding_huge_dim_with_overwrite_destroys_the_finished_store(tmp_path):
    assert _build(tmp_path, "o.zarr", "rademacher:16:2").returncode == 0
    result = _build(tmp_path, "o.zarr", "kronecker:2147483647,vectors=kronecker", "--overwrite")
    assert result.returncode in (1, 2) and "16777216" in result.stderr, result.stderr
    store = tif.open_store(str(tmp_path / "o.zarr"))  # still the finished store
    assert store.projection == tif.Projection(dim=16, seed=2)


# FINDING (fixed, session 51): build --projection rademacher:16777217 into a fresh --out exits 1
# after creating an empty incomplete store (and .OUT.lock); rerunning with a corrected
# --projection is then refused ('holds an incomplete store ... --resume'). Expected: refused
# (best a usage error, exit 2) writing nothing, like other out-of-range projections
def test_finding_huge_dim_leaves_a_store_that_blocks_the_corrected_command(tmp_path):
    result = _build(tmp_path, "f.zarr", "rademacher:16777217")
    assert result.returncode in (1, 2) and "16777216" in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []
    assert _build(tmp_path, "f.zarr", "rademacher:16").returncode == 0


# --- resume --------------------------------------------------------------------------------


def test_held_resume_with_an_equal_projection_spelled_otherwise(tmp_path):
    _interrupted(tmp_path / "h.zarr", KRON)
    result = _build(tmp_path, "h.zarr", "kronecker:36:4:1,vectors=dense,split=square,"
                    "per_checkpoint=true", "--batch-size", "10", "--resume")
    assert result.returncode == 0, result.stderr
    _same_rows(tmp_path / "h.zarr", _api_store(KRON, batch_size=10), exact=False)


@pytest.mark.parametrize(("text", "differs"), [
    ("kronecker:36:4,per_checkpoint=false", "per_checkpoint=False"),
    ("kronecker:36:4", "per_checkpoint=False"),
    (KRON_TEXT + ",vectors=kronecker", "vectors='kronecker'"),
    (KRON_TEXT + ",split=shape", "split='shape'"),
    ("kronecker:36,per_checkpoint=true", "seed=0"),
    ("sjlt:36:4,per_checkpoint=true", "kind='sjlt'"),
])
def test_held_resume_with_another_field_is_refused_and_nothing_mixed(tmp_path, text, differs):
    path = tmp_path / "h.zarr"
    _interrupted(path, KRON)
    result = _build(tmp_path, "h.zarr", text, "--batch-size", "10", "--resume")
    assert result.returncode == 1, result.stderr
    assert "cannot resume" in result.stderr and differs in result.stderr, result.stderr
    assert "per_checkpoint=True" in result.stderr  # the store's own projection is named
    info = cli_here("info", "h.zarr", cwd=tmp_path)
    assert "16 rows written" in info.stdout and "per_checkpoint=True" in info.stdout
    # and the right spelling still resumes it to the uninterrupted rows
    resumed = _build(tmp_path, "h.zarr", KRON_TEXT, "--batch-size", "10", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    _same_rows(path, _api_store(KRON, batch_size=10), exact=False)


# FINDING (fixed, session 51): a resume refused for another --projection says 'Call build_store
# with the same arguments as the interrupted build' and shows Projection(...) reprs; the command
# line's words (the --projection text to pass, as done for --batch-size) are missing
def test_finding_refused_resume_names_the_projection_flag_to_pass(tmp_path):
    _interrupted(tmp_path / "h.zarr", KRON)
    result = _build(tmp_path, "h.zarr", "kronecker:36:4", "--batch-size", "10", "--resume")
    assert result.returncode == 1
    assert "build_store with the same arguments" not in result.stderr, result.stderr
    assert f"--projection {KRON_TEXT}" in result.stderr, result.stderr


def test_held_identity_spelled_with_or_without_p_never_mixes(tmp_path):
    """``identity`` and ``identity:57`` give the same rows (p = 57): a resume across the two
    spellings either resumes to those rows or is refused naming both."""
    for started, resumed in ((tif.Projection(kind="identity"), "identity:57"),
                             (tif.Projection(kind="identity", dim=57), "identity")):
        path = tmp_path / f"{resumed.replace(':', '_')}.zarr"
        _interrupted(path, started)
        result = _build(tmp_path, path.name, resumed, "--batch-size", "10", "--resume")
        if result.returncode == 0:
            _same_rows(path, _api_store(started, batch_size=10))
        else:
            assert result.returncode == 1 and "cannot resume" in result.stderr
            assert "dim=57" in result.stderr and "dim=None" in result.stderr
            assert "16 rows written" in cli_here("info", path.name, cwd=tmp_path).stdout


# --- shards and commit ---------------------------------------------------------------------


def test_held_parts_with_other_fields_are_refused_and_the_commit_is_whole(tmp_path):
    projection = tif.Projection(dim=36, seed=4, kind="kronecker", vectors="kronecker",
                                split="shape", per_checkpoint=True)
    text = "kronecker:36:4,vectors=kronecker,split=shape,per_checkpoint=true"
    assert _build(tmp_path, "s.zarr", text, "--shard", "0/2").returncode == 0
    for other in ("kronecker:36:4,split=shape,per_checkpoint=true",
                  "kronecker:36:4,vectors=kronecker,per_checkpoint=true",
                  "kronecker:36:4,vectors=kronecker,split=shape"):
        refused = _build(tmp_path, "s.zarr", other, "--shard", "1/2")
        assert refused.returncode == 1 and "projection" in refused.stderr, refused.stderr
        early = cli_here("commit", "s.zarr", cwd=tmp_path)
        assert early.returncode == 1, early.stdout
    same = _build(tmp_path, "s.zarr", "kronecker:36:4:1,per_checkpoint=true,split=shape,"
                  "vectors=kronecker", "--shard", "1/2")
    assert same.returncode == 0, same.stderr
    assert cli_here("commit", "s.zarr", cwd=tmp_path).returncode == 0
    _same_rows(tmp_path / "s.zarr", _api_store(projection), exact=False)
    info = cli_here("info", "s.zarr", cwd=tmp_path)
    for field in ("kind='kronecker'", "split='shape'", "per_checkpoint=True",
                  "vectors='kronecker'", "dim=36", "seed=4"):
        assert field in info.stdout, info.stdout


def test_held_overwrite_is_refused_with_shard(tmp_path):
    result = _build(tmp_path, "s.zarr", KRON_TEXT, "--shard", "0/2", "--overwrite")
    assert result.returncode == 1 and "--overwrite cannot be used with --shard" in result.stderr
    assert not (tmp_path / "s.zarr").exists()


# --- other build options with the new fields -----------------------------------------------


def test_held_layers_biases_only_with_kronecker_vectors_equal_the_api(tmp_path):
    projection = tif.Projection(dim=36, seed=4, kind="kronecker", vectors="kronecker",
                                per_checkpoint=True)
    with pytest.warns(UserWarning):
        result = _build(tmp_path, "l.zarr", KRON_TEXT + ",vectors=kronecker", "--layers",
                        "*.bias")
    assert result.returncode == 0, result.stderr
    with pytest.warns(UserWarning):
        expected = _api_store(projection, options=tif.GradientOptions(select=["*.bias"]))
    _same_rows(tmp_path / "l.zarr", expected)
    assert "p=9" in cli_here("info", "l.zarr", cwd=tmp_path).stdout


def test_held_checkpointing_with_kronecker_vectors_equals_the_factorised_api(tmp_path):
    projection = tif.Projection(dim=36, seed=4, kind="kronecker", vectors="kronecker",
                                per_checkpoint=True)
    result = _build(tmp_path, "c.zarr", KRON_TEXT + ",vectors=kronecker", "--checkpointing")
    assert result.returncode == 0, result.stderr
    _same_rows(tmp_path / "c.zarr", _api_store(projection), exact=False)


def test_held_preconditioner_with_kronecker_vectors_builds_and_scores_as_the_api(tmp_path):
    _record(tmp_path / "ckpts")
    projection = tif.Projection(dim=36, seed=4, kind="kronecker", vectors="kronecker",
                                per_checkpoint=True)
    result = _build(tmp_path, "p.zarr", KRON_TEXT + ",vectors=kronecker", "--recorded", "ckpts",
                    "--preconditioner", "adam")
    assert result.returncode == 0, result.stderr
    spec = _tiny_spec()
    checkpoints = tif.load_recorded_checkpoints(tmp_path / "ckpts", spec.model)
    expected = _api_store(projection, checkpoints=checkpoints,
                          preconditioners=tif.load_recorded_preconditioners(
                              tmp_path / "ckpts", spec.model, kind="adam"))
    _same_rows(tmp_path / "p.zarr", expected)
    scored = cli_here("score", "p.zarr", "--spec", MAKE, "--recorded", "ckpts", "--output",
                      "s.npy", "--quiet", cwd=tmp_path)
    assert scored.returncode == 0, scored.stderr
    test = _api_store(projection, data=spec.test["test"], checkpoints=checkpoints)
    np.testing.assert_allclose(np.load(tmp_path / "s.npy"), tif.score(expected, test).numpy(),
                               rtol=1e-6, atol=1e-7)


# --- readers of per-checkpoint stores ------------------------------------------------------


def test_held_score_self_influence_select_report_of_a_per_checkpoint_store(tmp_path):
    projection = tif.Projection(dim=16, seed=2, kind="sjlt", nnz=2, per_checkpoint=True)
    assert _build(tmp_path, "s.zarr", "sjlt:16:2:2,per_checkpoint=true").returncode == 0
    expected = _api_store(projection)
    _same_rows(tmp_path / "s.zarr", expected)
    spec = _tiny_spec()
    full = tif.score(expected, _api_store(projection, data=spec.test["test"])).numpy()

    def run(*args):
        result = cli_here(*args, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        return result

    run("score", "s.zarr", "--spec", MAKE, "--output", "full.npy", "--quiet")
    np.testing.assert_allclose(np.load(tmp_path / "full.npy"), full, rtol=1e-6, atol=1e-7)
    run("score", "s.zarr", "--spec", MAKE, "--output", "top.json", "--top-k", "3", "--quiet")
    top = json.loads((tmp_path / "top.json").read_text())
    assert np.array_equal(np.asarray(top["indices"]), np.argsort(-full, axis=1)[:, :3])
    run("self-influence", "s.zarr", "--output", "si.npy", "--quiet")
    np.testing.assert_allclose(np.load(tmp_path / "si.npy"),
                               np.asarray(tif.self_influence(expected)), rtol=1e-6)
    run("select", "full.npy", "--top-k", "4", "--output", "sel.json", "--quiet")
    chosen = tif.select_training_data(torch.from_numpy(np.load(tmp_path / "full.npy")), k=4)
    assert json.loads((tmp_path / "sel.json").read_text())["indices"] == [
        int(i) for i in chosen.indices]
    run("report", "s.zarr", "--spec", MAKE, "--output", "r.html", "--quiet")
    assert (tmp_path / "r.html").stat().st_size > 0


def test_held_per_checkpoint_store_refuses_test_checkpoints_of_other_names(tmp_path):
    spec = _tiny_spec()
    for i, checkpoint in enumerate(spec.checkpoints):
        torch.save({k: v.clone() for k, v in dict(checkpoint.params).items()},
                   tmp_path / f"e{i}.pt")
        shutil.copy(tmp_path / f"e{i}.pt", tmp_path / f"f{i}.pt")
    built = _build(tmp_path, "n.zarr", "rademacher:16:2,per_checkpoint=true", "--checkpoints",
                   "e0.pt@0.1", "e1.pt@0.05")
    assert built.returncode == 0, built.stderr

    def score(*files):
        return cli_here("score", "n.zarr", "--spec", MAKE, "--checkpoints", *files,
                        "--output", "s.npy", "--quiet", cwd=tmp_path)

    renamed = score("f0.pt@0.1", "f1.pt@0.05")  # same weights, other names
    assert renamed.returncode == 1 and "per checkpoint" in renamed.stderr, renamed.stderr
    assert "'e0'" in renamed.stderr and "'f0'" in renamed.stderr
    swapped = score("e1.pt@0.1", "e0.pt@0.05")
    assert swapped.returncode == 1 and "differs" in swapped.stderr, swapped.stderr
    assert not (tmp_path / "s.npy").exists()
    assert score("e0.pt@0.1", "e1.pt@0.05").returncode == 0
