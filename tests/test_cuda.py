"""On a CUDA device, everything issue 23 found on paper: each test would fail on the code
before it (float32, not only float64; test tensors, not only stores; norm layers; TF32 on; a
CPU model with ``device="cuda"``; bounded device memory). Skipped without CUDA; their CPU
twins (stand-in devices, a fake stream backend) are in tests/test_devices*.py,
tests/store/test_device_copy.py, tests/store/test_pinned_memory.py,
tests/build/test_copy_out.py and tests/test_precision_norms.py.

    pytest -m cuda tests/     # the GPU verdict, with benchmarks/gpu.py --quick
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tests.conftest import make_checkpoints, make_data, make_mlp
from tests.reference import exact_tracin
from tracinfunc.interop import to_framework

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

PROJ = tif.Projection(dim=64, seed=0)


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double().cpu() - expected.double().cpu()).norm() / expected.norm())


@pytest.fixture
def setup32():
    model = make_mlp(d_in=20, hidden=64, d_out=5, dtype=torch.float32).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    train = make_data(300, d_in=20, n_classes=5, dtype=torch.float32, seed=1)
    test = make_data(9, d_in=20, n_classes=5, dtype=torch.float32, seed=3)
    return loss, make_checkpoints(model), train, test


@pytest.fixture
def stores(setup32):
    loss, ckpts, train, test = setup32
    store = tif.build_store(loss, ckpts, train, projection=PROJ, progress=False)
    test_store = tif.build_store(loss, ckpts, test, projection=PROJ, progress=False)
    return store, test_store


def _as_tensor(store) -> torch.Tensor:
    n = store.meta.n_train
    return torch.stack([store.read_rows(c, 0, n) for c in range(store.meta.n_ckpt)])


@pytest.mark.parametrize("normalize", [False, True])
def test_score_and_top_k_take_cuda_test_tensors(stores, normalize):
    # Item 1: the lr scale was a CPU tensor and `test * scale` failed.
    store, test_store = stores
    expected = tif.score(store, test_store, device="cpu", normalize=normalize)
    test = _as_tensor(test_store).cuda()
    got = tif.score(store, test, normalize=normalize)
    assert got.device.type == "cuda"
    assert _relative(got, expected) < 1e-5
    for source in (store, tif.to_pinned(store)):
        values, indices = tif.top_k(source, test, k=5, normalize=normalize)
        expected_values, _ = tif.top_k(store, test_store, k=5, device="cpu",
                                       normalize=normalize)
        assert indices.device.type == "cuda"
        torch.testing.assert_close(values.cpu(), expected_values, rtol=1e-4, atol=1e-6)


def test_indexed_top_k_takes_cuda_test_tensors(stores):
    pytest.importorskip("faiss")
    store, test_store = stores
    index = tif.build_index(store, nlist=4)
    expected = tif.indexed_top_k(store, test_store, k=5, index=index, nprobe=4)
    got = tif.indexed_top_k(store, _as_tensor(test_store).cuda(), k=5, index=index, nprobe=4)
    torch.testing.assert_close(got, expected)


def test_scores_with_tf32_on_stay_float32_accurate(setup32):
    # Item 7: TF32 inherited from the process gave ~1e-3 relative error.
    loss, ckpts, train, test = setup32
    identity = tif.Projection(kind="identity")
    expected = exact_tracin(loss, ckpts, train, test)
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        store = tif.build_store(loss, ckpts, train, projection=identity, device="cuda",
                                progress=False)
        test_store = tif.build_store(loss, ckpts, test, projection=identity, device="cuda",
                                     progress=False)
        got = tif.score(store, test_store, device="cuda")
        assert torch.get_float32_matmul_precision() == "high"  # restored
    finally:
        torch.set_float32_matmul_precision(saved)
    assert _relative(got, expected) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.BatchNorm1d])
def test_norm_layers_under_cuda_autocast(norm, dtype):
    # Item 3: "expected scalar type Half but found Float".
    if not tif.grads.autocast_supported("cuda", dtype):
        pytest.skip(f"this GPU has no {dtype} autocast")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), norm(32), nn.Tanh(), nn.Linear(32, 5)).cuda()
    model.eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    params = {k: v.detach() for k, v in model.named_parameters()}
    batch = tuple(t.cuda() for t in make_data(16, d_in=20, n_classes=5, dtype=torch.float32))
    full = tif.projected_grads(loss, PROJ)(params, batch)
    half = tif.projected_grads(loss, PROJ, options=tif.GradientOptions(mixed_precision=dtype))(
        params, batch
    )
    assert _relative(half, full) < (0.05 if dtype == torch.bfloat16 else 0.01)


def test_float16_small_losses_are_not_flushed_on_cuda():
    # Item 8: no loss scaling, so confident examples got all-zero gradients (relative error
    # 1). Kept: every example whose loss is above float32's rounding (> 0). Below it the
    # gradients are under 1e-8, out of float16's reach with a scale float16 can hold (the
    # first GPU run, 2026-11-26: a scale of 2**24 was inf on CUDA); those rows stay finite.
    # The forward's own float16 rounding (saturated tanh units) moves a row by up to ~0.1.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 5)).eval()
    with torch.no_grad():
        model[2].weight.mul_(30)
        x = torch.randn(64, 20)
        y = model(x).argmax(1)
        losses = F.cross_entropy(model(x), y, reduction="none")
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    loss = tif.loss_from_module(model, F.cross_entropy)
    params = {k: v.detach() for k, v in model.named_parameters()}
    full = tif.projected_grads(loss, PROJ)(params, (x, y))
    half = tif.projected_grads(
        loss, PROJ, options=tif.GradientOptions(mixed_precision=torch.float16)
    )(params, (x, y))
    per_row = ((half - full).norm(dim=1) / full.norm(dim=1)).cpu()
    assert torch.isfinite(half).all()
    kept = per_row[losses > 0]
    worst = per_row.argsort(descending=True)[:5].tolist()
    detail = [(i, round(float(per_row[i]), 4), float(losses[i])) for i in worst]
    assert len(kept) >= 50, detail
    assert float(kept.max()) < 0.15, f"(row, relative error, float32 loss): {detail}"
    assert float(kept.median()) < 0.01, detail


def test_cpu_model_with_buffers_builds_on_cuda():
    # Item 4: the first-batch check used the module's CPU BatchNorm statistics (then said
    # "put the model in eval mode").
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.BatchNorm1d(32), nn.Tanh(),
                          nn.Linear(32, 5)).eval()
    model[1].running_mean.normal_(0, 0.3)
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = [tif.Checkpoint(params={k: v.detach().clone()
                                    for k, v in model.named_parameters()})]
    data = make_data(40, d_in=20, n_classes=5, dtype=torch.float32)
    on_gpu = tif.build_store(loss, ckpts, data, projection=PROJ, device="cuda", progress=False)
    on_cpu = tif.build_store(loss, ckpts, data, projection=PROJ, progress=False)
    assert _relative(_as_tensor(on_gpu), _as_tensor(on_cpu)) < 1e-5


def test_checkpoint_load_follows_a_gpu_model(tmp_path):
    model = make_mlp(dtype=torch.float32)
    torch.save(model.state_dict(), tmp_path / "w.pt")
    ckpt = tif.Checkpoint.load(tmp_path / "w.pt", model.cuda())
    assert {v.device.type for v in ckpt.params.values()} == {"cuda"}


def _identity_store(rows: torch.Tensor) -> tif.GradientStore:
    """A one-checkpoint in-memory store holding ``rows`` ``[1, n, k]`` as they are."""
    from tracinfunc.build.loop import new_store_meta

    meta = new_store_meta(
        [("c0", 1.0, "f")],
        tif.projection.canonical_layout({"w": (rows.shape[2],)}),
        tif.Projection(dim=None, kind="identity"),
        torch.float32,
        None,
    )
    writer = tif.store.MemoryWriter(meta)
    writer.append(rows, rows.norm(dim=-1))
    return writer.finish()


def test_streaming_keeps_device_memory_bounded():
    # Item 10: a fresh device buffer per piece, so memory grew when compute lagged copies.
    n, k = 200_000, 256  # 205 MB of float32 rows, streamed in 4096-row (4 MiB) pieces
    store = _identity_store(torch.randn(1, n, k))
    test = torch.randn(1, 8, k, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()
    values, _ = tif.top_k(store, test, k=3, chunk_rows=4096)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_reserved() - before
    assert grown < 64 * 2**20, f"{grown / 2**20:.0f} MiB reserved for 4 MiB pieces"
    expected, _ = tif.top_k(store, test.cpu(), k=3, device="cpu")
    torch.testing.assert_close(values.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_score_refuses_a_matrix_larger_than_the_gpu():
    # Item 11: [n_test, n_train] was allocated on the GPU unchecked.
    n_train, n_test = 2_000_000, 200_000  # 1.6 TB of float32 scores, 8 MB of rows
    store = _identity_store(torch.ones(1, n_train, 1))
    with pytest.raises(tif.errors.MemoryBudgetError, match="top_k"):
        tif.score(store, torch.ones(1, n_test, 1, device="cuda"))


def test_a_pinned_store_pins_its_own_size_and_gives_it_back():
    # Item 12: the caching host allocator pinned a 20.5 GB store as 32 GB and kept it.
    n, k = int(20.5 * 2**20) // (4 * 256), 256  # 20.5 MiB of float32 rows
    rows = torch.randn(1, n, k)
    stats = getattr(torch.cuda, "host_memory_stats", None)  # the caching host allocator's
    reserved = (lambda: stats()["allocated_bytes.current"]) if stats else None
    before = reserved() if reserved else 0
    store = tif.to_pinned(_identity_store(rows))
    assert store.pinned and store.view_rows(0, 0, 1).is_pinned()
    if reserved:  # nothing taken from the caching host allocator (it rounds to 32 MiB)
        assert reserved() - before < 2**20
    test = torch.randn(1, 8, k, device="cuda")
    torch.testing.assert_close(tif.score(store, test, chunk_rows=4096).cpu(),
                               tif.score(store, test.cpu(), device="cpu"), rtol=1e-5, atol=1e-4)
    del store
    gc.collect()  # unregistered and freed: pinning the same memory again works
    assert tif.to_pinned(_identity_store(rows)).pinned


@pytest.mark.parametrize("dtype", ["int8", "sign"])
@pytest.mark.parametrize("kind", ["pinned", "zarr"])
def test_quantised_stores_dequantise_on_the_gpu(setup32, tmp_path, kind, dtype):
    # Item 13: codes pinned but float32 rows sent; Zarr codes dequantised on the CPU.
    loss, ckpts, train, test = setup32
    store = tif.build_store(loss, ckpts, train, projection=PROJ, dtype=dtype, store="pinned",
                            progress=False)
    if kind == "zarr":
        store = tif.save_store(store, tmp_path / "q.zarr")
    test_store = tif.build_store(loss, ckpts, test, projection=PROJ, progress=False)
    expected = tif.score(store, test_store, device="cpu")
    got = tif.score(store, test_store, device="cuda", chunk_rows=64)
    assert got.device.type == "cuda" and _relative(got, expected) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("target", ["memory", "pinned", "zarr"])
def test_a_gpu_build_overlapping_its_writes_stores_the_serial_rows(setup32, tmp_path, dtype,
                                                                   target):
    # Item 14: the copy-out pipeline gives the rows a serial GPU build gives, bit for bit.
    from tracinfunc.build import copy_out

    loss, ckpts, train, _ = setup32

    def build(name):
        store = tmp_path / f"{name}.zarr" if target == "zarr" else target
        return tif.build_store(loss, ckpts, train, projection=PROJ, dtype=dtype, store=store,
                               device="cuda", batch_size=32, progress=False)

    overlapped = build("overlapped")
    real = copy_out.copy_backend
    copy_out.copy_backend = lambda device: None  # the serial loop
    try:
        serial = build("serial")
    finally:
        copy_out.copy_backend = real
    n = serial.meta.n_train
    for c in range(serial.meta.n_ckpt):
        assert torch.equal(overlapped.read_rows(c, 0, n), serial.read_rows(c, 0, n))
        assert torch.equal(overlapped.read_norms(c, 0, n), serial.read_norms(c, 0, n))


def test_recorded_checkpoints_follow_a_gpu_model(tmp_path):
    # Item 4: load_recorded_checkpoints mapped everything to the CPU.
    model = make_mlp(dtype=torch.float32).cuda()
    optimizer = torch.optim.SGD(model[-1].parameters(), lr=0.1)
    recorder = tif.training.CheckpointRecorder(tmp_path, model, optimizer, every=1)
    x, y = make_data(8, dtype=torch.float32)
    F.cross_entropy(model(x.cuda()), y.cuda()).backward()
    optimizer.step()
    recorder.step()
    (ckpt,) = tif.load_recorded_checkpoints(tmp_path, model)
    assert {v.device.type for v in ckpt.params.values()} == {"cuda"}


@two_gpus
def test_out_on_another_gpu_is_refused(stores):
    # Item 6: _check_out compared only the device type.
    store, test_store = stores
    out = torch.empty(9, 300, device="cuda:1")
    with pytest.raises(tif.errors.InvalidArgumentError, match="cuda:0"):
        list(tif.score_chunks(store, test_store, device="cuda:0", out=out))


@two_gpus
def test_results_on_a_non_current_gpu_export_to_jax_and_cupy(stores):
    # Item 5: DLPack raised BufferError for another GPU's tensor.
    store, test_store = stores
    scores = tif.score(store, test_store, device="cuda:1")
    for framework in ("jax", "cupy"):
        try:
            exported = to_framework(scores, framework)
        except ImportError:
            continue
        assert exported.shape == (9, 300)


@pytest.mark.parametrize("caller_precision", [None, "tensorfloat32"])
def test_jax_builds_on_the_gpu_run_in_ieee_float32(caller_precision):
    """JAX's default float32 matmul on a GPU is TF32: before tracinfunc.jax compiled its
    programs in IEEE float32 (tracinfunc/jax/precision.py), a Flax walkthrough on an H100
    scored 2.2e-4 off float64. Exact (identity) rows from JAX on the GPU against the torch
    CPU build of the same weights, also when the caller asks for TF32."""
    jax = pytest.importorskip("jax")
    if jax.default_backend() == "cpu":
        pytest.skip("needs JAX with a GPU")
    import tracinfunc.jax as tj
    from tests.jax_helpers import paired_mlp, to_jax_batch

    loss, ckpts, jax_loss, jax_ckpts, mapping, train, test = paired_mlp(n_train=64, n_test=9)
    identity = tif.Projection(kind="identity")
    expected = tif.score(tif.build_store(loss, ckpts, train, projection=identity),
                         tif.build_store(loss, ckpts, test, projection=identity), device="cpu")
    gpu = jax.devices("gpu")[0]
    # from_torch keeps the CPU tensors' device (DLPack): a batch put on the GPU is refused
    # by name (tracinfunc/jax/build.py: device_check) until the parameters go there too.
    on_gpu = tuple(jax.device_put(leaf, gpu) for leaf in to_jax_batch(train))
    with pytest.raises(tif.errors.InvalidArgumentError, match="committed to different devices"):
        tj.build_store(jax_loss, jax_ckpts, on_gpu, projection=identity, mapping=mapping)
    jax_ckpts = [tj.Checkpoint(jax.device_put(c.params, gpu), lr=c.lr, name=c.name)
                 for c in jax_ckpts]

    def build(batch):
        on_gpu = tuple(jax.device_put(leaf, gpu) for leaf in to_jax_batch(batch))
        return tj.build_store(jax_loss, jax_ckpts, on_gpu, projection=identity, mapping=mapping)

    if caller_precision is None:
        got = tif.score(build(train), build(test), device="cpu")
    else:
        with jax.default_matmul_precision(caller_precision):
            got = tif.score(build(train), build(test), device="cpu")
    assert _relative(got, expected) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_folded_under_vmap_runs_the_cuda_kernels_per_example(dtype):
    """Session 50's fold (tracinfunc/_attention.py) was proved on the CPU's kernel only. On a
    GPU the folded batch goes to flash / memory-efficient attention: outputs and gradients
    must equal each example's own call of the same kernel, with no batching-rule fallback."""
    import warnings

    from torch.func import vmap

    from tracinfunc._attention import vmap_attention

    torch.manual_seed(0)
    shape = (4, 2, 4, 64, 64)  # [B, N, H, L, E]: examples, then the loss's own batch

    def leaf():
        return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)

    q, k, v = leaf(), leaf(), leaf()

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    reference = torch.stack([attend(q[i], k[i], v[i]) for i in range(shape[0])])
    ref_grads = torch.autograd.grad(reference.float().square().sum(), [q, k, v])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with vmap_attention():
            out = vmap(attend)(q, k, v)
    grads = torch.autograd.grad(out.float().square().sum(), [q, k, v])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _relative(out, reference) <= tol
    for got, want in zip(grads, ref_grads, strict=True):
        assert _relative(got, want) <= tol


def test_hand_written_gpt2_loss_projects_all_parameters_on_cuda():
    """A hand-written ``functional_call`` GPT-2 loss, ``kind="kronecker"`` with
    ``vectors="kronecker"`` over every parameter, on the GPU in float32 (fused attention
    folded under vmap) against the same rows from the CPU in float64."""
    from torch.func import functional_call

    from tests.lm_helpers import params_of, tiny_gpt2, token_batch

    spec = tif.Projection(dim=256, kind="kronecker", vectors="kronecker")
    ids = token_batch(n=6, length=16)["input_ids"]

    def rows(model, device):
        def hand_written(p, example):
            one = example[None]
            return functional_call(model, p, (), {"input_ids": one, "labels": one}).loss

        params = params_of(model)
        return tif.projected_grads(hand_written, spec)(params, ids.to(device))

    expected = rows(tiny_gpt2(seed=3, dtype=torch.float64), "cpu")
    got = rows(tiny_gpt2(seed=3, dtype=torch.float32).cuda(), "cuda")
    assert got.device.type == "cuda"
    assert _relative(got, expected) <= 1e-4
