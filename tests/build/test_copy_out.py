"""build_store's copy-out pipeline (issue 23, item 14), driven by the fake device backend.

On a GPU the rows of batch i are checked, copied to page-locked host buffers on a side
stream and written by a writer thread while batch i+1 is computed. Here the fake backend
(``tests/fake_device.py``) stands in for the GPU: its copies run only when waited for, and
it checks that no copy out runs before the side stream waited on the compute producing the
rows, that the writer reads a host buffer only after waiting on the copy into it, and that
no copy into a host buffer is queued while the writer reads it. The rows stored equal the
serial build's bit for bit; at most ``depth`` batches are in flight; writer errors, NaN
rows and an interrupted build behave as in the serial loop.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch

import tracinfunc as tif
from tests.fake_device import FakeBackend
from tracinfunc.build import copy_out as copy_out_module
from tracinfunc.store.memory.dense import MemoryWriter
from tracinfunc.store.memory.pinned import PinnedWriter
from tracinfunc.store.zarr.writer import ZarrWriter

PROJ = tif.Projection(dim=12, seed=0)
BATCH = 8  # 40 rows: 5 batches


def _build(setup, store, dtype, tmp_path, name):
    loss, ckpts, train, _ = setup
    target = tmp_path / f"{name}.zarr" if store == "zarr" else store
    return tif.build_store(loss, ckpts, train, projection=PROJ, dtype=dtype, store=target,
                           batch_size=BATCH, progress=False)


def _stored(store):
    meta = store.meta
    n = meta.n_train
    out = []
    for c in range(meta.n_ckpt):
        if meta.quantization is not None:
            out.extend(store.read_codes(c, 0, n))
        out.extend([store.read_rows(c, 0, n), store.read_norms(c, 0, n)])
    return out


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("store", ["memory", "pinned", "zarr"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "sign"])
def test_pipelined_rows_equal_the_serial_build_bit_for_bit(mlp_setup32, tmp_path, monkeypatch,
                                                           store, dtype, eager):
    serial = _build(mlp_setup32, store, dtype, tmp_path, "serial")
    made: list[FakeBackend] = []

    def backend(device):
        made.append(FakeBackend(eager=eager))
        return made[-1]

    monkeypatch.setattr(copy_out_module, "copy_backend", backend)
    _check_writer_reads(monkeypatch, made)
    pipelined = _build(mlp_setup32, store, dtype, tmp_path, "pipelined")
    assert len(made) == 1
    # stored (+ scales), norms (+ row peaks for float16: checked against its range), finite
    parts = 4 if dtype in ("int8", "sign", "float16") else 3
    assert made[0].copied_out == 4 * parts  # every batch after the first (written serially)
    hosts = {key for key, slot in made[0].slots.items() if slot.host}
    assert len(hosts) == 2 * parts  # depth 2: two sets of host buffers, reused
    for got, expected in zip(_stored(pipelined), _stored(serial), strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def _check_writer_reads(monkeypatch, made):
    for cls in (MemoryWriter, PinnedWriter, ZarrWriter):
        for name in ("append", "append_codes"):
            real = getattr(cls, name)

            def checked(self, *tensors, real=real):
                if threading.current_thread().name != "tracinfunc-writer":
                    return real(self, *tensors)  # the first batch, written serially
                with made[-1].host_reading(*tensors):
                    return real(self, *tensors)

            monkeypatch.setattr(cls, name, functools.wraps(real)(checked))
    real_check = copy_out_module.check_finite_flags

    def check_finite_flags(finite, meta, *, first_row):
        with made[-1].host_reading(finite):
            return real_check(finite, meta, first_row=first_row)

    monkeypatch.setattr(copy_out_module, "check_finite_flags", check_finite_flags)
    real_peaks = copy_out_module.check_peaks

    def check_peaks(peaks, meta, **kw):
        with made[-1].host_reading(peaks):
            return real_peaks(peaks, meta, **kw)

    monkeypatch.setattr(copy_out_module, "check_peaks", check_peaks)


def _pipelined(monkeypatch, made, *, eager=False):
    def backend(device):
        made.append(FakeBackend(eager=eager))
        return made[-1]

    monkeypatch.setattr(copy_out_module, "copy_backend", backend)
    _check_writer_reads(monkeypatch, made)


def test_at_most_depth_batches_are_in_flight(mlp_setup32, monkeypatch):
    # The writer is held until the compute thread finds every slot taken: it must then wait
    # (on_full) with exactly depth batches handed off and not yet written.
    made: list[FakeBackend] = []
    _pipelined(monkeypatch, made)
    gate, counts, at_full = threading.Event(), {"put": 0, "written": 0}, []
    real_put, real_append = copy_out_module.CopyOut.put, MemoryWriter.append

    def put(self, rows):
        real_put(self, rows)
        counts["put"] += 1

    def append(self, rows, norms):
        if threading.current_thread().name == "tracinfunc-writer":  # not the serial first
            assert gate.wait(timeout=60), "the compute thread never waited for a slot"
            counts["written"] += 1
        real_append(self, rows, norms)

    def on_full():
        at_full.append(counts["put"] - counts["written"])
        gate.set()

    monkeypatch.setattr(copy_out_module.CopyOut, "put", put)
    monkeypatch.setattr(MemoryWriter, "append", append)
    monkeypatch.setattr(copy_out_module.CopyOut, "on_full", staticmethod(on_full))
    loss, ckpts, train, _ = mlp_setup32
    tif.build_store(loss, ckpts, train, projection=PROJ, batch_size=BATCH, progress=False)
    assert at_full[0] == 2 and counts == {"put": 4, "written": 4}


def test_a_writer_error_surfaces_and_nothing_is_written_after_it(mlp_setup32, monkeypatch):
    made: list[FakeBackend] = []
    _pipelined(monkeypatch, made)
    calls, gate = [], threading.Event()
    real_append = MemoryWriter.append

    def append(self, rows, norms):
        calls.append(rows.shape[1])
        if len(calls) == 3:  # fails once the compute thread waits with batches queued
            assert gate.wait(timeout=60), "the compute thread never waited for a slot"
            raise OSError("disk full")
        real_append(self, rows, norms)

    monkeypatch.setattr(MemoryWriter, "append", append)
    monkeypatch.setattr(copy_out_module.CopyOut, "on_full", staticmethod(gate.set))
    writers = []
    loss, ckpts, train, _ = mlp_setup32
    with pytest.raises(OSError, match="disk full"):
        tif.build_store(loss, ckpts, train, projection=PROJ, batch_size=BATCH, progress=False,
                        store=lambda meta: writers.append(MemoryWriter(meta)) or writers[-1])
    assert len(calls) == 3 and writers[0].rows_written == 2 * BATCH


def _nan_data(train, row):
    x, y = train
    x = x.clone()
    x[row] = float("nan")
    return x, y


@pytest.mark.parametrize("pipelined", [False, True])
def test_nan_rows_raise_the_serial_error_after_writing_the_batches_before(mlp_setup32,
                                                                          monkeypatch, pipelined):
    loss, ckpts, train, _ = mlp_setup32
    made: list[FakeBackend] = []
    if pipelined:
        _pipelined(monkeypatch, made)
    writers = []
    with pytest.raises(tif.errors.NonFiniteGradientError) as error:
        tif.build_store(loss, ckpts, _nan_data(train, 19), projection=PROJ, batch_size=BATCH,
                        progress=False,
                        store=lambda meta: writers.append(MemoryWriter(meta)) or writers[-1])
    assert str(error.value).startswith("build_store: checkpoint 'epoch-0' gives NaN/inf "
                                       "gradients for examples [19] (row 19 first)")
    assert writers[0].rows_written == 2 * BATCH and len(made) == int(pipelined)


@pytest.mark.parametrize("pipelined", [False, True])
def test_finite_rows_whose_norm_overflows_are_refused_by_their_example(monkeypatch, pipelined):
    # Entries of 3e38 are finite but their float32 norm is not: the store cannot keep it.
    made: list[FakeBackend] = []
    if pipelined:
        _pipelined(monkeypatch, made)
    x = torch.ones(40, 4)
    x[19, :2] = 3e38
    ckpt = tif.Checkpoint({"w": torch.zeros(4)}, lr=0.1, name="c")
    with pytest.raises(tif.errors.NonFiniteGradientError) as error:
        tif.build_store(lambda params, ex: (params["w"] * ex).sum(), [ckpt], x,
                        projection=tif.Projection(kind="identity"), batch_size=BATCH,
                        progress=False)
    message = str(error.value)
    assert "examples [19]" in message and "norm overflows float32" in message, message
    assert "NaN/inf" not in message and len(made) == int(pipelined)


@pytest.mark.parametrize("pipelined", [False, True])
def test_an_interrupted_build_keeps_every_batch_handed_off(mlp_setup32, monkeypatch, pipelined):
    # KeyboardInterrupt while batch 4 is read: batches 0-3, computed before it, are all in
    # the writer when the exception leaves build_store (a Zarr build resumes from there).
    loss, ckpts, train, _ = mlp_setup32
    made: list[FakeBackend] = []
    if pipelined:
        _pipelined(monkeypatch, made)
    x, y = train

    def interrupted():
        for start in range(0, 40, BATCH):
            if start == 4 * BATCH:
                raise KeyboardInterrupt
            yield x[start : start + BATCH], y[start : start + BATCH]

    writers = []
    with pytest.raises(KeyboardInterrupt):
        tif.build_store(loss, ckpts, interrupted(), projection=PROJ, progress=False,
                        store=lambda meta: writers.append(MemoryWriter(meta)) or writers[-1])
    assert writers[0].rows_written == 4 * BATCH and len(made) == int(pipelined)
    whole = tif.build_store(loss, ckpts, train, projection=PROJ, batch_size=BATCH,
                            progress=False)
    kept = writers[0].finish()
    for c in range(3):
        assert torch.equal(kept.read_rows(c, 0, 4 * BATCH), whole.read_rows(c, 0, 4 * BATCH))


@pytest.mark.parametrize("broken, rule", [
    ("wait", "before the side stream waited on the compute"),
    ("synchronize", "the host read a buffer"),
])
def test_the_fake_catches_a_pipeline_that_skips_a_wait(mlp_setup32, monkeypatch, broken, rule):
    # The checks can fail: without the side stream's wait on the compute, a copy out may
    # read rows not yet computed; without the host's wait on the copy, the writer reads a
    # host buffer the copy has not filled.
    made: list[FakeBackend] = []

    def backend(device):
        fake = FakeBackend()
        if broken == "wait":
            real_wait = fake.wait
            fake.wait = lambda stream, event: None if stream == fake.side else \
                real_wait(stream, event)
        else:
            fake.synchronize = lambda event: None
        made.append(fake)
        return fake

    monkeypatch.setattr(copy_out_module, "copy_backend", backend)
    _check_writer_reads(monkeypatch, made)
    loss, ckpts, train, _ = mlp_setup32
    with pytest.raises(AssertionError, match=rule):
        tif.build_store(loss, ckpts, train, projection=PROJ, batch_size=BATCH, progress=False)


@pytest.mark.parametrize("pipelined", [False, True])
def test_rows_beyond_float16_raise_the_serial_error_after_writing_the_batches_before(
        mlp_setup32, monkeypatch, pipelined):
    # Row 19's loss is scaled by 1e7: finite in float32, inf in float16 storage (max 65504).
    loss, ckpts, train, _ = mlp_setup32
    x, y = train
    x = x.clone()
    x[19, 0] = 1e4

    def big(params, example):
        return loss(params, example) * torch.where(example[0][0] > 1e3, 1e7, 1.0)

    made: list[FakeBackend] = []
    if pipelined:
        _pipelined(monkeypatch, made)
    writers = []
    with pytest.raises(tif.errors.NonFiniteGradientError) as error:
        tif.build_store(big, ckpts, (x, y), projection=PROJ, batch_size=BATCH, dtype="float16",
                        progress=False,
                        store=lambda meta: writers.append(MemoryWriter(meta)) or writers[-1])
    message = str(error.value)
    assert message.startswith("build_store: checkpoint 'epoch-0' gives gradients up to ")
    assert "for rows [19], beyond the range of float16 storage (largest 65504)" in message
    assert "torch.bfloat16 or torch.float32" in message
    assert writers[0].rows_written == 2 * BATCH and len(made) == int(pipelined)
