"""Hostile input, fuzzed (issue 16, "What to prove" 5): a right answer or a TracInFuncError."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracinfunc as tif
from tests.store.test_tamper import N_TRAIN, memory_store

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
STORE = memory_store()
ROWS = torch.stack([STORE.read_rows(c, 0, N_TRAIN) for c in range(STORE.n_ckpt)])

index_like = st.one_of(
    st.integers(-5, N_TRAIN + 5), st.booleans(), st.floats(allow_nan=True),
    st.none(), st.text(max_size=3), st.just(torch.tensor(2)), st.just(torch.tensor(2.0)),
)


@SETTINGS
@given(ckpt=index_like, start=index_like, stop=index_like)
def test_read_rows_is_exact_or_refused(ckpt, start, stop):
    for store in (STORE,):
        try:
            got = store.read_rows(ckpt, start, stop)
        except tif.TracInFuncError as error:
            assert "read_rows" in str(error)
            continue
        c, a, b = int(ckpt), int(start), int(stop)
        assert not isinstance(ckpt, bool) and 0 <= c < STORE.n_ckpt and 0 <= a <= b <= N_TRAIN
        assert torch.equal(got, ROWS[c, a:b])


json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10, 10**12), st.text(max_size=4),
              st.floats(allow_nan=True, allow_infinity=True)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                 max_size=3),
    max_leaves=5,
)
FIELDS = ["n_train", "k", "dtype", "complete", "format_version", "dataset_fingerprint",
          "projection", "checkpoints", "layout", "integrity", "extra"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "g.zarr"
    tif.save_store(STORE, path, progress=False, chunk_rows=8, shard_rows=32)
    return path


@SETTINGS
@given(field=st.sampled_from(FIELDS), value=json_value)
def test_any_edit_of_the_metadata_is_refused_at_open(saved, field, value):
    original = (saved / "zarr.json").read_text()
    document = json.loads(original)
    before = document["attributes"]["tracinfunc"].get(field)
    document["attributes"]["tracinfunc"][field] = value
    try:
        (saved / "zarr.json").write_text(json.dumps(document))
        same = json.dumps(before, sort_keys=True) == json.dumps(value, sort_keys=True)
        if same and not (isinstance(value, float) and math.isnan(value)):
            assert tif.open_store(saved).meta == STORE.meta
        else:
            with pytest.raises(tif.errors.CorruptStoreError, match="zarr.json"):
                tif.open_store(saved)
            with pytest.raises(tif.TracInFuncError):
                tif.store.read_store_meta(saved)
    finally:
        (saved / "zarr.json").write_text(original)


@SETTINGS
@given(lr=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3),
                    st.booleans(), st.none(), st.text(max_size=2)))
def test_checkpoint_lr_is_a_finite_positive_number_or_refused(lr):
    params = {"w": torch.zeros(2, 3)}
    # Scores are float32: an lr outside float32's normal range would make them inf or 0.
    f32 = torch.finfo(torch.float32)
    valid = isinstance(lr, int | float) and not isinstance(lr, bool) and math.isfinite(lr) \
        and f32.tiny <= lr <= f32.max
    try:
        checkpoint = tif.Checkpoint(params, lr=lr)
    except tif.TracInFuncError as error:
        assert not valid and "lr must " in str(error) and "e.g. lr=0.1" in str(error)
        return
    assert valid and checkpoint.lr == float(lr)


@SETTINGS
@given(kind=st.sampled_from(["memory", "pinned", "zarr"]),
       bad=st.sampled_from([math.nan, math.inf, -math.inf]),
       ckpt=st.integers(0, 2), row=st.integers(0, 4), where=st.sampled_from(["rows", "norms"]))
def test_writers_refuse_non_finite_rows(tmp_path_factory, kind, bad, ckpt, row, where):
    meta = STORE.meta.replace(n_train=0, complete=False)
    rows = ROWS[:, :5].clone()
    norms = rows.norm(dim=-1)
    (rows if where == "rows" else norms)[ckpt, row] = bad
    writers = {"memory": lambda: tif.store.MemoryWriter(meta),
               "pinned": lambda: tif.store.PinnedWriter(meta, n_train=5),
               "zarr": lambda: tif.store.ZarrWriter(tmp_path_factory.mktemp("w") / "g.zarr", meta)}
    writer = writers[kind]()
    with pytest.raises(
        tif.errors.NonFiniteGradientError, match=f"checkpoint index {ckpt}, row {row}"
    ):
        writer.append(rows, norms)
