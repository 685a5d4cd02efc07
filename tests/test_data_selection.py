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
    torch.testing.assert_close(tif.data_selection.less_scores(scores, tasks=tasks),
                               torch.tensor(expected, dtype=torch.float64))
    # LESS's released code: contiguous equal tasks, reshape(n_train, n_tasks, -1).mean.max.
    blocks = ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    nine = torch.randn(9, 20, generator=g, dtype=torch.float64)
    reference = nine.T.reshape(20, 3, 3).mean(-1).max(-1).values
    torch.testing.assert_close(tif.data_selection.less_scores(nine, tasks=blocks), reference)
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
    with pytest.raises(tif.errors.InvalidArgumentError, match="scores hold NaN"):
        tif.select_training_data(torch.tensor([1.0, float("nan")]), k=1)
    with pytest.raises(tif.errors.InvalidArgumentError, match="one label per validation row"):
        tif.data_selection.less_scores(torch.zeros(3, 4), tasks=["a", "b"])
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
    with pytest.raises(tif.errors.InvalidArgumentError, match="dataset has 2 items"):
        tif.TopExamples(torch.ones(1, 1), torch.tensor([[5]]), ["a", "b"])
    with pytest.raises(tif.errors.InvalidArgumentError, match="1 queries for 2 rows"):
        tif.TopExamples(torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), ["a"],
                        queries=["q"])
    with pytest.raises(tif.errors.OutputPathError, match=r"must end in .json or .csv"):
        tif.TopExamples(torch.ones(1), torch.zeros(1, dtype=torch.long), ["a"]).save("x.txt")
