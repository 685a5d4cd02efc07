"""tracinfunc.evaluate: LDS against hand and brute-force computations, the resumable
retraining harness and mislabel curves (the quality benchmark: test_benchmarks_quick.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import tracinfunc.evaluate as ev
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError, TracInFuncError


def brute_ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties averaged, by counting (the textbook definition)."""
    return [sum(v < x for v in values) + (sum(v == x for v in values) + 1) / 2 for x in values]


def brute_spearman(x: list[float], y: list[float]) -> float:
    rx, ry = brute_ranks(x), brute_ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else math.nan


# ---- Spearman and LDS -------------------------------------------------------------------

def test_spearman_matches_a_brute_force_loop_with_ties():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (9, 6), generator=g).double()  # few values: many ties
    y = torch.randn(9, 6, generator=g, dtype=torch.float64).round(decimals=0)
    got = ev.spearman(x, y)
    for col in range(6):
        want = brute_spearman(x[:, col].tolist(), y[:, col].tolist())
        if math.isnan(want):
            assert math.isnan(got[col])
        else:
            assert got[col].item() == pytest.approx(want, abs=1e-12)


def test_spearman_of_a_constant_column_is_nan():
    x = torch.tensor([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]])
    got = ev.spearman(x, torch.tensor([[3.0, 1.0], [2.0, 2.0], [1.0, 3.0]]))
    assert got[0].item() == pytest.approx(-1.0) and math.isnan(got[1])


def test_lds_matches_a_hand_computation():
    scores = torch.tensor([[1.0, 2.0, 4.0], [-1.0, 0.0, 1.0]])
    subsets = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 0, 0]], dtype=torch.bool)
    outputs = torch.tensor([[2.0, 0.0], [3.0, 1.0], [1.0, 2.0], [0.0, 3.0]])
    # test 0: predicted 3, 5, 6, 1 -> ranks 2, 3, 4, 1; outputs ranks 3, 4, 2, 1;
    #   d = -1, -1, 2, 0, so rho = 1 - 6 * 6 / (4 * 15) = 0.4.
    # test 1: predicted -1, 0, 1, -1 -> ranks 1.5, 3, 4, 1.5 (tie); outputs ranks 1, 2, 3, 4;
    #   centred -1, .5, 1.5, -1 and -1.5, -.5, .5, 1.5: rho = 0.5 / sqrt(4.5 * 5).
    rho = [0.4, 0.5 / math.sqrt(22.5)]
    result = ev.lds(scores, subsets, outputs, n_bootstrap=0)
    assert result.per_test.tolist() == pytest.approx(rho, abs=1e-12)
    assert result.mean == pytest.approx(sum(rho) / 2, abs=1e-12)
    assert result.low == result.high == result.mean and result.n_subsets == 4


def test_lds_bootstrap_matches_a_brute_force_resampling():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 12, generator=g)
    subsets = ev.draw_subsets(12, 10, seed=2)
    outputs = subsets.double() @ scores.double().T + torch.randn(10, 3, generator=g).double()
    result = ev.lds(scores, subsets, outputs, n_bootstrap=40, confidence=0.8, seed=5)
    predicted = (subsets.double() @ scores.double().T).tolist()
    rng, values = torch.Generator().manual_seed(5), []
    for _ in range(40):
        pick = torch.randint(10, (10,), generator=rng).tolist()
        rhos = [brute_spearman([predicted[j][t] for j in pick],
                               [outputs[j, t].item() for j in pick]) for t in range(3)]
        values.append(float(np.nanmean(rhos)))
    low, high = np.quantile(values, [0.1, 0.9])
    assert (result.low, result.high) == pytest.approx((low, high), abs=1e-12)
    assert result.low <= result.mean <= result.high
    again = ev.lds(scores, subsets, outputs, n_bootstrap=40, confidence=0.8, seed=5)
    assert (again.low, again.high) == (result.low, result.high)  # seeded: a pure function


def test_lds_is_one_for_the_true_linear_datamodel():
    g = torch.Generator().manual_seed(3)
    true = torch.randn(4, 30, generator=g, dtype=torch.float64)
    subsets = ev.draw_subsets(30, 20, alpha=0.3, seed=0)
    outputs = (subsets.double() @ true.T).exp()  # a monotone map keeps every rank
    assert ev.lds(true, subsets, outputs, n_bootstrap=20).low == pytest.approx(1.0)


@pytest.mark.parametrize(("args", "error", "match"), [
    ((torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(4, 2)), InvalidTypeError,
     "lds: subsets must be a bool mask"),
    ((torch.zeros(2, 3), torch.ones(4, 3, dtype=torch.bool), torch.zeros(2, 4)),
     InvalidArgumentError, r"expected scores \[n_test, n_train\].*got scores \[2, 3\].*transpose"),
    ((torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, 2)),
     InvalidArgumentError, r"at least 3 subsets \(.*\), got 2; retrain on more"),
    ((np.zeros((2, 3)), torch.ones(4, 3, dtype=torch.bool), torch.zeros(4, 2)),
     InvalidTypeError, "scores must be a 2-D tensor, got ndarray"),
    ((torch.zeros(2, 3), torch.ones(4, 3, dtype=torch.bool), torch.zeros(4, 2)),
     InvalidArgumentError, "constant ones for all; check that the subsets differ"),
])
def test_lds_errors_say_what_was_expected_got_and_the_fix(args, error, match):
    with pytest.raises(error, match=match) as info:
        ev.lds(*args)
    assert isinstance(info.value, TracInFuncError)


def test_lds_rejects_bad_bootstrap_options():
    args = (torch.zeros(1, 3), ev.draw_subsets(3, 4), torch.zeros(4, 1))
    with pytest.raises(InvalidArgumentError, match="n_bootstrap must be an int >= 0, got -1"):
        ev.lds(*args, n_bootstrap=-1)
    with pytest.raises(InvalidArgumentError, match=r"confidence must be a float in \(0, 1\)"):
        ev.lds(*args, confidence=1.5)


# ---- the retraining harness ---------------------------------------------------------------

class Counting:
    """A deterministic ``train_fn``: a nonlinear function of the subset; counts its calls."""

    def __init__(self, fail_after: int | None = None):
        self.calls, self.fail_after = 0, fail_after
        self.weights = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))

    def __call__(self, indices: torch.Tensor) -> torch.Tensor:
        if self.fail_after is not None and self.calls == self.fail_after:
            raise KeyboardInterrupt  # what Ctrl-C or a killed job leaves behind
        self.calls += 1
        return self.weights[indices].sum(0).tanh()


def test_draw_subsets_is_seeded_and_has_the_asked_size():
    masks = ev.draw_subsets(10, 6, alpha=0.3, seed=4)
    assert masks.shape == (6, 10) and masks.sum(1).tolist() == [3] * 6
    assert torch.equal(masks, ev.draw_subsets(10, 6, alpha=0.3, seed=4))
    assert not torch.equal(masks, ev.draw_subsets(10, 6, alpha=0.3, seed=5))


def test_harness_measures_every_subset_with_train_fn():
    fn = Counting()
    run = ev.retrain_subsets(fn, 12, 5, seed=1, progress=False)
    assert fn.calls == 5 and run.outputs.shape == (5, 3)
    for j in range(5):
        want = fn.weights[run.subsets[j].nonzero().squeeze(1)].sum(0).tanh().double()
        assert torch.equal(run.outputs[j], want)


def test_interrupted_harness_resumes_and_gives_identical_results(tmp_path):
    whole = ev.retrain_subsets(Counting(), 12, 7, seed=1, path=tmp_path / "a", progress=False)
    with pytest.raises(KeyboardInterrupt):
        ev.retrain_subsets(Counting(fail_after=3), 12, 7, seed=1, path=tmp_path / "b",
                           progress=False)
    rest = Counting()
    resumed = ev.retrain_subsets(rest, 12, 7, seed=1, path=tmp_path / "b", progress=False)
    assert rest.calls == 4  # only the subsets the killed run did not finish
    assert torch.equal(resumed.outputs, whole.outputs)
    assert torch.equal(resumed.subsets, whole.subsets)
    done = Counting()
    ev.retrain_subsets(done, 12, 7, seed=1, path=tmp_path / "b", progress=False)
    assert done.calls == 0
    loaded = ev.load_retrain(tmp_path / "b")
    assert torch.equal(loaded.outputs, whole.outputs) and loaded.seed == 1


@pytest.mark.parametrize("changed", [{"seed": 2}, {"alpha": 0.25}, {"n_train": 11},
                                     {"n_subsets": 6}])
def test_resuming_with_other_settings_is_refused(tmp_path, changed):
    settings = {"n_train": 12, "n_subsets": 7, "alpha": 0.5, "seed": 1}
    with pytest.raises(KeyboardInterrupt):
        ev.retrain_subsets(Counting(fail_after=2), **settings, path=tmp_path, progress=False)
    with pytest.raises(InvalidArgumentError, match=r"retrain_subsets: the results at .* were "
                       r"made with \{.*\}, but this call asks for .*pass the same settings"):
        ev.retrain_subsets(Counting(), **{**settings, **changed}, path=tmp_path, progress=False)


def test_harness_never_overwrites_files_it_did_not_write(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(InvalidArgumentError, match="holds other files; pass another path"):
        ev.retrain_subsets(Counting(), 12, 3, path=tmp_path, progress=False)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_load_retrain_refuses_an_unfinished_or_missing_run(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        ev.retrain_subsets(Counting(fail_after=2), 12, 7, path=tmp_path / "r", progress=False)
    with pytest.raises(InvalidArgumentError, match="finished run of 7 subsets.*got 2 done"):
        ev.load_retrain(tmp_path / "r")
    with pytest.raises(InvalidArgumentError, match="expected a Zarr group written by"):
        ev.load_retrain(tmp_path / "nothing")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"alpha": 1.0}, r"alpha must be a float in \(0, 1\)"),
    ({"n_subsets": 0}, "n_subsets must be an int >= 1, got 0"),
    ({"seed": -1}, "seed must be an int >= 0, got -1"),
])
def test_harness_argument_errors(kwargs, match):
    settings = {"n_train": 12, "n_subsets": 3, **kwargs}
    with pytest.raises(InvalidArgumentError, match=match):
        ev.retrain_subsets(Counting(), **settings, progress=False)


def test_harness_rejects_bad_measurements():
    with pytest.raises(InvalidArgumentError, match=r"must return shape \[n_test\].*got \[2, 2\]"):
        ev.retrain_subsets(lambda idx: torch.zeros(2, 2), 12, 3, progress=False)
    with pytest.raises(InvalidArgumentError, match="finite measurements.*got NaN"):
        ev.retrain_subsets(lambda idx: torch.full((2,), math.nan), 12, 3, progress=False)
    with pytest.raises(InvalidTypeError, match="must return a tensor.*got list"):
        ev.retrain_subsets(lambda idx: [0.0], 12, 3, progress=False)


def test_lds_from_files_matches_lds(tmp_path):
    run = ev.retrain_subsets(Counting(), 12, 8, path=tmp_path / "run", progress=False)
    scores = Counting().weights.T.contiguous()  # [3, 12]: the true linear part of train_fn
    np.save(tmp_path / "scores.npy", scores.numpy())
    torch.save(scores, tmp_path / "scores.pt")
    want = ev.lds(scores, run.subsets, run.outputs, n_bootstrap=30)
    for name in ("scores.npy", "scores.pt"):
        got = ev.evaluate_lds_from_files(tmp_path / name, tmp_path / "run", n_bootstrap=30)
        assert (got.mean, got.low, got.high) == (want.mean, want.low, want.high)
    with pytest.raises(InvalidArgumentError, match=r"expected an existing .npy or .pt file"):
        ev.evaluate_lds_from_files(tmp_path / "scores.csv", tmp_path / "run")


# ---- mislabel detection -------------------------------------------------------------------

def test_mislabel_curve_matches_a_brute_force_count():
    g = torch.Generator().manual_seed(0)
    suspicion = torch.randint(0, 5, (20,), generator=g).float()  # ties: index order
    flipped = torch.tensor([1, 4, 7, 19])
    curve = ev.mislabel_curve(suspicion, flipped)
    order = sorted(range(20), key=lambda i: (-suspicion[i].item(), i))
    found = [sum(i in flipped.tolist() for i in order[:n]) / 4 for n in range(21)]
    assert curve.found.tolist() == pytest.approx(found, abs=0)
    auc = sum((found[n] + found[n + 1]) / 2 / 20 for n in range(20))
    assert curve.auc == pytest.approx(auc, abs=1e-12)
    mask = torch.zeros(20, dtype=torch.bool)
    mask[flipped] = True
    assert torch.equal(ev.mislabel_curve(suspicion, mask).found, curve.found)
    assert curve.found_at(0.5) == found[10]


def test_mislabel_auc_of_perfect_and_worst_rankings():
    flipped = torch.tensor([8, 9])
    assert ev.mislabel_curve(torch.arange(10.0), flipped).auc == pytest.approx(1 - 2 / 20)
    assert ev.mislabel_curve(-torch.arange(10.0), flipped).auc == pytest.approx(2 / 20)


def test_mislabel_errors():
    with pytest.raises(InvalidArgumentError, match="expected at least one flipped example"):
        ev.mislabel_curve(torch.zeros(4), torch.zeros(4, dtype=torch.bool))
    with pytest.raises(InvalidArgumentError, match=r"indices in \[0, 4\), got range \[0, 9\]"):
        ev.mislabel_curve(torch.zeros(4), torch.tensor([0, 9]))
    with pytest.raises(InvalidArgumentError, match="mask of length n_train=4, got 3"):
        ev.mislabel_curve(torch.zeros(4), torch.ones(3, dtype=torch.bool))
    with pytest.raises(InvalidTypeError, match="flipped must be a bool mask"):
        ev.mislabel_curve(torch.zeros(4), torch.tensor([0.5]))
    with pytest.raises(InvalidTypeError, match="suspicion must be a real 1-D tensor"):
        ev.mislabel_curve(torch.zeros(4, 1), torch.tensor([0]))

