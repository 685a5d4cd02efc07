"""The same store built with another torch thread count is the same store (issue 24, item 4).

Rows are not bit-identical across thread counts: torch and BLAS sum reductions in an order
that depends on the number of threads, so ``torchrun`` (one thread per process) and a
one-process build differ by float32 rounding. What must hold is that they agree to rounding,
that their metadata is identical, and that an index built on one serves the other. Another
store (other data, same metadata) must still be refused.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tracinfunc as tif
from tests.search.test_search import _store, _test_grads
from tracinfunc.search.binding import meta_fingerprint, norms_mismatch

pytest.importorskip("faiss")

LRS = (0.5, 0.2)


def _lora_store(threads: int, path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=128, intermediate_size=344, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=1000, max_position_embeddings=128)
        model = peft.get_peft_model(
            transformers.LlamaForCausalLM(config),
            peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)).eval()
        for name, param in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: give the adapters a gradient
                torch.nn.init.normal_(param, std=0.02)
        ids = torch.randint(0, 1000, (32, 64))
        return tif.build_store(
            tif.causal_lm_loss(model), [tif.Checkpoint.from_module(model, lr=0.1)],
            {"input_ids": ids}, projection=tif.Projection(dim=256, seed=0, kind="sjlt"),
            batch_size=8, store=path,
            options=tif.GradientOptions(select=["*lora_A*", "*lora_B*"]))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("threads", [2, 8])  # 8: rows differ in their last bits here
def test_a_store_built_with_1_and_more_threads_is_one_store_for_its_index(tmp_path, threads):
    one = _lora_store(1, tmp_path / "one.zarr")
    eight = _lora_store(threads, tmp_path / "more.zarr")
    a, b = one.read_rows(0, 0, 32), eight.read_rows(0, 0, 32)
    # Equal to float32 rounding (bit-identical only at equal thread counts: see docs).
    assert (a - b).norm(dim=-1).max() <= 1e-5 * a.norm(dim=-1).max()
    assert meta_fingerprint(one.meta) == meta_fingerprint(eight.meta)
    index = tif.build_index(one, nlist=1)
    reloaded = tif.load_index(index.path, eight)  # refused before: the rows' bits differed
    test = a[None, :3]  # [n_ckpt=1, 3, k]: the first examples as queries
    _, exact = tif.top_k(eight, test, 5)
    _, found = tif.indexed_top_k(eight, test, 5, index=reloaded, nprobe=1)
    assert torch.equal(found, exact)


def _rows(store) -> torch.Tensor:
    """``[n_ckpt, n_train, k]``."""
    meta = store.meta
    return torch.stack([store.read_rows(c, 0, meta.n_train) for c in range(meta.n_ckpt)])


def _nudged(store, ulps: int):
    """The store's rows moved by up to ``ulps`` float32 ulps each, as rounding moves them."""
    original = _rows(store)
    rows = original.to(torch.float32)
    g = torch.Generator().manual_seed(3)
    steps = torch.randint(-ulps, ulps + 1, rows.shape, generator=g).to(torch.float32)
    spacing = torch.nextafter(rows, torch.full_like(rows, float("inf"))) - rows
    moved = (rows + steps * spacing).to(original.dtype)
    return tif.store.MemoryStore(store.meta, moved, moved.norm(dim=-1))


def test_an_index_accepts_rows_equal_to_rounding_and_refuses_other_data():
    store = _store(lrs=LRS)
    index = tif.build_index(store, nlist=4)
    tif.indexed_top_k(_nudged(store, 4), _test_grads(), 3, index=index)  # accepted

    rows = _rows(store)
    rows[:, 17] = rows[:, 18]  # one example replaced by another's, at both checkpoints
    swapped = tif.store.MemoryStore(store.meta, rows, rows.norm(dim=-1))
    with pytest.raises(tif.errors.IncompatibleGradientsError,
                       match=r"2 of 600 row norms differ .*first: row 17 at checkpoint 0"):
        tif.indexed_top_k(swapped, _test_grads(), 3, index=index)

    scaled = tif.store.MemoryStore(store.meta, _rows(store) * (1 + 1e-3),
                                   _rows(store).norm(dim=-1) * (1 + 1e-3))  # another precision
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="600 of 600 row norms"):
        tif.indexed_top_k(scaled, _test_grads(), 3, index=index)


def test_norms_mismatch_counts_nan_and_shape_as_different():
    norms = np.ones((2, 5), np.float32)
    assert norms_mismatch(norms, norms * (1 + 1e-6)) is None
    with_nan = norms.copy()
    with_nan[1, 3] = np.nan
    assert "first: row 3 at checkpoint 1" in norms_mismatch(norms, with_nan)
    assert "shape (2, 5) recorded, (2, 4) read" in norms_mismatch(norms, norms[:, :4])


def _rewrite_meta(index_path, edit):
    from tracinfunc.search.files import _checksum

    saved = json.loads((index_path / "meta.json").read_text())
    body = edit({key: value for key, value in saved.items() if key != "checksum"})
    (index_path / "meta.json").write_text(json.dumps({**body, "checksum": _checksum(body)}))


def test_an_index_saved_before_format_3_is_bound_by_its_exact_fingerprint(tmp_path):
    store = tif.save_store(_store(lrs=LRS), tmp_path / "a.zarr", chunk_rows=16)
    index = tif.build_index(store, nlist=4)
    (index.path / "norms.npy").unlink()

    def as_format_2(body):
        del body["files"]["norms.npy"]
        return {**body, "format_version": 2}

    _rewrite_meta(index.path, as_format_2)
    assert tif.load_index(index.path, store).norms is None
    nudged = _nudged(store, 1)
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="same metadata, other rows"):
        tif.load_index(index.path, nudged)


def test_a_format_3_index_without_its_norms_is_corrupt(tmp_path):
    store = tif.save_store(_store(lrs=LRS), tmp_path / "a.zarr", chunk_rows=16)
    index = tif.build_index(store, nlist=4)

    def without_norms(body):
        del body["files"]["norms.npy"]
        return body

    _rewrite_meta(index.path, without_norms)  # checksum recomputed: only the entry is gone
    with pytest.raises(tif.errors.CorruptStoreError, match="does not match its checksum"):
        tif.load_index(index.path, store)
    tif.build_index(store, nlist=4, overwrite=True)
    (index.path / "norms.npy").unlink()
    with pytest.raises(tif.errors.CorruptStoreError, match=r"norms.npy .*\(missing"):
        tif.load_index(index.path, store)
