"""Hostile pass atk3 (JAX frontend: compile-once cache, padding, sharding, stores scored from
torch; HOSTILE.md classes 2-5). Black box, from docs/jax.md and docs/concepts/stores.md only.

FAILING now (finding):
- test_float16_store_overflow_refused: build_store(..., dtype=torch.float16) with gradient
  entries above float16's 65504 writes inf rows and score() returns inf/NaN, silently, while a
  NaN/inf gradient is refused by index before the cast (the torch frontend does the same).
HELD (regression guards): every other test here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

import tracinfunc as tif  # noqa: E402
import tracinfunc.jax as tj  # noqa: E402
from tests.conftest import child_env  # noqa: E402
from tracinfunc.errors import EmptyDataError, TracInFuncError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


SCRIPT = textwrap.dedent('''
    import sys, numpy as np, jax, jax.numpy as jnp, optax, torch
    import tracinfunc as tif, tracinfunc.jax as tj
    r = np.random.default_rng(0)
    x = r.normal(size=(23, 5)).astype(np.float32); y = r.integers(0, 3, 23).astype(np.int32)
    p = {"params": {"Dense_0": {"kernel": jnp.asarray(r.normal(size=(5, 3)).astype(np.float32)),
                                "bias": jnp.asarray(r.normal(size=3).astype(np.float32))}}}
    def loss(v, ex):
        d = v["params"]["Dense_0"]
        return optax.softmax_cross_entropy_with_integer_labels(ex[0] @ d["kernel"] + d["bias"], ex[1])
    CONFIGS = {
        "base": dict(P=dict(dim=8)), "seed1": dict(P=dict(dim=8, seed=1)),
        "dim16": dict(P=dict(dim=16)), "sjlt": dict(P=dict(dim=8, kind="sjlt", nnz=2)),
        "kron": dict(P=dict(dim=4, kind="kronecker")), "identity": dict(P=dict(kind="identity")),
        "bf16": dict(P=dict(dim=8), dtype=torch.bfloat16), "chunk5": dict(P=dict(dim=8), chunk=5),
        "rename": dict(P=dict(dim=8), rename={"Dense_0.weight": "fc.weight"}),
        "identitymap": dict(P=dict(dim=8), identity=True), "rows10": dict(P=dict(dim=8), n=10),
    }
    def run(name):
        c = CONFIGS[name]; n = c.get("n", 23)
        ck = [tj.Checkpoint(p, lr=0.1, name="a"),
              tj.Checkpoint(jax.tree_util.tree_map(lambda a: a * 1.5, p), lr=0.2, name="b")]
        mp = (tj.ParamMapping.identity(p) if c.get("identity")
              else tj.ParamMapping.flax(p, rename=c.get("rename")))
        st = tj.build_store(loss, ck, (x[:n], y[:n]), projection=tif.Projection(**c["P"]), mapping=mp,
                            chunk_size=c.get("chunk"), dtype=c.get("dtype", torch.float32))
        return np.stack([st.read_rows(i, 0, n).float().numpy() for i in range(2)])
    names = sys.argv[2:] or list(CONFIGS)
    np.savez(sys.argv[1], **{nm: run(nm) for nm in names})
''')


def _run(tmp_path, out, *names):
    script = tmp_path / "cache.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, str(script), str(out), *names], env=child_env(),
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    return np.load(out)


def test_held_compile_cache_never_reuses_a_stale_program(tmp_path):
    """One process builds 11 configurations with the same loss object; each equals a fresh
    process building only that configuration, and shorter chunks/row counts equal base."""
    together = _run(tmp_path, tmp_path / "all.npz")
    for name in ("kron", "rename"):
        alone = _run(tmp_path, tmp_path / f"{name}.npz", name)[name]
        np.testing.assert_array_equal(together[name], alone, err_msg=name)
    np.testing.assert_allclose(together["chunk5"], together["base"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(together["rows10"], together["base"][:, :10])
    assert np.abs(together["rename"] - together["base"]).max() > 0.1


def test_held_sharded_batch_and_params_equal_unsharded(tmp_path):
    script = tmp_path / "shard.py"
    script.write_text(textwrap.dedent('''
        import numpy as np, jax, jax.numpy as jnp, optax, tracinfunc as tif, tracinfunc.jax as tj
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as PS
        assert len(jax.devices()) == 4
        r = np.random.default_rng(0)
        x = r.normal(size=(24, 5)).astype(np.float32); y = r.integers(0, 4, 24).astype(np.int32)
        p = {"w": jnp.asarray(r.normal(size=(5, 4)).astype(np.float32)), "b": jnp.zeros(4)}
        loss = lambda q, ex: optax.softmax_cross_entropy_with_integer_labels(ex[0] @ q["w"] + q["b"], ex[1])
        mesh = Mesh(np.array(jax.devices()), ("d",))
        sh = lambda a, spec: jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))
        P = tif.Projection(dim=8)
        ref = tj.build_store(loss, [tj.Checkpoint(p, lr=0.1, name="a")], (x, y), projection=P)
        ps = {"w": sh(p["w"], PS(None, "d")), "b": sh(p["b"], PS("d"))}
        st = tj.build_store(loss, [tj.Checkpoint(ps, lr=0.1, name="a")],
                            (sh(x, PS("d")), sh(y, PS("d"))), projection=P, chunk_size=7)
        assert st.meta.checkpoints == ref.meta.checkpoints
        assert float((st.read_rows(0, 0, 24) - ref.read_rows(0, 0, 24)).abs().max()) < 1e-5
    '''))
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]


def _loss(v, ex):
    return optax.softmax_cross_entropy_with_integer_labels(ex[0] @ v["w"] + v["b"], ex[1])


def _small():
    r = np.random.default_rng(0)
    p = {"w": jnp.asarray(r.normal(size=(5, 3)).astype(np.float32)), "b": jnp.zeros(3)}
    return p, r.normal(size=(20, 5)).astype(np.float32), r.integers(0, 3, 20).astype(np.int32)


def test_held_zarr_store_from_jax_scored_from_torch(tmp_path):
    p, x, y = _small()
    ck = [tj.Checkpoint(p, lr=0.1, name="a"), tj.Checkpoint(jax.tree_util.tree_map(lambda a: a * 2, p), lr=0.3, name="b")]
    P = tif.Projection(dim=8)
    tj.build_store(_loss, ck, (x, y), projection=P, store=str(tmp_path / "g.zarr"))
    store = tif.GradientStore.open(str(tmp_path / "g.zarr"))
    test = tj.build_store(_loss, ck, (x[:5], y[:5]), projection=P)
    mem = tj.build_store(_loss, ck, (x, y), projection=P)
    s = tif.score(store, test, output="jax")
    assert isinstance(s, jax.Array) and s.shape == (5, 20) and s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(s), tif.score(mem, test, output="numpy"))
    v, i = tif.top_k(store, test, k=3, output="jax")
    assert isinstance(v, jax.Array) and i.dtype == jnp.int32
    with pytest.raises(TracInFuncError):      # another build onto the finished store
        tj.build_store(_loss, [tj.Checkpoint(p, lr=0.5, name="a")], (x, y), projection=P,
                       store=str(tmp_path / "g.zarr"))
    with pytest.raises(TracInFuncError):      # a file inside it
        tj.build_store(_loss, ck, (x, y), projection=P, store=str(tmp_path / "g.zarr" / "zarr.json"))
    assert torch.equal(tif.GradientStore.open(str(tmp_path / "g.zarr")).read_rows(0, 0, 20),
                       mem.read_rows(0, 0, 20))


def test_held_build_store_bad_data():
    p, x, y = _small()
    ck = [tj.Checkpoint(p, lr=0.1, name="a")]
    P = tif.Projection(dim=8)
    with pytest.raises(EmptyDataError):
        tj.build_store(_loss, ck, (x[:0], y[:0]), projection=P)
    with pytest.raises(TracInFuncError, match="leading"):
        tj.build_store(_loss, ck, (x, y[:10]), projection=P)
    xn = x.copy()
    xn[5, 2] = np.nan
    with pytest.raises(TracInFuncError, match="5"):
        tj.build_store(_loss, ck, (xn, y), projection=P)
    st = tj.build_store(_loss, ck, (x, y), projection=P)
    with pytest.raises(TracInFuncError, match="k must"):
        tif.top_k(st, st, k=21)


def test_held_snapshot_survives_in_place_training():
    p, x, y = _small()
    w, b = np.asarray(p["w"]).copy(), np.zeros(3, np.float32)
    ckpt = tj.Checkpoint({"w": w, "b": b}, lr=0.1, name="e0")
    P = tif.Projection(dim=8)
    ref = tj.build_store(_loss, [tj.Checkpoint({"w": w.copy(), "b": b.copy()}, lr=0.1, name="e0")], (x, y), projection=P)
    w *= 3.0
    b += 1.0
    got = tj.build_store(_loss, [ckpt], (x, y), projection=P)
    assert torch.equal(got.read_rows(0, 0, 20), ref.read_rows(0, 0, 20))


def test_float16_store_overflow_refused():
    """FAILS now: rows hold inf and the scores are not finite; expected a refusal naming the
    examples and the fix (float32 or bfloat16 storage)."""
    r = np.random.default_rng(0)
    x = (r.normal(size=(12, 5)) * 1e5).astype(np.float32)
    y = r.integers(0, 3, 12).astype(np.int32)
    p = {"w": jnp.ones((5, 3)) * 0.01, "b": jnp.zeros(3)}
    try:
        st = tj.build_store(_loss, [tj.Checkpoint(p, lr=0.1, name="a")], (x, y),
                            projection=tif.Projection(dim=8), dtype=torch.float16)
    except TracInFuncError as err:
        assert "float16" in str(err)
        return
    assert torch.isfinite(st.read_rows(0, 0, 12)).all(), "float16 overflow stored as inf"
    assert torch.isfinite(tif.score(st, st)).all()
