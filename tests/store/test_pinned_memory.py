"""PinnedStore memory is pinned at its own size (issue 23, item 12).

torch's caching host allocator (``pin_memory=True``) rounds every block up to a power of two
and keeps freed blocks pinned: a 20.5 GB store pinned 32 GB. A store's memory is now one
ordinary page-aligned allocation registered with ``cudaHostRegister``. Without a GPU the
registration (``host_pinning``) is replaced by a fake that records what is asked of it; the
same code path then runs on the CPU: bytes requested, reads, and unregistration on free.
"""

from __future__ import annotations

import gc

import pytest
import torch

import tracinfunc as tif
from tracinfunc.build.loop import new_store_meta
from tracinfunc.projection import canonical_layout
from tracinfunc.store.memory import pinned

MIB = 2**20


class FakePinning:
    """Records registrations; refuses overlapping ones (as CUDA does) and unaligned ones."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}  # address -> bytes
        self.requested: list[int] = []
        self.unregistered: list[int] = []

    def register(self, address: int, nbytes: int) -> None:
        assert address % pinned.PAGE == 0 and nbytes % pinned.PAGE == 0 and nbytes > 0
        for start, size in self.live.items():
            assert address + nbytes <= start or start + size <= address, "pages registered twice"
        self.live[address] = nbytes
        self.requested.append(nbytes)

    def unregister(self, address: int) -> None:
        del self.live[address]
        self.unregistered.append(address)


@pytest.fixture
def fake(monkeypatch):
    fake = FakePinning()
    monkeypatch.setattr(pinned, "host_pinning", lambda: fake)
    return fake


def _meta(n: int, k: int, dtype="float32", ckpts: int = 1):
    return new_store_meta([(f"c{i}", 1.0, "f") for i in range(ckpts)],
                          canonical_layout({"w": (k,)}), tif.Projection(dim=None, kind="identity"),
                          dtype, None)


def _rows(n: int, k: int, ckpts: int = 1) -> torch.Tensor:
    return torch.randn(ckpts, n, k, generator=torch.Generator().manual_seed(0))


def test_a_store_of_20_5_mib_pins_20_5_mib_not_32(fake):
    # 20.5 MiB of float32 rows: the caching allocator would have pinned 32 MiB.
    k = 64
    n = int(20.5 * MIB) // (4 * k)
    rows = _rows(n, k)
    store = tif.store.PinnedStore(_meta(n, k).replace(n_train=n), rows, rows.norm(dim=-1))
    needed = rows.numel() * 4
    assert max(fake.requested) >= needed and max(fake.requested) - needed < pinned.PAGE
    assert sum(fake.requested) < needed + 2 * pinned.PAGE  # rows (+ nothing else pinned)
    assert sum(fake.requested) < 2**25  # never rounded up to the next power of two
    assert torch.equal(store.read_rows(0, 0, n), rows[0])
    assert torch.equal(store.view_rows(0, n - 3, n), rows[0, n - 3:])


@pytest.mark.parametrize("n_train_known", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "sign"])
def test_writers_pin_exactly_what_the_store_holds(fake, n_train_known, dtype):
    n, k, ckpts = 1000, 48, 2
    meta = _meta(n, k, dtype, ckpts)
    rows = _rows(n, k, ckpts)
    writer = tif.store.PinnedWriter(meta, n_train=n if n_train_known else None)
    for start in range(0, n, 300):  # blocks of uneven size
        block = rows[:, start : start + 300]
        writer.append(block, block.norm(dim=-1))
    store = writer.finish()
    reference = tif.store.MemoryWriter(meta)
    reference.append(rows, rows.norm(dim=-1))
    reference = reference.finish()
    width = {"float32": 4 * k, "float16": 2 * k, "int8": k, "sign": -(-k // 8)}[dtype]
    needed = [ckpts * n * width] + ([ckpts * n * 4] if dtype in ("int8", "sign") else [])
    pages = [-(-b // pinned.PAGE) * pinned.PAGE for b in needed]
    assert sorted(fake.requested) == sorted(pages)  # codes and scales: never float32 rows
    for c in range(ckpts):
        assert torch.equal(store.read_rows(c, 0, n), reference.read_rows(c, 0, n))
        assert torch.equal(store.read_norms(c, 0, n), reference.read_norms(c, 0, n))


def test_pinned_memory_is_unregistered_when_the_last_view_is_freed(fake):
    n, k = 500, 16
    rows = _rows(n, k)
    store = tif.store.PinnedStore(_meta(n, k).replace(n_train=n), rows, rows.norm(dim=-1))
    (address,) = fake.live
    view = store.view_rows(0, 10, 20)
    del store
    gc.collect()
    assert fake.unregistered == []  # a view still reads it
    assert torch.equal(view, rows[0, 10:20])
    del view
    gc.collect()
    assert fake.unregistered == [address] and not fake.live


def test_scores_from_an_exactly_pinned_store_equal_the_memory_store(fake, mlp_setup32):
    loss, ckpts, train, test = mlp_setup32
    projection = tif.Projection(dim=16, seed=0)
    memory = tif.build_store(loss, ckpts, train, projection=projection, progress=False)
    pinned_store = tif.build_store(loss, ckpts, train, projection=projection,
                                   store="pinned", progress=False)
    test_store = tif.build_store(loss, ckpts, test, projection=projection, progress=False)
    assert fake.requested  # the pinned build went through the registration
    torch.testing.assert_close(tif.score(pinned_store, test_store, chunk_rows=7),
                               tif.score(memory, test_store, chunk_rows=7), rtol=0, atol=0)


def test_a_failed_registration_falls_back_to_torchs_pinned_memory_and_says_so(monkeypatch):
    class Refusing:
        def register(self, address, nbytes):
            raise RuntimeError("cudaErrorMemoryAllocation")

    asked = []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):  # no CUDA here: record the request only
        asked.append(pin_memory)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(pinned, "host_pinning", Refusing)
    monkeypatch.setattr(torch, "empty", empty)
    with pytest.warns(RuntimeWarning, match="cudaErrorMemoryAllocation"):
        tensor = pinned.pinned_store_empty((3, 5), torch.float32)
    assert tensor.shape == (3, 5) and asked[-1] is True
