"""Helpers shared by the benchmarks and their child processes (torch, numpy and stdlib only).

Each timed method runs in a fresh child process, so its peak RSS (``VmHWM``) is its own;
children print one JSON line (the last line of stdout) that the parent collects. Children warm
up on a tiny slice of the problem with the same code first (one-time costs of torch.func,
thread pools and lazy imports are not what is compared), then time the real run.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time

import numpy as np
import torch
from torch import nn


def peak_rss_mb() -> float:
    """This process's own peak resident set size so far, in MiB: ``VmHWM``, which exec starts
    afresh. Linux's ``ru_maxrss`` of a child started by ``subprocess`` also holds the RSS its
    parent had when it forked (an empty child of an 800 MiB parent reports 811 MiB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # no /proc: KiB


def current_rss_mb() -> float:
    """This process's resident set size now, in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def tiny(problem: dict) -> dict:
    """The first two training batches and one test batch: a warm-up run of the same code."""
    batch = problem["batch"]
    (x_train, y_train), (x_test, y_test) = problem["train"], problem["test"]
    return {**problem, "train": (x_train[:2 * batch], y_train[:2 * batch]),
            "test": (x_test[:batch], y_test[:batch])}


def emit(result: dict) -> None:
    """The child's result: one JSON line, last on stdout."""
    print(json.dumps(result), flush=True)


def run_child(cmd: list[str], *, env: dict | None = None, timeout: float = 3600) -> dict:
    """Run a child benchmark process and return its JSON result (raises with its stderr)."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, Python {platform.python_version()}")


class Timer:
    """Wall seconds (``seconds``) and this process's CPU seconds (``cpu``) of a block."""

    def __enter__(self):
        self.start, self.start_cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        self.cpu = time.process_time() - self.start_cpu


def linear_model(d_in: int, n_classes: int) -> nn.Module:
    return nn.Linear(d_in, n_classes)


def synthetic(n_train: int, n_test: int, d_in: int = 784, n_classes: int = 10, seed: int = 0):
    """MNIST-shaped data from a random linear teacher with label noise (fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_test, d_in, generator=g)
    teacher = torch.randn(d_in, n_classes, generator=g) / d_in**0.5
    logits = x @ teacher * 3 + torch.randn(n_train + n_test, n_classes, generator=g)
    y = logits.argmax(dim=1)
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def digits(n_test: int = 360, seed: int = 0):
    """sklearn digits (8x8 images, 10 classes), standardised, a fixed train/test split."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def train_checkpoints(model: nn.Module, x, y, *, epochs=2, lr=0.1, batch=100, seed=0):
    """Plain SGD; a state-dict snapshot after each epoch. Returns ``([state], [lr])``."""
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    states = []
    for _ in range(epochs):
        for i in range(0, len(y), batch):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[i:i + batch]), y[i:i + batch]).backward()
            opt.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states, [lr] * epochs


def agreement(scores: np.ndarray, exact: np.ndarray, top: int = 10) -> dict:
    """How well ``scores`` ``[n_test, n_train]`` agree with exact TracIn.

    pearson: correlation of all entries; spearman: mean over test rows of the rank
    correlation; top10: mean overlap of the ``top`` proponents.
    """
    s, e = scores.astype(np.float64), exact.astype(np.float64)
    pearson = float(np.corrcoef(s.ravel(), e.ravel())[0, 1])

    def ranks(a):
        return np.argsort(np.argsort(a, axis=1), axis=1).astype(np.float64)

    rs, re_ = ranks(s), ranks(e)
    rs -= rs.mean(1, keepdims=True)
    re_ -= re_.mean(1, keepdims=True)
    spearman = float(np.mean((rs * re_).sum(1) / np.sqrt((rs**2).sum(1) * (re_**2).sum(1))))
    top_s = np.argsort(-s, axis=1)[:, :top]
    top_e = np.argsort(-e, axis=1)[:, :top]
    pairs = zip(top_s, top_e, strict=True)
    overlap = float(np.mean([len(set(a) & set(b)) / top for a, b in pairs]))
    return {"pearson": pearson, "spearman": spearman, "top10": overlap}


def python_of_dattri() -> str:
    """The interpreter of dattri's own environment: $DATTRI_PYTHON or .venv-dattri."""
    default = os.path.join(os.path.dirname(_here()), ".venv-dattri", "bin", "python")
    return os.environ.get("DATTRI_PYTHON", default)


def check_interpreter(python: str, module: str, install: str) -> str | None:
    """``None`` if ``python`` imports ``module``, else a message saying how to install it."""
    if not os.path.exists(python):
        return f"{python} does not exist; {install}"
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"{python} cannot import {module} ({probe.stderr.strip()[-200:]}); {install}"
    return None


def _here() -> str:
    return os.path.dirname(os.path.abspath(__file__))


ROOT = os.path.dirname(_here())
PYTHON = sys.executable
