"""build_store merges a small model's loader batches into fewer gradient calls (issue 34),
only in memory and without memory options, never splitting a batch, rows unchanged."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_checkpoints, make_data, make_mlp
from tracinfunc.build.merge import MERGE_EXAMPLES, merge_limit, merged_calls
from tracinfunc.projection import canonical_layout

PROJ = tif.Projection(dim=16, seed=0)


def _counted():
    """A loss and the list of batch sizes it was traced with (one per vmapped call)."""
    model = make_mlp(dtype=torch.float32).eval()
    inner = tif.loss_from_module(model, F.cross_entropy)
    calls = []

    def loss(params, example):
        calls.append(1)
        return inner(params, example)

    return loss, make_checkpoints(model), calls


def _batches(x, y, size):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(y), size)]


def _rows(store):
    return torch.stack([store.read_rows(c, 0, store.n_train) for c in range(store.n_ckpt)])


def test_merged_calls_keep_order_and_never_split():
    sizes = [3, 4, 9, 1, 1, 2]
    data = [torch.arange(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
    out = list(merged_batches(data, 8))
    assert [len(b) for b in out] == [7, 9, 4]  # 3+4; 9 alone (larger than the limit); 1+1+2
    assert torch.equal(torch.cat(out), torch.arange(sum(sizes)))


def test_limit_is_zero_on_disk_or_with_a_memory_option():
    layout = canonical_layout({"w": torch.zeros(10, 10)})
    plain = tif.GradientOptions()
    assert merge_limit(layout, 4, plain, in_memory=True) == MERGE_EXAMPLES
    assert merge_limit(layout, 4, plain, in_memory=False) == 0
    for options in (tif.GradientOptions(chunk_size=4), tif.GradientOptions(memory_budget=2**20)):
        assert merge_limit(layout, 4, options, in_memory=True) == 0
    huge = canonical_layout({"w": torch.empty(2**14, 2**12, device="meta")})  # 3 x 256 MiB
    assert merge_limit(huge, 4, plain, in_memory=True) == 0


@pytest.mark.parametrize("kind", ["rademacher", "sjlt", "kronecker"])
def test_in_memory_build_merges_calls_and_keeps_rows(kind, tmp_path):
    loss, ckpts, calls = _counted()
    x, y = make_data(40, dtype=torch.float32, seed=1)
    spec = tif.Projection(dim=16, seed=0, kind=kind)
    merged = tif.build_store(loss, ckpts, _batches(x, y, 4), projection=spec)
    merged_calls, calls[:] = len(calls), []
    per_batch = tif.build_store(loss, ckpts, _batches(x, y, 4), projection=spec, batch_size=4)
    per_batch_calls, calls[:] = len(calls), []
    on_disk = tif.build_store(loss, ckpts, _batches(x, y, 4), projection=spec,
                              store=str(tmp_path / "g.zarr"))
    assert per_batch_calls > merged_calls and len(calls) == per_batch_calls
    # Batch size changes float32 matmul blocking, hence a float32 tolerance.
    torch.testing.assert_close(_rows(merged), _rows(per_batch), rtol=1e-5, atol=1e-6)
    assert torch.equal(_rows(on_disk), _rows(per_batch))  # on disk: the data's own batches


def test_memory_options_keep_the_batches():
    loss, ckpts, calls = _counted()
    x, y = make_data(40, dtype=torch.float32, seed=1)
    options = tif.GradientOptions(chunk_size=4)
    tif.build_store(loss, ckpts, _batches(x, y, 4), projection=PROJ, options=options)
    chunked, calls[:] = len(calls), []
    tif.build_store(loss, ckpts, _batches(x, y, 4), projection=PROJ, batch_size=4,
                    options=options)
    assert chunked == len(calls)


def test_a_callable_store_keeps_the_batches(tmp_path):
    loss, ckpts, calls = _counted()
    x, y = make_data(40, dtype=torch.float32, seed=1)
    writer = functools.partial(tif.store.ZarrWriter, tmp_path / "g.zarr")
    tif.build_store(loss, ckpts, _batches(x, y, 4), projection=PROJ, store=writer)
    own, calls[:] = len(calls), []
    tif.build_store(loss, ckpts, _batches(x, y, 4), projection=PROJ, batch_size=4)
    assert own == len(calls)


def test_batches_of_another_structure_are_not_merged():
    x = torch.zeros(2, 3)
    data = [(x, x[:, 0]), (x, x[:, 0]), {"x": x}, (x.double(), x[:, 0]), (x, x[:, 0])]
    assert [type(b).__name__ for b in merged_batches(data, 100)] == ["tuple", "dict", "tuple",
                                                                     "tuple"]
    assert [len(b[0]) if isinstance(b, tuple) else 2 for b in merged_batches(data, 100)] == [
        4, 2, 2, 2]


def test_a_merged_call_failing_on_one_batch_names_that_batch():
    # Batch 6 holds a label out of range: same structure, merged with the others; the failing
    # call is re-run batch by batch to name it.
    loss, ckpts, _ = _counted()
    x, y = make_data(40, dtype=torch.float32, seed=1)
    y = y.clone()
    y[32] = 99
    with pytest.raises(tif.errors.LossFunctionError,
                       match=r"failed on batch 6 of data \(rows 30-34\)"):
        tif.build_store(loss, ckpts, _batches(x, y, 5), projection=PROJ, progress=False)
    with pytest.raises(tif.errors.LossFunctionError, match=r"rows 20-39 \(batch_size=20\)"):
        tif.build_store(loss, ckpts, _batches(x, y, 5), projection=PROJ, progress=False,
                        batch_size=20)


def test_merged_cpu_batches_are_one_copy_and_others_as_large_as_the_call():
    data = [(torch.arange(i, i + 3), torch.full((3, 2), float(i))) for i in range(0, 12, 3)]
    first = merged_batches(data, 100)[0]
    assert torch.equal(first[0], torch.arange(12))
    assert torch.equal(first[1][:, 0], torch.arange(12).float().div(3).floor().mul(3))
    for leaf in first:  # copies: no storage shared with the loader's tensors
        assert all(leaf.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
                   for batch in data for x in batch)
    on_meta = [tuple(x.to("meta") for x in batch) for batch in data]
    (call,) = merged_batches(on_meta, 100)
    assert [tuple(leaf.shape) for leaf in call] == [(12,), (12, 2)]
    assert call[0].untyped_storage().nbytes() == 12 * 8  # the call's size, not the limit's


def merged_batches(batches, limit):
    return [batch for batch, _, _ in merged_calls(batches, limit)]
