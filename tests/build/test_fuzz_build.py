"""build_store fuzzed (issue 16): any batch structure ends in a store or a TracInFuncError."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracinfunc as tif
from tests.conftest import make_checkpoints, make_mlp

MODEL = make_mlp(dtype=torch.float32).eval()
LOSS = tif.loss_from_module(MODEL, F.cross_entropy)
CKPTS = make_checkpoints(MODEL)
PROJ = tif.Projection(dim=4)
DTYPES = [torch.float32, torch.float64, torch.int64, torch.complex64, torch.bool]


def _leaf(draw, b, dtype, width):
    shape = (b, width) if width else (b,)
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=torch.bool)
    if dtype == torch.complex64:
        return torch.zeros(shape, dtype=torch.complex64)
    values = torch.randn(shape, dtype=torch.float64)
    if b and draw(st.booleans()):
        values[0] = draw(st.sampled_from([math.nan, math.inf]))
    return values.to(dtype) if dtype.is_floating_point else values.abs().long() % 3


@st.composite
def batches(draw):
    """A list of batches whose sizes, dtypes, widths and structure may change batch to batch."""
    out = []
    for _ in range(draw(st.integers(0, 3))):
        b = draw(st.integers(0, 4))
        x = _leaf(draw, b, draw(st.sampled_from(DTYPES)), draw(st.sampled_from([6, 5, 0])))
        y_size = b if draw(st.booleans()) else b + 1  # sometimes ragged
        y = torch.zeros(y_size, dtype=draw(st.sampled_from([torch.int64, torch.float32])))
        structure = draw(st.sampled_from(["tuple", "dict", "tensor", "list"]))
        out.append({"tuple": (x, y), "dict": {"x": x, "y": y}, "tensor": x,
                    "list": [x, y]}[structure])
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=batches(), as_generator=st.booleans())
def test_build_store_ends_in_a_store_or_a_tracinfunc_error(data, as_generator):
    source = (batch for batch in data) if as_generator else data
    try:
        store = tif.build_store(LOSS, CKPTS, source, projection=PROJ, progress=False)
    except tif.TracInFuncError as error:
        message = str(error)
        assert message.split(":")[0] in {"build_store", "projected_grads"}, message
        return
    first_leaves = [b if isinstance(b, torch.Tensor) else
                    b["x"] if isinstance(b, dict) else b[0] for b in data]
    assert store.n_train == sum(leaf.shape[0] for leaf in first_leaves)
    assert bool(torch.isfinite(store.read_rows(0, 0, store.n_train)).all())


@pytest.mark.parametrize("bad", [
    [(torch.randn(2, 6), torch.zeros(2, dtype=torch.long)), {"x": torch.randn(2, 6)}],
])
def test_a_generator_whose_structure_changes_is_refused(bad):
    with pytest.raises(tif.TracInFuncError):
        tif.build_store(LOSS, CKPTS, (b for b in bad), projection=PROJ, progress=False)


@pytest.mark.parametrize("layout", ["transposed", "expanded", "strided"])
def test_non_contiguous_and_expanded_batches_give_the_contiguous_rows(layout):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 6, generator=g)
    y = torch.randint(0, 3, (5,), generator=g)
    odd = {"transposed": lambda: x.t().contiguous().t(),
           "expanded": lambda: x[:1].expand(5, 6),
           "strided": lambda: torch.randn(10, 6, generator=g)[::2]}[layout]()
    assert not odd.is_contiguous() or layout == "transposed"
    store = tif.build_store(LOSS, CKPTS, (odd, y), projection=PROJ, progress=False)
    plain = tif.build_store(LOSS, CKPTS, (odd.contiguous(), y), projection=PROJ,
                            progress=False)
    for c in range(store.n_ckpt):  # the same up to float32 rounding of strided kernels
        torch.testing.assert_close(store.read_rows(c, 0, 5), plain.read_rows(c, 0, 5),
                                   rtol=1e-5, atol=1e-6)
