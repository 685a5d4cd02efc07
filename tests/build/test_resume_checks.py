"""Resuming checks more than the first batch (issue 25 item 9): an example inserted or dropped
before the resume point shifts every stored row after it, and the last stored batch shows it."""

from __future__ import annotations

import functools

import pytest
import torch

import tracinfunc as tif

PROJECTION = tif.Projection(dim=16, seed=0)


def _batches(x, y, size=4):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def _writer(path):
    return functools.partial(tif.store.ZarrWriter, path, chunk_rows=4, shard_rows=8)


def _interrupt(loss, ckpts, batches, path, after):
    def dying():
        yield from batches[:after]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tif.build_store(loss, ckpts, dying(), projection=PROJECTION, store=_writer(path))


@pytest.mark.parametrize("change", ["inserted", "dropped"])
@pytest.mark.parametrize("size", [4, 3], ids=["aligned", "straddling"])
def test_an_example_inserted_or_dropped_before_the_resume_point_is_refused(
        mlp_setup32, tmp_path, change, size):
    loss, ckpts, (x, y), _ = mlp_setup32
    path = tmp_path / "g.zarr"
    _interrupt(loss, ckpts, _batches(x, y, size), path, after=24 // size)
    stored = tif.store.read_store_meta(path).n_train
    assert stored >= 16
    at = 10  # after the first batch, before the resume point
    if change == "inserted":
        x2, y2 = torch.cat([x[:at], x[at + 20 : at + 21], x[at:]]), torch.cat(
            [y[:at], y[at + 20 : at + 21], y[at:]])
    else:
        x2, y2 = torch.cat([x[:at], x[at + 1 :]]), torch.cat([y[:at], y[at + 1 :]])
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="does not match the store"):
        tif.build_store(loss, ckpts, _batches(x2, y2, size), projection=PROJECTION,
                        store=_writer(path))
    assert tif.store.read_store_meta(path).n_train == stored  # nothing merged
    resumed = tif.build_store(loss, ckpts, _batches(x, y, size), projection=PROJECTION,
                              store=_writer(path))
    whole = tif.build_store(loss, ckpts, _batches(x, y, size), projection=PROJECTION,
                            batch_size=size)  # the resumed build's calls (memory would merge)
    for c in range(whole.n_ckpt):
        assert torch.equal(resumed.read_rows(c, 0, 40), whole.read_rows(c, 0, 40))
