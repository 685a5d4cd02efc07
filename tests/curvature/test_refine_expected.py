"""Refinement on the expected Fisher (``with_refinement(fisher="expected")``, issue 33 ask 1).

The product ``F v`` (a jvp of the logits, the output-space Fisher, a vjp) is checked against
an explicit float64 matrix built by a Python loop with ``torch.autograd.grad``: every example,
every scored position, every label, weighted by the model's probability of that label. It
must also equal the expectation of what the library's samplers draw (the exact classification
sampler's kept Fisher; the mean of many causal-LM draws), and conjugate gradient on it must
converge to the explicit ``(F + lambda I)^-1 g``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tests.curvature.cli_setup import saved_for_cli
from tracinfunc.curvature import causal_lm_sampler, classification_sampler, fit_curvature
from tracinfunc.curvature.expected import expected_product
from tracinfunc.curvature.fisher import sampled_gradients
from tracinfunc.errors import InvalidArgumentError, NonFiniteGradientError

IDENTITY = tif.Projection(kind="identity")
VOCAB, LENGTH = 6, 5


class TinyLM(nn.Module):
    """Embedding, a causal mixing of the previous position, a head: logits ``[b, T, V]``."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix, self.head = nn.Embedding(VOCAB, 4), nn.Linear(4, 4), nn.Linear(4, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        previous = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        return self.head(torch.tanh(h + self.mix(previous)))


def _lm_data():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (5, LENGTH), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 3:] = 0  # right padding
    labels = ids.clone()
    labels[2, :3] = -100  # a prompt that is not scored
    labels[4, :] = -100  # no scored position at all: contributes nothing, still counted
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    model = TinyLM().double().eval()
    loss = tif.causal_lm_loss(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    return model, loss, params, _lm_data()


def _flat(tensors, names):
    return torch.cat([tensors[n].reshape(-1) for n in names])


def explicit_lm_fisher(model, params, batch, names):
    """``(1 / m) sum_j sum_t sum_y p_t(y) g g^T``, ``g`` the gradient of the mean scored
    next-token loss with position ``t``'s label set to ``y`` (every other position's term has
    zero expectation): by a loop with torch.autograd.grad, float64."""
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    p = sum(params[n].numel() for n in names)
    total = torch.zeros(p, p, dtype=torch.float64)
    leaves = {n: params[n].clone().requires_grad_(True) for n in names}
    for j in range(ids.shape[0]):
        scored = [t for t in range(1, LENGTH) if labels[j, t] != -100 and mask[j, t] != 0]
        for t in scored:
            logits = torch.func.functional_call(model, leaves, (ids[j:j + 1],))[0]  # [T, V]
            probs = logits[t - 1].softmax(-1).detach()
            for y in range(VOCAB):
                term = -torch.log_softmax(logits[t - 1], -1)[y] / len(scored)
                g = torch.autograd.grad(term, [leaves[n] for n in names], retain_graph=True)
                flat = torch.cat([x.reshape(-1) for x in g])
                total += probs[y] * torch.outer(flat, flat)
    return total / ids.shape[0]


def loop_grad(loss, params, example, order):
    """One example's gradient by torch.autograd.grad, flat in ``order``."""
    leaves = {n: params[n].clone().requires_grad_(True) for n in params}
    return _flat(dict(zip(order, torch.autograd.grad(loss(leaves, example),
                                                     [leaves[n] for n in order]),
                          strict=True)), order)


def test_causal_lm_product_equals_the_explicit_expected_fisher(lm):
    model, loss, params, batch = lm
    names = ["head.weight", "mix.weight", "emb.weight"]  # out of the module's order
    matrix = explicit_lm_fisher(model, params, batch, names)
    g = torch.Generator().manual_seed(1)
    vectors = {n: torch.randn(3, *params[n].shape, dtype=torch.float64, generator=g)
               for n in names}
    split = ({k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()})
    product = expected_product(loss, params, names, split)
    got = torch.stack([_flat({n: product(vectors)[n][i] for n in names}, names)
                       for i in range(3)])
    want = torch.stack([matrix @ _flat({n: vectors[n][i] for n in names}, names)
                        for i in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert product.method == "expected" and product.kept is None


def test_causal_lm_expected_fisher_is_the_mean_of_the_samplers_draws(lm):
    """The scaling (1 / n^2 per position, 1 / m over inputs) is the sampler's: many drawn
    label sequences average to the expected Fisher (Monte Carlo: 3,000 draws per input)."""
    model, loss, params, batch = lm
    names = ["head.weight", "mix.weight"]
    labelled = [causal_lm_sampler(samples=3000)(loss, params, batch,
                                                torch.Generator().manual_seed(0))]
    gradients, weights = sampled_gradients(loss, params, names, labelled)
    sampled = (gradients.T * weights) @ gradients / weights.sum()
    expected = explicit_lm_fisher(model, params, batch, names)
    error = torch.linalg.matrix_norm(sampled - expected) / torch.linalg.matrix_norm(expected)
    assert error < 0.05, float(error)
    # and a scaling off by n (the GGN of the mean loss instead of its Fisher) would be caught
    assert torch.linalg.matrix_norm(sampled - 2 * expected) / torch.linalg.matrix_norm(
        expected) > 0.5


@pytest.fixture(scope="module")
def classifier():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(30, 4, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (30,), generator=g)
    return model, loss, (x, y)


def test_classifier_product_equals_the_exact_samplers_fisher(classifier):
    _, loss, (x, y) = classifier
    params = {k: v.detach() for k, v in loss.module.named_parameters()}
    names = sorted(params)
    batches = ((x[:12], y[:12]), (x[12:20], y[12:20]))
    labelled = [classification_sampler(exact=True)(loss, params, b, torch.Generator())
                for b in batches]
    gradients, weights = sampled_gradients(loss, params, names, labelled)
    matrix = (gradients.T * weights) @ gradients / weights.sum()
    vectors = {n: torch.randn(4, *params[n].shape, dtype=torch.float64) for n in names}
    out = expected_product(loss, params, names, batches)(vectors)
    got = torch.stack([_flat({n: out[n][i] for n in names}, names) for i in range(4)])
    want = torch.stack([matrix @ _flat({n: vectors[n][i] for n in names}, names)
                        for i in range(4)])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_classifier_with_another_criterion_uses_its_gradients(classifier):
    """D [C, C] is the criterion's own gradient at every class: a label-smoothed loss is
    not cross-entropy's diag(p) - p p^T, and the product follows it."""
    model, _, (x, y) = classifier

    def smoothed(outputs, target):
        return F.cross_entropy(outputs, target, label_smoothing=0.2)

    loss = tif.loss_from_module(model, smoothed)
    params = {k: v.detach() for k, v in model.named_parameters()}
    names = sorted(params)
    batches = ((x[:10], y[:10]),)
    labelled = [classification_sampler(exact=True)(loss, params, batches[0], torch.Generator())]
    gradients, weights = sampled_gradients(loss, params, names, labelled)
    matrix = (gradients.T * weights) @ gradients / weights.sum()
    vectors = {n: torch.randn(2, *params[n].shape, dtype=torch.float64) for n in names}
    out = expected_product(loss, params, names, batches)(vectors)
    got = torch.stack([_flat({n: out[n][i] for n in names}, names) for i in range(2)])
    want = torch.stack([matrix @ _flat({n: vectors[n][i] for n in names}, names)
                        for i in range(2)])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_refined_queries_converge_to_the_explicit_solve(lm):
    """CG on the expected Fisher, preconditioned by EK-FAC: ``(F + lambda I)^-1 g`` of the
    explicit matrix, through preconditioned_test_grads and score."""
    model, loss, params, batch = lm
    names = sorted(params)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.5, name="a")]
    fitted = fit_curvature(loss, ckpts, batch, kind="ekfac")
    damping = fitted.damping[0]
    refined = fitted.with_refinement(batch, steps=200, tolerance=1e-11, fisher="expected")
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VOCAB, (3, LENGTH), generator=g)
    test = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    queries = tif.preconditioned_test_grads(loss, ckpts, test, refined, projection=IDENTITY)
    order = [n for n, _ in refined.layout]  # the identity projection's columns
    matrix = explicit_lm_fisher(model, params, batch, order)
    rhs = torch.stack([loop_grad(loss, params, {k: v[i] for k, v in test.items()}, order)
                       for i in range(3)])
    want = torch.linalg.solve(matrix + damping * torch.eye(matrix.shape[0],
                                                           dtype=torch.float64), rhs.T).T
    got = queries.read_rows(0, 0, 3)
    torch.testing.assert_close(got.double(), want, rtol=1e-7, atol=1e-9)
    extra = queries.meta.extra["curvature"]
    assert extra["solvers"] == ["cg"] and extra["residuals"][0][-1] <= 1e-11
    assert refined.metadata()["refinement"]["fisher"] == "expected"
    assert names  # every parameter was refined


def test_expected_and_sampled_queries_are_never_mixed(lm):
    model, loss, _, batch = lm
    ckpts = [tif.Checkpoint.from_module(model, name="a")]
    fitted = fit_curvature(loss, ckpts, batch, kind="ekfac")
    sampled = fitted.with_refinement(batch, steps=2)
    expected = fitted.with_refinement(batch, steps=2, fisher="expected")
    assert sampled.digest != expected.digest
    store = tif.build_store(loss, ckpts, batch, projection=IDENTITY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # 2 steps: not converged
        queries = tif.preconditioned_test_grads(loss, ckpts, batch, expected,
                                                projection=IDENTITY)
    tif.score(store, queries, curvature=expected)
    with pytest.raises(tif.errors.IncompatibleGradientsError):
        tif.score(store, queries, curvature=sampled)


@pytest.mark.parametrize("kwargs, match", [
    ({"fisher": "exact"}, "fisher must be one of 'sampled', 'expected', got 'exact'"),
    ({"fisher": None}, "fisher must be one of"),
    ({"fisher": "expected", "solver": "direct"}, "no exact solve; use solver='cg'"),
    ({"fisher": "expected", "sampler": causal_lm_sampler()}, "sampler= and seed= have no use"),
    ({"fisher": "expected", "seed": 3}, "got seed=3"),
])
def test_bad_fisher_arguments_are_refused_with_the_way_out(lm, kwargs, match):
    model, loss, _, batch = lm
    fitted = fit_curvature(loss, [tif.Checkpoint.from_module(model, name="a")], batch,
                           kind="ekfac")
    with pytest.raises(InvalidArgumentError, match=match):
        fitted.with_refinement(batch, **kwargs)


def test_a_loss_without_a_known_expected_fisher_is_refused_before_any_work(lm):
    model, loss, _, batch = lm
    ckpts = [tif.Checkpoint.from_module(model, name="a")]
    fitted = fit_curvature(loss, ckpts, batch, kind="ekfac")
    refined = fitted.with_refinement(batch, fisher="expected")

    def hand_written(p, example):
        return loss(p, example)

    with pytest.raises(InvalidArgumentError, match="fisher='sampled'"):
        tif.preconditioned_test_grads(hand_written, ckpts, batch, refined, projection=IDENTITY)


def test_non_finite_refinement_examples_are_named(lm):
    model, _, _, _ = lm

    class Poisoned(nn.Module):  # NaN logits wherever the input holds token VOCAB - 1
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, attention_mask=None):
            out = self.inner(input_ids)
            return torch.where((input_ids == VOCAB - 1)[..., None], torch.nan, out)

    poisoned = Poisoned().eval()
    ploss = tif.causal_lm_loss(poisoned)
    ckpts = [tif.Checkpoint.from_module(poisoned, name="a")]
    ids = torch.randint(0, VOCAB - 1, (6, LENGTH), generator=torch.Generator().manual_seed(2))
    clean = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    fitted = fit_curvature(ploss, ckpts, clean, kind="ekfac")
    dirty = {k: v.clone() for k, v in clean.items()}
    dirty["input_ids"][[2, 4], 1] = VOCAB - 1
    refined = fitted.with_refinement(dirty, fisher="expected")
    with pytest.raises(NonFiniteGradientError,
                       match=r"refinement example\(s\) 2, 4 give NaN or infinite logits"):
        tif.preconditioned_test_grads(ploss, ckpts, clean, refined, projection=IDENTITY)


def test_cli_refine_fisher_matches_the_api(tmp_path, capsys):

    import numpy as np

    from tracinfunc.cli import main
    from tracinfunc.curvature.test_grads import MARK

    saved = saved_for_cli(tmp_path)
    spec_path, spec, projection, store, curvature = (
        saved.spec_path, saved.spec, saved.projection, saved.store, saved.curvature)
    out = tmp_path / "scores.npy"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        code = main(["score", str(tmp_path / "grads.zarr"), "--spec", f"{spec_path}:make",
                     "--curvature", str(tmp_path / "curvature.zarr"), "--refine-steps", "2",
                     "--refine-examples", "8", "--refine-fisher", "expected", "--output",
                     str(out), "--quiet"])
        assert code == 0
        queries = {fisher: tif.preconditioned_test_grads(
            spec.loss, spec.checkpoints, spec.test["test"],
            curvature.with_refinement(spec.train, steps=2, max_examples=8, fisher=fisher),
            projection=projection) for fisher in ("expected", "sampled")}
    refined = curvature.with_refinement(spec.train, steps=2, max_examples=8, fisher="expected")
    assert queries["expected"].meta.extra[MARK]["digest"] == refined.digest
    np.testing.assert_allclose(np.load(out), tif.score(store, queries["expected"],
                                                       curvature=refined).numpy(),
                               rtol=1e-5, atol=1e-6)
    # the flag changes the matrix solved, hence the scores
    assert not np.allclose(queries["expected"].read_rows(0, 0, 2).numpy(),
                           queries["sampled"].read_rows(0, 0, 2).numpy(), rtol=1e-4)
    with pytest.raises(SystemExit) as exited:  # a usage error, as argparse's own
        main(["score", str(tmp_path / "grads.zarr"), "--spec", f"{spec_path}:make",
              "--curvature", str(tmp_path / "curvature.zarr"), "--refine-fisher", "expected",
              "--output", str(tmp_path / "x.npy"), "--quiet"])
    assert exited.value.code == 2
    assert "--refine-fisher goes with --refine-steps" in capsys.readouterr().err
    assert not (tmp_path / "x.npy").exists()
    with pytest.raises(SystemExit) as exited:  # the expected Fisher has no direct solve
        main(["score", str(tmp_path / "grads.zarr"), "--spec", f"{spec_path}:make",
              "--curvature", str(tmp_path / "curvature.zarr"), "--refine-steps", "2",
              "--refine-fisher", "expected", "--refine-solver", "direct",
              "--output", str(tmp_path / "y.npy"), "--quiet"])
    assert exited.value.code == 2 and not (tmp_path / "y.npy").exists()
    assert "use --refine-solver cg with it" in capsys.readouterr().err


def test_query_vectors_in_chunks_give_the_same_product(lm, monkeypatch):
    """A language model's logits times every query would not fit: the vectors go through the
    jvp in chunks under CHUNK_BYTES (here one vector at a time), with the same answer."""
    from tracinfunc.curvature import expected

    _, loss, params, batch = lm
    names = sorted(params)
    vectors = {n: torch.randn(5, *params[n].shape, dtype=torch.float64) for n in names}
    whole = expected_product(loss, params, names, (batch,))(vectors)
    monkeypatch.setattr(expected, "CHUNK_BYTES", 1)
    chunked = expected_product(loss, params, names, (batch,))(vectors)
    for name in names:
        torch.testing.assert_close(chunked[name], whole[name], rtol=1e-12, atol=1e-14)


def test_classification_sampler_refuses_float_targets_and_fills_a_label_column(classifier):
    """Found by atk41 on the expected Fisher, and present in the sampler fit_curvature uses by
    default: one-hot float targets got class indices, which a soft-label criterion broadcast
    into a wrong Fisher, silently. A [b, 1] integer column gets labels of that shape."""
    model, _, (x, y) = classifier

    def soft(outputs, target):
        return -(target * outputs.log_softmax(-1)).sum(-1).mean()

    ckpts = [tif.Checkpoint.from_module(model, name="a")]
    with pytest.raises(InvalidArgumentError, match="one-hot or soft labels"):
        fit_curvature(tif.loss_from_module(model, soft), ckpts, (x, F.one_hot(y, 3).double()),
                      kind="dense")

    def column(outputs, target):
        return F.cross_entropy(outputs, target.squeeze(-1))

    as_column = fit_curvature(tif.loss_from_module(model, column), ckpts, (x, y[:, None]),
                              kind="dense", sampler=classification_sampler(exact=True))
    plain = fit_curvature(tif.loss_from_module(model, F.cross_entropy), ckpts, (x, y),
                          kind="dense", sampler=classification_sampler(exact=True))
    for name in plain.estimates[0]:
        torch.testing.assert_close(as_column.estimates[0][name], plain.estimates[0][name])
