"""An in-memory build of known size computes each call's rows straight into the store's
reserved rows (``next_rows_slot``): the same bits as a call block copied in, the same
errors, one slot lent at a time. (Size hints that are wrong: ``tests/store/
test_memory_reserve.py``'s lying datasets, whose calls are now computed in place.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_checkpoints, make_data, make_mlp
from tracinfunc.build import torch as build_torch
from tracinfunc.store.memory import dense
from tracinfunc.store.memory.dense import MemoryWriter, next_rows_slot

PROJ = tif.Projection(dim=16, seed=0, kind="kronecker")


@pytest.fixture
def setup():
    model = make_mlp(dtype=torch.float32).eval()
    x, y = make_data(n=50, dtype=torch.float32)
    return tif.loss_from_module(model, F.cross_entropy), make_checkpoints(model), x, y


def _batches(x, y, size):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(y), size)]


def _rows(store):
    return torch.stack([store.read_rows(c, 0, store.n_train) for c in range(store.n_ckpt)])


def _lent(monkeypatch) -> list:
    """Record the slots the build loop is lent (``None`` where it is refused one)."""
    lent = []

    def spy(writer, b, dtype):
        slot = next_rows_slot(writer, b, dtype)
        lent.append(None if slot is None else (writer._arena_rows, b))
        return slot

    monkeypatch.setattr(build_torch, "next_rows_slot", spy)
    return lent


def _no_slots(monkeypatch) -> None:
    monkeypatch.setattr(build_torch, "next_rows_slot", lambda writer, b, dtype: None)


@pytest.mark.parametrize("kind", ["rademacher", "sjlt", "kronecker", "identity"])
@pytest.mark.parametrize("batch_size", [None, 7])
def test_rows_in_place_equal_rows_copied_in(setup, monkeypatch, kind, batch_size):
    loss, ckpts, x, y = setup
    proj = tif.Projection(kind="identity") if kind == "identity" else \
        tif.Projection(dim=16, seed=0, kind=kind)
    lent = _lent(monkeypatch)
    store = tif.build_store(loss, ckpts, _batches(x, y, 6), projection=proj,
                            batch_size=batch_size, progress=False)
    assert lent and all(slot is not None for slot in lent)  # every call computed in place
    starts = [start for start, _ in lent]
    assert starts == sorted(starts) and starts[0] == 0
    assert sum(b for _, b in lent) == 50
    with monkeypatch.context() as patch:
        _no_slots(patch)
        copied = tif.build_store(loss, ckpts, _batches(x, y, 6), projection=proj,
                                 batch_size=batch_size, progress=False)
    assert torch.equal(_rows(store), _rows(copied))
    assert torch.equal(store.read_norms(0, 0, 50), copied.read_norms(0, 0, 50))


def test_a_float16_store_checks_rows_before_the_cast(setup, monkeypatch):
    """The reserved rows of a float16 store are float16: no slot is lent (rows are checked
    in float32 before the cast), so an entry beyond float16 is refused as before."""
    loss, ckpts, x, y = setup
    x = x.clone()
    x[23, 0] = 1e4

    def big(params, example):  # row 23's loss x 1e7: finite in float32, inf in float16
        return loss(params, example) * torch.where(example[0][0] > 1e3, 1e7, 1.0)

    lent = _lent(monkeypatch)
    with pytest.raises(tif.errors.NonFiniteGradientError) as error:
        tif.build_store(big, ckpts, _batches(x, y, 10), projection=PROJ,
                        dtype=torch.float16, progress=False)
    assert lent and all(slot is None for slot in lent)
    assert "rows [23], beyond the range of float16 storage" in str(error.value)
    with monkeypatch.context() as patch:
        _no_slots(patch)
        with pytest.raises(tif.errors.NonFiniteGradientError) as before:
            tif.build_store(big, ckpts, _batches(x, y, 10), projection=PROJ,
                            dtype=torch.float16, progress=False)
    assert str(error.value) == str(before.value)
    store = tif.build_store(loss, ckpts, _batches(x, y, 10), projection=PROJ,
                            dtype=torch.float16, progress=False)
    assert store.read_rows(0, 0, 50).dtype == torch.float16


def test_nan_rows_in_a_later_call_raise_the_same_error(setup, monkeypatch):
    loss, ckpts, x, y = setup
    bad = x.clone()
    bad[37] = float("nan")
    with pytest.raises(tif.errors.NonFiniteGradientError) as error:
        tif.build_store(loss, ckpts, _batches(bad, y, 5), projection=PROJ, batch_size=10,
                        progress=False)
    with monkeypatch.context() as patch:
        _no_slots(patch)
        with pytest.raises(tif.errors.NonFiniteGradientError) as before:
            tif.build_store(loss, ckpts, _batches(bad, y, 5), projection=PROJ, batch_size=10,
                            progress=False)
    assert str(error.value) == str(before.value) and "37" in str(error.value)


def _reserved_writer(rows: int) -> tuple[MemoryWriter, object]:
    """An empty in-memory writer of a small store's layout, ``rows`` rows reserved."""
    model = make_mlp(dtype=torch.float32).eval()
    meta = tif.build_store(tif.loss_from_module(model, F.cross_entropy),
                           make_checkpoints(model), make_data(n=4, dtype=torch.float32),
                           projection=PROJ, progress=False).meta
    writer = MemoryWriter(meta.replace(n_train=0, complete=False))
    dense.reserve_rows(writer, rows)
    return writer, meta


def test_one_slot_at_a_time():
    """A slot is lent only when the one before it was appended (a pipeline that computes
    call i + 1 before writing call i gets a fresh block for it)."""
    writer, meta = _reserved_writer(10)
    first = next_rows_slot(writer, 4, torch.float32)
    assert first is not None and next_rows_slot(writer, 4, torch.float32) is None
    first.fill_(1.0)
    dense.append_fresh(writer, first, first.norm(dim=-1))
    second = next_rows_slot(writer, 4, torch.float32)
    assert second is not None and second.data_ptr() != first.data_ptr()
    second.fill_(2.0)
    dense.append_fresh(writer, second, second.norm(dim=-1))
    assert next_rows_slot(writer, 4, torch.float32) is None  # 8 of 10 used: no room for 4
    rest = torch.full((meta.n_ckpt, 2, meta.k), 3.0)
    dense.append_fresh(writer, rest, rest.norm(dim=-1))
    store = writer.finish()
    rows = store.read_rows(0, 0, 10)
    assert torch.equal(rows[:, 0], torch.tensor([1.0] * 4 + [2.0] * 4 + [3.0] * 2))
    assert torch.equal(store.read_norms(0, 0, 10), rows.norm(dim=-1))


def test_rows_not_in_the_lent_slot_are_copied():
    """Rows handed to ``append_fresh`` that are not the lent slot (another tensor, or the
    slot's memory at another shape) are copied in, and the slot is no longer lent."""
    writer, meta = _reserved_writer(6)
    slot = next_rows_slot(writer, 4, torch.float32)
    slot.fill_(9.0)
    other = torch.full((meta.n_ckpt, 3, meta.k), 1.0)
    dense.append_fresh(writer, other, other.norm(dim=-1))
    assert writer._lent is None and writer._arena_rows == 3
    again = next_rows_slot(writer, 3, torch.float32)
    again.fill_(2.0)
    dense.append_fresh(writer, again, again.norm(dim=-1))
    rows = writer.finish().read_rows(0, 0, 6)
    assert torch.equal(rows[:, 0], torch.tensor([1.0] * 3 + [2.0] * 3))
