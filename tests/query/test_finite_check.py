"""The test-row finiteness check of every query (one ``aminmax`` pass, no bool mask) refuses
exactly what ``isfinite(rows).all()`` refuses."""

from __future__ import annotations

import itertools

import pytest
import torch

from tracinfunc.query.checks import _all_finite

BAD = (float("nan"), float("inf"), -float("inf"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32,
                                   torch.float64])
def test_every_mix_of_nan_and_infinities_is_refused(dtype):
    rows = torch.randn(2, 7, 5).to(dtype)
    assert _all_finite(rows)
    for count in (1, 2, 3):
        for values in itertools.combinations(BAD, count):  # +inf with -inf, NaN with both
            poisoned = rows.clone()
            for i, value in enumerate(values):
                poisoned[i % 2, 3 + i, i] = value
            assert not _all_finite(poisoned)
            assert _all_finite(poisoned) == bool(torch.isfinite(poisoned).all())


def test_extremes_and_empty_rows_are_finite():
    info = torch.finfo(torch.float32)
    rows = torch.tensor([[[info.max, -info.max, info.tiny, -0.0, 1e-45]]])
    assert _all_finite(rows)
    assert _all_finite(torch.empty(2, 0, 5))  # no test rows: nothing non-finite
