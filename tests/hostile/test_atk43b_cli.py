"""Outside pass atk43b (black box, docs only): ``tracinfunc score`` with ``--refine-solver neumann``
flags and ``--normalize``. Every test here HELD on the commit it was written against (regression
guards): usage errors exit 2 naming the flag, a count over the spec's batches exits 1 naming the
flag, nothing is written on error, and the numbers equal the Python API's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tracinfunc as tif
from tests.conftest import child_env

REPO = Path(__file__).resolve().parents[2]
SPEC = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F
    import tracinfunc as tif
    torch.manual_seed(0)
    X = torch.randn(40, 6); Y = torch.randint(0, 3, (40,))
    XT = torch.randn(5, 6); YT = torch.randint(0, 3, (5,))
    torch.manual_seed(0)
    M = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).eval()
    LOSS = tif.loss_from_module(M, F.cross_entropy)
    CKPTS = [tif.Checkpoint.from_module(M, lr=0.1, name="a")]
    TRAIN = [(X[:1], Y[:1]), (X[1:], Y[1:])]
    def make():
        return tif.cli.Spec(loss=LOSS, train=TRAIN, test={"test": (XT, YT)}, checkpoints=CKPTS, model=M)
''')


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "atk43b_exp.py").write_text(SPEC)
    sys.path.insert(0, str(root))
    try:
        import atk43b_exp as exp
    finally:
        sys.path.remove(str(root))
    proj = tif.Projection(kind="identity")
    store = tif.save_store(tif.build_store(exp.LOSS, exp.CKPTS, exp.TRAIN, projection=proj), root / "g.zarr")
    cur = tif.fit_curvature(exp.LOSS, exp.CKPTS, exp.TRAIN, kind="ekfac", damping=0.1)
    tif.save_curvature(cur, root / "c.zarr")
    return root, exp, store, cur


def cli(root, *args, curvature=True):
    cmd = [sys.executable, "-m", "tracinfunc", "--quiet", "score", str(root / "g.zarr"),
           "--spec", f"{root / 'atk43b_exp.py'}:make", "--test", "test"]
    cmd += ["--curvature", str(root / "c.zarr")] if curvature else []
    out = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120,
                         env=child_env())
    return out.returncode, out.stderr


BAD = [
    (["--refine-steps", "2", "--refine-solver", "neumann", "--refine-step-size", v], 2, "--refine-step-size")
    for v in ("0", "2.5", "nan", "1e400")
] + [
    (["--refine-steps", "2", "--refine-solver", "neumann", "--refine-batches-per-step", v], 2,
     "--refine-batches-per-step") for v in ("0", "1.5")
] + [
    (["--refine-steps", "2", "--refine-solver", "neumann", "--refine-batches-per-step", "3"], 1,
     "--refine-batches-per-step 3 is more than the 2 batches"),
    (["--refine-steps", "2", "--refine-solver", "neumann", "--refine-examples", "1",
      "--refine-batches-per-step", "2"], 1, "more than the 1 batches"),
    (["--refine-steps", "2", "--refine-step-size", "0.5"], 2, "--refine-step-size belongs to --refine-solver neumann"),
    (["--refine-steps", "2", "--refine-solver", "cg", "--refine-batches-per-step", "1"], 2, "--refine-batches-per-step"),
    (["--refine-solver", "neumann"], 2, "--refine-steps"),
]


@pytest.mark.parametrize("args,rc,needle", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_held_bad_refine_flags_name_the_flag_and_write_nothing(setup, args, rc, needle):
    """HELD: each bad value is refused naming the flag, with the documented exit status."""
    root = setup[0]
    out = root / "never.npy"
    code, err = cli(root, *args, "--output", str(out))
    assert code == rc, err
    assert needle in err, err
    assert not out.exists()


def test_held_cli_neumann_equals_the_api(setup):
    """HELD: --refine-solver neumann --refine-step-size 0.5 equals with_refinement in Python."""
    root, exp, store, cur = setup
    out = root / "neumann.npy"
    code, err = cli(root, "--refine-steps", "2", "--refine-solver", "neumann", "--refine-step-size", "0.5",
                    "--output", str(out))
    assert code == 0, err
    refined = cur.with_refinement(exp.TRAIN, solver="neumann", steps=2, step_size=0.5)
    queries = tif.preconditioned_test_grads(exp.LOSS, exp.CKPTS, (exp.XT, exp.YT), refined, projection=store.projection)
    want = tif.score(store, queries, curvature=refined).double().numpy()
    assert np.allclose(np.load(out), want, rtol=1e-6, atol=1e-9)


def test_held_cli_normalize_equals_float64_cosine(setup):
    """HELD: score --normalize equals the float64 cosine of the spec's test gradients."""
    root, exp, store, _ = setup
    out = root / "cos.npy"
    code, err = cli(root, "--normalize", "--output", str(out), curvature=False)
    assert code == 0, err
    test = tif.build_store(exp.LOSS, exp.CKPTS, (exp.XT, exp.YT), projection=store.projection)
    t = test.read_rows(0, 0, 5).double()
    x = store.read_rows(0, 0, 40).double()
    want = 0.1 * (t / t.norm(dim=1, keepdim=True)) @ (x / store.read_norms(0, 0, 40).double()[:, None]).T
    assert np.allclose(np.load(out), want.numpy(), atol=1e-6)
