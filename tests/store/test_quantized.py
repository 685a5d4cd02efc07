"""Quantised stores (issue 17, item 4): int8 codes or 1-bit signs, each row with a scale.

The kernels against their error bounds and bit layout; every store kind (memory, pinned,
Zarr, sharded Zarr) holding them, against a float64 reference computed from the explicit
dequantised matrix; conversions; and the conformance suite on quantised variants.
"""

from __future__ import annotations

import functools
import json
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tracinfunc as tif
from tests.reference import flat_loop_grads
from tracinfunc.store.codes import dequantize, quantize
from tracinfunc.testing import StoreConformance, reference_store

PROJ = tif.Projection(dim=16, seed=0)
QUANTIZATIONS = ["int8", "sign"]


def all_rows(store):
    return torch.stack([store.read_rows(c, 0, store.n_train) for c in range(store.n_ckpt)])


def all_norms(store):
    return torch.stack([store.read_norms(c, 0, store.n_train) for c in range(store.n_ckpt)])


def all_codes(store):
    pairs = [store.read_codes(c, 0, store.n_train) for c in range(store.n_ckpt)]
    return torch.stack([c for c, _ in pairs]), torch.stack([s for _, s in pairs])


def tiny(path, **options):
    return functools.partial(tif.store.ZarrWriter, path, chunk_rows=4, shard_rows=16, **options)


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "no CUDA, not pinned"
        return fn(*args, **kwargs)


# ---- the kernels ----------------------------------------------------------------------------

rows_strategy = st.tuples(st.integers(1, 5), st.integers(1, 40), st.integers(-30, 30),
                          st.integers(0, 2**31 - 1))


def random_rows(n, k, exponent, seed):
    """Rows of mixed magnitude around ``2**exponent``, one of them zero, some heavy-tailed."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, k, generator=g) * 2.0**exponent
    rows[0] = 0.0
    rows[-1, 0] *= 1e3  # one outlier: a large scale, most codes small
    return rows


@settings(max_examples=60, deadline=None)
@given(rows_strategy)
def test_int8_round_trip_is_within_half_a_step(case):
    rows = random_rows(*case)
    codes, scales = quantize(rows, "int8")
    back = dequantize(codes, scales, "int8", rows.shape[1])
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert back.dtype == torch.float32 and back.shape == rows.shape
    torch.testing.assert_close(scales, rows.abs().amax(dim=1) / 127, rtol=2**-23, atol=0)
    assert codes.abs().max() <= 127
    # |row - scale * code| <= scale / 2, up to float32 rounding of row / scale and code * scale
    assert ((rows - back).abs() <= scales[:, None] * (0.5 + 2e-5)).all()
    nonzero = scales > 0
    assert (codes[nonzero].abs().amax(dim=1) == 127).all()  # the largest value is +-127 steps
    assert scales[0] == 0 and (codes[0] == 0).all() and (back[0] == 0).all()  # zero row exact


@settings(max_examples=60, deadline=None)
@given(rows_strategy)
def test_sign_round_trip_is_the_mean_magnitude_times_the_sign(case):
    rows = random_rows(*case)
    k = rows.shape[1]
    codes, scales = quantize(rows, "sign")
    back = dequantize(codes, scales, "sign", k)
    assert codes.dtype == torch.uint8 and codes.shape == (rows.shape[0], -(-k // 8))
    torch.testing.assert_close(scales, rows.abs().mean(dim=1), rtol=1e-6, atol=0)
    signs = torch.where(rows < 0, -1.0, 1.0)
    assert torch.equal(back, scales[:, None] * signs)
    assert (back[0] == 0).all()


def test_sign_scale_minimises_the_l2_error():
    rows = random_rows(4, 33, 0, 7)[1:]
    _, scales = quantize(rows, "sign")
    signs = torch.where(rows < 0, -1.0, 1.0).double()
    error = (rows.double() - scales.double()[:, None] * signs).norm(dim=1)
    for factor in (0.99, 1.01):
        other = (rows.double() - factor * scales.double()[:, None] * signs).norm(dim=1)
        assert (error < other).all()


def test_sign_bits_are_packed_little_endian_negative_set():
    row = torch.tensor([[-1.0, 2, -3, 0, 5, -6, 7, 8, -9, 10]])
    codes, scales = quantize(row, "sign")
    # values 0, 2, 5 negative -> bits 0, 2, 5 of byte 0; value 8 -> bit 0 of byte 1
    assert codes.tolist() == [[1 + 4 + 32, 1]]
    assert scales.item() == pytest.approx(5.1)
    rows = random_rows(6, 21, 0, 3)
    expected = np.packbits((rows < 0).numpy(), axis=1, bitorder="little")
    assert np.array_equal(quantize(rows, "sign")[0].numpy(), expected)


def test_float64_rows_quantise_as_their_float32_values():
    rows = random_rows(5, 12, 2, 11)
    for quantization in QUANTIZATIONS:
        for ours, theirs in zip(quantize(rows.double(), quantization),
                                quantize(rows, quantization), strict=True):
            assert torch.equal(ours, theirs)


# ---- every store kind -----------------------------------------------------------------------

KINDS = ["memory", "pinned", "zarr", "zarr-zstd"]


@pytest.fixture(scope="module")
def setup():
    from tests.conftest import make_checkpoints, make_data, make_mlp

    model = make_mlp(dtype=torch.float32).eval()
    loss = tif.loss_from_module(model, torch.nn.functional.cross_entropy)
    return loss, make_checkpoints(model), make_data(40, dtype=torch.float32, seed=1), \
        make_data(7, dtype=torch.float32, seed=3)


@pytest.fixture(scope="module")
def float_store(setup):
    loss, ckpts, train, _ = setup
    return tif.build_store(loss, ckpts, train, projection=PROJ)


@pytest.fixture(scope="module")
def test_store(setup):
    loss, ckpts, _, test = setup
    return tif.build_store(loss, ckpts, test, projection=PROJ)


@pytest.fixture(scope="module", params=QUANTIZATIONS)
def quantization(request):
    return request.param


@pytest.fixture(scope="module")
def memory_store(setup, quantization):
    loss, ckpts, train, _ = setup
    return tif.build_store(loss, ckpts, train, projection=PROJ, dtype=quantization)


@pytest.fixture(scope="module", params=KINDS)
def store(request, setup, quantization, tmp_path_factory):
    loss, ckpts, train, _ = setup
    path = tmp_path_factory.mktemp("q") / "g.zarr"
    target = {"memory": "memory", "pinned": "pinned", "zarr": tiny(path),
              "zarr-zstd": tiny(path, compression="zstd")}[request.param]
    return quiet(tif.build_store, loss, ckpts, train, projection=PROJ, dtype=quantization,
                 store=target)


def test_a_quantised_store_reads_dequantised_float32_rows(store, quantization, float_store):
    meta = store.meta
    assert meta.quantization == quantization and meta.dtype == "float32"
    assert meta.torch_dtype == torch.float32 and store.dtype == torch.float32
    assert f"stored as {quantization}" in repr(store)
    assert isinstance(store, tif.GradientStore) and isinstance(
        store, tif.store.SupportsQuantizedRows
    )
    assert not isinstance(store, tif.store.SupportsRowViews)  # no views of codes as rows
    codes, scales = all_codes(store)
    assert torch.equal(all_rows(store), dequantize(codes, scales, quantization, 16))
    expected_codes, expected_scales = quantize(all_rows(float_store), quantization)
    assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)
    # Norms are those of the unquantised rows, bit for bit.
    assert torch.equal(all_norms(store), all_norms(float_store))
    assert meta.replace(quantization=None) == float_store.meta


def test_every_kind_reads_the_same_rows_and_ranges(store, memory_store):
    assert torch.equal(all_rows(store), all_rows(memory_store))
    for start, stop in [(3, 29), (16, 40), (5, 6), (39, 40), (7, 7)]:
        assert torch.equal(store.read_rows(2, start, stop), memory_store.read_rows(2, start,
                                                                                    stop))
        codes, scales = store.read_codes(1, start, stop)
        assert codes.shape[0] == scales.shape[0] == stop - start
    buffer = torch.full((10, 16), float("nan"))
    view = store.read_rows(0, 30, 37, out=buffer)
    assert view.data_ptr() == buffer.data_ptr()
    assert torch.equal(view, memory_store.read_rows(0, 30, 37))
    with pytest.raises(ValueError, match=r"out must be \[>= 2, 16\] torch.float32"):
        store.read_rows(0, 0, 2, out=torch.empty(2, 16, dtype=torch.int8))


def test_scores_equal_a_float64_reference_from_the_explicit_dequantised_matrix(
        store, quantization, test_store):
    codes, scales = all_codes(store)
    width = codes.shape[-1]
    # Dequantised by hand: code * scale (one float32 multiplication, as documented), or
    # +-scale from the bits read one by one.
    if quantization == "int8":
        matrix = (codes.float() * scales[..., None]).double()
        torch.testing.assert_close(matrix, codes.double() * scales.double()[..., None],
                                   rtol=2**-24, atol=0)
    else:
        bits = [[[(int(codes[c, i, j // 8]) >> (j % 8)) & 1 for j in range(16)]
                 for i in range(40)] for c in range(3)]
        matrix = (1 - 2 * torch.tensor(bits, dtype=torch.float64)) * scales.double()[..., None]
        assert width == 2
    test = all_rows(test_store).double()
    lrs = torch.tensor(store.meta.lrs, dtype=torch.float64)
    expected = torch.einsum("c,ctk,cnk->tn", lrs, test, matrix)
    torch.testing.assert_close(tif.score(store, test_store).double(), expected, rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(tif.score(store, test_store, chunk_rows=7).double(), expected,
                               rtol=1e-5, atol=1e-6)
    # float64 test gradients: float64 accumulation, exact up to float64 rounding
    torch.testing.assert_close(tif.score(store, test), expected, rtol=1e-12, atol=1e-12)
    unit = matrix / all_norms(store).double()[..., None]  # cosine uses the exact norms
    cosine = torch.einsum("c,ctk,cnk->tn", lrs, test / test.norm(dim=-1, keepdim=True), unit)
    torch.testing.assert_close(tif.score(store, test, normalize=True), cosine, rtol=1e-12,
                               atol=1e-12)


def test_top_k_and_self_influence(store, float_store, test_store):
    scores = tif.score(store, test_store)
    values, indices = tif.top_k(store, test_store, k=5, chunk_rows=6)
    expected_values, expected_indices = scores.sort(dim=1, descending=True, stable=True)
    assert torch.equal(indices, expected_indices[:, :5])
    torch.testing.assert_close(values, expected_values[:, :5])
    low, _ = tif.top_k(store, test_store, k=3, largest=False)
    torch.testing.assert_close(low, scores.sort(dim=1).values[:, :3])
    # From the exact norms: the float32 store's self-influence, bit for bit.
    assert torch.equal(tif.self_influence(store), tif.self_influence(float_store))


def test_int8_scores_are_close_to_float32_and_sign_scores_correlate(store, quantization,
                                                                    float_store, test_store):
    exact, ours = tif.score(float_store, test_store), tif.score(store, test_store)
    error = ((ours - exact).norm() / exact.norm()).item()
    assert error < (0.02 if quantization == "int8" else 0.7)
    correlation = torch.corrcoef(torch.stack([ours.flatten(), exact.flatten()]))[0, 1]
    assert correlation > (0.999 if quantization == "int8" else 0.7)


def test_memory_per_row(quantization, memory_store):
    codes, scales = all_codes(memory_store)
    assert codes.element_size() * codes.shape[-1] == {"int8": 16, "sign": 2}[quantization]
    assert scales.dtype == torch.float32


# ---- Zarr: layout, reopening, integrity, resuming, parts ------------------------------------

@pytest.fixture
def zarr_store(setup, quantization, tmp_path):
    loss, ckpts, train, _ = setup
    return tif.build_store(loss, ckpts, train, projection=PROJ, dtype=quantization,
                           store=tiny(tmp_path / "g.zarr"))


def test_zarr_layout_reopens_and_verifies(zarr_store, quantization, memory_store, tmp_path):
    import zarr

    group = zarr.open_group(tmp_path / "g.zarr", mode="r")
    codes, scales = group["rows/0"], group["scales/0"]
    assert codes.dtype == np.dtype({"int8": "int8", "sign": "uint8"}[quantization])
    assert codes.shape == (40, {"int8": 16, "sign": 2}[quantization])
    assert scales.dtype == np.float32 and scales.shape == (40,)
    assert group["norms/0"].dtype == np.float32
    assert group.attrs["tracinfunc"]["quantization"] == quantization
    assert zarr_store.raw_reads  # codes are read straight from the shard files
    reopened = tif.open_store(tmp_path / "g.zarr")
    assert reopened.meta == memory_store.meta
    assert torch.equal(all_rows(reopened), all_rows(memory_store))
    tif.verify_store(reopened)
    assert tif.store.read_store_meta(tmp_path / "g.zarr").quantization == quantization


def test_damaged_scales_are_detected(zarr_store, tmp_path):
    shard = tmp_path / "g.zarr" / "scales" / "1" / "c" / "0"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0xFF  # a flipped byte of a scale
    shard.write_bytes(bytes(data))
    reopened = tif.open_store(tmp_path / "g.zarr")
    with pytest.raises(tif.errors.CorruptStoreError, match="checkpoint 'epoch-1'"):
        tif.verify_store(reopened)
    with pytest.raises(tif.errors.CorruptStoreError, match=r"rows \[0, 16\)"):
        reopened.read_rows(1, 0, 16)
    assert torch.equal(reopened.read_rows(0, 0, 16), zarr_store.read_rows(0, 0, 16))


def test_an_edited_quantization_is_refused_at_open(zarr_store, tmp_path):
    path = tmp_path / "g.zarr" / "zarr.json"
    data = json.loads(path.read_text())
    attrs = data["attributes"]["tracinfunc"]
    attrs["quantization"] = "sign" if attrs["quantization"] == "int8" else "int8"
    path.write_text(json.dumps(data))
    with pytest.raises(tif.errors.CorruptStoreError, match="does not match its checksum"):
        tif.open_store(tmp_path / "g.zarr")
    attrs["quantization"] = "int4"
    path.write_text(json.dumps(data))
    with pytest.raises(tif.errors.CorruptStoreError, match="quantization must be None or one of"):
        tif.open_store(tmp_path / "g.zarr")


def _batches(x, y, size=6):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def test_an_interrupted_quantised_build_resumes_bit_identically(setup, quantization, tmp_path):
    loss, ckpts, (x, y), _ = setup
    path = tmp_path / "g.zarr"
    writer = functools.partial(tif.store.ZarrWriter, path, chunk_rows=4, shard_rows=8)

    def dying():
        yield from _batches(x, y)[:5]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tif.build_store(loss, ckpts, dying(), projection=PROJ, dtype=quantization, store=writer)
    assert tif.store.read_store_meta(path).n_train == 24  # 3 whole shards of 8
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="does not match the store"):
        tif.build_store(loss, ckpts, _batches(x + 1, y), projection=PROJ, dtype=quantization,
                        store=writer)
    other = "sign" if quantization == "int8" else "int8"
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="cannot resume.*quantization"):
        tif.build_store(loss, ckpts, _batches(x, y), projection=PROJ, dtype=other, store=writer)
    resumed = tif.build_store(loss, ckpts, _batches(x, y), projection=PROJ, dtype=quantization,
                              store=writer)
    whole = tif.build_store(loss, ckpts, _batches(x, y), projection=PROJ, dtype=quantization,
                            batch_size=6)  # the resumed build's calls (memory would merge)
    assert resumed.meta == whole.meta
    for ours, theirs in zip(all_codes(resumed), all_codes(whole), strict=True):
        assert torch.equal(ours, theirs)
    assert torch.equal(all_norms(resumed), all_norms(whole))
    again = tif.build_store(loss, ckpts, _batches(x, y), projection=PROJ, dtype=quantization,
                            store=writer)  # a re-run of the finished build: the same store
    assert torch.equal(all_rows(again), all_rows(whole))


def test_sharded_parts_commit_to_the_one_process_store(setup, quantization, tmp_path):
    loss, ckpts, (x, y), _ = setup
    whole = tif.build_store(loss, ckpts, _batches(x, y), projection=PROJ, dtype=quantization,
                            store=tiny(tmp_path / "whole.zarr"))
    part = functools.partial(tif.store.PartWriter, tmp_path / "parts.zarr", chunk_rows=4,
                             shard_rows=16)
    for index in (1, 0):
        tif.build_store(loss, ckpts, _batches(x, y), projection=PROJ, dtype=quantization,
                        store=part, shard=(index, 2))
    committed = tif.store.commit_store(tmp_path / "parts.zarr")
    assert committed.meta == whole.meta
    for ours, theirs in zip(all_codes(committed), all_codes(whole), strict=True):
        assert torch.equal(ours, theirs)
    assert torch.equal(all_norms(committed), all_norms(whole))
    tif.verify_store(committed)


# ---- conversions ----------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["memory", "pinned", "zarr"])
def test_conversions_copy_codes_bit_for_bit(store, target, tmp_path):
    converted = quiet({
        "memory": lambda: tif.to_memory(store),
        "pinned": lambda: tif.to_pinned(store),
        "zarr": lambda: tif.save_store(store, tmp_path / "copy.zarr", chunk_rows=8),
    }[target])
    expected = {"memory": tif.store.QuantizedMemoryStore, "pinned": tif.store.QuantizedPinnedStore,
                "zarr": tif.store.ZarrStore}[target]
    assert type(converted) is expected and converted.meta == store.meta
    for ours, theirs in zip(all_codes(converted), all_codes(store), strict=True):
        assert torch.equal(ours, theirs)
    assert torch.equal(all_norms(converted), all_norms(store))


def test_conversions_between_float_and_quantised_storage(float_store, memory_store,
                                                         quantization, tmp_path):
    # float32 -> quantised: the same codes as quantising while building
    for convert in (lambda: tif.to_memory(float_store, dtype=quantization),
                    lambda: quiet(tif.to_pinned, float_store, dtype=quantization),
                    lambda: tif.save_store(float_store, tmp_path / "q.zarr", dtype=quantization)):
        converted = convert()
        assert converted.meta == memory_store.meta
        for ours, theirs in zip(all_codes(converted), all_codes(memory_store), strict=True):
            assert torch.equal(ours, theirs)
    # quantised -> float32 (the dequantised rows) and float16; norms stay the exact ones
    back = tif.to_memory(memory_store, dtype=torch.float32)
    assert type(back) is tif.store.MemoryStore and back.meta == float_store.meta
    assert torch.equal(all_rows(back), all_rows(memory_store))
    assert torch.equal(all_norms(back), all_norms(float_store))
    half = tif.save_store(memory_store, tmp_path / "h.zarr", dtype=torch.float16)
    assert half.meta.dtype == "float16" and half.meta.quantization is None
    assert torch.equal(all_rows(half), all_rows(memory_store).half())
    # int8 <-> sign re-quantises the dequantised rows
    other = "sign" if quantization == "int8" else "int8"
    switched = tif.to_memory(memory_store, dtype=other)
    assert switched.meta.quantization == other
    assert torch.equal(all_codes(switched)[0], quantize(all_rows(memory_store), other)[0])


def test_save_store_over_itself_keeps_the_codes(zarr_store, tmp_path):
    before = all_codes(zarr_store)
    again = tif.save_store(zarr_store, tmp_path / "g.zarr", overwrite=True)
    for ours, theirs in zip(all_codes(again), before, strict=True):
        assert torch.equal(ours, theirs)


# ---- what is refused, and how it is said ----------------------------------------------------

def test_other_dtypes_are_refused_saying_what_is_accepted(setup, float_store):
    loss, ckpts, train, _ = setup
    for dtype in ("int4", torch.int16, "float8", torch.uint8):  # "float16" is taken, as "int8"
        with pytest.raises(tif.errors.InvalidArgumentError) as error:
            tif.build_store(loss, ckpts, train, projection=PROJ, dtype=dtype)
        message = str(error.value)
        assert message.startswith("build_store: dtype must be a storage dtype")  # expected
        assert "torch.int8 or 'int8'" in message and "'sign'" in message
        assert f"got {dtype!r}" in message and "Pass e.g. dtype=torch.float16" in message
    with pytest.raises(
        tif.errors.InvalidArgumentError, match="to_memory: dtype must be.*got 'int4'"
    ):
        tif.to_memory(float_store, dtype="int4")
    with pytest.raises(tif.errors.InvalidArgumentError, match="save_store: dtype must be"):
        tif.save_store(float_store, "unused.zarr", dtype=torch.int32)


def test_the_kernels_and_finished_writers_refuse_what_they_cannot_do(memory_store, tmp_path):
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match=r"quantize: quantization must be one of \['int8', 'sign'\], got "
                             r"'int4'; pass 'int8'"):
        quantize(torch.ones(2, 3), "int4")
    with pytest.raises(tif.errors.InvalidArgumentError, match="dequantize: .*got None; pass the "
                                                       "store's meta.quantization"):
        dequantize(torch.ones(2, 3), torch.ones(2), None, 3)
    codes, scales = all_codes(memory_store)
    meta = memory_store.meta.replace(n_train=0, complete=False)
    for writer in (tif.store.MemoryWriter(meta), quiet(tif.store.PinnedWriter, meta),
                   tif.store.ZarrWriter(tmp_path / "w.zarr", meta)):
        writer.append_codes(codes, scales, all_norms(memory_store))
        finished = quiet(writer.finish)
        assert torch.equal(all_codes(finished)[0], codes)
        with pytest.raises(
            tif.errors.ReadOnlyStoreError, match="append_codes: the store is already finished"
        ):
            writer.append_codes(codes, scales, all_norms(memory_store))


def test_metadata_is_parsed_strictly_and_old_stores_read_as_float(memory_store):
    data = json.loads(json.dumps(memory_store.meta.to_dict()))
    assert tif.store.StoreMeta.from_dict(data) == memory_store.meta
    del data["quantization"]  # written before the field existed
    assert tif.store.StoreMeta.from_dict(data).quantization is None
    for bad, dtype in (("int4", "float32"), (8, "float32"), ("int8", "float16")):
        with pytest.raises(tif.errors.InvalidArgumentError) as error:
            tif.store.StoreMeta.from_dict({**data, "quantization": bad, "dtype": dtype})
        message = str(error.value)
        assert "quantization must be None or one of ['int8', 'sign'] with dtype 'float32'" \
            in message
        assert f"got quantization={bad!r}, dtype={dtype!r}" in message
        assert "e.g. quantization='int8'" in message


def test_quantised_blocks_and_stores_of_the_wrong_shape_are_refused(memory_store, float_store,
                                                                    tmp_path):
    meta = memory_store.meta
    codes, scales = all_codes(memory_store)
    norms = all_norms(memory_store)
    with pytest.raises(tif.errors.InvalidArgumentError) as error:
        tif.store.QuantizedMemoryStore(meta, codes.float(), scales, norms)
    assert "codes must be" in str(error.value) and "got [3, 40" in str(error.value)
    assert "quantise rows with" in str(error.value)
    writer = tif.store.MemoryWriter(meta.replace(n_train=0, complete=False))
    with pytest.raises(tif.errors.InvalidArgumentError) as error:
        writer.append_codes(codes[:2], scales[:2], norms[:2])
    message = str(error.value)
    assert message.startswith("MemoryWriter.append_codes: expected codes [n_ckpt=3, b, ")
    assert "got codes [2, 40" in message and "pass what read_codes" in message
    with pytest.raises(
        tif.errors.InvalidArgumentError,
        match="scales must be finite and non-negative.*pass the scales quantize",
    ):
        writer.append_codes(codes, -scales - 1, norms)
    saved = tif.save_store(float_store, tmp_path / "f.zarr")
    with pytest.raises(tif.errors.InvalidArgumentError) as error:
        saved.read_codes(0, 0, 4)
    message = str(error.value)
    assert "holds float32 rows, not codes" in message and "dtype='int8'" in message


# ---- the conformance suite on quantised variants of every built-in store --------------------

class QuantizedConformance(StoreConformance):
    """The shipped suite with a quantised reference store, int8 and sign."""

    @pytest.fixture(params=QUANTIZATIONS)
    def reference(self, request):
        return reference_store(self.n_train, self.k, quantization=request.param)


class TestQuantizedMemoryStore(QuantizedConformance):
    def make_store(self, reference, tmp_path):
        return tif.to_memory(reference)


class TestQuantizedPinnedStore(QuantizedConformance):
    def make_store(self, reference, tmp_path):
        return quiet(tif.to_pinned, reference)


@pytest.mark.parametrize("compression", [None, "zstd"])
class TestQuantizedZarrStore(QuantizedConformance):
    @pytest.fixture
    def store(self, reference, tmp_path, compression):
        return tif.save_store(reference, tmp_path / "s.zarr", chunk_rows=4, shard_rows=16,
                              compression=compression)


def test_reference_stores_are_exactly_representable():
    for quantization in QUANTIZATIONS:
        store = reference_store(quantization=quantization)
        rows = all_rows(store)
        # requantised: the same rows up to float32 rounding of the scales
        torch.testing.assert_close(dequantize(*quantize(rows, quantization), quantization, 16),
                                   rows, rtol=1e-6, atol=0)
        torch.testing.assert_close(all_norms(store), rows.norm(dim=-1))


def test_flat_reference_grads_quantise_within_the_bound(mlp_setup):
    """The identity projection's rows are the exact gradients (tests/reference.py): int8
    storage keeps each within half a step."""
    loss, ckpts, train, _ = mlp_setup
    store = tif.build_store(loss, ckpts, train, projection=tif.Projection(kind="identity"),
                            dtype="int8")
    for c, ckpt in enumerate(ckpts):
        exact = flat_loop_grads(loss, ckpt.params, train)  # [n, p] float64
        _, scales = store.read_codes(c, 0, store.n_train)
        rows = store.read_rows(c, 0, store.n_train).double()
        assert ((rows - exact).abs() <= scales.double()[:, None] * (0.5 + 1e-4)).all()
        torch.testing.assert_close(store.read_norms(c, 0, store.n_train).double(),
                                   exact.norm(dim=1), rtol=1e-6, atol=0)
