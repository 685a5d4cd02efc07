"""Several GPUs, proven on the CPU (issue 23, items 5 and 6): DLPack export under the
tensor's own GPU, and torchrun ranks pinned to their LOCAL_RANK before NCCL starts."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from tracinfunc import distributed, interop


@pytest.fixture
def device_guards(monkeypatch):
    """torch.cuda.device faked: records which device was made current, and when."""
    log = []

    @contextlib.contextmanager
    def device(which):
        log.append(("enter", torch.device(which)))
        yield
        log.append(("exit", torch.device(which)))

    monkeypatch.setattr(torch.cuda, "device", device)
    return log


def test_export_from_a_gpu_makes_that_gpu_current(device_guards):
    on_gpu_1 = types.SimpleNamespace(device=torch.device("cuda", 1))
    with interop._exporting_from(on_gpu_1):
        device_guards.append(("export", None))
    assert device_guards == [("enter", torch.device("cuda", 1)), ("export", None),
                             ("exit", torch.device("cuda", 1))]
    with interop._exporting_from(torch.zeros(2)):  # CPU: nothing to switch
        pass
    assert len(device_guards) == 3


def test_cupy_export_runs_under_the_guard(monkeypatch):
    inside = []

    @contextlib.contextmanager
    def guard(tensor):
        inside.append(True)
        yield
        inside.append(False)

    fake_cupy = types.SimpleNamespace(from_dlpack=lambda t: ("cupy", list(inside)))
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake_cupy)
    monkeypatch.setattr(interop, "_exporting_from", guard)
    kind, state = interop.to_framework(torch.arange(3.0), "cupy")
    assert kind == "cupy" and state == [True]  # from_dlpack ran inside the guard


def test_torchrun_on_gpus_sets_the_local_device_before_nccl(monkeypatch):
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set", index)))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend: calls.append(("init", backend)))
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    assert distributed.init_from_environment()
    assert calls == [("set", 3), ("init", "nccl")]
