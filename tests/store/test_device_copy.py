"""The GPU copy schedule (tracinfunc.store.device_copy) driven by a fake device on the CPU.

The fake (``tests/fake_device.py``) runs copies only when something waits for them and
checks that no buffer is read before its copy landed, none is overwritten before the compute
reading it was waited on, and no host buffer is handed back while a copy still reads it
(issue 23, item 10: the old CUDA path allocated a fresh device buffer per piece).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import tracinfunc as tif
from tests.fake_device import FakeBackend
from tracinfunc.query import stream as stream_module
from tracinfunc.store.device_copy import copy_through_ring

score_module = importlib.import_module("tracinfunc.query.chunks")


def _host(fake: FakeBackend, pieces: int, *, rows: int = 5, k: int = 4, buffers: int = 2):
    """Host pieces through ``buffers`` reused host buffers, as the reader thread gives them;
    a release checks that no copy still reads the buffer, and the next fill overwrites it."""
    host = [torch.empty(rows, k) for _ in range(buffers)]
    free = list(range(buffers))
    log = {"taken": 0, "released": 0}

    def release_of(index):
        def release():
            assert not fake.reads_source(host[index]), "host buffer released while copied"
            free.append(index)
            log["released"] += 1
        return release

    def generate():
        for i in range(pieces):
            assert free, "the consumer holds more host buffers than exist"
            index = free.pop(0)
            host[index].fill_(float(i))  # what a reader thread does to a reused buffer
            log["taken"] += 1
            yield (0, i * rows, (i + 1) * rows), host[index][: rows - i % 2], release_of(index)

    return generate(), log


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_ring_reads_each_piece_after_its_copy_and_reuses_at_most_depth_buffers(eager, depth):
    fake = FakeBackend(eager=eager)
    host, log = _host(fake, pieces=9)
    for i, (_, rows) in enumerate(copy_through_ring(host, fake, depth=depth, max_rows=5)):
        fake.read(rows)
        assert rows.shape == (5 - i % 2, 4) and bool((rows == i).all()), f"piece {i}"
    assert fake.allocated == depth
    assert log["released"] == log["taken"] == 9 and fake.copies_run == 9


@pytest.mark.parametrize("eager", [False, True])
def test_early_exit_waits_for_copies_and_hands_every_host_buffer_back(eager):
    fake = FakeBackend(eager=eager)
    host, log = _host(fake, pieces=9)
    ring = copy_through_ring(host, fake, depth=3, max_rows=5)
    for i, (_, rows) in enumerate(ring):
        fake.read(rows)
        if i == 3:
            break
    ring.close()
    assert log["released"] == log["taken"] == 4
    assert not any(op[0] == "copy" for op in fake.queue)


def test_an_error_in_the_reader_cleans_up_and_propagates():
    fake = FakeBackend()
    host, log = _host(fake, pieces=9)

    def failing():
        for i in range(9):
            if i == 4:
                raise OSError("disk gone")
            yield next(host)

    with pytest.raises(OSError, match="disk gone"):
        for _, rows in copy_through_ring(failing(), fake, depth=2, max_rows=5):
            fake.read(rows)
    assert log["released"] == log["taken"] == 4


def test_the_fake_catches_a_schedule_without_the_consumed_wait(monkeypatch):
    # The checks can fail: without the side stream's wait on "consumed", a copy into a slot
    # may run before the compute that reads the slot's previous piece.
    fake = FakeBackend(eager=True)
    real_wait = fake.wait
    monkeypatch.setattr(fake, "wait", lambda stream, event: None if stream == fake.side
                        else real_wait(stream, event))
    host, _ = _host(fake, pieces=4, buffers=3)
    with pytest.raises(AssertionError, match="overwrote a buffer"):
        for _, rows in copy_through_ring(host, fake, depth=1, max_rows=5):
            fake.read(rows)


@pytest.mark.parametrize("on_disk", [False, True])
@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_scores_through_the_fake_device_equal_the_cpu_path(mlp_setup32, tmp_path, monkeypatch,
                                                           on_disk, eager, normalize):
    loss, ckpts, train, test = mlp_setup32
    store = tif.build_store(loss, ckpts, train, projection=tif.Projection(dim=16, seed=0),
                            progress=False)
    if on_disk:
        store = tif.save_store(store, tmp_path / "g.zarr")
    test_store = tif.build_store(loss, ckpts, test, projection=store.projection,
                                 progress=False)
    expected = tif.score(store, test_store, chunk_rows=7, normalize=normalize)
    fakes = []

    def fake_backend(device):
        fakes.append(FakeBackend(eager=eager))
        return fakes[-1]

    real_accumulate = score_module._accumulate

    def reading(block, test, train, inverse, *, first, **options):
        fakes[-1].read(train)  # the compute reads the streamed rows
        return real_accumulate(block, test, train, inverse, first=first, **options)

    monkeypatch.setattr(stream_module, "copy_backend", fake_backend)
    monkeypatch.setattr(score_module, "_accumulate", reading)
    got = tif.score(store, test_store, chunk_rows=7, normalize=normalize)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert fakes[-1].allocated == 3 and fakes[-1].copies_run == 3 * 6  # 3 ckpts x 6 chunks
    values, indices = tif.top_k(store, test_store, k=4, chunk_rows=7, normalize=normalize)
    expected_top = tif.top_k(store, test_store, k=4, chunk_rows=7, normalize=normalize,
                             device="cpu")
    torch.testing.assert_close((values, indices), expected_top, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["int8", "sign"])
def test_quantised_stores_send_codes_and_dequantise_on_the_device(mlp_setup32, monkeypatch,
                                                                  dtype):
    # Issue 23 item 13: the codes were pinned but float32 rows (4-32x the bytes) were sent.
    loss, ckpts, train, test = mlp_setup32
    projection = tif.Projection(dim=16, seed=0)
    store = tif.build_store(loss, ckpts, train, projection=projection, dtype=dtype,
                            store="pinned", progress=False)
    test_store = tif.build_store(loss, ckpts, test, projection=projection, progress=False)
    expected = tif.score(store, test_store, chunk_rows=7)
    fakes = []
    allocated = []

    def fake_backend(device):
        fakes.append(FakeBackend())
        real_empty = fakes[-1].empty
        fakes[-1].empty = lambda shape, dtype: allocated.append(dtype) or real_empty(shape, dtype)
        return fakes[-1]

    monkeypatch.setattr(stream_module, "copy_backend", fake_backend)
    got = tif.score(store, test_store, chunk_rows=7)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    codes = torch.int8 if dtype == "int8" else torch.uint8
    assert sorted(map(str, set(allocated))) == sorted(map(str, {codes, torch.float32}))
    assert allocated.count(codes) == 3  # depth buffers of codes, depth of scales


def _counting_backend(fakes, sources, *, pins_host=False):
    def make(device):
        fake = FakeBackend()
        fake.pins_host = pins_host
        real_copy = fake.copy

        def copy(target, source, stream):
            sources.append(source)
            real_copy(target, source, stream)

        fake.copy = copy
        fakes.append(fake)
        return fake

    return make


@pytest.mark.parametrize("pins_host", [False, True])
@pytest.mark.parametrize("kind", ["pinned", "zarr"])
@pytest.mark.parametrize("dtype", ["int8", "sign"])
def test_quantised_stores_copy_code_bytes_not_float32_bytes(mlp_setup32, tmp_path, monkeypatch,
                                                            kind, dtype, pins_host):
    # Issue 23 item 13: a QuantizedPinnedStore's codes were cloned into pageable memory
    # (read_codes) and a quantised Zarr store was dequantised on the CPU, float32 rows (4-32x
    # the bytes) crossing to the device.
    loss, ckpts, train, test = mlp_setup32
    projection = tif.Projection(dim=20, seed=0)
    store = tif.build_store(loss, ckpts, train, projection=projection, dtype=dtype,
                            store="pinned", progress=False)
    if kind == "zarr":
        store = tif.save_store(store, tmp_path / "q.zarr")
    test_store = tif.build_store(loss, ckpts, test, projection=projection, progress=False)
    expected = tif.score(store, test_store, chunk_rows=7, device="cpu")
    fakes, sources, pinned_buffers = [], [], []
    monkeypatch.setattr(stream_module, "copy_backend",
                        _counting_backend(fakes, sources, pins_host=pins_host))
    monkeypatch.setattr(stream_module, "_is_pinned", lambda tensor: True)  # "page-locked"
    real_pinned_empty = stream_module.pinned_empty
    monkeypatch.setattr(stream_module, "pinned_empty", lambda shape, dtype: pinned_buffers.append(
        (shape, dtype)) or real_pinned_empty(shape, dtype))
    got = tif.score(store, test_store, chunk_rows=7)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    meta = store.meta
    width = meta.k if dtype == "int8" else -(-meta.k // 8)
    code_bytes = meta.n_ckpt * meta.n_train * (width + 4)  # codes and a float32 scale per row
    assert sum(source.nbytes for source in sources) == code_bytes
    assert code_bytes * 3 < meta.n_ckpt * meta.n_train * meta.k * 4  # the float32 bytes
    codes_storage = store._codes.untyped_storage().data_ptr() if kind == "pinned" else None
    if kind == "pinned":  # straight from the store's own (pinned) memory: no staging copy
        assert {source.untyped_storage().data_ptr() for source in sources[::2]} == {codes_storage}
        assert pinned_buffers == []
    elif pins_host:  # Zarr: read into a reused ring of page-locked host buffers
        assert len(pinned_buffers) == 2 * 3  # codes and scales, depth 3
        assert len({source.untyped_storage().data_ptr() for source in sources}) == 2 * 3


def test_quantised_zarr_rows_are_dequantised_on_a_plain_device(mlp_setup32, tmp_path,
                                                               monkeypatch):
    # mps, xpu, ... (no asynchronous backend): the codes travel, and dequantise there.
    loss, ckpts, train, _ = mlp_setup32
    store = tif.build_store(loss, ckpts, train, projection=tif.Projection(dim=20, seed=0),
                            dtype="int8", store=tmp_path / "q.zarr", progress=False)
    seen = []
    real = stream_module.dequantize

    def spy(codes, scales, quantization, k, **kwargs):
        seen.append((codes.device, codes.dtype, scales.device))
        return real(codes, scales, quantization, k, **kwargs)

    monkeypatch.setattr(stream_module, "dequantize", spy)
    meta_device = torch.device("meta")
    pieces = [(c, s, min(s + 16, 40)) for s in range(0, 40, 16) for c in range(3)]
    rows = list(stream_module.stream_rows(store, pieces, device=meta_device, max_rows=16))
    assert {(r.device, r.dtype, r.shape[1]) for _, r in rows} == {(meta_device, torch.float32, 20)}
    assert set(seen) == {(meta_device, torch.int8, meta_device)} and len(seen) == len(pieces)
