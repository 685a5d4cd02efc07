"""The suite's CPU pinning (tests/conftest.py): a test not marked ``cuda`` sees no GPU, on a
machine with one, in this process and in the processes it starts; a machine without one is
left exactly as it is. Driven on the CPU by telling ``cpu_only`` the machine has a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, child_env, cpu_only


def test_a_machine_with_cuda_is_hidden_from_the_test_and_its_children():
    real = torch.cuda.is_available
    with pytest.MonkeyPatch.context() as monkeypatch, \
            cpu_only(monkeypatch, torch_cuda=True, jax_accelerated=False):
        assert torch.cuda.is_available() is False
        env = child_env()
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["JAX_PLATFORMS"] == "cpu"
        out = subprocess.run(
            [sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'] == '')"],
            env=env, capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "True"
    assert torch.cuda.is_available is real  # restored


def test_jax_arrays_land_on_the_cpu_device():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    before = jax.config.jax_default_device
    with pytest.MonkeyPatch.context() as monkeypatch, \
            cpu_only(monkeypatch, torch_cuda=False, jax_accelerated=True):
        array = jnp.ones(3) + 1
        assert {d.platform for d in array.devices()} == {"cpu"}
        assert jax.config.jax_default_device == "cpu"
    assert jax.config.jax_default_device == before


def test_a_machine_without_a_gpu_is_left_as_it_is(monkeypatch):
    before = (torch.cuda.is_available, os.environ.get("CUDA_VISIBLE_DEVICES"),
              os.environ.get("JAX_PLATFORMS"))
    with cpu_only(monkeypatch, torch_cuda=False, jax_accelerated=False):
        assert (torch.cuda.is_available, os.environ.get("CUDA_VISIBLE_DEVICES"),
                os.environ.get("JAX_PLATFORMS")) == before


def test_child_env_keeps_the_callers_python_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/site")
    path = child_env(EXTRA="1")["PYTHONPATH"].split(os.pathsep)
    assert path[0] == str(REPO)
    assert path[1] == "/somewhere/site" and child_env(EXTRA="1")["EXTRA"] == "1"
