"""The ``batch_size`` record of a Zarr build (group attribute ``tracinfunc_build``): what it
holds, and the resumes and re-runs it refuses (w37-recfix)."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch

import tracinfunc as tif
from tracinfunc.errors import IncompatibleGradientsError, InvalidArgumentError

PROJECTION = tif.Projection(dim=16, seed=0)


def _loader(x, y, size, die_after=None):
    batches = [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]

    def gen():
        for j, batch in enumerate(batches):
            if j == die_after:
                raise KeyboardInterrupt
            yield batch

    return gen()


def _build(setup, path, batch_size, *, size=4, die_after=None, mixed_precision=None):
    loss, ckpts, (x, y), _ = setup
    writer = functools.partial(tif.store.ZarrWriter, path, chunk_rows=4, shard_rows=4)
    return tif.build_store(loss, ckpts, _loader(x, y, size, die_after), projection=PROJECTION,
                           store=writer, batch_size=batch_size,
                           options=tif.GradientOptions(mixed_precision=mixed_precision))


def _record(path):
    return json.loads((path / "zarr.json").read_text())["attributes"].get("tracinfunc_build")


def test_numpy_batch_size_is_an_int_and_a_bad_one_writes_nothing(mlp_setup32, tmp_path):
    store = _build(mlp_setup32, tmp_path / "np.zarr", np.int64(8))
    ref = _build(mlp_setup32, tmp_path / "ref.zarr", 8)
    assert _record(tmp_path / "np.zarr") == {"batch_size": 8, "mixed_precision": None}
    assert torch.equal(store.read_rows(0, 0, 40), ref.read_rows(0, 0, 40))
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        _build(mlp_setup32, tmp_path / "bad.zarr", 2.0)
    assert not (tmp_path / "bad.zarr").exists()


def test_none_records_the_first_batch_and_refuses_another_loader(mlp_setup32, tmp_path):
    path = tmp_path / "g.zarr"
    with pytest.raises(KeyboardInterrupt):
        _build(mlp_setup32, path, None, size=4, die_after=6)
    assert _record(path) == {"batch_size": None, "first_batch": 4, "mixed_precision": None}
    with pytest.raises(IncompatibleGradientsError, match=r"first batch held 4 .* 8 now"):
        _build(mlp_setup32, path, None, size=8)
    assert _record(path) == {"batch_size": None, "first_batch": 4, "mixed_precision": None}
    ref = _build(mlp_setup32, tmp_path / "ref.zarr", None, size=4)
    done = _build(mlp_setup32, path, None, size=4)
    assert torch.equal(done.read_rows(0, 0, 40), ref.read_rows(0, 0, 40))


def test_a_finished_store_refuses_another_batch_size_untouched(mlp_setup32, tmp_path):
    path = tmp_path / "g.zarr"
    _build(mlp_setup32, path, 8)
    before = (path / "zarr.json").read_text()
    with pytest.raises(IncompatibleGradientsError, match=r"finished .* batch_size=8 when built, "
                                                         r"12 now"):
        _build(mlp_setup32, path, 12)
    assert (path / "zarr.json").read_text() == before
    assert _build(mlp_setup32, path, 8).n_train == 40  # the same arguments: the store back
    _build(mlp_setup32, tmp_path / "n.zarr", None, size=4)
    with pytest.raises(IncompatibleGradientsError, match="first batch held 4 .* 5 now"):
        _build(mlp_setup32, tmp_path / "n.zarr", None, size=5)


def test_a_store_from_before_the_record_is_resumed_without_one(mlp_setup32, tmp_path):
    path = tmp_path / "g.zarr"
    with pytest.raises(KeyboardInterrupt):
        _build(mlp_setup32, path, 8, die_after=6)
    meta = json.loads((path / "zarr.json").read_text())
    del meta["attributes"]["tracinfunc_build"]
    (path / "zarr.json").write_text(json.dumps(meta))
    assert _build(mlp_setup32, path, 8).n_train == 40
    assert _record(path) is None


def test_a_part_records_batch_size_and_refuses_another_on_resume(mlp_setup32, tmp_path):
    loss, ckpts, (x, y), _ = mlp_setup32
    path = tmp_path / "g.zarr"

    def part(batch_size, data):
        return tif.build_store(loss, ckpts, data, projection=PROJECTION, batch_size=batch_size,
                               store=functools.partial(tif.store.PartWriter, path, shard_rows=4),
                               shard=(0, 2))

    class Dying(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            if i >= 8:
                raise KeyboardInterrupt
            return x[i], y[i]

    with pytest.raises(KeyboardInterrupt):
        part(8, torch.utils.data.DataLoader(Dying(), batch_size=4))
    with pytest.raises(IncompatibleGradientsError, match=r"batch_size 8 but now with 12"):
        part(12, [(x, y)])
    assert part(8, [(x, y)]).complete


@pytest.mark.parametrize("batch_size", [8, None])
def test_another_mixed_precision_is_refused_on_resume_and_rerun(mlp_setup32, tmp_path,
                                                               batch_size):
    """float16 rows agree with float32 within the resume check's 1e-3: only the record
    keeps a store from mixing them (atk38)."""
    path, f16 = tmp_path / "g.zarr", torch.float16
    with pytest.raises(KeyboardInterrupt):
        _build(mlp_setup32, path, batch_size, die_after=6, mixed_precision=f16)
    assert _record(path)["mixed_precision"] == "float16"
    before = (path / "zarr.json").read_text()
    with pytest.raises(IncompatibleGradientsError,
                       match=r"mixed_precision=torch.float16 when started, None now"):
        _build(mlp_setup32, path, batch_size)
    assert (path / "zarr.json").read_text() == before
    finished = _build(mlp_setup32, path, batch_size, mixed_precision=f16)
    assert finished.n_train == 40
    for other in (None, torch.bfloat16):
        with pytest.raises(IncompatibleGradientsError, match=r"when built, .* now.*another path"):
            _build(mlp_setup32, path, batch_size, mixed_precision=other)


def test_a_record_from_before_mixed_precision_is_accepted(mlp_setup32, tmp_path):
    path = tmp_path / "g.zarr"
    with pytest.raises(KeyboardInterrupt):
        _build(mlp_setup32, path, 8, die_after=6)
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"]["tracinfunc_build"] = {"batch_size": 8}  # as written before the key
    (path / "zarr.json").write_text(json.dumps(meta))
    try:  # not refused by the record; the data check may still see float16's rounding
        _build(mlp_setup32, path, 8, mixed_precision=torch.float16)
    except IncompatibleGradientsError as error:
        assert "when started" not in str(error) and "differ from the stored" in str(error)
    assert _build(mlp_setup32, path, 8).n_train == 40
    assert _record(path) == {"batch_size": 8}  # not given a guessed key
