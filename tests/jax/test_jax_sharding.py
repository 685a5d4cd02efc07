"""Arrays sharded over several (host) devices are accepted by tj.build_store (issue 32 item 6).

The device count is fixed when JAX starts, so the check runs in a child process with
``--xla_force_host_platform_device_count=4``; it prints the largest difference between the
rows of a sharded build and those of the same build from unsharded arrays.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import child_env

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import tracinfunc as tif, tracinfunc.jax as tj
from tests.jax_helpers import flax_mlp_loss, flax_template

assert jax.device_count() == 4, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("d",))
rng = np.random.default_rng(0)
params = jax.tree_util.tree_map(lambda l: jnp.asarray(rng.normal(size=l.shape), jnp.float32),
                                flax_template())
x, y = rng.normal(size=(40, 6)).astype(np.float32), rng.integers(0, 3, 40).astype(np.int32)
rows = NamedSharding(mesh, P("d"))
sharded = (jax.device_put(x, rows), jax.device_put(y, rows))
replicated = jax.device_put(params, NamedSharding(mesh, P()))
mapping = tj.ParamMapping.flax(params)
projection = tif.Projection(dim=16, seed=1)
plain = tj.build_store(flax_mlp_loss, [tj.Checkpoint(params, lr=0.1)], (x, y),
                       projection=projection, mapping=mapping)
# Sharded batches (the last one smaller: padded) and replicated parameters.
batches = [tuple(jax.device_put(a[s:s + 16], rows) for a in (x, y)) for s in (0, 16)]
batches.append(tuple(a[32:] for a in (x, y)))
store = tj.build_store(flax_mlp_loss, [tj.Checkpoint(replicated, lr=0.1)], batches,
                       projection=projection, mapping=mapping)
whole = tj.build_store(flax_mlp_loss, [tj.Checkpoint(replicated, lr=0.1)], sharded,
                       projection=projection, mapping=mapping)
assert store.meta.checkpoints == plain.meta.checkpoints
ref = plain.read_rows(0, 0, 40).numpy()
diff = max(float(np.abs(s.read_rows(0, 0, 40).numpy() - ref).max()) for s in (store, whole))
print("maxdiff", diff / float(np.abs(ref).max()))
"""


def test_sharded_batches_and_params_build_the_same_store():
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    diff = float(done.stdout.split("maxdiff")[-1])
    assert diff <= 1e-6
