"""Device handling proven on the CPU: a stand-in device (``meta``), faked device queries, TF32
flags toggled on a CPU build. Each test would fail on the code the GPU review found wrong
(issue 23); the ``cuda``-marked twins are in ``tests/test_cuda.py``."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

import tracinfunc as tif
from tracinfunc import _devices
from tracinfunc.query.stream import stream_rows

score_module = importlib.import_module("tracinfunc.query.chunks")  # the streaming loop
prepared_module = importlib.import_module("tracinfunc.query.prepared")
META = torch.device("meta")


@pytest.fixture
def stores(mlp_setup32):
    loss, ckpts, train, test = mlp_setup32
    projection = tif.Projection(dim=16, seed=0)
    store = tif.build_store(loss, ckpts, train, projection=projection, progress=False)
    test_store = tif.build_store(loss, ckpts, test, projection=projection, progress=False)
    return store, test_store


def _test_tensor(test_store) -> torch.Tensor:
    n = test_store.meta.n_train
    return torch.stack([test_store.read_rows(c, 0, n) for c in range(test_store.meta.n_ckpt)])


def _queries_on(monkeypatch, module, device: torch.device) -> None:
    """Test gradients arrive on ``device`` (a stand-in for a GPU tensor), unless the caller
    asks query_matrix for a device."""
    real = module.query_matrix

    def on_device(meta, test_grads, device=None):
        rows, norms = real(meta, test_grads, device=torch.device("cpu"))
        target = stand_in if device is None else device
        return rows.to(target), norms.to(target)

    stand_in = device
    monkeypatch.setattr(module, "query_matrix", on_device)


@pytest.mark.parametrize("normalize", [False, True])
def test_score_keeps_queries_scales_and_rows_on_the_target_device(stores, monkeypatch,
                                                                  normalize):
    # Issue 23 item 1: the lr scale was a CPU tensor, so `test * scale` failed for CUDA test
    # gradients. The meta device stands in for the GPU the test gradients live on.
    store, test_store = stores
    _queries_on(monkeypatch, prepared_module, META)
    seen = []
    real = score_module._accumulate

    def spy(block, test, train, inverse, *, first, **options):
        tensors = [block, test, train] + ([inverse] if inverse is not None else [])
        seen.append({t.device.type for t in tensors})
        return real(block, test, train, inverse, first=first, **options)

    monkeypatch.setattr(score_module, "_accumulate", spy)
    got = tif.score(store, _test_tensor(test_store), device=META, normalize=normalize)
    assert got.device == META and got.shape == (7, 40)
    assert seen and all(devices == {"meta"} for devices in seen)


def test_top_k_runs_with_queries_on_the_target_device(stores, monkeypatch):
    store, test_store = stores
    _queries_on(monkeypatch, prepared_module, META)
    values, indices = tif.top_k(store, _test_tensor(test_store), k=3, device=META)
    assert values.device == META and indices.shape == (7, 3)


def test_indexed_top_k_brings_device_queries_to_the_cpu(stores, monkeypatch):
    pytest.importorskip("faiss")

    store, test_store = stores
    test = _test_tensor(test_store)
    index = tif.build_index(store, nlist=2)
    expected = tif.indexed_top_k(store, test, k=3, index=index, nprobe=2)
    _queries_on(monkeypatch, prepared_module, META)  # test gradients on "the GPU"
    got = tif.indexed_top_k(store, test, k=3, index=index, nprobe=2)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("in_memory", [True, False])
def test_stream_rows_puts_rows_on_any_device(stores, tmp_path, in_memory):
    # Issue 23 item 2: devices other than CUDA (mps, xpu) got the CPU rows.
    store = stores[0]
    if not in_memory:
        store = tif.save_store(store, tmp_path / "g.zarr")
    pieces = [(c, s, min(s + 16, 40)) for s in range(0, 40, 16) for c in range(3)]
    devices = {rows.device for _, rows in stream_rows(store, pieces, device=META, max_rows=16)}
    assert devices == {META}


def test_canonical_device_fills_the_current_index():
    def index_of(device_type):
        return 1 if device_type == "cuda" else None

    assert _devices.canonical_device("cuda", index_of) == torch.device("cuda", 1)
    assert _devices.canonical_device("cuda:0", index_of) == torch.device("cuda", 0)
    assert _devices.canonical_device("cpu", index_of) == torch.device("cpu")


def test_out_on_another_gpu_is_refused(stores, monkeypatch):
    # Issue 23 item 6: _check_out compared only the device type, so an `out` on cuda:1 was
    # taken for a computation on cuda:0. Only the comparison is exercised (no GPU here).
    meta = stores[0].meta
    monkeypatch.setattr(_devices, "current_index", lambda t: 0 if t == "cuda" else None)
    out = torch.empty(7, 40)
    score_module._check_out(out, (7, 40), torch.float32, torch.device("cpu"))  # accepted
    fake_out = SimpleNamespace(shape=(7, 40), dtype=torch.float32, device=torch.device("cuda:1"))
    with pytest.raises(tif.errors.InvalidArgumentError, match="cuda:0"):
        score_module._check_out(fake_out, (7, meta.n_train), torch.float32,
                                torch.device("cuda"))


def test_score_refuses_a_matrix_larger_than_free_device_memory(stores, monkeypatch):
    # Issue 23 item 11: score materialised [n_test, n_train] on the GPU without a check.
    store, test_store = stores
    monkeypatch.setattr(_devices, "free_bytes", lambda device: 1000)
    with pytest.raises(tif.errors.MemoryBudgetError, match=r"score:.*\[7, 40\].*top_k.*rows="):
        tif.score(store, test_store, device="cpu")
    monkeypatch.setattr(_devices, "free_bytes", lambda device: 10**9)
    assert tif.score(store, test_store, device="cpu").shape == (7, 40)


class _PrecisionSpy(TorchFunctionMode):
    """Records the float32 matmul precision in force at every matmul."""

    MATMULS = frozenset({torch.Tensor.addmm_, torch.matmul, torch.Tensor.__matmul__, torch.mm,
                         torch.bmm, torch.nn.functional.linear})

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.MATMULS:
            knobs = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
            self.seen.add((torch.get_float32_matmul_precision(),
                           *(getattr(k, "fp32_precision", "ieee") for k in knobs)))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def tf32_on():
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # TF32 on CUDA, bfloat16 in oneDNN
    yield
    torch.set_float32_matmul_precision(saved)


def test_score_runs_in_full_float32_and_restores_tf32(stores, tf32_on):
    # Issue 23 item 7: TF32 was inherited from the process.
    store, test_store = stores
    with _PrecisionSpy() as spy:
        tif.score(store, test_store)
    assert spy.seen == {("highest", "ieee", "ieee")}
    assert torch.get_float32_matmul_precision() == "medium"


@pytest.mark.parametrize("kind", ["rademacher", "kronecker", "sjlt"])
def test_projected_grads_run_in_full_float32_and_restore_tf32(mlp_setup32, tf32_on, kind):
    loss, ckpts, train, _ = mlp_setup32
    options = {"nnz": 2} if kind == "sjlt" else {}
    fn = tif.projected_grads(loss, tif.Projection(dim=16, kind=kind, seed=0, **options))
    with _PrecisionSpy() as spy:
        fn(dict(ckpts[0].params), train)
    assert spy.seen and all(seen == ("highest", "ieee", "ieee") for seen in spy.seen)
    assert torch.get_float32_matmul_precision() == "medium"


def test_full_float32_restores_on_error(tf32_on):
    with pytest.raises(RuntimeError, match="boom"), _devices.full_float32():
        assert torch.get_float32_matmul_precision() == "highest"
        raise RuntimeError("boom")
    assert torch.get_float32_matmul_precision() == "medium"


def test_a_row_range_of_an_in_memory_store_streams_views_without_a_copy(stores, monkeypatch):
    # Issue 23 item 13: rows= on an in-memory (or pinned) store read through buffers (a copy
    # per piece, and on a GPU a pinned staging copy) instead of lending views.
    from tracinfunc.query import stream as stream_module
    from tracinfunc.query.rows import row_range
    from tracinfunc.store.protocols import SupportsRowViews

    store, test_store = stores
    part = row_range(store, (8, 30))
    assert isinstance(part, SupportsRowViews)
    assert part.view_rows(1, 2, 5).data_ptr() == store.view_rows(1, 10, 13).data_ptr()
    expected = tif.score(store, test_store)[:, 8:30]

    def no_buffers(*args, **kwargs):
        raise AssertionError("an in-memory row range was read through buffers")

    monkeypatch.setattr(stream_module, "_prefetch", no_buffers)
    torch.testing.assert_close(tif.score(store, test_store, rows=(8, 30)), expected)
