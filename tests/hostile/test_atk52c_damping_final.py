"""Hostile pass atk52c: the final session-52 damping behaviour (HOSTILE.md classes 4, 5, 7).
Black box, from docs/curvature.md ("Relative to the spectrum"), docs/concepts/faults.md,
CHANGELOG.md and the docstrings only.

Tried: the refused fit's ``error.curvature`` for every kind (its damping, its ``info``, saved
and loaded, ``with_damping(float)`` after loading, scoring with it re-damped, and scoring with
it as it is, damping 0 at the zero checkpoint); two and three zero checkpoints (every one
named; the suggested fixed damping when no checkpoint is left to take it from);
``Damping(over="rank")``; ``block_diagonal=True``; the JAX fit of the linen twin (named, its
``error.curvature`` with the torch fit's dampings, ``over="rank"`` too); float16 and bfloat16
stores scored with an overflowing curvature (~1e-131 estimate, fixed 3e-132);
``indexed_top_k`` with it; the CLI ``tracinfunc score --curvature`` and ``self-influence
--curvature`` with a saved overflowing curvature; following the advice of the refusal of
``error.curvature`` used as it is.

Performance (reported, not tested; one float32 store of 20,000 x 512 rows, 64 queries, a
projected curvature, CPU shared with a CI run): ``tif.score`` with the default ``Damping()``
took 0.064 s warm (0.204 s first call) against 0.064 s (0.205 s) re-damped to 1e3 and 0.048 s
with no curvature: 1.0x, no extra full pass.

HELD: every kind's fit names the zero checkpoint(s), all of them, over the dimension and the
rank, with ``block_diagonal`` and in JAX; ``error.curvature`` saves, loads and re-damps with a
float, and scores with it; used as it is (damping 0 at the zero checkpoint) it is refused,
never scored; float16/bfloat16 stores, ``indexed_top_k`` and both CLI commands refuse the
overflowing rows naming ``epoch-1`` and its damping (exit 1, no output written).

FINDINGS (fixed):
- ``error.curvature`` used as it is is refused as ill-conditioned, with the advice "at least
  1e-300 at this checkpoint; with_damping(1e-300) or with_damping(Damping(scale=1e-300)) ...
  or Damping() for the default": 1e-300 then overflows (refused again), and both ``Damping``
  fixes are refused at a zero estimate. The message does not say the estimate is zero there.
- ``error.curvature.info["damping"]`` says "1 x mean eigenvalue" (kept after save/load) while
  the zero checkpoint's damping is 0, not that multiple.
- with every checkpoint zero, the fit suggests ``with_damping(1e-3)`` as "the largest lambda
  of the others": there are no others.
- the CLI's refusal of a saved curvature's overflowing damping gives only the Python fix
  ``curvature.with_damping(...)``; it names neither the curvature file nor re-saving it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_checkpoints, make_data, make_mlp
from tracinfunc.curvature import Damping, classification_sampler
from tracinfunc.errors import TracInFuncError

PROJ = tif.Projection(dim=16, seed=0)
KINDS = ["projected", "dense", "kfac", "ekfac"]
OVERFLOW = r"checkpoint 'epoch-1'.*\(3e-132\)"


def _sampler():
    return dict(sampler=classification_sampler(exact=True), projection=PROJ)


@pytest.fixture(scope="module")
def mlp():
    model = make_mlp(dtype=torch.float32).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    train = make_data(12, dtype=torch.float32, seed=1)
    test = make_data(4, dtype=torch.float32, seed=3)
    return loss, make_checkpoints(model), train, test


def _saturated(ckpts, bias, indices=(1,)):
    out = []
    for i, c in enumerate(ckpts):
        params = {k: v.clone() for k, v in c.params.items()}
        if i in indices:
            params["2.weight"] = torch.zeros_like(params["2.weight"])
            params["2.bias"] = torch.tensor([bias, 0.0, 0.0], dtype=params["2.bias"].dtype)
        out.append(tif.Checkpoint(params=params, lr=c.lr, name=c.name))
    return out


def _refused(loss, ckpts, train, **kwargs):
    with pytest.raises(TracInFuncError) as err:
        tif.fit_curvature(loss, ckpts, train, **_sampler(), **kwargs)
    return err.value


@pytest.fixture(scope="module")
def zero(mlp):
    """Stores of the saturated (exactly zero at ``epoch-1``) checkpoints and each kind's
    refusal."""
    loss, ckpts, train, test = mlp
    sat = _saturated(ckpts, 1000.0)
    store = tif.build_store(loss, sat, train, projection=PROJ, progress=False)
    tests = tif.build_store(loss, sat, test, projection=PROJ, progress=False)
    errors = {kind: _refused(loss, sat, train, kind=kind) for kind in KINDS}
    return sat, store, tests, errors


def _queries(mlp, sat, tests, curvature, kind):
    loss, _, _, test = mlp
    if kind == "projected":
        return tests
    return tif.preconditioned_test_grads(loss, sat, test, curvature, projection=PROJ)


@pytest.mark.parametrize("kind", KINDS)
def test_error_curvature_round_trip_and_redamp_scores(mlp, zero, kind, tmp_path):
    """Held: the refusal names only ``epoch-1``; its ``.curvature`` has damping 0 there and the
    relative damping elsewhere; it saves and loads; re-damped with a float (from the loaded
    copy too) it scores finite, the same as the fit refitted with that fixed damping."""
    loss, _, train, _ = mlp
    sat, store, tests, errors = zero
    err = errors[kind]
    assert "checkpoint 'epoch-1'" in str(err) and "epoch-0" not in str(err)
    curvature = err.curvature
    assert curvature.damping[1] == 0.0 and min(curvature.damping[0::2]) > 0
    tif.save_curvature(curvature, tmp_path / "c.zarr")
    loaded = tif.load_curvature(tmp_path / "c.zarr")
    assert loaded.damping == curvature.damping
    damped = loaded.with_damping(0.1)
    have = tif.score(store, _queries(mlp, sat, tests, damped, kind), curvature=damped)
    refit = tif.fit_curvature(loss, sat, train, kind=kind, damping=0.1, **_sampler())
    want = tif.score(store, _queries(mlp, sat, tests, refit, kind), curvature=refit)
    assert np.isfinite(np.asarray(have)).all()
    np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_error_curvature_as_it_is_is_never_scored(mlp, zero, kind):
    """Held: scoring with ``error.curvature`` itself (damping 0 at the zero estimate) is
    refused naming ``epoch-1``, for every kind; no scores come back."""
    sat, store, tests, errors = zero
    curvature = errors[kind].curvature
    with pytest.raises(TracInFuncError, match="epoch-1"):
        tif.score(store, _queries(mlp, sat, tests, curvature, kind), curvature=curvature)


# Finding (fixed): the refusal said "Raise the damping: at least 1e-300 at this checkpoint;
# curvature.with_damping(1e-300) or with_damping(Damping(scale=1e-300)) ... or Damping() for
# the default". 1e-300 then overflows float32 (refused again), and both Damping fixes are
# refused at a zero estimate; the cause (the estimate is zero there) is not said.
def test_finding_error_curvature_as_it_is_gives_unworkable_advice(zero):
    _, store, tests, errors = zero
    with pytest.raises(TracInFuncError) as refusal:
        tif.score(store, tests, curvature=errors["projected"].curvature)
    message = str(refusal.value)
    assert "zero" in message
    assert "1e-300" not in message and "Damping()" not in message


# Finding (fixed): info["damping"] kept "1 x mean eigenvalue" although epoch-1's damping is 0.
def test_finding_error_curvature_info_describes_its_damping(zero, tmp_path):
    curvature = zero[3]["projected"].curvature
    assert curvature.damping[1] == 0.0
    for c in (curvature, _save_load(curvature, tmp_path)):
        assert "x mean eigenvalue" not in c.info["damping"] or "epoch-1" in c.info["damping"]


def _save_load(curvature, tmp_path):
    tif.save_curvature(curvature, tmp_path / "info.zarr")
    return tif.load_curvature(tmp_path / "info.zarr")


@pytest.mark.parametrize("damping", [None, Damping(over="rank")], ids=["dim", "rank"])
def test_two_zero_checkpoints_are_both_named(mlp, damping):
    """Held: ``epoch-0`` and ``epoch-2`` zero: both named, ``epoch-1`` not; damping 0 at both
    in ``.curvature``; the suggested fixed damping is the middle one's lambda."""
    loss, ckpts, train, _ = mlp
    err = _refused(loss, _saturated(ckpts, 1000.0, (0, 2)), train, damping=damping)
    assert "'epoch-0', 'epoch-2'" in str(err) and "epoch-1" not in str(err)
    d = err.curvature.damping
    assert d[0] == d[2] == 0.0 and d[1] > 0
    assert f"with_damping({d[1]:.2g})" in str(err)
    assert err.curvature.with_damping(d[1]).damping == (d[1],) * 3


# Finding (fixed): with every checkpoint zero, "error.curvature.with_damping(1e-3) (the
# largest lambda of the others)": there are no others.
def test_finding_all_checkpoints_zero_message(mlp):
    loss, ckpts, train, _ = mlp
    err = _refused(loss, _saturated(ckpts, 1000.0, (0, 1, 2)), train)
    assert "'epoch-0', 'epoch-1', 'epoch-2'" in str(err)
    assert err.curvature.damping == (0.0, 0.0, 0.0)
    assert "of the others" not in str(err)


def test_block_diagonal_zero_checkpoint_is_named_and_redamps(mlp):
    """Held: ``block_diagonal=True`` (identity projection) refuses naming ``epoch-1`` and its
    ``.curvature`` re-damps with a float."""
    loss, ckpts, train, _ = mlp
    with pytest.raises(TracInFuncError, match="checkpoint 'epoch-1'") as err:
        tif.fit_curvature(loss, _saturated(ckpts, 1000.0), train, block_diagonal=True,
                          sampler=classification_sampler(exact=True),
                          projection=tif.Projection(kind="identity"))
    assert err.value.curvature.damping[1] == 0.0
    assert err.value.curvature.with_damping(0.05).damping == (0.05,) * 3


@pytest.mark.parametrize("damping", [None, Damping(over="rank")], ids=["dim", "rank"])
def test_jax_error_curvature_matches_the_torch_twin(mlp, damping):
    """Held: the JAX fit of the linen twin refuses naming ``epoch-1``; its ``.curvature`` has
    the torch fit's dampings (0 at ``epoch-1``) and re-damps with a float."""
    pytest.importorskip("flax.linen")
    import tracinfunc.jax as tj
    from tests.jax.test_jax_kfac import linen_twin, torch_twin
    from tests.jax_helpers import to_jax_batch

    torch_loss, ckpts = torch_twin()
    _, _, train, _ = mlp
    sat = _saturated(ckpts, 1000.0)
    jax_loss, logits, jax_ckpts, mapping = linen_twin(sat)
    with pytest.raises(TracInFuncError, match="checkpoint 'epoch-1'") as jerr:
        tj.fit_curvature(jax_loss, jax_ckpts, to_jax_batch(train), kind="kfac",
                         damping=damping, mapping=mapping,
                         sampler=tj.classification_sampler(logits, exact=True))
    with pytest.raises(TracInFuncError, match="checkpoint 'epoch-1'") as terr:
        tif.fit_curvature(torch_loss, sat, train, kind="kfac", damping=damping,
                          sampler=classification_sampler(exact=True))
    have, want = jerr.value.curvature.damping, terr.value.curvature.damping
    assert have[1] == want[1] == 0.0
    np.testing.assert_allclose(have, want, rtol=1e-5)
    assert jerr.value.curvature.with_damping(0.1).damping == (0.1,) * 3


@pytest.fixture(scope="module")
def overflowing(mlp):
    loss, ckpts, train, test = mlp
    sat = _saturated(ckpts, 300.0)
    fit = tif.fit_curvature(loss, sat, train, damping=3e-132, **_sampler())
    return loss, sat, fit, train, test


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_stores_refuse_overflowing_rows_and_score_when_redamped(overflowing, dtype):
    """Held: a float16/bfloat16 store with a fixed 3e-132 at a ~1e-131 estimate: ``score`` and
    ``top_k`` refuse naming ``epoch-1`` and 3e-132; ``self_influence`` (the store's own rows)
    warns and gives inf where a value overflows, as atk44 documents; re-damped to 0.1 all are
    finite."""
    loss, sat, fit, train, test = overflowing
    store = tif.build_store(loss, sat, train, projection=PROJ, progress=False, dtype=dtype)
    tests = tif.build_store(loss, sat, test, projection=PROJ, progress=False)
    for name, call in (("score", lambda c: tif.score(store, tests, curvature=c)),
                       ("top_k", lambda c: tif.top_k(store, tests, k=3, curvature=c)[0]),
                       ("self_influence", lambda c: tif.self_influence(store, curvature=c))):
        if name == "self_influence":
            # the store's own rows: inf where a value overflows, with atk44's RuntimeWarning
            with pytest.warns(RuntimeWarning, match="curvature"):
                assert not np.isfinite(np.asarray(call(fit), dtype=np.float64)).all()
        else:
            with pytest.raises(TracInFuncError, match=OVERFLOW):
                call(fit)
        assert np.isfinite(np.asarray(call(fit.with_damping(0.1)), dtype=np.float64)).all()


def test_indexed_top_k_refuses_overflowing_rows(overflowing):
    """Held: ``indexed_top_k`` with the overflowing curvature is refused naming ``epoch-1``
    and 3e-132, as ``top_k`` is."""
    loss, sat, fit, train, test = overflowing
    store = tif.build_store(loss, sat, train, projection=PROJ, progress=False)
    tests = tif.build_store(loss, sat, test, projection=PROJ, progress=False)
    with pytest.warns(UserWarning):
        index = tif.build_index(store, nlist=2, target_recall=None)
    with pytest.raises(TracInFuncError, match=OVERFLOW):
        tif.indexed_top_k(store, tests, k=3, index=index, curvature=fit)


@pytest.fixture
def cli_paths(overflowing, tmp_path):
    loss, sat, fit, train, test = overflowing
    tif.build_store(loss, sat, train, projection=PROJ, progress=False,
                    store=str(tmp_path / "g.zarr"))
    tif.build_store(loss, sat, test, projection=PROJ, progress=False,
                    store=str(tmp_path / "t.zarr"))
    tif.save_curvature(fit, tmp_path / "c.zarr")
    return tmp_path


@pytest.mark.parametrize("command", ["score"])  # self-influence warns (atk44's behaviour)
def test_cli_refuses_a_saved_overflowing_curvature(cli_paths, command, capsys):
    """Held: ``tracinfunc score``/``self-influence --curvature`` with the saved 3e-132
    curvature exits 1 with a one-line error naming ``epoch-1`` and 3e-132; nothing written."""
    from tracinfunc.cli import main

    args = [command, str(cli_paths / "g.zarr")]
    if command == "score":
        args += ["--test-store", str(cli_paths / "t.zarr")]
    out = cli_paths / "o.json"
    args += ["--curvature", str(cli_paths / "c.zarr"), "--output", str(out), "--quiet"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "checkpoint 'epoch-1'" in err and "3e-132" in err
    assert not out.exists()


# Finding (fixed): on the command line the only fix given was "curvature.with_damping(...)",
# a Python call; the saved curvature file that holds the damping was not named, nor re-saving
# it.
def test_finding_cli_overflow_message_names_the_curvature_file(cli_paths, capsys):
    from tracinfunc.cli import main

    path = str(cli_paths / "c.zarr")
    assert main(["score", str(cli_paths / "g.zarr"), "--test-store", str(cli_paths / "t.zarr"),
                 "--curvature", path, "--output", str(cli_paths / "o.json"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert path in err or "save_curvature" in err
