"""Hostile pass atk52: how ``tracinfunc.jax.fit_curvature`` resolves its damping, beside
``tracinfunc.fit_curvature`` on the torch twin (HOSTILE.md classes 3, 4, 5). Black box, from
docs/jax.md, docs/curvature.md, docs/concepts/faults.md and the docstrings only.

Tried: every kind (``"projected"`` on a Rademacher and an identity projection,
``block_diagonal=True``, ``"dense"``, ``"kfac"``, ``"ekfac"``) with ``damping=`` None, a
float, ``Damping(scale)``, ``Damping(over="rank")`` and both; ``with_damping`` (float and both
rules), ``mean_eigenvalues``, ``ranks``, ``condition_numbers``, ``info["damping"]``; save, load
and re-damp; scores through ``tif.score`` and ``tj.preconditioned_test_grads``; one checkpoint
against several; bad dampings (negative, NaN, inf, bool, str, 0-d NumPy/JAX/torch scalars,
a vector, ``Damping`` with odd scales and ``over``); damping 0 on a rank-deficient estimate; a
checkpoint whose estimate is exactly zero (rank 0) or ~1e-131 (a saturated softmax).

HELD: JAX and torch agree (damping to 1e-6, ranks, means, info text, errors) for every kind and
rule, after ``with_damping`` and after save/load; bad values are refused with the same clear
message in both frontends.

FINDINGS (fixed; shared by both frontends):
- a rank-0 checkpoint among others: ``Damping()`` silently resolves its lambda to ``scale x 1``
  (1.0, 3.0, 0.1, 0.3 by kind) while ``info`` says "``scale`` x mean eigenvalue" and the mean
  is 0; no warning or error names the checkpoint.
- a checkpoint whose estimate is ~1e-131 (softmax saturated at logit 300): the default damping
  follows it down to 3e-131 and ``"projected"`` scores reach 2.8e129, silently.
- the same case with ``"ekfac"``: refused, but the error says "use float32 parameters" (they
  are float32) and does not name the checkpoint.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
pytest.importorskip("flax.linen")
jnp = jax.numpy

import tracinfunc as tif  # noqa: E402
import tracinfunc.jax as tj  # noqa: E402
from tests.conftest import make_data  # noqa: E402
from tests.jax.test_jax_kfac import linen_twin, torch_twin  # noqa: E402
from tests.jax_helpers import to_jax_batch  # noqa: E402
from tracinfunc.curvature import Damping, classification_sampler  # noqa: E402
from tracinfunc.errors import IllConditionedError, TracInFuncError  # noqa: E402

RADEMACHER = tif.Projection(dim=24, seed=5)
IDENTITY = tif.Projection(kind="identity")
DEFAULT_SCALE = {"projected": 1.0, "dense": 3.0, "kfac": 0.1, "ekfac": 0.3}


@pytest.fixture(scope="module")
def twin():
    loss, ckpts = torch_twin()
    train = make_data(12, dtype=torch.float32, seed=1)
    test = make_data(4, dtype=torch.float32, seed=3)
    return loss, ckpts, train, test


def _fit_both(loss, ckpts, train, kind, damping=None, projection=RADEMACHER, block=False):
    jax_loss, logits, jax_ckpts, mapping = linen_twin(ckpts)
    kw = dict(kind=kind, damping=damping, block_diagonal=block, projection=projection)
    torch_fit = tif.fit_curvature(loss, ckpts, train, sampler=classification_sampler(exact=True),
                                  **kw)
    jax_fit = tj.fit_curvature(jax_loss, jax_ckpts, to_jax_batch(train), mapping=mapping,
                               sampler=tj.classification_sampler(logits, exact=True), **kw)
    return torch_fit, jax_fit


def _jax_fit(ckpts, train, damping, kind="projected", projection=RADEMACHER):
    jax_loss, logits, jax_ckpts, mapping = linen_twin(ckpts)
    return tj.fit_curvature(jax_loss, jax_ckpts, to_jax_batch(train), kind=kind,
                            projection=projection, mapping=mapping, damping=damping,
                            sampler=tj.classification_sampler(logits, exact=True))


def _torch_fit(loss, ckpts, train, damping, kind="projected", projection=RADEMACHER):
    return tif.fit_curvature(loss, ckpts, train, kind=kind, projection=projection,
                             damping=damping, sampler=classification_sampler(exact=True))


def _assert_same(torch_fit, jax_fit):
    assert jax_fit.damping == pytest.approx(torch_fit.damping, rel=1e-6)
    assert jax_fit.ranks() == torch_fit.ranks()
    assert jax_fit.mean_eigenvalues() == pytest.approx(torch_fit.mean_eigenvalues(), rel=1e-6)
    assert jax_fit.mean_eigenvalues("rank") == pytest.approx(
        torch_fit.mean_eigenvalues("rank"), rel=1e-6)
    assert jax_fit.info["damping"] == torch_fit.info["damping"]


DAMPINGS = [None, 0.01, Damping(scale=2.0), Damping(over="rank"), Damping(scale=2.0, over="rank")]
DAMPING_IDS = ["default", "float", "scale2", "rank", "scale2-rank"]
KINDS = [("projected", RADEMACHER, False), ("projected", IDENTITY, True),
         ("projected", IDENTITY, False), ("dense", RADEMACHER, False),
         ("kfac", RADEMACHER, False), ("ekfac", RADEMACHER, False)]
KIND_IDS = ["projected-rademacher", "projected-identity-blocks", "projected-identity", "dense",
            "kfac", "ekfac"]


@pytest.mark.parametrize(("kind", "projection", "block"), KINDS, ids=KIND_IDS)
def test_every_kind_and_damping_rule_resolves_as_the_torch_twin(twin, kind, projection, block):
    """Held: lambda, ranks, both means and the info text agree for every rule; each lambda is
    the rule applied to the fit's own means."""
    loss, ckpts, train, _ = twin
    for damping in DAMPINGS:
        torch_fit, jax_fit = _fit_both(loss, ckpts, train, kind, damping, projection, block)
        _assert_same(torch_fit, jax_fit)
        if isinstance(damping, float):
            assert jax_fit.damping == (damping,) * len(ckpts)
            assert jax_fit.info["damping"] == "fixed"
        else:
            rule = damping or Damping()
            scale = rule.scale or DEFAULT_SCALE[kind]
            means = jax_fit.mean_eigenvalues(rule.over)
            assert jax_fit.damping == pytest.approx([scale * m for m in means], rel=1e-12)


def test_rank_rule_differs_from_the_dimension_rule_on_a_rank_deficient_estimate(twin):
    """Held: on an identity-projected Fisher of rank 24 in 83 dimensions the rank rule damps
    more, in both frontends (the rule is applied, not silently dropped)."""
    loss, ckpts, train, _ = twin
    torch_fit, jax_fit = _fit_both(loss, ckpts, train, "projected", Damping(over="rank"),
                                   IDENTITY)
    assert jax_fit.ranks()[0] < jax_fit.dim
    dimension = jax_fit.with_damping(Damping())
    assert all(r > 2 * d for r, d in zip(jax_fit.damping, dimension.damping, strict=True))
    _assert_same(torch_fit, jax_fit)


@pytest.mark.parametrize("kind", ["projected", "ekfac"])
def test_with_damping_and_save_load_keep_the_twins_equal(twin, tmp_path, kind):
    """Held: re-damping a JAX fit (float, both rules), directly or after save/load, equals the
    same on the torch fit, info text included."""
    loss, ckpts, train, _ = twin
    torch_fit, jax_fit = _fit_both(loss, ckpts, train, kind)
    tif.save_curvature(jax_fit, tmp_path / "jax.zarr")
    tif.save_curvature(torch_fit, tmp_path / "torch.zarr")
    loaded_jax = tif.load_curvature(tmp_path / "jax.zarr")
    loaded_torch = tif.load_curvature(tmp_path / "torch.zarr")
    assert loaded_jax.damping == jax_fit.damping
    assert loaded_jax.ranks() == jax_fit.ranks()
    for damping in [0.02, Damping(over="rank"), Damping(scale=0.5, over="rank"), Damping()]:
        want = torch_fit.with_damping(damping)
        for got in (jax_fit.with_damping(damping), loaded_jax.with_damping(damping)):
            _assert_same(want, got)
        assert loaded_torch.with_damping(damping).damping == want.damping


@pytest.mark.parametrize("kind", ["projected", "ekfac"])
def test_rank_damped_scores_of_the_jax_fit_equal_the_torch_fit(twin, kind):
    """Held: scores with ``Damping(over="rank")`` from JAX test gradients and the JAX fit
    equal torch's."""
    loss, ckpts, train, test = twin
    jax_loss, _, jax_ckpts, mapping = linen_twin(ckpts)
    damping = Damping(scale=3.0, over="rank")
    torch_fit, jax_fit = _fit_both(loss, ckpts, train, kind, damping)
    store = tif.build_store(loss, ckpts, train, projection=RADEMACHER, progress=False)
    if kind == "projected":
        torch_q = jax_q = tif.build_store(loss, ckpts, test, projection=RADEMACHER,
                                          progress=False)
    else:
        torch_q = tif.preconditioned_test_grads(loss, ckpts, test, torch_fit,
                                                projection=RADEMACHER)
        jax_q = tj.preconditioned_test_grads(jax_loss, jax_ckpts, to_jax_batch(test), jax_fit,
                                             projection=RADEMACHER, mapping=mapping)
    want = torch.as_tensor(np.asarray(tif.score(store, torch_q, curvature=torch_fit))).double()
    have = torch.as_tensor(np.asarray(tif.score(store, jax_q, curvature=jax_fit))).double()
    assert float((have - want).abs().max() / want.abs().max()) <= 1e-5


def test_one_checkpoint_resolves_as_the_same_checkpoint_among_several(twin):
    """Held: damping is per checkpoint; fitting one checkpoint alone gives its lambda."""
    _, ckpts, train, _ = twin
    for damping in [Damping(), Damping(over="rank")]:
        many = _jax_fit(ckpts, train, damping, kind="ekfac")
        for c in range(len(ckpts)):
            one = _jax_fit([ckpts[c]], train, damping, kind="ekfac")
            assert one.damping[0] == pytest.approx(many.damping[c], rel=1e-9)
            assert one.ranks()[0] == many.ranks()[c]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), -float("inf"), True, "0.1"],
                         ids=["negative", "nan", "inf", "-inf", "bool", "str"])
def test_bad_damping_is_refused_as_torch_refuses_it(twin, bad):
    """Held: refused with the same message in both frontends, naming the JAX function."""
    loss, ckpts, train, _ = twin
    with pytest.raises(TracInFuncError) as torch_err:
        _torch_fit(loss, ckpts, train, bad)
    with pytest.raises(TracInFuncError) as jax_err:
        _jax_fit(ckpts, train, bad)
    assert type(jax_err.value) is type(torch_err.value)
    message = str(jax_err.value)
    assert message.startswith("tracinfunc.jax.fit_curvature: damping must be")
    assert message.removeprefix("tracinfunc.jax.") == str(torch_err.value)
    assert "e.g." in message


@pytest.mark.parametrize("value", [np.float32(0.05), np.array(0.05), torch.tensor(0.05),
                                   jnp.float32(0.05), jnp.asarray(0.05)],
                         ids=["np-scalar", "np-0d", "torch-0d", "jnp-scalar", "jnp-0d"])
def test_zero_d_scalars_are_read_as_a_float(twin, value):
    """Held: a 0-d NumPy/torch/JAX damping is the float it holds, in both frontends."""
    loss, ckpts, train, _ = twin
    got = _jax_fit(ckpts, train, value).damping
    assert got == _torch_fit(loss, ckpts, train, value).damping
    assert got == pytest.approx((0.05,) * len(ckpts), rel=1e-7)


@pytest.mark.parametrize("value", [jnp.asarray([0.1, 0.2, 0.3]), np.array([0.05]),
                                   jnp.asarray(float("nan"))],
                         ids=["jnp-vector", "np-1-vector", "jnp-nan"])
def test_array_or_nan_array_damping_is_refused(twin, value):
    """Held: an array damping (even one per checkpoint) or a 0-d NaN array is refused."""
    loss, ckpts, train, _ = twin
    with pytest.raises(TracInFuncError, match="damping"):
        _jax_fit(ckpts, train, value)
    with pytest.raises(TracInFuncError, match="damping"):
        _torch_fit(loss, ckpts, train, value)


@pytest.mark.parametrize("kwargs", [dict(scale=0.0), dict(scale=-2.0), dict(scale=float("nan")),
                                    dict(scale=float("inf")), dict(scale=True),
                                    dict(scale="1"), dict(over="Rank"), dict(over="trace")])
def test_damping_with_an_odd_scale_or_rule_is_refused_by_name(kwargs):
    """Held: ``Damping`` refuses its own bad fields, naming the field and an example."""
    field = next(iter(kwargs))
    with pytest.raises(TracInFuncError, match=f"Damping: {field} must be") as err:
        Damping(**kwargs)
    assert "e.g." in str(err.value)


def test_zero_damping_on_a_rank_deficient_jax_fit_is_refused_at_first_use(twin, tmp_path):
    """Held: damping 0 on the identity-projected Fisher (rank 24 of 83) is kept by the fit and
    by save/load, refused by ``score`` and ``with_damping(0.0)`` with the damping that fixes it;
    the torch twin gives the same condition numbers."""
    loss, ckpts, train, test = twin
    torch_fit, jax_fit = _fit_both(loss, ckpts, train, "projected", 0.0, IDENTITY)
    assert jax_fit.condition_numbers()[0] > 1 / np.finfo(np.float32).eps
    assert jax_fit.condition_numbers() == pytest.approx(torch_fit.condition_numbers(), rel=1e-3)
    store = tif.build_store(loss, ckpts, train, projection=IDENTITY, progress=False)
    tests = tif.build_store(loss, ckpts, test, projection=IDENTITY, progress=False)
    tif.save_curvature(jax_fit, tmp_path / "c.zarr")
    loaded = tif.load_curvature(tmp_path / "c.zarr")
    for curvature in (jax_fit, loaded):
        with pytest.raises(IllConditionedError, match="epoch-0") as err:
            tif.score(store, tests, curvature=curvature)
        assert "with_damping" in str(err.value) and "Damping(scale=" in str(err.value)
        with pytest.raises(IllConditionedError):
            curvature.with_damping(0.0)
        assert curvature.with_damping(Damping(over="rank")).condition_numbers()[0] < 1e3


def _saturated(ckpts, bias):
    """Checkpoint 1 with the output layer zeroed and bias [bias, 0, 0]: softmax ~one-hot."""
    out = list(ckpts)
    params = {k: v.clone() for k, v in ckpts[1].params.items()}
    params["2.weight"] = torch.zeros_like(params["2.weight"])
    params["2.bias"] = torch.tensor([bias, 0.0, 0.0])
    out[1] = tif.Checkpoint(params=params, lr=ckpts[1].lr, name=ckpts[1].name)
    return out


def test_rank_zero_checkpoint_resolves_alike_in_both_frontends(twin):
    """Held (parity): an exactly zero estimate at checkpoint 1 gives the same ranks and means
    in JAX and torch for every kind with a fixed damping, and the same refusal naming the
    checkpoint with a relative one (fixed after this pass: see the finding below)."""
    loss, ckpts, train, _ = twin
    sat = _saturated(ckpts, 1000.0)
    for kind in ["projected", "dense", "kfac", "ekfac"]:
        torch_fit, jax_fit = _fit_both(loss, sat, train, kind, 0.1)
        assert jax_fit.ranks()[1] == 0 and jax_fit.mean_eigenvalues()[1] == 0.0
        _assert_same(torch_fit, jax_fit)
        for damping in [None, Damping(over="rank")]:
            messages = []
            for fit in (_torch_fit, lambda *a, **k: _jax_fit(*a[1:], **k)):
                with pytest.raises(TracInFuncError, match="which is zero at checkpoint "
                                                          "'epoch-1'") as err:
                    fit(loss, sat, train, damping, kind=kind)
                messages.append(str(err.value).removeprefix("tracinfunc.jax."))
            assert messages[0].split(":", 1)[1] == messages[1].split(":", 1)[1]


# Finding (fixed): a rank-0 checkpoint's Damping() lambda silently became scale x 1 (info:
# "x mean eigenvalue", mean 0) and nothing named the checkpoint; now refused by name.
@pytest.mark.parametrize("kind", ["projected", "ekfac"])
def test_finding_rank_zero_checkpoint_damping_is_not_silently_invented(twin, kind):
    """A relative damping of a zero estimate has no scale to be relative to: the fit refuses
    naming the checkpoint (``epoch-1``) and keeps the estimates in the error, re-dampable
    with a fixed damping (before: lambda = scale x 1, silently)."""
    _, ckpts, train, _ = twin
    sat = _saturated(ckpts, 1000.0)
    with pytest.raises(TracInFuncError, match=r"zero at checkpoint 'epoch-1'.*fixed damping"
                       ) as err:
        _jax_fit(sat, train, Damping(), kind=kind)
    kept = err.value.curvature
    assert kept.damping[1] == 0.0 and kept.damping[0] > 0
    assert set(kept.with_damping(0.1).damping) == {0.1}


# Finding (fixed): a ~1e-131 Fisher (saturated softmax) got lambda 3e-131 by default and
# "projected" scores reached 2.8e129, silently. Rows that overflow float32 are now refused by
# name when scoring (the default damping, or a fixed one as small).
def test_finding_near_zero_estimate_gives_astronomical_projected_scores(twin):
    """The checkpoint's Fisher is ~1e-131 but test gradients of other labels are O(1): the
    relative default damping follows the Fisher down, so ``score`` should refuse naming the
    checkpoint (and so for a fixed damping as small), not return 1e129."""
    loss, ckpts, train, test = twin
    sat = _saturated(ckpts, 300.0)
    fit = _jax_fit(sat, train, None)  # lambda ~3e-132 at epoch-1: relative, as asked
    store = tif.build_store(loss, sat, train, projection=RADEMACHER, progress=False)
    tests = tif.build_store(loss, sat, test, projection=RADEMACHER, progress=False)
    with pytest.raises(TracInFuncError, match=r"checkpoint 'epoch-1'.*Raise the damping"):
        tif.score(store, tests, curvature=fit)
    fit = _jax_fit(sat[1:], train, 3e-132)
    store = tif.build_store(loss, sat[1:], train, projection=RADEMACHER, progress=False)
    tests = tif.build_store(loss, sat[1:], test, projection=RADEMACHER, progress=False)
    with pytest.raises(TracInFuncError, match=r"checkpoint 'epoch-1'.*damping there \(3e-132\)"
                       r".*Raise the damping"):
        tif.score(store, tests, curvature=fit)


# Finding (fixed): refused, but the error said "use float32 parameters" (they are float32)
# and did not name the checkpoint epoch-1.
def test_finding_near_zero_estimate_ekfac_error_names_the_checkpoint(twin):
    """``tj.preconditioned_test_grads`` refuses the ~1e130 preconditioned gradients; the fix
    it gives should fit the case: name the checkpoint and the damping, not float32."""
    _, ckpts, train, test = twin
    sat = _saturated(ckpts, 300.0)
    jax_loss, _, jax_ckpts, mapping = linen_twin(sat[1:])
    fit = _jax_fit(sat[1:], train, 3e-132, kind="ekfac")
    with pytest.raises(TracInFuncError) as err:
        tj.preconditioned_test_grads(jax_loss, jax_ckpts, to_jax_batch(test), fit,
                                     projection=RADEMACHER, mapping=mapping)
    message = str(err.value)
    assert "epoch-1" in message and "3e-132" in message
    assert "float32" not in message.split("largest value")[1]
