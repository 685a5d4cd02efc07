"""Automatic chunk_size from a memory budget."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_data, make_mlp


def test_chunk_size_is_the_budget_over_the_per_example_cost():
    assert tif.grads.chunk_size_for_budget(2**30, 10_000_000) == 2**30 // (3 * 4 * 10_000_000)
    assert tif.grads.chunk_size_for_budget(1200, 100, itemsize=4, copies=3) == 1
    assert tif.grads.chunk_size_for_budget(1200, 100, itemsize=2, copies=1) == 6


def test_a_budget_below_one_example_is_reported():
    with pytest.raises(tif.errors.MemoryBudgetError, match=r"memory_budget=100 bytes cannot hold"):
        tif.grads.chunk_size_for_budget(100, 1000)
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    params = dict(model.named_parameters())
    with pytest.raises(tif.errors.MemoryBudgetError, match="projected_grads: memory_budget=64"):
        tif.projected_grads(
            loss, tif.Projection(dim=4), options=tif.GradientOptions(memory_budget=64)
        )(params, make_data(3))


def test_budget_options_are_validated():
    loss = tif.loss_from_module(make_mlp().eval(), F.cross_entropy)
    with pytest.raises(ValueError, match="chunk_size or memory_budget, not both"):
        tif.per_sample_grads(loss, options=tif.GradientOptions(chunk_size=2, memory_budget=2**20))
    with pytest.raises(ValueError, match="memory_budget must be a positive number of bytes"):
        tif.per_sample_grads(loss, options=tif.GradientOptions(memory_budget=-1))


@pytest.mark.parametrize("budget", [8 * 83 * 3, 2**20])  # 1-example chunks (p=83), one chunk
def test_budget_never_changes_results(budget):
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    params = {k: v.detach() for k, v in model.named_parameters()}
    batch = make_data(7)
    projection = tif.Projection(dim=6)
    whole = tif.projected_grads(loss, projection)(params, batch)
    budgeted = tif.projected_grads(
        loss, projection, options=tif.GradientOptions(memory_budget=budget)
    )(params, batch)
    torch.testing.assert_close(budgeted, whole, rtol=0, atol=1e-12)


def test_memory_budget_bounds_peak_memory():
    """1M parameters, 256 examples: 1 GB of per-example gradients unbounded (the chunk_size
    test in test_grads.py measures that); with a 128 MiB budget the call adds about that."""
    script = textwrap.dedent(
        """
        import resource, sys, torch
        import tracinfunc as tif
        def peak():  # MiB, this process's own: ru_maxrss also holds pytest's RSS at fork
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) // 1024
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        torch.manual_seed(0)
        w = {"w": torch.randn(1000, 1000) * 0.01}
        x = torch.randn(256, 1000)
        def loss(params, x):
            return (params["w"] @ x).tanh().sum()
        fn = tif.projected_grads(loss, tif.Projection(dim=4, seed=0),
                            options=tif.GradientOptions(memory_budget=128 * 2**20))
        fn(w, x[:1])  # fixed costs: projection blocks, vmap set-up
        before = peak()
        assert fn(w, x).shape == (256, 4)
        print(peak() - before)
        """
    )

    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True)
    growth = int(result.stdout.strip().splitlines()[-1])
    assert growth < 128 + 64, growth  # the budget, plus slack for the allocator
