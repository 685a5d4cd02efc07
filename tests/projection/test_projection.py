"""Tests for tracinfunc.projection: bit-exact NumPy reference, determinism, vmap, statistics."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import vmap

import tracinfunc.projection._kernels as hashing_module
import tracinfunc.projection.keys as projection_module
from tests import numpy_projection as ref
from tests.conftest import child_env
from tracinfunc.errors import InvalidProjectionError
from tracinfunc.projection import (
    Projection,
    block_seed,
    canonical_layout,
    kronecker_factors,
    kronecker_split,
    make_projector,
    rademacher_block,
    sjlt_block,
)

GOLDEN_DIGEST = "3addf9def6ab24267d700184e9441530d257829cfb9882e0e830188c0d3e3587"
ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"fc2.weight": (3, 8), "fc1.bias": (8,), "conv.weight": (2, 1, 3, 3), "fc1.weight": (8, 6)}


def random_grads(seed, shapes=SHAPES, batch=(), dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*batch, *shape, generator=gen, dtype=dtype)
            for name, shape in shapes.items()}


def example(grads, i):
    return {name: g[i] for name, g in grads.items()}


# --- bit-exact agreement with the NumPy reference -------------------------------------------

@pytest.mark.parametrize(("seed", "dim", "name", "shape", "rows"), [
    (0, 16, "fc.weight", (10, 30), (0, 300)),
    (7, 37, "fc.bias", (37,), (0, 37)),
    (2**63 - 1, 5, "layers.0.attn.q_proj.weight", (64, 64), (1000, 3001)),  # middle row-block
    (123, 1, "ünïcode/name", (4, 1, 2), (3, 5)),
])
def test_rademacher_block_is_bit_identical_to_numpy(seed, dim, name, shape, rows):
    block = rademacher_block(Projection(dim=dim, seed=seed), name, shape, *rows)
    expected = ref.rademacher_block(seed, dim, name, shape, *rows)
    assert block.dtype == torch.float32 and block.shape == (rows[1] - rows[0], dim)
    assert torch.equal(block, torch.from_numpy(expected))


@pytest.mark.parametrize(("seed", "dim", "nnz", "name", "shape", "rows"), [
    (0, 16, 1, "fc.weight", (10, 30), (0, 300)),
    (9, 1000, 4, "fc.bias", (37,), (0, 37)),
    (2**40, 3, 3, "emb.weight", (500, 20), (4321, 7777)),  # middle row-block, nnz = dim
    (5, 2**31 - 1, 2, "huge_k", (50,), (10, 50)),  # Lemire at the largest allowed k
])
def test_sjlt_block_is_bit_identical_to_numpy(seed, dim, nnz, name, shape, rows):
    spec = Projection(dim=dim, seed=seed, kind="sjlt", nnz=nnz)
    cols, signs = sjlt_block(spec, name, shape, *rows)
    ref_cols, ref_signs = ref.sjlt_block(seed, dim, nnz, name, shape, *rows)
    assert cols.dtype == torch.int64 and signs.dtype == torch.float32
    assert cols.shape == signs.shape == (rows[1] - rows[0], nnz)
    assert torch.equal(cols, torch.from_numpy(ref_cols))
    assert torch.equal(signs, torch.from_numpy(ref_signs))
    assert int(cols.min()) >= 0 and int(cols.max()) < dim


def test_block_seed_matches_numpy_and_is_two_uint32():
    spec = Projection(dim=64, seed=3, kind="sjlt", nnz=2)
    keys = block_seed(spec, "fc.weight", (3, 4))
    assert keys == ref.block_seed(3, "sjlt", 64, 2, "fc.weight", (3, 4))
    assert all(0 <= key < 2**32 for key in keys)


@pytest.mark.parametrize("kind", ["identity", "rademacher", "sjlt", "kronecker"])
def test_projector_matches_numpy_reference(kind):
    spec = Projection(kind=kind) if kind == "identity" else Projection(
        dim=24, seed=11, kind=kind, nnz=3 if kind == "sjlt" else 1)
    grads = random_grads(0)
    got = make_projector(spec, canonical_layout(grads), dtype=torch.float64)(grads)
    expected = ref.project({n: g.numpy() for n, g in grads.items()}, 11, kind, spec.dim, spec.nnz)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("seed", "dim", "name", "shape"), [
    (0, 512, "fc.weight", (10, 30)),
    (2**63 - 1, 37, "conv.weight", (4, 3, 2, 5)),  # prime dim: 1 x 37
    (5, 64, "emb.weight", (700, 3)),
])
@pytest.mark.parametrize("split", ["shape", "square"])
def test_kronecker_factors_are_bit_identical_to_numpy(seed, dim, name, shape, split):
    spec = Projection(dim=dim, seed=seed, kind="kronecker", split=split)
    p_out, p_in = kronecker_factors(spec, name, shape)
    ref_out, ref_in = ref.kronecker_factors(seed, dim, name, shape, split)
    k_out, k_in = kronecker_split(dim, shape if split == "shape" else None)
    assert p_out.shape == (shape[0], k_out) and p_in.shape == (int(np.prod(shape[1:])), k_in)
    assert torch.equal(p_out, torch.from_numpy(ref_out))
    assert torch.equal(p_in, torch.from_numpy(ref_in))


@pytest.mark.parametrize(("dim", "shape", "split"), [
    (256, (10, 64), (8, 32)),     # the logistic-regression weight: 16 x 16 wasted 6 rows
    (256, (64, 784), (4, 64)),
    (1024, (1024, 1024), (32, 32)),
    (256, (3, 5), (16, 16)),      # fewer entries than k: the pair that wastes least
    (37, (4, 3, 2, 5), (1, 37)),  # prime k: only 1 x k or k x 1
])
def test_kronecker_split_follows_the_weight_shape(dim, shape, split):
    assert kronecker_split(dim, shape) == split == ref.kronecker_split(dim, shape)
    k_out, k_in = split
    assert k_out * k_in == dim


@settings(max_examples=60, deadline=None)
@given(dim=st.integers(1, 4096), d_out=st.integers(1, 300), d_in=st.integers(1, 300))
def test_kronecker_split_never_exceeds_a_side_when_a_pair_fits(dim, d_out, d_in):
    k_out, k_in = kronecker_split(dim, (d_out, d_in))
    assert k_out * k_in == dim and (k_out, k_in) == ref.kronecker_split(dim, (d_out, d_in))
    fits = [(a, dim // a) for a in range(1, dim + 1)
            if dim % a == 0 and a <= d_out and dim // a <= d_in]
    if fits:
        assert k_out <= d_out and k_in <= d_in


def test_the_square_split_stays_the_default_and_shape_is_recorded():
    old = {"kind": "kronecker", "dim": 256, "seed": 0, "nnz": 1}  # no "split" recorded
    assert Projection.from_dict(old) == Projection(dim=256, kind="kronecker")
    assert Projection(dim=256, kind="kronecker").to_dict() == old  # metadata unchanged
    shape = Projection(dim=256, kind="kronecker", split="shape")
    assert Projection.from_dict(shape.to_dict()) == shape
    assert shape != Projection.from_dict(old)  # scoring refuses to mix the two
    with pytest.raises(InvalidProjectionError, match="split must be one of 'square', 'shape'"):
        Projection(dim=8, kind="kronecker", split="auto")
    with pytest.raises(InvalidProjectionError, match="and 'square' for other kinds"):
        Projection(dim=8, split="shape")


@pytest.mark.parametrize(("dim", "split"), [
    (512, (16, 32)), (1024, (32, 32)), (1, (1, 1)), (37, (1, 37)), (12, (3, 4)),
    (2**31 - 1, (1, 2**31 - 1)),
])
def test_kronecker_split(dim, split):
    assert kronecker_split(dim) == split == ref.kronecker_split(dim)


def test_kronecker_is_the_explicit_kronecker_matrix():
    """Matrices go through P_out (x) P_in; vectors through a Rademacher block; blocks add."""
    spec = Projection(dim=12, seed=4, kind="kronecker")
    grads = random_grads(9)
    got = make_projector(spec, canonical_layout(grads), dtype=torch.float64)(grads)
    expected = torch.zeros(12, dtype=torch.float64)
    for name, g in grads.items():
        if g.ndim >= 2:
            p_out, p_in = kronecker_factors(spec, name, g.shape, dtype=torch.float64)
            expected += g.reshape(-1) @ torch.kron(p_out, p_in)  # [d_out * d_in, 3 * 4]
        else:  # the Rademacher rule keyed with kind="kronecker"
            block = ref.rademacher_block(4, 12, name, g.shape, 0, g.numel(), kind="kronecker")
            expected += g @ torch.from_numpy(block).double()
    torch.testing.assert_close(got, expected / np.sqrt(12), rtol=1e-12, atol=1e-12)


def test_kronecker_factors_reject_vectors_and_other_kinds():
    with pytest.raises(InvalidProjectionError, match="needs at least two dimensions"):
        kronecker_factors(Projection(dim=4, kind="kronecker"), "b", (5,))
    with pytest.raises(InvalidProjectionError, match="expected a Projection with kind='kronecker'"):
        kronecker_factors(Projection(dim=4), "w", (5, 3))
    project = make_projector(Projection(dim=4, kind="kronecker"), {"w": (5, 3), "b": (5,)})
    with pytest.raises(InvalidProjectionError, match="'b' is not projected side by side"):
        project.kronecker_factors("b", torch.float32, torch.device("cpu"))


def _block_digest() -> str:
    block = rademacher_block(Projection(dim=33, seed=42), "a.weight", (70, 9), 17, 600)
    cols, signs = sjlt_block(Projection(dim=33, seed=42, kind="sjlt", nnz=4), "a", (630,), 0, 630)
    parts = (block.numpy().tobytes(), cols.numpy().tobytes(), signs.numpy().tobytes())
    return hashlib.sha256(b"".join(parts)).hexdigest()


def test_blocks_have_a_golden_hash():
    """Guards the element rule itself: changing it silently invalidates every saved store."""
    assert _block_digest() == GOLDEN_DIGEST


def test_blocks_are_identical_in_another_process():
    script = textwrap.dedent(
        """
        import hashlib, torch
        torch.set_num_threads(1)
        from tracinfunc.projection import Projection, rademacher_block, sjlt_block
        block = rademacher_block(Projection(dim=33, seed=42), "a.weight", (70, 9), 17, 600)
        cols, signs = sjlt_block(Projection(dim=33, seed=42, kind="sjlt", nnz=4), "a", (630,),
                                 0, 630)
        parts = (block.numpy().tobytes(), cols.numpy().tobytes(), signs.numpy().tobytes())
        print(hashlib.sha256(b"".join(parts)).hexdigest())
        """
    )
    env = child_env(PYTHONHASHSEED="12345")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True, env=env, cwd=ROOT)
    assert result.stdout.strip() == _block_digest()


# --- the Projector: vmap, chunking, caching, order ------------------------------------------

@pytest.mark.parametrize(("kind", "nnz"), [("rademacher", 1), ("sjlt", 1), ("sjlt", 3),
                                           ("identity", 1), ("kronecker", 1)])
def test_vmap_and_chunk_size_do_not_change_the_output(kind, nnz):
    spec = Projection(kind=kind) if kind == "identity" else Projection(
        dim=20, seed=1, kind=kind, nnz=nnz)
    grads = random_grads(1, batch=(7,))
    project = make_projector(spec, canonical_layout(SHAPES), dtype=torch.float64)
    loop = torch.stack([project(example(grads, i)) for i in range(7)])
    assert loop.shape == (7, spec.output_dim(canonical_layout(SHAPES)))
    for chunk_size in (None, 1, 3, 7):
        batched = vmap(project, chunk_size=chunk_size)(grads)
        torch.testing.assert_close(batched, loop, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(vmap(project)({n: g[:2] for n, g in grads.items()}), loop[:2],
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("kind", "nnz"), [("rademacher", 1), ("sjlt", 2)])
def test_row_block_generation_gives_the_cached_result(kind, nnz, monkeypatch):
    spec = Projection(dim=9, seed=4, kind=kind, nnz=nnz)
    layout = canonical_layout(SHAPES)
    grads = random_grads(2, batch=(5,))
    cached = vmap(make_projector(spec, layout, dtype=torch.float64))(grads)
    monkeypatch.setattr(hashing_module, "CPU_SLICE_ELEMENTS", 7 * 9)  # several row-blocks
    for cache_bytes in (0, 24 * 9 * 8):  # nothing cached; some blocks cached, others streamed
        project = make_projector(spec, layout, dtype=torch.float64, cache_bytes=cache_bytes)
        torch.testing.assert_close(vmap(project, chunk_size=2)(grads), cached,
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["rademacher", "sjlt"])
def test_blocks_are_generated_once_per_dtype(kind, monkeypatch):
    calls = []
    for fn in ("rademacher_rows", "sjlt_rows"):
        original = getattr(hashing_module, fn)
        monkeypatch.setattr(hashing_module, fn,
                            lambda *a, _f=original, **kw: calls.append(1) or _f(*a, **kw))
    grads = random_grads(7, batch=(6,))
    project = make_projector(Projection(dim=5, kind=kind), canonical_layout(SHAPES))  # float32
    made_at_construction = len(calls)
    assert made_at_construction >= len(SHAPES)
    first = vmap(project, chunk_size=2)(grads)  # float64: generated lazily inside vmap
    again = vmap(project, chunk_size=4)(grads)
    assert len(calls) == 2 * made_at_construction and torch.equal(first, again)
    fresh = make_projector(Projection(dim=5, kind=kind), canonical_layout(SHAPES),
                           dtype=torch.float64)
    torch.testing.assert_close(first, vmap(fresh)(grads), rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_blocks_equal_cpu_blocks():
    spec, sparse = Projection(dim=300, seed=9), Projection(dim=300, seed=9, kind="sjlt", nnz=3)
    block = rademacher_block(spec, "w", (70000,), 5, 70000, device="cuda")
    assert torch.equal(block.cpu(), rademacher_block(spec, "w", (70000,), 5, 70000))
    cols, signs = sjlt_block(sparse, "w", (70000,), 0, 70000, device="cuda")
    ref_cols, ref_signs = sjlt_block(sparse, "w", (70000,), 0, 70000)
    assert torch.equal(cols.cpu(), ref_cols) and torch.equal(signs.cpu(), ref_signs)
    kron = Projection(dim=512, seed=9, kind="kronecker")
    for got, expected in zip(kronecker_factors(kron, "w", (300, 7, 3), device="cuda"),
                             kronecker_factors(kron, "w", (300, 7, 3)), strict=True):
        assert torch.equal(got.cpu(), expected)
    grads = random_grads(8, batch=(4,))
    project = make_projector(spec, canonical_layout(SHAPES), device="cuda", dtype=torch.float64)
    on_gpu = vmap(project)({n: g.cuda() for n, g in grads.items()})
    torch.testing.assert_close(on_gpu.cpu(), vmap(project)(grads), rtol=1e-12, atol=1e-12)


def test_float32_and_float64_gradients_project_in_their_dtype():
    grads = random_grads(3, dtype=torch.float32)
    project = make_projector(Projection(dim=6, seed=0), canonical_layout(SHAPES))
    out32 = project(grads)
    out64 = project({n: g.double() for n, g in grads.items()})
    assert out32.dtype == torch.float32 and out64.dtype == torch.float64
    torch.testing.assert_close(out32.double(), out64, rtol=1e-5, atol=1e-5)


def test_dict_order_does_not_change_the_output():
    grads = random_grads(4)
    reversed_grads = dict(reversed(list(grads.items())))
    reversed_shapes = dict(reversed(list(SHAPES.items())))
    assert canonical_layout(reversed_shapes) == canonical_layout(SHAPES)
    assert [name for name, _ in canonical_layout(grads)] == sorted(SHAPES)
    for kind in ("identity", "rademacher", "sjlt", "kronecker"):
        spec = Projection(kind=kind) if kind == "identity" else Projection(dim=8, kind=kind)
        first = make_projector(spec, canonical_layout(SHAPES), dtype=torch.float64)(grads)
        second = make_projector(spec, canonical_layout(reversed_shapes),
                                dtype=torch.float64)(reversed_grads)
        assert torch.equal(first, second)


def test_identity_is_the_sorted_concatenation():
    grads = random_grads(5)
    out = make_projector(Projection(kind="identity"), canonical_layout(grads))(grads)
    assert torch.equal(out, torch.cat([grads[name].reshape(-1) for name in sorted(grads)]))


def test_different_seeds_and_names_give_different_blocks():
    a = rademacher_block(Projection(dim=64, seed=0), "w", (50,), 0, 50)
    assert not torch.equal(a, rademacher_block(Projection(dim=64, seed=1), "w", (50,), 0, 50))
    assert not torch.equal(a, rademacher_block(Projection(dim=64, seed=0), "v", (50,), 0, 50))
    assert not torch.equal(a, rademacher_block(Projection(dim=64, seed=0), "w", (5, 10), 0, 50))
    cols, _ = sjlt_block(Projection(dim=64, kind="sjlt"), "w", (50,), 0, 50)
    assert not torch.equal(cols, sjlt_block(Projection(dim=64, kind="sjlt"), "v", (50,), 0, 50)[0])
    # Mean and balance: a block is not all one sign, and columns are spread out.
    assert abs(float(a.mean())) < 0.1 and len(set(cols.flatten().tolist())) > 25


# --- statistics and properties --------------------------------------------------------------

@pytest.mark.parametrize(("kind", "nnz"), [("rademacher", 1), ("sjlt", 1), ("sjlt", 4),
                                           ("kronecker", 1)])
def test_inner_products_are_unbiased(kind, nnz):
    """E[<Pg, Pg'>] = <g, g'> over seeds, within 4 standard errors (deterministic seeds)."""
    shapes = {"a": (40, 25), "b": (1000,), "c": (6, 2, 3, 3)}
    gen = torch.Generator().manual_seed(0)
    g = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
    h = {n: 0.6 * g[n] + torch.randn(s, generator=gen, dtype=torch.float64)
         for n, s in shapes.items()}
    exact = sum(float((g[n] * h[n]).sum()) for n in shapes)
    layout = canonical_layout(shapes)
    dots = []
    for seed in range(200):
        project = make_projector(Projection(dim=64, seed=seed, kind=kind, nnz=nnz), layout,
                                 dtype=torch.float64)
        dots.append(float(project(g) @ project(h)))
    dots = np.array(dots)
    standard_error = dots.std(ddof=1) / np.sqrt(len(dots))
    assert abs(dots.mean() - exact) < 4 * standard_error, (dots.mean(), exact, standard_error)
    assert standard_error < 0.1 * exact  # the test has power


@settings(max_examples=25, deadline=None)
@given(
    a=st.floats(-3, 3), b=st.floats(-3, 3), seed=st.integers(0, 2**63 - 1),
    kind=st.sampled_from(["rademacher", "sjlt", "identity", "kronecker"]),
    data_seed=st.integers(0, 1000),
)
def test_projection_is_linear(a, b, seed, kind, data_seed):
    spec = Projection(kind=kind) if kind == "identity" else Projection(
        dim=7, seed=seed, kind=kind, nnz=2 if kind == "sjlt" else 1)
    project = make_projector(spec, canonical_layout(SHAPES), dtype=torch.float64)
    g, h = random_grads(data_seed), random_grads(data_seed + 1)
    combined = project({n: a * g[n] + b * h[n] for n in g})
    torch.testing.assert_close(combined, a * project(g) + b * project(h), rtol=1e-10, atol=1e-10)


@settings(max_examples=30, deadline=None)
@given(numel=st.integers(1, 300), cut=st.floats(0, 1), dim=st.integers(1, 40),
       seed=st.integers(0, 2**63 - 1))
def test_row_blocks_compose_exactly(numel, cut, dim, seed):
    middle = int(cut * numel)
    spec = Projection(dim=dim, seed=seed)
    whole = rademacher_block(spec, "p", (numel,), 0, numel)
    parts = [rademacher_block(spec, "p", (numel,), 0, middle),
             rademacher_block(spec, "p", (numel,), middle, numel)]
    assert torch.equal(whole, torch.cat(parts))
    sparse = Projection(dim=dim, seed=seed, kind="sjlt", nnz=min(dim, 3))
    cols, signs = sjlt_block(sparse, "p", (numel,), 0, numel)
    tail_cols, tail_signs = sjlt_block(sparse, "p", (numel,), middle, numel)
    assert torch.equal(cols[middle:], tail_cols) and torch.equal(signs[middle:], tail_signs)


# --- the spec ---------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [
    Projection(dim=512), Projection(kind="identity"), Projection(dim=3, kind="identity"),
    Projection(dim=4096, seed=2**63 - 1, kind="sjlt", nnz=8),
])
def test_to_dict_round_trips_through_json(spec):
    data = json.loads(json.dumps(spec.to_dict()))
    assert Projection.from_dict(data) == spec and hash(Projection.from_dict(data)) == hash(spec)


def test_numpy_integers_are_normalised_to_int():
    spec = Projection(dim=np.int64(8), seed=np.int32(3))
    assert type(spec.dim) is int and type(spec.seed) is int and spec == Projection(dim=8, seed=3)


def test_output_dim():
    layout = canonical_layout(SHAPES)
    assert Projection(dim=10).output_dim(layout) == 10
    assert Projection(kind="identity").output_dim(layout) == 24 + 8 + 18 + 48


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"dim": 8, "kind": "gauss"}, "kind must be one of"),
    ({"dim": 0}, "dim must be a positive int"),
    ({"dim": -3}, "dim must be a positive int"),
    ({"dim": None}, "dim must be an int"),
    ({"dim": 2.0}, "dim must be an int"),
    ({"dim": True}, "dim must be an int"),
    ({"dim": 2**31}, "dim must be a positive int"),
    ({"kind": "identity", "dim": 0}, "dim must be a positive int"),
    ({"dim": 4, "kind": "sjlt", "nnz": 5}, r"nnz must be in \[1, dim=4\]"),
    ({"dim": 4, "kind": "sjlt", "nnz": 0}, r"nnz must be in \[1, dim=4\]"),
    ({"dim": 4, "nnz": 2}, "nnz is for kind='sjlt' only"),
    ({"kind": "identity", "nnz": 2}, "nnz is for kind='sjlt' only"),
    ({"dim": 4, "seed": -1}, r"seed must be in \[0, 2\*\*63\)"),
    ({"dim": 4, "seed": 2**63}, r"seed must be in \[0, 2\*\*63\)"),
    ({"dim": 4, "seed": "0"}, "seed must be an int"),
])
def test_invalid_specs_are_rejected(kwargs, match):
    with pytest.raises(InvalidProjectionError, match=match):
        Projection(**kwargs)


def test_invalid_projection_error_is_a_value_error():
    with pytest.raises(ValueError, match="Projection: kind"):
        Projection(kind="dense")


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(InvalidProjectionError, match=r"keys among .* got \['k'\]"):
        Projection.from_dict({"k": 5})
    with pytest.raises(InvalidProjectionError, match="expected a mapping"):
        Projection.from_dict([("dim", 5)])


def test_identity_with_the_wrong_dim_is_rejected():
    layout = canonical_layout(SHAPES)
    with pytest.raises(InvalidProjectionError, match="keeps all p=98 gradient entries but dim=5"):
        Projection(dim=5, kind="identity").output_dim(layout)
    with pytest.raises(InvalidProjectionError, match="dim=5"):
        make_projector(Projection(dim=5, kind="identity"), layout)
    assert make_projector(Projection(dim=98, kind="identity"), layout).k == 98


def test_gradients_that_do_not_match_the_layout_are_rejected():
    project = make_projector(Projection(dim=4), canonical_layout(SHAPES))
    grads = random_grads(6, dtype=torch.float32)
    missing = {n: g for n, g in grads.items() if n != "fc1.bias"}
    with pytest.raises(InvalidProjectionError, match="missing 'fc1.bias'"):
        project(missing)
    with pytest.raises(InvalidProjectionError, match="extra 'head.weight'"):
        project({**grads, "head.weight": torch.zeros(2)})
    with pytest.raises(InvalidProjectionError, match=r"'fc2.weight' has shape \[5, 3, 8\], "
                                                     r"expected \[3, 8\].*inside torch.func.vmap"):
        project({**grads, "fc2.weight": torch.zeros(5, 3, 8)})
    with pytest.raises(InvalidProjectionError, match="must be a floating-point tensor"):
        project({**grads, "fc1.bias": torch.zeros(8, dtype=torch.int64)})
    with pytest.raises(InvalidProjectionError, match="expected one example's gradients"):
        project([grads["fc1.bias"]])


def test_malformed_layouts_are_rejected():
    spec = Projection(dim=4)
    with pytest.raises(InvalidProjectionError, match="must be unique"):
        make_projector(spec, (("w", (2,)), ("w", (3,))))
    with pytest.raises(InvalidProjectionError, match="at least one element"):
        make_projector(spec, {"w": (0, 3)})
    with pytest.raises(InvalidProjectionError, match="sequence of non-negative ints"):
        canonical_layout({"w": (2, -1)})
    with pytest.raises(InvalidProjectionError, match="names must be str"):
        canonical_layout({0: (2,)})
    with pytest.raises(InvalidProjectionError, match="cache_bytes must be a non-negative int"):
        make_projector(spec, {"w": (2,)}, cache_bytes=-1)
    with pytest.raises(TypeError, match="must be a tracinfunc.Projection"):
        make_projector({"dim": 4}, {"w": (2,)})


def test_colliding_block_seeds_are_rejected(monkeypatch):
    monkeypatch.setattr(projection_module, "block_seed", lambda projection, name, shape: (1, 2))
    with pytest.raises(InvalidProjectionError, match="'a', 'b' got the same block seed"):
        make_projector(Projection(dim=4), {"a": (2,), "b": (3,)})


def test_block_functions_check_their_arguments():
    with pytest.raises(InvalidProjectionError, match="expected a Projection with kind='sjlt'"):
        sjlt_block(Projection(dim=4), "w", (3,), 0, 3)
    with pytest.raises(InvalidProjectionError, match=r"row_stop <= numel=3"):
        rademacher_block(Projection(dim=4), "w", (3,), 0, 4)


def test_compiled_generation_is_bit_identical_cached_and_streamed(monkeypatch):
    calls = []
    compiled = hashing_module.compiled_rademacher_rows()  # compiles on first call (seconds)

    def counting(*args):
        calls.append(args[2:4])
        return compiled(*args)

    monkeypatch.setattr(hashing_module, "compiled_rademacher_rows", lambda: counting)
    layout = canonical_layout({"w": (40, 30), "b": (30,)})
    grads = {"w": torch.randn(5, 40, 30), "b": torch.randn(5, 30)}
    spec = Projection(dim=64, seed=3)
    for cache_bytes in (2**30, 0):  # cached blocks, then blocks streamed on every call
        eager = make_projector(spec, layout, cache_bytes=cache_bytes)
        fast = make_projector(spec, layout, cache_bytes=cache_bytes, compile=True)
        assert torch.equal(vmap(fast)(grads), vmap(eager)(grads))
    assert calls  # the compiled function really generated the blocks
    with pytest.raises(InvalidProjectionError, match="compile must be True or False"):
        make_projector(spec, layout, compile="yes")


def test_build_store_with_compiled_projection_equals_eager(mlp_setup32):
    import tracinfunc as tif

    loss, ckpts, train, _ = mlp_setup32
    spec = Projection(dim=16, seed=0)
    eager = tif.build_store(loss, ckpts, train, projection=spec)
    fast = tif.build_store(
        loss, ckpts, train, projection=spec, options=tif.GradientOptions(compile_projection=True)
    )
    for c in range(len(ckpts)):
        assert torch.equal(fast.read_rows(c, 0, 40), eager.read_rows(c, 0, 40))


def test_a_projector_refuses_a_dim_no_machine_can_hold():
    """Issue 16: Projection(dim=2**31-1) was accepted until the process was OOM-killed."""
    layout = canonical_layout({"w": (3, 4)})
    for kind in ("rademacher", "sjlt", "kronecker"):
        with pytest.raises(InvalidProjectionError, match=r"dim=2147483647 would give every "
                                                         r"example a \[2147483647\] row"):
            make_projector(Projection(dim=2**31 - 1, kind=kind), layout)
    make_projector(Projection(dim=4096, kind="sjlt"), layout)  # ordinary sizes are fine


def test_a_streamed_dense_block_is_one_matmul_per_row_range_under_vmap(monkeypatch):
    # The first GPU run (2026-11-26): `slice @ rows` under vmap lowered to a bmm that read the
    # block once per example (a batched gemv, 70% of a build's GPU time). The lowering is a
    # property of the program, not of timing: no bmm may appear.
    from torch.profiler import profile

    from tracinfunc.projection.torch import make_projector

    monkeypatch.setattr(hashing_module, "CPU_SLICE_ELEMENTS", 16 * 100)  # 12 row ranges
    layout = {"w": (40, 30)}
    projector = make_projector(Projection(dim=16, seed=0), layout, cache_bytes=0)
    grads = torch.randn(8, 40, 30, dtype=torch.float64)
    with profile(record_shapes=True) as prof:
        rows = vmap(lambda g: projector({"w": g}))(grads)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::bmm" not in ops and "aten::mm" in ops
    expected = torch.stack([projector({"w": g}) for g in grads])
    torch.testing.assert_close(rows, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["rademacher", "sjlt", "kronecker", "identity"])
@pytest.mark.parametrize("cache_bytes", [2**30, 0])
def test_vmapped_projector_over_zero_examples_gives_zero_rows(kind, cache_bytes):
    """vmap over an empty batch: [0, k] rows (a reshape(-1) there is ambiguous and raised)."""
    shapes = {"w": (30, 41), "b": (30,)}
    layout = canonical_layout(shapes)
    spec = Projection(kind="identity") if kind == "identity" else Projection(
        dim=8, seed=3, kind=kind)
    project = make_projector(spec, layout, dtype=torch.float64, cache_bytes=cache_bytes)
    empty = {name: torch.zeros(0, *shape, dtype=torch.float64) for name, shape in shapes.items()}
    rows = vmap(project)(empty)
    assert rows.shape == (0, project.k) and rows.dtype == torch.float64
