"""``flatten_batch`` (the fast path for plain tuples and lists of tensors) gives exactly
``tree_flatten``'s leaves, and batches round-trip through it; merged calls tell structures
apart as before (issue 34: torch's pytree was ~15 ms of a 120 ms small-model build)."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_leaves

from tracinfunc.batches import batch_leaves, flatten_batch, unflatten_batch
from tracinfunc.build.merge import merged_calls

Pair = namedtuple("Pair", "x y")
x, y = torch.randn(4, 3), torch.arange(4)
BATCHES = {
    "tensor": x,
    "tuple": (x, y),
    "list": [x, y],
    "one-tuple": (x,),
    "dict": {"x": x, "y": y},
    "namedtuple": Pair(x, y),
    "nested": (x, {"y": y, "z": [y, x]}),
    "tuple-with-int": (x, 3),
    "parameter": (torch.nn.Parameter(x), y),
    "empty-tuple": (),
}


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_leaves_equal_tree_flattens_and_the_batch_round_trips(name):
    batch = BATCHES[name]
    leaves, spec = flatten_batch(batch)
    want = tree_leaves(batch)
    assert len(leaves) == len(want) and all(a is b for a, b in zip(leaves, want, strict=True))
    assert all(a is b for a, b in zip(batch_leaves(batch), want, strict=True))
    back = unflatten_batch(leaves, spec)
    assert type(back) is type(batch)
    assert tree_flatten(back)[1] == tree_flatten(batch)[1]


def test_merged_calls_keep_tuples_lists_and_dicts_apart():
    batches = [(x, y), (x, y), [x, y], {"x": x, "y": y}, (x, y)]
    calls = list(merged_calls(batches, limit=100))
    assert [(first, sizes) for _, first, sizes in calls] == [(0, (4, 4)), (2, (4,)), (3, (4,)),
                                                             (4, (4,))]
    assert type(calls[0][0]) is tuple and type(calls[1][0]) is list
    assert torch.equal(calls[0][0][0], torch.cat([x, x]))
