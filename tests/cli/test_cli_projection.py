"""``--projection`` reaches every Projection field (issue 34: the CLI could not ask for
``vectors`` nor ``split``): ``KIND[:DIM[:SEED[:NNZ]]][,FIELD=VALUE...]``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tracinfunc as tif
from tests.cli.test_cli import SPEC, _tiny_spec, cli, cli_here
from tracinfunc.cli.commands import _projection


@pytest.mark.parametrize(("text", "expected"), [
    ("rademacher:32:7", tif.Projection(dim=32, seed=7)),
    ("sjlt:64:3:2", tif.Projection(dim=64, seed=3, kind="sjlt", nnz=2)),
    ("identity", tif.Projection(kind="identity")),
    ("kronecker:4096:0,vectors=kronecker",
     tif.Projection(dim=4096, kind="kronecker", vectors="kronecker")),
    ("kronecker:64:1,split=shape,vectors=kronecker,per_checkpoint=true",
     tif.Projection(dim=64, seed=1, kind="kronecker", split="shape", vectors="kronecker",
                    per_checkpoint=True)),
    ("rademacher:16,per_checkpoint=false", tif.Projection(dim=16)),
    ("kronecker,vectors=dense", tif.Projection(dim=512, kind="kronecker")),
])
def test_every_field_is_reachable(text, expected):
    assert _projection(text) == expected


@pytest.mark.parametrize(("text", "said"), [
    ("kronecker:64:vectors=kronecker", "FIELD=VALUE"),  # a colon where a comma belongs
    ("kronecker:64,foo=1", "got 'foo=1'"),
    ("kronecker:64,vectors", "got 'vectors'"),
    ("kronecker:64,", "got ''"),
    ("kronecker:64,vectors=kronecker,vectors=dense", "vectors is given twice"),
    ("kronecker:64,per_checkpoint=yes", "per_checkpoint must be true or false"),
    ("kronecker:64,dim=32", "got 'dim=32'"),  # positional fields stay positional
    ("rademacher:1:2:3:4", "4 numbers"),
    ("kronecker:64,vectors=bogus", "vectors must be one of"),
    ("sjlt:64,split=shape", "split must be one of"),
    ("identity,vectors=kronecker", "vectors must be one of"),
])
def test_malformed_projections_are_usage_errors_naming_the_part(tmp_path, text, said):
    result = cli_here("build", "--spec", f"{SPEC}:make", "--out", "x.zarr",
                      "--projection", text, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert said in result.stderr, result.stderr
    assert not (tmp_path / "x.zarr").exists()


def test_a_kronecker_vectors_store_built_and_scored_from_the_command_line(tmp_path):
    projection = tif.Projection(dim=36, seed=4, kind="kronecker", vectors="kronecker",
                                split="shape", per_checkpoint=True)
    built = cli("build", "--spec", f"{SPEC}:make", "--out", "v.zarr", "--quiet",
                "--projection", "kronecker:36:4,vectors=kronecker,split=shape,"
                "per_checkpoint=true", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    store = tif.GradientStore.open(str(tmp_path / "v.zarr"))
    assert store.projection == projection
    spec = _tiny_spec()
    expected = tif.build_store(spec.loss, spec.checkpoints, spec.train, projection=projection)
    n = expected.meta.n_train
    for c in range(expected.meta.n_ckpt):
        torch.testing.assert_close(store.read_rows(c, 0, n), expected.read_rows(c, 0, n),
                                   rtol=1e-6, atol=1e-7)
    info = cli_here("info", "v.zarr", cwd=tmp_path)
    assert info.returncode == 0 and "vectors='kronecker'" in info.stdout, info.stdout
    scored = cli("score", "v.zarr", "--spec", f"{SPEC}:make", "--output", "s.npy",
                 cwd=tmp_path)
    assert scored.returncode == 0, scored.stderr
    test = tif.build_store(spec.loss, spec.checkpoints, spec.test["test"], projection=projection)
    np.testing.assert_allclose(np.load(tmp_path / "s.npy"), tif.score(expected, test).numpy(),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("projection", [
    tif.Projection(dim=32, seed=7),
    tif.Projection(dim=64, seed=3, kind="sjlt", nnz=2),
    tif.Projection(kind="identity"),
    tif.Projection(kind="identity", per_checkpoint=True),
    tif.Projection(dim=4096, kind="kronecker", vectors="kronecker"),
    tif.Projection(dim=36, seed=4, kind="kronecker", split="shape", per_checkpoint=True),
    tif.Projection(dim=2**24, seed=2**63 - 1, kind="rademacher", per_checkpoint=True),
])
def test_projection_text_reads_back_as_the_same_projection(projection):
    """The text a refused resume tells the user to pass gives back the store's projection."""
    from tracinfunc.cli.commands import projection_text

    assert _projection(projection_text(projection)) == projection


def test_a_projection_no_projector_takes_is_refused_before_overwrite_deletes(tmp_path):
    """A dim over the projectors' limit (2**24) passes the spec's checks; it was found on the
    first batch, after overwrite=True had deleted the finished store (atk51b)."""
    import functools

    spec = _tiny_spec()
    path = str(tmp_path / "kept.zarr")
    kept = tif.build_store(spec.loss, spec.checkpoints, spec.train,
                           projection=tif.Projection(dim=8), store=path)
    rows = kept.read_rows(0, 0, kept.meta.n_train)
    too_big = tif.Projection(dim=2**24 + 1, kind="kronecker")
    replace = functools.partial(tif.store.ZarrWriter, path, overwrite=True)
    with pytest.raises(tif.errors.InvalidProjectionError, match="16777216"):
        tif.build_store(spec.loss, spec.checkpoints, spec.train, projection=too_big,
                        store=replace)
    with pytest.raises(tif.errors.InvalidProjectionError, match="p=|dim="):
        tif.build_store(spec.loss, spec.checkpoints, spec.train, store=replace,
                        projection=tif.Projection(kind="identity", dim=3))
    again = tif.GradientStore.open(path)
    assert again.projection == tif.Projection(dim=8)
    assert torch.equal(again.read_rows(0, 0, again.meta.n_train), rows)


def test_a_refused_resume_names_the_projection_flag_only_for_a_projection_difference():
    """Review, session 51: a layout difference naming a parameter called ``*projection*``
    (CLIP's ``text_projection``) must not be answered with a --projection flag, and a
    sharded build cannot be told to pass --overwrite (refused for shards)."""
    from tracinfunc.cli.commands import _with_flag
    from tracinfunc.errors import IncompatibleGradientsError

    layout = IncompatibleGradientsError("build_store: cannot resume ...: its parameter layout "
                                        "is (('text_projection.weight', (4, 4)),) but ...")
    layout.path, layout.difference = "s.zarr", "its parameter layout is ... text_projection"
    assert _with_flag(layout, sharded=False) is layout
    projection = IncompatibleGradientsError("build_store: cannot resume ...")
    projection.path, projection.difference = "s.zarr", "its projection is ... but ..."
    projection.recorded_projection = tif.Projection(dim=8, kind="sjlt", nnz=2)
    said = str(_with_flag(projection, sharded=True))
    assert "--projection sjlt:8:0:2" in said and "delete the store's directory" in said
    assert "--overwrite" not in said
    assert "pass --overwrite" in str(_with_flag(projection, sharded=False))


def test_a_projection_the_grammar_cannot_say_gets_no_flag():
    from tracinfunc.cli.commands import projection_text

    assert projection_text(tif.Projection(kind="identity", seed=3)) is None
    assert projection_text(tif.Projection(kind="identity")) == "identity"
