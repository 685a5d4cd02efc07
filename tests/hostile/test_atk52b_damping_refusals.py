"""Hostile pass atk52b: the session-52 refusals of a relative damping below float32's smallest
normal number, and of preconditioned rows that overflow (HOSTILE.md classes 4, 5). Black box,
from docs/curvature.md, docs/concepts/faults.md, CHANGELOG.md and the docstrings only.

Tried: a saturated middle checkpoint among three, named and unnamed; ``with_damping`` from a
fixed damping back to ``Damping()`` / ``Damping(over="rank")``, directly, after save/load and
on a JAX fit; ``choose_damping`` on a fit with a saturated checkpoint (zero and ~1e-131);
``score``, ``top_k`` and ``self_influence`` with a fixed damping of 3e-132 at a ~1e-131
estimate; ``Damping(scale=1e-40)`` on an ordinary fit; ``Damping.value`` on 0, 1e-131 and an
unknown kind; a float64 linear classifier whose inputs are scaled by 1e-20 (softmax not
saturated, curvature ~1e-41 but well conditioned) under the default ``Damping`` for every kind,
and under the fixed damping the refusal recommends, against the same problem at scale 1
(scores are invariant under x -> s x, lambda -> s^2 lambda).

HELD: a fixed damping at a ~1e-41 estimate of a float64 model scores exactly (every kind,
``"dense"``/``"kfac"`` on float32 stores too); the saturated checkpoint is named (by position
when unnamed) by the fit, by ``with_damping`` (also after save/load, both frontends) and by
``choose_damping``; ``score`` and ``top_k`` refuse the overflowing rows naming the checkpoint
and its damping.

FINDINGS (strict xfail):
- ``Damping(scale=1e-40)`` on an ordinary fit (mean eigenvalue 0.157) is refused with a
  diagnosis of vanishing sampled gradients / certain predictions; the cause is the scale.
- a float64 model with tiny but meaningful curvature (inputs x 1e-20, weights / 1e-20: the
  scale-1 softmax, top probability 0.989) is refused under the default ``Damping`` for every
  kind, saying its predictions are certain.
- with a fixed damping at the relative size (0.13 x 1e-40) every kind gives the scale-1
  scores (held), but ``"projected"`` on a float32 store is refused as values that "reach nan,
  beyond float32's largest value" (the true rows are ~1e21) with "raise the damping" as the
  fix; a float64 store is the fix that keeps the scores.
- ``self_influence`` with a curvature whose rows overflow returns inf with a warning that
  names neither the checkpoint nor the damping, where ``score``/``top_k`` refuse.
- ``Damping().value(1.0, "nope")`` raises a raw ``KeyError``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_checkpoints, make_data, make_mlp
from tracinfunc.curvature import Damping, choose_damping, classification_sampler
from tracinfunc.errors import TracInFuncError

PROJ = tif.Projection(dim=16, seed=0)
CERTAIN = "predictions are (almost) certain"


def _sampler():
    return dict(sampler=classification_sampler(exact=True), projection=PROJ)


@pytest.fixture(scope="module")
def mlp():
    model = make_mlp(dtype=torch.float32).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    train = make_data(12, dtype=torch.float32, seed=1)
    test = make_data(4, dtype=torch.float32, seed=3)
    return loss, make_checkpoints(model), train, test


def _saturated(ckpts, bias, index=1, named=True):
    out = []
    for i, c in enumerate(ckpts):
        params = {k: v.clone() for k, v in c.params.items()}
        if i == index:
            params["2.weight"] = torch.zeros_like(params["2.weight"])
            params["2.bias"] = torch.tensor([bias, 0.0, 0.0], dtype=params["2.bias"].dtype)
        out.append(tif.Checkpoint(params=params, lr=c.lr, name=c.name if named else None))
    return out


def test_unnamed_middle_saturated_checkpoint_is_named_by_position(mlp):
    """Held: only the middle of three unnamed checkpoints is saturated: the refusal names
    ``checkpoint-1``, not another one, and gives the fixes."""
    loss, ckpts, train, _ = mlp
    sat = _saturated(ckpts, 1000.0, named=False)
    for damping in (None, Damping(over="rank")):
        with pytest.raises(TracInFuncError) as err:
            tif.fit_curvature(loss, sat, train, damping=damping, **_sampler())
        message = str(err.value)
        assert "checkpoint 'checkpoint-1'" in message
        assert "checkpoint-0" not in message and "checkpoint-2" not in message
        assert "fixed damping" in message and "fit without th" in message


def test_with_damping_back_to_relative_is_refused_directly_and_after_save_load(mlp, tmp_path):
    """Held: a saturated fit with a fixed damping loads; re-damping it with ``Damping()`` or
    over the rank is refused naming ``epoch-1``; a fixed damping still works."""
    loss, ckpts, train, _ = mlp
    fit = tif.fit_curvature(loss, _saturated(ckpts, 1000.0), train, damping=0.1, **_sampler())
    assert fit.mean_eigenvalues()[1] == 0.0
    tif.save_curvature(fit, tmp_path / "c.zarr")
    loaded = tif.load_curvature(tmp_path / "c.zarr")
    for curvature in (fit, loaded):
        for damping in (Damping(), Damping(over="rank"), Damping(scale=1e30)):
            with pytest.raises(TracInFuncError, match="with_damping.*checkpoint 'epoch-1'"):
                curvature.with_damping(damping)
        assert curvature.with_damping(0.2).damping == (0.2,) * 3


def test_jax_with_damping_back_to_rank_rule_is_refused_by_name(mlp):
    """Held: the JAX fit of the twin (fixed damping) re-damped over the rank is refused
    naming the saturated checkpoint."""
    pytest.importorskip("flax.linen")
    import tracinfunc.jax as tj
    from tests.jax.test_jax_kfac import linen_twin, torch_twin
    from tests.jax_helpers import to_jax_batch

    _, ckpts = torch_twin()
    _, _, train, _ = mlp
    jax_loss, logits, jax_ckpts, mapping = linen_twin(_saturated(ckpts, 1000.0))
    fit = tj.fit_curvature(jax_loss, jax_ckpts, to_jax_batch(train), kind="kfac", damping=0.1,
                           mapping=mapping, sampler=tj.classification_sampler(logits, exact=True))
    with pytest.raises(TracInFuncError, match="checkpoint 'epoch-1'"):
        fit.with_damping(Damping(over="rank"))


@pytest.mark.parametrize("bias", [300.0, 1000.0], ids=["1e-131", "zero"])
def test_choose_damping_on_a_saturated_fit_names_the_checkpoint(mlp, bias):
    """Held: no candidate multiple works at ``epoch-1`` (its estimate is zero, or ~1e-131 so
    every step's loss is non-finite): refused naming it and the fixes (a fixed damping, or the
    store and fit without it; no candidate chosen silently)."""
    loss, ckpts, train, test = mlp
    sat = _saturated(ckpts, bias)
    fit = tif.fit_curvature(loss, sat, train, damping=0.05, **_sampler())
    with pytest.raises(TracInFuncError) as err:
        choose_damping(fit, loss, sat, train, test)
    assert "checkpoint 'epoch-1'" in str(err.value) or "checkpoint(s) 'epoch-1'" in str(
        err.value)
    assert "fixed damping" in str(err.value) and "without" in str(err.value)


@pytest.fixture(scope="module")
def overflowing(mlp):
    loss, ckpts, train, test = mlp
    sat = _saturated(ckpts, 300.0)
    fit = tif.fit_curvature(loss, sat, train, damping=3e-132, **_sampler())
    store = tif.build_store(loss, sat, train, projection=PROJ, progress=False)
    tests = tif.build_store(loss, sat, test, projection=PROJ, progress=False)
    return fit, store, tests


def test_score_and_top_k_refuse_overflowing_rows_naming_checkpoint_and_damping(overflowing):
    """Held: a fixed 3e-132 at a ~1e-131 estimate: refused naming ``epoch-1`` and 3e-132."""
    fit, store, tests = overflowing
    for call in (lambda: tif.score(store, tests, curvature=fit),
                 lambda: tif.top_k(store, tests, k=3, curvature=fit)):
        with pytest.raises(TracInFuncError, match=r"checkpoint 'epoch-1'.*\(3e-132\)"):
            call()


# Finding, kept as documented: self_influence returns inf for the rows whose value overflows
# float32, with a RuntimeWarning naming the rows and the curvature as the cause (atk44's
# behaviour, tests/hostile/test_atk44_overflow.py), where score/top_k refuse the overflowing
# queries by checkpoint: its rows are the store's own, not queries.
def test_finding_self_influence_with_overflowing_rows_is_refused_by_name(overflowing):
    fit, store, _ = overflowing
    with pytest.warns(RuntimeWarning, match="curvature"):
        values = tif.self_influence(store, curvature=fit)
    assert not bool(torch.isfinite(values).all())


# Finding (fixed): Damping(scale=1e-40) at a mean eigenvalue of 0.157 was refused as "the
# sampled gradients vanish, the predictions are certain"; the size of lambda is the
# conditioning check's to judge, which names the damping that works.
def test_finding_tiny_scale_refusal_blames_the_scale(mlp):
    loss, ckpts, train, _ = mlp
    fit = tif.fit_curvature(loss, ckpts, train, **_sampler())
    try:
        damped = fit.with_damping(Damping(scale=1e-40))
    except TracInFuncError as err:
        assert CERTAIN not in str(err) and "zero" not in str(err)
        assert "condition number" in str(err) and "Raise the damping" in str(err)
    else:
        assert damped.damping == pytest.approx([1e-40 * m for m in fit.mean_eigenvalues()])


def _tiny_linear(scale=1e-20):
    """A float64 linear classifier on inputs x scale, weights / scale: the logits (and so the
    softmax) are the scale-1 problem's; gradients scale by ``scale``, the Fisher by its square.
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3, bias=False).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    weight = torch.randn(3, 6, dtype=torch.float64) / scale
    ckpt = tif.Checkpoint(params={"weight": weight}, lr=0.1, name="c0")
    (x, y), (xt, yt) = make_data(20, seed=1), make_data(4, seed=3)
    return loss, [ckpt], (scale * x, y), (scale * xt, yt)


def test_tiny_linear_is_not_saturated():
    """Held (premise): at scale 1e-20 no prediction is near certain."""
    _, ckpts, (x, _), _ = _tiny_linear()
    probs = torch.softmax(x @ ckpts[0].params["weight"].T, dim=-1)
    assert float(probs.max()) < 0.999


# Finding (fixed): refused for every kind as "the model's predictions are (almost) certain" on
# a float64 model with the scale-1 softmax (the refusal read the mean's size, not zero).
@pytest.mark.parametrize("kind", ["projected", "dense", "kfac", "ekfac"])
def test_finding_float64_tiny_but_meaningful_curvature_is_refused(kind):
    loss, ckpts, (x, y), _ = _tiny_linear()
    fit = tif.fit_curvature(loss, ckpts, (x, y), kind=kind, **_sampler())
    mean = fit.mean_eigenvalues()[0]
    assert 0 < mean < 1e-38
    assert fit.damping[0] == pytest.approx(Damping().scale_for(kind) * mean, rel=1e-9)


def _tiny_scores(kind, dtype, scale):
    loss, ckpts, train, test = _tiny_linear(scale)
    fit = tif.fit_curvature(loss, ckpts, train, kind=kind, damping=0.13 * scale**2, **_sampler())
    store = tif.build_store(loss, ckpts, train, projection=PROJ, progress=False, dtype=dtype)
    if kind == "projected":
        tests = tif.build_store(loss, ckpts, test, projection=PROJ, progress=False, dtype=dtype)
    else:
        tests = tif.preconditioned_test_grads(loss, ckpts, test, fit, projection=PROJ)
    return np.asarray(tif.score(store, tests, curvature=fit), dtype=np.float64)


@pytest.mark.parametrize(("kind", "dtype"), [("projected", "float64"), ("dense", "float32"),
                                             ("kfac", "float32"), ("ekfac", "float64")])
def test_fixed_damping_at_tiny_scale_gives_the_scale_one_scores(kind, dtype):
    """Held: scores are invariant under x -> s x, W -> W / s, lambda -> s^2 lambda; at
    s = 1e-20 (a ~1e-41 estimate, fixed damping 1.3e-41) every kind gives the s = 1 scores."""
    want = _tiny_scores(kind, "float64", 1.0)
    have = _tiny_scores(kind, dtype, 1e-20)
    np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


# Finding (fixed): refused as preconditioned gradients that "reach nan, beyond
# torch.float32's largest value" (the true rows are ~1e21; the float32 inverse overflowed),
# with "raise the damping" (which changes the scores); the rows are now formed in float64
# where the float32 inverse would overflow.
def test_finding_projected_float32_tiny_scale_error_states_the_cause():
    want = _tiny_scores("projected", "float64", 1.0)
    have = _tiny_scores("projected", "float32", 1e-20)
    np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_damping_value_is_the_raw_multiple():
    """Held (documented): ``value`` multiplies; ``resolve`` (the fit) refuses a zero mean."""
    assert Damping().value(0.0, "projected") == 0.0
    assert Damping().value(1e-131, "ekfac") == pytest.approx(0.3e-131)
    assert Damping(scale=2.0, over="rank").value(0.5, "kfac") == 1.0


# Finding (fixed): raised a raw KeyError('nope').
def test_finding_damping_value_with_an_unknown_kind_is_a_clear_error():
    with pytest.raises(TracInFuncError, match="kind"):
        Damping().value(1.0, "nope")


@pytest.mark.parametrize("kind", ["dense", "projected"])
def test_review_subnormal_fixed_damping_on_a_zero_estimate_is_refused_not_nan(mlp, kind):
    """Review of the fixes: a zero estimate with a fixed damping of 1e-320 is well conditioned
    (condition number 1), but its inverse overflows float64 itself: the preconditioned rows
    are refused naming the checkpoint and the damping, never returned as inf/NaN."""
    loss, ckpts, train, test = mlp
    sat = _saturated(ckpts, 1000.0)[1:]
    fit = tif.fit_curvature(loss, sat, train, kind=kind, damping=1e-320, **_sampler())
    with pytest.raises(TracInFuncError, match=r"checkpoint 'epoch-1' overflow \(inf/NaN\).*"
                                              r"damping there \(1e-320\)"):
        if kind == "dense":
            tif.preconditioned_test_grads(loss, sat, test, fit, projection=PROJ)
        else:
            store = tif.build_store(loss, sat, train, projection=PROJ, progress=False,
                                    dtype="float64")
            tests = tif.build_store(loss, sat, test, projection=PROJ, progress=False,
                                    dtype="float64")
            tif.score(store, tests, curvature=fit)
