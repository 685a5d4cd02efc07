"""Data selection (LESS's aggregation, plain top-k) and top-k rows shown as training examples."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tracinfunc as tif


def _less_by_hand(scores, tasks):
    """Per task the mean over its validation rows, then the max over tasks, by loops."""
    n_test, n_train = scores.shape
    out = []
    for j in range(n_train):
        means = []
        for task in dict.fromkeys(tasks):
            rows = [i for i in range(n_test) if tasks[i] == task]
            means.append(sum(float(scores[i, j]) for i in rows) / len(rows))
        out.append(max(means))
    return out


def test_less_aggregation_is_max_over_tasks_of_the_mean_within_each():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(7, 20, generator=g, dtype=torch.float64)
    tasks = ["qa", "math", "qa", "code", "math", "qa", "code"]
    expected = _less_by_hand(scores, tasks)
    torch.testing.assert_close(tif.select.less_scores(scores, tasks=tasks),
                               torch.tensor(expected, dtype=torch.float64))
    # LESS's released code: contiguous equal tasks, reshape(n_train, n_tasks, -1).mean.max.
    blocks = ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    nine = torch.randn(9, 20, generator=g, dtype=torch.float64)
    reference = nine.T.reshape(20, 3, 3).mean(-1).max(-1).values
    torch.testing.assert_close(tif.select.less_scores(nine, tasks=blocks), reference)
    chosen = tif.select_training_data(scores, fraction=0.25, tasks=tasks)
    assert chosen.indices.tolist() == sorted(range(20), key=lambda j: -expected[j])[:5]
    torch.testing.assert_close(chosen.scores, torch.tensor(expected)[chosen.indices].double())
    assert chosen.n_train == 20


def test_a_task_with_one_strong_example_does_not_win_by_the_max_inside():
    # Row 0 of task "a" loves training example 0; its other rows hate it. LESS averages within
    # a task, so example 1 (liked by all of task "b") ranks first.
    scores = torch.tensor([[9.0, 0.0], [-9.0, 0.0], [-9.0, 0.0], [0.0, 1.0]])
    chosen = tif.select_training_data(scores, k=1, tasks=["a", "a", "a", "b"])
    assert chosen.indices.tolist() == [1]


def test_plain_top_k_and_fraction_of_a_vector():
    scores = np.array([0.1, 0.5, -2.0, 0.5, 3.0], dtype=np.float32)
    assert tif.select_training_data(scores, k=3).indices.tolist() == [4, 1, 3]  # ties: row order
    assert tif.select_training_data(scores, fraction=0.5).indices.tolist() == [4, 1]
    assert tif.select_training_data(scores, fraction=0.01).indices.tolist() == [4]  # at least 1
    one_task = torch.tensor([[1.0, 2.0, 0.0], [3.0, -1.0, 0.0]])
    assert tif.select_training_data(one_task, k=2).indices.tolist() == [0, 1]  # means 2, 0.5


@pytest.mark.parametrize(("kwargs", "match"), [
    ({}, "give k .* or fraction"),
    ({"k": 2, "fraction": 0.1}, "exactly one"),
    ({"k": 0}, r"k must be an int in \[1, 5\]"),
    ({"k": 6}, r"k must be an int in \[1, 5\]"),
    ({"fraction": 1.5}, r"fraction must be in \(0, 1\]"),
    ({"fraction": 0.5, "tasks": ["a"] * 5}, "tasks= groups the rows of a score matrix"),
])
def test_selection_errors(kwargs, match):
    with pytest.raises(tif.errors.InvalidArgumentError, match=match):
        tif.select_training_data(torch.arange(5.0), **kwargs)


def test_selection_refuses_nan_and_misshaped_tasks():
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match=r"scores must be finite .* NaN at training rows 1"):
        tif.select_training_data(torch.tensor([1.0, float("nan")]), k=1)
    with pytest.raises(tif.errors.InvalidArgumentError, match="one label per validation row"):
        tif.select.less_scores(torch.zeros(3, 4), tasks=["a", "b"])
    with pytest.raises(tif.errors.InvalidArgumentError, match=r"float \[n_train\] or"):
        tif.select_training_data(torch.zeros(2, 2, 2), k=1)


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids)


def test_top_examples_map_rows_to_items_and_show_text(tmp_path):
    texts = ["alpha", "beta", "gamma", "delta"]
    top = tif.TopExamples(torch.tensor([[0.9, 0.5], [0.7, -0.1]]),
                          torch.tensor([[2, 0], [3, 1]]), texts, queries=["q0", "q1"])
    assert top[0] == [(pytest.approx(0.9), 2, "gamma"), (pytest.approx(0.5), 0, "alpha")]
    shown = str(top)
    assert "test 0: q0" in shown and "[2] gamma" in shown and "[1] beta" in shown
    saved = json.loads(top.save(tmp_path / "top.json").read_text())
    assert [(r["test_index"], r["rank"], r["train_index"], r["text"]) for r in saved] == [
        (0, 0, 2, "gamma"), (0, 1, 0, "alpha"), (1, 0, 3, "delta"), (1, 1, 1, "beta")]
    with pytest.raises(tif.errors.OutputPathError, match="exists"):
        top.save(tmp_path / "top.json")
    top.save(tmp_path / "top.csv")
    assert (tmp_path / "top.csv").read_text().splitlines()[1].startswith("0,q0,0,2,")
    # A batch dict of token ids, decoded without its padding.
    batch = {"input_ids": torch.tensor([[1, 2, 0], [3, 3, 3]]),
             "attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}
    tokens = tif.TopExamples(torch.tensor([1.0, 0.5]), torch.tensor([1, 0]), batch,
                             tokenizer=_Tokenizer())
    assert [tokens.as_text(item) for _, _, item in tokens[0]] == ["ccc", "ab"]
    # A selection's rows as items.
    chosen = tif.select_training_data(torch.tensor([0.0, 2.0, 1.0, -1.0]), k=2)
    assert [item for _, _, item in chosen.examples(texts)[0]] == ["beta", "gamma"]


def test_top_examples_errors():
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match=r"rows in \[0, 2\), got rows beyond the dataset.s 2 "
                       r"items at \[test row, rank\] \[0, 0\] \(e.g. 5\)"):
        tif.TopExamples(torch.ones(1, 1), torch.tensor([[5]]), ["a", "b"])
    with pytest.raises(tif.errors.InvalidArgumentError, match="1 queries for 2 rows"):
        tif.TopExamples(torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), ["a"],
                        queries=["q"])
    with pytest.raises(tif.errors.OutputPathError, match=r"must end in .json or .csv"):
        tif.TopExamples(torch.ones(1), torch.zeros(1, dtype=torch.long), ["a"]).save("x.txt")


# Hostile inputs (issue 31, findings 7-9; HOSTILE.md class 4). Each failed before its fix.

_LABELS = [0, 1, 0, 1, 2, 2]


def _label_spellings():
    import importlib.util
    spellings = {"list": _LABELS, "tuple": tuple(_LABELS), "ndarray": np.array(_LABELS),
                 "ndarray int32": np.array(_LABELS, np.int32), "tensor": torch.tensor(_LABELS),
                 "whole floats": [float(t) for t in _LABELS],
                 "float tensor": torch.tensor(_LABELS, dtype=torch.float32),
                 "numpy scalars": [np.int64(t) for t in _LABELS],
                 "0-d tensors": list(torch.tensor(_LABELS))}
    if importlib.util.find_spec("jax") is not None:
        import jax.numpy as jnp
        spellings["jax"] = jnp.array(_LABELS)
        spellings["jax scalars"] = [jnp.int32(t) for t in _LABELS]
    return spellings


@pytest.mark.parametrize("spelling", sorted(_label_spellings()))
def test_every_spelling_of_the_labels_groups_the_same_rows(spelling):
    # Before: tensor labels hash by identity, so each row was its own task (max |diff| ~2).
    scores = torch.randn(6, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tasks = _label_spellings()[spelling]
    expected = torch.tensor(_less_by_hand(scores, _LABELS), dtype=torch.float64)
    torch.testing.assert_close(tif.select.less_scores(scores, tasks=tasks), expected,
                               rtol=0, atol=0)
    chosen = tif.select_training_data(scores, k=3, tasks=tasks)
    assert chosen.indices.tolist() == torch.sort(expected, descending=True,
                                                 stable=True).indices[:3].tolist()


def test_string_labels_from_numpy_equal_the_list():
    scores = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    labels = ["qa", "math", "qa", "code"]
    assert torch.equal(tif.select.less_scores(scores, tasks=np.array(labels)),
                       tif.select.less_scores(scores, tasks=labels))


@pytest.mark.parametrize(("tasks", "error", "match"), [
    ([[0], [1], [0]], tif.errors.InvalidTypeError, r"row 0 is \[0\] \(list\)"),  # was unhashable
    ([0, 0.5, 1], tif.errors.InvalidTypeError, "row 1 is 0.5, a float that is not a whole"),
    ([0, None, 1], tif.errors.InvalidTypeError, r"row 1 is None \(NoneType\)"),
    ([1, 1.0, True], tif.errors.InvalidTypeError, r"row 2 is True \(bool\)"),  # was one task
    (torch.tensor([[0], [1], [0]]), tif.errors.InvalidArgumentError, "got a 2-D array"),
    (np.array(1), tif.errors.InvalidArgumentError, "got a 0-D array"),  # was len() of unsized
    (np.array([True, False, True]), tif.errors.InvalidTypeError, "got booleans"),
    (torch.tensor([0.0, float("nan"), 1.0]), tif.errors.InvalidTypeError, "row 1 is nan"),
    ("abc", tif.errors.InvalidTypeError, "got str 'abc'"),
    ((t for t in "abc"), tif.errors.InvalidTypeError, "got generator"),
    ({0, 1, 2}, tif.errors.InvalidTypeError, "got set"),
    ([0, 1], tif.errors.InvalidArgumentError, r"one label per validation row \(3 rows\), got 2"),
])
def test_labels_of_the_wrong_kind_are_refused_saying_what_was_expected(tasks, error, match):
    with pytest.raises(error, match=match) as raised:
        tif.select.less_scores(torch.zeros(3, 4), tasks=tasks)
    assert "less_scores: tasks must" in str(raised.value)


@pytest.mark.parametrize(("where", "values", "match"), [
    ([(0, 3), (2, 3)], [np.inf, -np.inf], r"2 \+inf/-inf at \[test row, training row\] "
                                         r"\[0, 3\], \[2, 3\]"),  # was: NaN mean, ranked first
    ([(1, 0)], [np.nan], r"1 NaN at \[test row, training row\] \[1, 0\]"),
    ([(0, 7)], [np.inf], r"1 \+inf at"),
])
def test_non_finite_scores_are_refused_by_position(where, values, match):
    scores = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    for (row, col), value in zip(where, values, strict=True):
        scores[row, col] = value
    with pytest.raises(tif.errors.InvalidArgumentError, match="scores must be finite.*" + match):
        tif.select_training_data(scores, k=2, tasks=[0, 0, 1, 1])
    with pytest.raises(tif.errors.InvalidArgumentError, match=match):
        tif.select.less_scores(scores)
    with pytest.raises(tif.errors.InvalidArgumentError, match="at training rows 1"):
        tif.select_training_data(torch.tensor([0.0, -np.inf]), k=1)


def test_float32_means_do_not_overflow_into_inf():
    big = torch.finfo(torch.float32).max
    scores = torch.tensor([[big, 1.0], [big, 2.0]])
    less = tif.select.less_scores(scores)
    assert less.dtype == torch.float32 and torch.isfinite(less).all() and less[0] == big
    assert tif.select_training_data(scores, k=1).indices.tolist() == [0]


@pytest.mark.parametrize("k", [np.int64(2), np.int32(2), torch.tensor(2)])
def test_numpy_and_torch_integers_count_as_k(k):
    chosen = tif.select_training_data(torch.tensor([0.0, 3.0, 1.0]), k=k)
    assert chosen.indices.tolist() == [1, 2]
    assert tif.select_training_data(torch.tensor([0.0, 3.0, 1.0]),
                                    fraction=np.float32(0.5)).indices.tolist() == [1]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"k": 2.0}, r"k must be an int in \[1, 3\].*got 2.0"),
    ({"k": True}, r"got True"),
    ({"k": np.float64(1.0)}, r"got np.float64\(1.0\)"),
    ({"k": 4}, r"got 4; pass at most n_train=3"),
    ({"fraction": float("nan")}, r"fraction must be in \(0, 1\], got nan"),
])
def test_k_and_fraction_of_the_wrong_kind_are_refused(kwargs, match):
    with pytest.raises(tif.errors.InvalidArgumentError, match=match):
        tif.select_training_data(torch.tensor([0.0, 3.0, 1.0]), **kwargs)


def test_one_row_and_one_task_select_that_row():
    assert tif.select_training_data(torch.ones(1), fraction=0.05).indices.tolist() == [0]
    assert tif.select_training_data(torch.ones(1, 1), k=1, tasks=["a"]).indices.tolist() == [0]
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match=r"with rows, got torch.float32 \[0\]"):
        tif.select_training_data(torch.zeros(0), k=1)


@pytest.mark.parametrize(("indices", "error", "match"), [
    (torch.tensor([[1.7, 0.2]]), tif.errors.InvalidTypeError, "got torch.float32; floats would"),
    ([[1.7, 0.2]], tif.errors.InvalidTypeError, "must be integer training rows"),
    (np.array([[1.0, 0.0]]), tif.errors.InvalidTypeError, "got torch.float64"),
    (torch.tensor([[True, False]]), tif.errors.InvalidTypeError, "got torch.bool"),
    (torch.tensor([[-1, 0]]), tif.errors.InvalidArgumentError,
     r"got negative rows at \[test row, rank\] \[0, 0\] \(e.g. -1\)"),
    (torch.tensor([[1, 1]]), tif.errors.InvalidArgumentError, "must not repeat a training row"),
    (torch.tensor([[1], [0]]), tif.errors.InvalidArgumentError, r"got \[1, 2\] and \[2, 1\]"),
])
def test_top_examples_refuses_indices_it_would_truncate_or_misread(indices, error, match):
    with pytest.raises(error, match="TopExamples: .*" + match):
        tif.TopExamples(torch.tensor([[1.0, 0.5]]), indices, ["a", "b", "c"])


def test_top_examples_refuses_nan_values_and_takes_integer_arrays():
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match=r"NaN at \[test row, rank\] \[0, 1\]"):
        tif.TopExamples(torch.tensor([[1.0, float("nan")]]), torch.tensor([[2, 0]]), "abc")
    for indices in (np.array([[2, 0]]), [[2, 0]], torch.tensor([[2, 0]], dtype=torch.uint8)):
        top = tif.TopExamples(np.array([[1.0, -np.inf]]), indices, ["a", "b", "c"])
        assert top[0] == [(1.0, 2, "c"), (float("-inf"), 0, "a")]
        assert top.indices.dtype == torch.int64
    empty = tif.TopExamples(torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.long), [])
    assert len(empty) == 0 and empty.records() == []


def test_a_selection_shown_with_another_dataset_is_refused():
    chosen = tif.select_training_data(torch.tensor([0.0, 2.0, 1.0]), k=2)
    assert [item for _, _, item in chosen.examples(["a", "b", "c"])[0]] == ["b", "c"]
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match=r"ranked 3 training rows but the dataset has 5 items"):
        chosen.examples(["a", "b", "c", "d", "e"])  # was: items of other data, silently
    with pytest.raises(tif.errors.InvalidArgumentError, match="dataset has 4 items"):
        chosen.examples({"text": ["a", "b", "c", "d"]})
