"""Large fresh host buffers ask for 2 MiB pages over their own aligned interior, and nothing
else changes (issue 34: first-touch page faults of the score matrix and an in-memory
store's rows)."""

from __future__ import annotations

import pytest
import torch

import tracinfunc as tif
from tracinfunc import _host_memory

MIB = 2**20


@pytest.fixture
def advised(monkeypatch) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []

    def madvise(address, length, advice):
        calls.append((address.value, length.value))
        assert advice == 14  # MADV_HUGEPAGE
        return 0

    monkeypatch.setattr(_host_memory, "_madvise", lambda: madvise)
    return calls


@pytest.mark.parametrize(("shape", "dtype"), [((2000, 10000), torch.float32),
                                              ((3, 7001, 513), torch.float16),
                                              ((9 * MIB // 8,), torch.float64)])
def test_a_large_buffer_advises_only_its_own_aligned_interior(advised, shape, dtype):
    tensor = _host_memory.host_empty(shape, dtype)
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    assert tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == nbytes
    (address, length), = advised
    start = tensor.data_ptr()
    assert address % (2 * MIB) == 0 and length % (2 * MIB) == 0 and length > 0
    assert start <= address and address + length <= start + nbytes  # nothing of another's
    assert nbytes - length < 4 * MIB  # all but the unaligned ends


def test_small_buffers_are_not_advised(advised):
    _host_memory.host_empty((1000, 1000), torch.float32)  # 4 MB
    assert advised == []


def test_without_madvise_a_buffer_is_an_ordinary_one(monkeypatch):
    monkeypatch.setattr(_host_memory, "_madvise", lambda: None)
    tensor = _host_memory.host_empty((3000, 1000), torch.float32)
    tensor.fill_(2.0)
    assert float(tensor.sum()) == 2.0 * 3_000_000


def test_the_real_advice_is_taken_or_refused_harmlessly():
    """On this machine's kernel (THP on, madvise or never): values are what is written."""
    tensor = _host_memory.host_empty((4096, 4096), torch.float32)  # 64 MiB
    tensor.copy_(torch.arange(4096.0).expand(4096, 4096))
    assert torch.equal(tensor[:, 7], torch.full((4096,), 7.0))


def test_score_and_in_memory_builds_use_advised_buffers(advised):
    rows = torch.randn(1, 3000, 1024, generator=torch.Generator().manual_seed(0))
    meta = tif.store.StoreMeta(projection=tif.Projection(dim=1024, seed=3),
                               checkpoints=(tif.store.CheckpointMeta("c0", 0.1, "f0"),),
                               layout=(("w", (1024,)),), n_train=3000, k=1024)
    store = tif.store.MemoryStore(meta, rows, rows.norm(dim=-1))
    test = torch.randn(1, 1000, 1024, generator=torch.Generator().manual_seed(1))
    scores = tif.score(store, test, device="cpu")  # [1000, 3000]: 12 MB
    assert len(advised) == 1
    torch.testing.assert_close(scores.double(), test[0].double() @ rows[0].double().T * 0.1,
                               rtol=1e-5, atol=1e-4)


def test_a_reserved_in_memory_store_is_advised(advised):
    from tracinfunc.store.memory.dense import reserve_rows

    meta = tif.store.StoreMeta(projection=tif.Projection(dim=1024, seed=3),
                               checkpoints=(tif.store.CheckpointMeta("c0", 0.1, "f0"),),
                               layout=(("w", (1024,)),), n_train=0, k=1024, complete=False)
    writer = tif.store.MemoryWriter(meta)
    reserve_rows(writer, 4000)  # 16 MB of rows
    assert len(advised) == 1
    rows = torch.randn(1, 4000, 1024)
    writer.append(rows, rows.norm(dim=-1))
    assert torch.equal(writer.finish().view_rows(0, 0, 4000), rows[0])
