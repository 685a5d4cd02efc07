"""Checkpoints and data committed to different devices (found on an H100, session 51:
``ParamMapping.from_torch`` keeps a CPU tensor's device through DLPack, and a batch put on
the GPU then failed inside the compiled program as ``LossFunctionError`` blaming the loss).

JAX fixes its device count at start, so each case runs in a child process with two host
devices standing in for a CPU and a GPU; it prints one line per case.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import jax, jax.numpy as jnp, numpy as np
import tracinfunc as tif, tracinfunc.jax as tj
from tests.jax_helpers import flax_mlp_loss, flax_template
from tracinfunc.errors import InvalidArgumentError

assert jax.device_count() == 2, jax.devices()
one, two = jax.devices()
rng = np.random.default_rng(0)
params = jax.tree_util.tree_map(lambda l: jnp.asarray(rng.normal(size=l.shape), jnp.float32),
                                flax_template())
x, y = rng.normal(size=(24, 6)).astype(np.float32), rng.integers(0, 3, 24).astype(np.int32)
projection = tif.Projection(dim=16, seed=1)
mapping = tj.ParamMapping.flax(params)


def logits(variables, x):
    p = variables["params"]
    h = jnp.tanh(x @ p["layers_0"]["kernel"] + p["layers_0"]["bias"])
    return h @ p["layers_2"]["kernel"] + p["layers_2"]["bias"]


def ckpts(*devices):
    return [tj.Checkpoint(params if d is None else jax.device_put(params, d), lr=0.1,
                          name=f"c{i}") for i, d in enumerate(devices)]


def batch(device):
    return (x, y) if device is None else (jax.device_put(x, device), jax.device_put(y, device))


def build(c, b):
    return tj.build_store(flax_mlp_loss, c, b, projection=projection, mapping=mapping)


def fit(c, b):
    return tj.fit_curvature(flax_mlp_loss, c, b, kind="projected", projection=projection,
                            mapping=mapping, sampler=tj.classification_sampler(logits))


def precondition(c, b):
    curvature = fit(ckpts(*[None] * len(c)), batch(None))  # fitted on the default device
    return tj.preconditioned_test_grads(flax_mlp_loss, c, b, curvature,
                                        projection=projection, mapping=mapping)


def outcome(call, c, b):
    try:
        call(c, b)
    except InvalidArgumentError as error:
        return "refused: " + " ".join(str(error).split())
    except Exception as error:
        return f"other {type(error).__name__}: " + " ".join(str(error).split())[:300]
    return "ran"


reference = build(ckpts(None), batch(None)).read_rows(0, 0, 24)
for name, call in (("build", build), ("fit", fit), ("precondition", precondition)):
    print(name, "params on 2, batch on 1 |", outcome(call, ckpts(two), batch(one)))
    print(name, "checkpoints on 1 and 2 |", outcome(call, ckpts(one, two), batch(None)))
for c, b, what in ((ckpts(two), batch(None), "params on 2, batch uncommitted"),
                   (ckpts(None), batch(two), "params uncommitted, batch on 2")):
    rows = build(c, b).read_rows(0, 0, 24)
    print("rows", what, "|", float((rows - reference).abs().max()))
"""


@pytest.fixture(scope="module")
def lines() -> dict[str, str]:
    # Host devices stand in for a CPU and a GPU, also on a machine with a GPU.
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split(" | ", 1) for line in done.stdout.splitlines() if " | " in line)


@pytest.mark.parametrize("call", ["build", "fit", "precondition"])
def test_data_on_another_device_than_the_parameters_is_refused_naming_both(lines, call):
    said = lines[f"{call} params on 2, batch on 1"]
    assert said.startswith("refused: "), said
    assert "checkpoint 'c0'" in said and "batch 0 of data" in said, said
    assert "jax.device_put" in said, said


@pytest.mark.parametrize("call", ["build", "fit", "precondition"])
def test_checkpoints_on_two_devices_are_refused(lines, call):
    said = lines[f"{call} checkpoints on 1 and 2"]
    assert said.startswith("refused: "), said
    assert "checkpoint 'c0'" in said and "checkpoint 'c1'" in said, said


@pytest.mark.parametrize("what", ["params on 2, batch uncommitted",
                                  "params uncommitted, batch on 2"])
def test_uncommitted_arrays_follow_the_committed_ones(lines, what):
    assert float(lines[f"rows {what}"]) <= 1e-6
