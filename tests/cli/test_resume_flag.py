"""A refused resume in the command line's words: the ``--batch-size`` flag to pass."""

from __future__ import annotations

import functools

import pytest

import tracinfunc as tif
from tracinfunc.cli.commands import _with_flag
from tracinfunc.errors import IncompatibleGradientsError


@pytest.mark.parametrize(("started", "flag"), [(8, "with --batch-size 8"),
                                               (None, "without --batch-size")])
def test_the_refusal_names_the_flag_of_the_recorded_batch_size(mlp_setup32, tmp_path, started,
                                                               flag):
    loss, ckpts, (x, y), _ = mlp_setup32
    path = tmp_path / "g.zarr"

    def build(batch_size, die=False):
        def data():
            for i in range(0, 40, 4):
                if die and i == 24:
                    raise KeyboardInterrupt
                yield x[i : i + 4], y[i : i + 4]

        return tif.build_store(loss, ckpts, data(), projection=tif.Projection(dim=16, seed=0),
                               batch_size=batch_size, store=functools.partial(
                                   tif.store.ZarrWriter, path, chunk_rows=4, shard_rows=4))

    with pytest.raises(KeyboardInterrupt):
        build(started, die=True)
    with pytest.raises(IncompatibleGradientsError) as refused:
        build(12)
    said = str(_with_flag(refused.value))
    assert said.startswith(str(refused.value)) and said.endswith(f"run the same command {flag}.")
    unrelated = IncompatibleGradientsError("other")
    assert _with_flag(unrelated) is unrelated
