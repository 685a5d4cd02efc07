"""atk2 outside pass, surface 3: LESS selection and TopExamples (classes 4 and 5).

Failing tests (found by the pass) first; tests marked HELD guard attacks that held."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tracinfunc as tif
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError

S = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
TASKS = [0, 0, 1, 1, 2, 2]


def test_tasks_as_a_bfloat16_tensor_of_whole_numbers_select_like_ints():
    """language-models.md: tasks may be a 1-D torch array of ints (whole floats count as
    ints); every spelling selects the same rows. A bfloat16 tensor raises a raw
    'TypeError: Got unsupported ScalarType BFloat16'."""
    want = tif.select_training_data(S, k=3, tasks=TASKS).indices.tolist()
    got = tif.select_training_data(S, k=3, tasks=torch.tensor(TASKS).bfloat16())
    assert got.indices.tolist() == want


def test_topexamples_refuses_a_python_bool_inside_a_list_of_indices():
    """language-models.md: bool indices are refused, never truncated to other rows. A bool
    tensor is refused, but [[True, 2, 3]] is accepted and shown as row 1."""
    v = torch.tensor([[3.0, 2.0, 1.0]])
    with pytest.raises(InvalidTypeError):
        tif.select.TopExamples(v, [[True, 2, 3]], [f"ex{j}" for j in range(10)])


def test_topexamples_save_json_with_infinite_scores_is_valid_json(tmp_path):
    """+-inf values are accepted and shown; saved 'as JSON' they are written as the bare
    tokens Infinity / -Infinity, which are not JSON (RFC 8259): strict parsers (JavaScript,
    jq, Go) refuse the file. Expected: a valid JSON document (e.g. null or a string)."""
    t = tif.select.TopExamples(torch.tensor([[float("inf"), 2.0, float("-inf")]]),
                               torch.tensor([[1, 2, 3]]), [f"ex{j}" for j in range(10)])
    t.save(tmp_path / "t.json")

    def strict(c):
        raise ValueError(f"not JSON: {c}")

    json.loads((tmp_path / "t.json").read_text(), parse_constant=strict)


# ---------------------------------------------------------------- HELD (regression guards)


@pytest.mark.parametrize("spelling", ["tensor", "numpy", "floats", "np_float16", "0d_tensors",
                                      "np_int_scalars", "strs"])
def test_held_every_spelling_of_tasks_selects_the_same_rows(spelling):
    want = tif.select_training_data(S, k=3, tasks=TASKS).indices.tolist()
    tasks = {
        "tensor": torch.tensor(TASKS), "numpy": np.array(TASKS),
        "floats": [float(t) for t in TASKS], "np_float16": np.array(TASKS, dtype=np.float16),
        "0d_tensors": [torch.tensor(t) for t in TASKS],
        "np_int_scalars": [np.int64(t) for t in TASKS], "strs": [str(t) for t in TASKS],
    }[spelling]
    assert tif.select_training_data(S, k=3, tasks=tasks).indices.tolist() == want


@pytest.mark.parametrize("bad", [[0, 0, None, 1, 2, 2], [0, 0, float("nan"), 1, 2, 2],
                                 [0, 0, float("inf"), 1, 2, 2], [0, 0, 1], "aabbcc"])
def test_held_bad_tasks_are_refused(bad):
    with pytest.raises((InvalidArgumentError, InvalidTypeError)):
        tif.select_training_data(S, k=3, tasks=bad)


@pytest.mark.parametrize("vals", [[float("nan")], [float("inf")], [float("-inf")],
                                  [float("inf"), float("-inf")]])
def test_held_non_finite_scores_are_refused(vals):
    s2 = S.clone()
    for j, v in enumerate(vals):
        s2[j, 4] = v
    with pytest.raises(InvalidArgumentError, match=r"\[0, 4\]"):
        tif.select_training_data(s2, k=3, tasks=TASKS)


def test_held_float32_mean_that_would_overflow_is_accumulated_wider():
    s4 = torch.full((2, 5), 3.4e38)
    assert torch.isfinite(tif.select.less_scores(s4)).all()


@pytest.mark.parametrize("idx", [[[-1, 2, 3]], [[10, 2, 3]], [[1, 1, 3]], [[1.0, 2.0, 3.0]]])
def test_held_topexamples_bad_indices_are_refused(idx):
    with pytest.raises((InvalidArgumentError, InvalidTypeError)):
        tif.select.TopExamples(torch.tensor([[3.0, 2.0, 1.0]]), idx, [str(j) for j in range(10)])
