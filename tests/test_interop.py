"""DLPack interop: arrays in, arrays out, zero-copy where promised (data pointers compared)."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import tracinfunc as tif
from tracinfunc._validate import calling
from tracinfunc.interop import (
    _aligned_empty as aligned_empty,
)
from tracinfunc.interop import (
    _is_aligned as is_aligned,
)
from tracinfunc.interop import (
    as_tensor,
    framework_of,
    resolve_output,
    to_framework,
)


def _ptr(array) -> int:
    if isinstance(array, torch.Tensor):
        return array.data_ptr()
    if isinstance(array, np.ndarray):
        return array.ctypes.data
    return array.unsafe_buffer_pointer()


def test_import_tracinfunc_does_not_import_jax():
    code = ("import sys, tracinfunc, tracinfunc.interop; "
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("make", [
    lambda: np.arange(12, dtype=np.float32).reshape(3, 4),
    lambda: jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
], ids=["numpy", "jax"])
def test_as_tensor_shares_memory(make):
    array = make()
    tensor = as_tensor(array)
    assert isinstance(tensor, torch.Tensor) and tensor.shape == (3, 4)
    assert tensor.data_ptr() == _ptr(array)
    np.testing.assert_array_equal(tensor.numpy(), np.asarray(array))


def test_as_tensor_passes_tensors_and_rejects_lists():
    t = torch.ones(2)
    assert as_tensor(t) is t
    with pytest.raises(TypeError, match=r"score: expected a torch.Tensor or an array"), \
            calling("score"):
        as_tensor([1.0, 2.0])


def test_aligned_empty_is_aligned_for_every_dtype_and_offset():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64):
        for n in (0, 1, 3, 1000):
            t = aligned_empty((n, 3), dtype)
            assert t.shape == (n, 3) and t.dtype == dtype and t.is_contiguous()
            assert is_aligned(t)


def test_to_jax_is_zero_copy_for_aligned_tensors():
    t = aligned_empty((4, 5)).copy_(torch.arange(20.0).reshape(4, 5))
    a = to_framework(t, "jax")
    assert isinstance(a, jax.Array) and _ptr(a) == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


@pytest.mark.parametrize("view", [lambda t: t[0, 1:], lambda t: t.T], ids=["unaligned",
                                                                            "transposed"])
def test_to_jax_copies_unaligned_or_strided_views(view):
    base = torch.arange(40.0).reshape(5, 8)
    t = view(base)
    a = to_framework(t, "jax")
    assert _ptr(a) != t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_to_numpy_is_zero_copy_and_torch_is_identity():
    t = torch.arange(6.0)
    assert _ptr(to_framework(t, "numpy")) == t.data_ptr()
    assert to_framework(t, "torch") is t
    bf = to_framework(torch.ones(3, dtype=torch.bfloat16), "numpy")
    assert str(bf.dtype) == "bfloat16"


def test_framework_and_output_resolution():
    assert framework_of(torch.ones(1)) == "torch"
    assert framework_of(np.ones(1)) == "numpy"
    assert framework_of(jnp.ones(1)) == "jax"
    assert resolve_output(None, None) == "torch"
    assert resolve_output(None, jnp.ones(1)) == "jax"
    with pytest.raises(ValueError, match="score: output must be one of"), calling("score"):
        resolve_output("tensorflow", None)
    with pytest.raises(ValueError, match="score: pass output= or like=, not both"), \
            calling("score"):
        resolve_output("jax", np.ones(1))
    with pytest.raises(TypeError, match="top_k: like= must be a torch, NumPy, JAX or CuPy"), \
            calling("top_k"):
        resolve_output(None, [1.0])


def _store_and_test(mlp_setup32):
    loss, ckpts, train, test = mlp_setup32
    projection = tif.Projection(dim=16, seed=0)
    store = tif.build_store(loss, ckpts, train, projection=projection)
    test_rows = tif.projected_grads(loss, projection)
    rows = torch.stack([test_rows(c.params, test) for c in ckpts])  # [n_ckpt, n_test, k]
    return store, rows


@pytest.mark.parametrize("framework", ["numpy", "jax"])
def test_score_takes_dlpack_arrays_and_returns_the_inputs_framework(mlp_setup32, framework):
    store, rows = _store_and_test(mlp_setup32)
    expected = tif.score(store, rows)
    array = rows.numpy() if framework == "numpy" else jnp.asarray(rows.numpy())
    got = tif.score(store, array, like=array)
    assert framework_of(got) == framework
    np.testing.assert_array_equal(np.asarray(got), expected.numpy())
    values, indices = tif.top_k(store, array, k=5, output=framework)
    exp_values, exp_indices = tif.top_k(store, rows, k=5)
    assert framework_of(values) == framework_of(indices) == framework
    np.testing.assert_array_equal(np.asarray(values), exp_values.numpy())
    np.testing.assert_array_equal(np.asarray(indices), exp_indices.numpy())
    si = tif.self_influence(store, output=framework)
    np.testing.assert_array_equal(np.asarray(si), tif.self_influence(store).numpy())
    chunks = list(tif.score_chunks(store, array))
    np.testing.assert_array_equal(chunks[0][1].numpy(), expected[:, : chunks[0][1].shape[1]])


def test_score_results_reach_jax_without_a_copy(mlp_setup32, monkeypatch):
    """The result tensor torch computed is the buffer JAX gets (aligned, not pinned)."""
    store, rows = _store_and_test(mlp_setup32)
    made = []
    original = to_framework

    def spy(tensor, framework):
        made.append(tensor)
        return original(tensor, framework)

    for name in ("tracinfunc.query.score", "tracinfunc.query.top_k"):
        monkeypatch.setattr(sys.modules[name], "to_framework", spy)
    got = tif.score(store, rows, output="jax")
    assert _ptr(got) == made[0].data_ptr()
    values, _ = tif.top_k(store, rows, k=3, output="jax")
    assert _ptr(values) == made[1].data_ptr()


def test_score_rejects_a_bad_output_before_work(mlp_setup32):
    store, rows = _store_and_test(mlp_setup32)
    with pytest.raises(ValueError, match="score: output must be one of"):
        tif.score(store, rows, output="tf")


def test_memory_writer_accepts_jax_and_numpy_blocks(mlp_setup32):
    store, _ = _store_and_test(mlp_setup32)
    meta = store.meta.replace(n_train=0, complete=False)
    rows = np.stack([store.read_rows(c, 0, store.n_train).numpy() for c in range(store.n_ckpt)])
    norms = np.stack([store.read_norms(c, 0, store.n_train).numpy()
                      for c in range(store.n_ckpt)])
    writer = tif.store.MemoryWriter(meta)
    writer.append(jnp.asarray(rows[:, :10]), jnp.asarray(norms[:, :10]))
    writer.append(rows[:, 10:], norms[:, 10:])
    again = writer.finish()
    torch.testing.assert_close(tif.score(again, torch.from_numpy(rows[:, :3])),
                               tif.score(store, torch.from_numpy(rows[:, :3])), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_tensors_are_copied_before_jax_sees_them():
    t = torch.arange(64.0).pin_memory()
    a = to_framework(t, "jax")
    assert _ptr(a) != t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_checkpoint_takes_jax_and_numpy_arrays():
    w = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)
    b = np.zeros(2, dtype=np.float32)
    ckpt = tif.Checkpoint(params={"fc.weight": w, "fc.bias": b}, lr=0.5)
    assert ckpt.params["fc.weight"].data_ptr() == _ptr(w)
    assert ckpt.params["fc.bias"].data_ptr() == _ptr(b)
    same = tif.Checkpoint(params={"fc.weight": torch.arange(6.0).reshape(2, 3),
                                  "fc.bias": torch.zeros(2)})
    assert ckpt.fingerprint == same.fingerprint
