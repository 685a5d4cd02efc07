"""Outside (docs-only) pass over the atk38 float16 fixes.

Surfaces: float16 loss scaling with its retries (`projected_grads`, `per_sample_grads`,
`build_store`, `stages=`), empty batches, the Zarr build record's `mixed_precision` (resume
and re-run refusals, sharded parts), and the `NonFiniteGradientError` text.

The tests in the first section FAIL on the code as found (findings, asserting the expected
behaviour). The section "Held" keeps attacks that held, as regression tests.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import child_env
from tracinfunc.errors import (
    IncompatibleGradientsError,
    NonFiniteGradientError,
    StageMismatchError,
)

F16 = tif.GradientOptions(mixed_precision=torch.float16)
PROJ = tif.Projection(dim=8, seed=0)
REPO = Path(__file__).resolve().parents[2]


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).eval()


def _data(n: int = 40, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _weighted_criterion(bad: float):
    """Cross-entropy times `bad` for examples of class 2 (one example's loss huge/inf/NaN)."""

    def crit(out, target):
        w = torch.where(target == 2, torch.tensor(bad), torch.tensor(1.0))
        return (F.cross_entropy(out, target, reduction="none") * w).mean()

    return crit


def _weighted_loss(model):
    base = tif.loss_from_module(model, F.cross_entropy)

    def loss(params, example):
        x, y, w = example
        return base(params, (x, y)) * w

    return loss


def _batches(x, y, stop=None):
    for i in range(10):
        if stop is not None and i == stop:
            raise KeyboardInterrupt
        yield x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4]


def _writer(path):
    return functools.partial(tif.store.ZarrWriter, path, chunk_rows=4, shard_rows=8)


def _interrupted_f16_store(path, model, x, y):
    """A Zarr build under float16 killed after 5 batches: 16 rows (two shards) on disk."""
    ck = [tif.Checkpoint.from_module(model, lr=0.1, name="c0")]
    loss = tif.loss_from_module(model, F.cross_entropy)
    with pytest.raises(KeyboardInterrupt):
        tif.build_store(loss, ck, _batches(x, y, stop=5), projection=PROJ,
                        store=_writer(path), options=F16)
    return loss, ck


def _snapshot(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------------------------------
# Findings: these fail on the code as found.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        tif.GradientOptions(mixed_precision=torch.float16, chunk_size=4),
        tif.GradientOptions(mixed_precision=torch.float16, memory_budget=2**20),
        tif.GradientOptions(chunk_size=4),
    ],
    ids=["f16-chunk", "f16-budget", "f32-chunk"],
)
def test_empty_batch_with_chunking_gives_empty_rows(options):
    """CHANGELOG: empty batches give `[0, k]` / `{name: [0, *shape]}`; with `chunk_size=` or
    `memory_budget=` they raised a bare `AssertionError: arg_spec must not be None` (torch's
    chunked vmap)."""
    model = _model()
    x, y = _data()
    params = tif.Checkpoint.from_module(model, lr=0.1, name="c").params
    loss = tif.loss_from_module(model, F.cross_entropy)
    rows = tif.projected_grads(loss, PROJ, options=options)(params, (x[:0], y[:0]))
    assert tuple(rows.shape) == (0, 8)
    grads = tif.per_sample_grads(loss, options=options)(params, (x[:0], y[:0]))
    assert {k: tuple(v.shape) for k, v in grads.items()} == {
        k: (0, *v.shape) for k, v in params.items()
    }


@pytest.mark.parametrize("mixed_precision", [None, torch.float16], ids=["f32", "f16"])
def test_staged_build_with_an_infinite_loss_in_the_first_batch_is_not_a_stage_mismatch(
    mixed_precision,
):
    """A +inf per-example loss in the first batch under `stages=` was reported as
    `StageMismatchError` ("the stages do not reproduce the model's loss ... relative difference
    nan"), telling the user to re-list their submodules; the same loss without stages (or in a
    later batch) is a `NonFiniteGradientError` naming the rows."""
    model = _model()
    x, y = _data()
    crit = _weighted_criterion(float("inf"))
    loss = tif.loss_from_module(model, crit)
    stages = tif.model_stages(model, crit)
    ck = [tif.Checkpoint.from_module(model, lr=0.1, name="c0")]
    options = tif.GradientOptions(mixed_precision=mixed_precision, stages=stages)
    with pytest.raises(tif.TracInFuncError) as info:
        tif.build_store(loss, ck, (x, y), projection=PROJ, options=options)
    assert not isinstance(info.value, StageMismatchError), str(info.value)
    assert isinstance(info.value, NonFiniteGradientError), str(info.value)
    first_bad = int((y == 2).nonzero()[0])
    assert f"[{first_bad}" in str(info.value)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run([sys.executable, "-m", "tracinfunc", *args], capture_output=True,
                          text=True, env=env, timeout=120)


_SPEC = """
import torch, torch.nn as nn, torch.nn.functional as F
import tracinfunc as tif

def make():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).eval()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)
    return tif.cli.Spec(loss=tif.loss_from_module(m, F.cross_entropy),
                        train=[(x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]) for i in range(10)],
                        test={"test": (x[:5], y[:5])},
                        checkpoints=[tif.Checkpoint.from_module(m, lr=0.1, name="c0")], model=m)
"""


def test_cli_resume_with_another_mixed_precision_names_the_flag(tmp_path):
    """`tracinfunc build --resume` with another `--mixed-precision` is refused (held), but the
    fix is given in Python only ("pass GradientOptions(mixed_precision=torch.float16)"); the
    batch-size refusal names the flag ("On the command line: run the same command without
    --batch-size"). A CLI user should be told `--mixed-precision fp16`."""
    model = _model()
    x, y = _data()
    store = tmp_path / "g.zarr"
    _interrupted_f16_store(store, model, x, y)
    (tmp_path / "spec.py").write_text(_SPEC)
    before = _snapshot(store)
    res = _run_cli("build", "--spec", f"{tmp_path / 'spec.py'}:make", "--out", str(store),
                   "--projection", "rademacher:8:0", "--mixed-precision", "bf16", "--quiet",
                   "--resume")
    assert res.returncode != 0
    assert "float16" in res.stderr and "bfloat16" in res.stderr
    assert _snapshot(store) == before
    assert "--mixed-precision fp16" in res.stderr, res.stderr


def test_a_refused_resume_leaves_no_lock_file(tmp_path):
    """docs/concepts/stores.md: "A refused target leaves nothing behind: a writer that refuses
    after taking its lock removes the lock file." A resume refused for its `mixed_precision`
    (also for its dtype or batch size, and a sharded part re-run with another one) leaves
    `.g.zarr.lock` beside the store; the interrupted build itself had left none."""
    model = _model()
    x, y = _data()
    store = tmp_path / "g.zarr"
    loss, ck = _interrupted_f16_store(store, model, x, y)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zarr"]
    with pytest.raises(IncompatibleGradientsError):
        tif.build_store(loss, ck, _batches(x, y), projection=PROJ, store=str(store),
                        options=tif.GradientOptions())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zarr"]


# ---------------------------------------------------------------------------------------
# Held: attacks that held, kept as regression tests.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [F16, tif.GradientOptions(mixed_precision=torch.float16, chunk_size=4)],
    ids=["plain", "chunk4"],
)
def test_held_one_example_with_a_gradient_above_65504_leaves_the_others_bit_identical(options):
    model = _model()
    x, y = _data()
    params = tif.Checkpoint.from_module(model, lr=0.1, name="c").params
    loss = _weighted_loss(model)
    w = torch.ones(40)
    w_big = w.clone()
    w_big[5] = 1e6
    ref = tif.projected_grads(loss, PROJ)(params, (x, y, w_big))
    assert ref[5].abs().max() > 65504
    rows = tif.projected_grads(loss, PROJ, options=options)(params, (x, y, w_big))
    rows0 = tif.projected_grads(loss, PROJ, options=options)(params, (x, y, w))
    others = torch.arange(40) != 5
    assert torch.equal(rows[others], rows0[others])
    assert torch.isfinite(rows[5]).all()
    assert (rows[5] - ref[5]).norm() / ref[5].norm() < 1e-2


@pytest.mark.parametrize("bad", [1e6, float("inf"), float("nan")])
def test_held_staged_float16_scales_one_bad_example_and_leaves_the_others(bad):
    model = _model()
    x, y = _data()
    params = tif.Checkpoint.from_module(model, lr=0.1, name="c").params
    crit, crit1 = _weighted_criterion(bad), _weighted_criterion(1.0)
    opts = tif.GradientOptions(mixed_precision=torch.float16, stages=tif.model_stages(model, crit))
    fn = tif.projected_grads(tif.loss_from_module(model, crit), PROJ, options=opts)
    fn(params, (x[y != 2], y[y != 2]))  # first call (stage check) on finite examples
    rows = fn(params, (x, y))
    opts1 = tif.GradientOptions(mixed_precision=torch.float16,
                                stages=tif.model_stages(model, crit1))
    rows0 = tif.projected_grads(tif.loss_from_module(model, crit1), PROJ, options=opts1)(
        params, (x, y))
    good = y != 2
    assert torch.equal(rows[good], rows0[good])
    if bad == 1e6:
        ref = tif.projected_grads(tif.loss_from_module(model, crit), PROJ)(params, (x, y))
        err = (rows[~good] - ref[~good]).norm(dim=1) / ref[~good].norm(dim=1)
        assert err.max() < 1e-2
    else:
        assert not torch.isfinite(rows[~good]).all(dim=1).any()


def test_held_build_store_names_mixed_precision_and_the_fix_for_nonfinite_rows():
    model = _model()
    x, y = _data()
    ck = [tif.Checkpoint.from_module(model, lr=0.1, name="c0")]
    w = torch.ones(40)
    w[7] = float("inf")
    with pytest.raises(NonFiniteGradientError) as info:
        tif.build_store(_weighted_loss(model), ck, (x, y, w), projection=PROJ, options=F16)
    msg = str(info.value)
    assert "[7]" in msg and "mixed_precision=torch.float16" in msg
    assert "torch.bfloat16" in msg and "None" in msg


def test_held_has_aux_returns_the_unscaled_aux_under_float16():
    model = _model()
    x, y = _data()
    params = tif.Checkpoint.from_module(model, lr=0.1, name="c").params
    loss = _weighted_loss(model)

    def with_aux(p, ex):
        v = loss(p, ex)
        return v, v.detach()

    w = torch.ones(40)
    w[5], w[6] = 1e6, 1e-9
    _, aux = tif.per_sample_grads(with_aux, has_aux=True, options=F16)(params, (x, y, w))
    _, aux32 = tif.per_sample_grads(with_aux, has_aux=True)(params, (x, y, w))
    assert ((aux - aux32).abs() / aux32.abs()).max() < 1e-2


def test_held_resume_and_rerun_with_another_mixed_precision_are_refused_untouched(tmp_path):
    model = _model()
    x, y = _data()
    store = tmp_path / "g.zarr"
    loss, ck = _interrupted_f16_store(store, model, x, y)
    before = _snapshot(store)
    for mp in (None, torch.bfloat16):
        with pytest.raises(IncompatibleGradientsError, match="float16"):
            tif.build_store(loss, ck, _batches(x, y), projection=PROJ, store=_writer(store),
                            options=tif.GradientOptions(mixed_precision=mp))
        assert _snapshot(store) == before
    done = tif.build_store(loss, ck, _batches(x, y), projection=PROJ, store=_writer(store),
                           options=F16)
    assert done.meta.n_train == 40
    finished = _snapshot(store)
    with pytest.raises(IncompatibleGradientsError, match="mixed_precision"):
        tif.build_store(loss, ck, _batches(x, y), projection=PROJ, store=str(store),
                        options=tif.GradientOptions())
    assert _snapshot(store) == finished


def test_held_commit_refuses_a_part_built_with_another_mixed_precision(tmp_path):
    model = _model()
    x, y = _data()
    ck = [tif.Checkpoint.from_module(model, lr=0.1, name="c0")]
    loss = tif.loss_from_module(model, F.cross_entropy)
    store = tmp_path / "p.zarr"
    tif.build_store(loss, ck, (x, y), projection=PROJ, store=str(store), shard=(0, 2),
                    options=F16)
    with pytest.raises(IncompatibleGradientsError, match="float16"):
        tif.build_store(loss, ck, (x, y), projection=PROJ, store=str(store), shard=(0, 2),
                        options=tif.GradientOptions())
    tif.build_store(loss, ck, (x, y), projection=PROJ, store=str(store), shard=(1, 2),
                    options=tif.GradientOptions(mixed_precision=torch.bfloat16))
    before = _snapshot(store)
    with pytest.raises(IncompatibleGradientsError, match="bfloat16"):
        tif.store.commit_store(str(store))
    assert _snapshot(store) == before
    shutil.rmtree(store)
