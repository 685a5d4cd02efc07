"""Attacks on ``projection_text`` (``info``, refused ``--resume``) and on the JAX device
check before a store is created (session atk51d)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import tracinfunc as tif
from tests.cli.test_cli import SPEC, _interrupted_build, cli_here
from tests.conftest import child_env
from tracinfunc.cli.commands import _projection, projection_text

ROOT = Path(__file__).resolve().parents[2]
P = tif.Projection

ROUND_TRIP = [
    P(kind="identity"),
    P(kind="identity", dim=63, seed=0),
    P(kind="identity", dim=63, seed=2**63 - 1),
    P(dim=32, seed=0),
    P(dim=32, seed=2**63 - 1),
    P(dim=32, kind="sjlt", nnz=1),
    P(dim=32, kind="sjlt", nnz=4, seed=2**63 - 1),
    P(dim=32, kind="sjlt", nnz=32),
    P(dim=32, kind="kronecker"),
    P(dim=32, kind="kronecker", split="shape"),
    P(dim=32, kind="kronecker", vectors="kronecker"),
    P(dim=32, kind="kronecker", split="shape", vectors="kronecker", per_checkpoint=True),
    P(dim=32, seed=3, per_checkpoint=True),
    P(dim=32, kind="sjlt", nnz=2, per_checkpoint=True),
]


@pytest.mark.parametrize("projection", ROUND_TRIP, ids=repr)
def test_projection_text_parses_back_to_the_same_projection(projection):
    text = projection_text(projection)
    assert text is not None
    assert _projection(text) == projection
    assert shlex.split(text) == [text]  # pasted into a shell, one argument as printed


def test_identity_without_dim_but_with_a_seed_has_no_text():
    assert projection_text(P(kind="identity", seed=5)) is None


def _info_projection_line(root: Path, name: str) -> str:
    result = cli_here("info", name, cwd=root)
    assert result.returncode == 0, result.stderr
    return next(line for line in result.stdout.splitlines() if line.startswith("projection"))


def _build(root: Path, out: str, text: str, *extra: str):
    return cli_here("build", "--spec", f"{SPEC}:make", "--out", out, "--batch-size", "10",
                    "--quiet", "--projection", text, *extra, cwd=root)


RESUMABLE = [P(dim=32, kind="sjlt", nnz=3, seed=2**63 - 1), P(dim=32, seed=4, per_checkpoint=True),
             P(kind="identity"),
             P(dim=32, kind="kronecker", split="shape", vectors="kronecker")]


@pytest.mark.parametrize("projection", RESUMABLE, ids=repr)
def test_pasted_info_text_and_refusal_text_resume_the_store(tmp_path, projection):
    _interrupted_build(tmp_path / "s", projection)
    line = _info_projection_line(tmp_path, "s")
    text = line.rsplit("(--projection ", 1)[1].removesuffix(")")
    refused = _build(tmp_path, "s", "rademacher:32:7", "--resume")
    assert refused.returncode == 1
    assert f"run the same command with --projection {text}, or pass --overwrite" in refused.stderr
    resumed = _build(tmp_path, "s", text, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    fresh = _build(tmp_path, "fresh", text)
    assert fresh.returncode == 0, fresh.stderr
    a, b = tif.open_store(str(tmp_path / "s")), tif.open_store(str(tmp_path / "fresh"))
    assert a.meta.complete and a.projection == b.projection == projection
    assert (a.read_rows(0, 0, 24) == b.read_rows(0, 0, 24)).all()


def test_identity_with_a_seed_prints_no_flag_and_says_so_on_resume(tmp_path):
    _interrupted_build(tmp_path / "s", P(kind="identity", seed=9))
    assert "--projection" not in _info_projection_line(tmp_path, "s")
    refused = _build(tmp_path, "s", "identity", "--resume")
    assert refused.returncode == 1
    assert "no --projection form" in refused.stderr
    assert "with --projection" not in refused.stderr


@pytest.mark.parametrize("extra", [("--dtype", "bfloat16"), ("--mixed-precision", "bf16")])
def test_refused_resume_for_another_reason_does_not_mention_projection(tmp_path, extra):
    _interrupted_build(tmp_path / "s")
    refused = _build(tmp_path, "s", "rademacher:32:7", "--resume", *extra)
    if refused.returncode == 2 and "invalid choice" in refused.stderr:
        pytest.skip(refused.stderr[-200:])
    assert refused.returncode == 1, refused.stderr
    assert "--projection" not in refused.stderr, refused.stderr


def test_refused_resume_for_batch_size_names_batch_size_not_projection(tmp_path):
    _interrupted_build(tmp_path / "s")
    refused = _build(tmp_path, "s", "rademacher:32:7", "--resume", "--batch-size", "12")
    assert refused.returncode == 1, refused.stderr
    assert "--batch-size 10" in refused.stderr and "--projection" not in refused.stderr


def _edit_projection(path: Path, **fields) -> None:
    meta_file = path / "zarr.json"
    meta = json.loads(meta_file.read_text())
    projection = meta["attributes"]["tracinfunc"]["projection"]
    for key, value in fields.items():
        if value is None:
            projection.pop(key, None)
        else:
            projection[key] = value
    meta_file.write_text(json.dumps(meta))


@pytest.mark.parametrize("fields", [{"nnz": None}, {"seed": None},
                                    {"split": "square", "vectors": "dense",
                                     "per_checkpoint": False}])
def test_metadata_with_defaults_spelt_or_left_out_prints_a_working_flag(tmp_path, fields):
    _interrupted_build(tmp_path / "s", P(dim=32, seed=0))
    _edit_projection(tmp_path / "s", **fields)
    line = _info_projection_line(tmp_path, "s")
    assert line.endswith("(--projection rademacher:32:0)"), line
    assert _build(tmp_path, "s", "rademacher:32:0", "--resume").returncode == 0


@pytest.mark.parametrize("fields", [{"kind": "rademacher\x1b[2J"}, {"split": "\x1b]0;x\x07"},
                                    {"seed": 7.5}, {"dim": "32\x1b[31m"}])
def test_crafted_projection_metadata_never_reaches_the_terminal_raw(tmp_path, fields):
    _interrupted_build(tmp_path / "s")
    _edit_projection(tmp_path / "s", **fields)
    for args in (("info", "s"), ("build", "--spec", f"{SPEC}:make", "--out", "s", "--resume",
                                 "--batch-size", "10", "--quiet", "--projection",
                                 "rademacher:32:7")):
        result = cli_here(*args, cwd=tmp_path)
        said = result.stdout + result.stderr
        assert "\x1b" not in said and "\x07" not in said, repr(said[-400:])
        if args[0] == "build":
            assert result.returncode != 0 or "(--projection" not in said


CHILD = r"""
import functools, os, sys
import jax, jax.numpy as jnp, numpy as np
import tracinfunc as tif, tracinfunc.jax as tj
from tests.jax_helpers import flax_mlp_loss, flax_template
from tracinfunc.errors import InvalidArgumentError
from tracinfunc.store.zarr.writer import ZarrWriter

assert jax.device_count() == 2, jax.devices()
one, two = jax.devices()
rng = np.random.default_rng(0)
params = jax.tree_util.tree_map(lambda l: jnp.asarray(rng.normal(size=l.shape), jnp.float32),
                                flax_template())
x, y = rng.normal(size=(24, 6)).astype(np.float32), rng.integers(0, 3, 24).astype(np.int32)
projection = tif.Projection(dim=16, seed=1)
mapping = tj.ParamMapping.flax(params)
root = sys.argv[1]


def logits(variables, x):
    p = variables["params"]
    h = jnp.tanh(x @ p["layers_0"]["kernel"] + p["layers_0"]["bias"])
    return h @ p["layers_2"]["kernel"] + p["layers_2"]["bias"]


def ckpts(*devices):
    return [tj.Checkpoint(params if d is None else jax.device_put(params, d), lr=0.1,
                          name=f"c{i}") for i, d in enumerate(devices)]


def outcome(call):
    try:
        call()
    except InvalidArgumentError as error:
        return "refused: " + " ".join(str(error).split())
    except Exception as error:
        return f"other {type(error).__name__}: " + " ".join(str(error).split())[:300]
    return "ran"


def build(c, store, loss=flax_mlp_loss):
    return tj.build_store(loss, c, (x, y), projection=projection, mapping=mapping, store=store)


def listing(path):
    return sorted(os.listdir(path)) if os.path.isdir(path) else "absent"


old = os.path.join(root, "old.zarr")
build(ckpts(None), old)
before = tif.open_store(old).read_rows(0, 0, 24)
print("overwrite |", outcome(lambda: build(ckpts(one, two),
                                           functools.partial(ZarrWriter, old, overwrite=True))))
after = tif.open_store(old)
print("overwrite kept |", after.meta.complete, float((after.read_rows(0, 0, 24) - before)
                                                     .abs().max()))
print("existing |", outcome(lambda: build(ckpts(one, two), old)))
print("existing kept |", tif.open_store(old).meta.complete)
fresh = os.path.join(root, "fresh.zarr")
print("fresh |", outcome(lambda: build(ckpts(one, two), fresh)))
print("fresh left |", listing(fresh))
leaves, tree = jax.tree_util.tree_flatten(params)
split = jax.tree_util.tree_unflatten(tree, [jax.device_put(leaf, (one, two)[i % 2])
                                            for i, leaf in enumerate(leaves)])
split_path = os.path.join(root, "split.zarr")
print("split |", outcome(lambda: build([tj.Checkpoint(split, lr=0.1, name="s")], split_path)))
print("split left |", listing(split_path))
state = {"scale": jax.device_put(jnp.ones(()), two)}


def loss_state(p, s, example):
    return flax_mlp_loss(p, example) * s["scale"]


st_path = os.path.join(root, "state.zarr")
print("state |", outcome(lambda: build([tj.Checkpoint(jax.device_put(params, one), lr=0.1,
                                                      name="w", state=state)],
                                       st_path, loss=loss_state)))
print("state left |", listing(st_path))
print("mix |", outcome(lambda: build(ckpts(None, two), os.path.join(root, "mix.zarr"))))
calls = []
base = tj.classification_sampler(logits)


def sampler(*a, **k):
    calls.append(1)
    return base(*a, **k)


for kind in ("projected", "ekfac"):
    print(f"fit {kind} |", outcome(lambda: tj.fit_curvature(
        flax_mlp_loss, ckpts(one, two), (x, y), kind=kind, projection=projection,
        mapping=mapping, sampler=sampler)))
print("fit sampler calls |", len(calls))
"""


@pytest.fixture(scope="module")
def lines(tmp_path_factory) -> dict[str, str]:
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    root = tmp_path_factory.mktemp("devices")
    done = subprocess.run([sys.executable, "-c", CHILD, str(root)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split(" | ", 1) for line in done.stdout.splitlines() if " | " in line)


@pytest.mark.parametrize("case", ["overwrite", "existing", "fresh", "split", "state"])
def test_checkpoints_on_two_devices_refused_naming_them(lines, case):
    said = lines[case]
    assert said.startswith("refused: ") and "jax.device_put" in said, said
    assert "cpu:0" in said and "cpu:1" in said, said


def test_overwrite_keeps_the_old_store_when_refused(lines):
    assert lines["overwrite kept"] == "True 0.0"
    assert lines["existing kept"] == "True"


@pytest.mark.parametrize("case", ["fresh", "split", "state"])
def test_a_fresh_path_is_not_left_with_an_empty_store(lines, case):
    assert lines[f"{case} left"] == "absent"


def test_committed_and_uncommitted_checkpoints_still_build(lines):
    assert lines["mix"] == "ran"


@pytest.mark.parametrize("kind", ["projected", "ekfac"])
def test_fit_curvature_refuses_before_fitting(lines, kind):
    said = lines[f"fit {kind}"]
    assert said.startswith("refused: tracinfunc.jax.fit_curvature"), said
    assert "checkpoint 'c0'" in said and "checkpoint 'c1'" in said, said
    assert lines["fit sampler calls"] == "0"
