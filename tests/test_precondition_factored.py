"""Adam's second moment in factored (Adafactor) form on the factorised kronecker path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_data, make_mlp
from tests.lm_helpers import explicit_kronecker
from tests.reference import loop_grads
from tracinfunc.precondition.factored import adafactor_inverse_root

BETAS, EPS = (0.8, 0.95), 1e-6


def trained(steps=3):
    model = make_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05, betas=BETAS, eps=EPS)
    x, y = make_data(16, seed=5)
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval(), optimizer


def explicit_factored(v: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(r c^T / sum(r))`` written out as an explicit matrix."""
    r, c = v.sum(dim=1), v.sum(dim=0)
    return 1 / torch.sqrt(torch.outer(r, c) / r.sum())


def test_adafactor_inverse_root_is_the_explicit_matrix():
    v = torch.rand(5, 7, dtype=torch.float64) + 0.1
    a, b = adafactor_inverse_root(v)
    torch.testing.assert_close(torch.outer(a, b), explicit_factored(v), rtol=1e-12, atol=0)
    rank_one = torch.outer(torch.rand(5, dtype=torch.float64), torch.rand(7, dtype=torch.float64))
    # a rank-one second moment is recovered exactly
    torch.testing.assert_close(torch.outer(*adafactor_inverse_root(rank_one)),
                               1 / rank_one.sqrt(), rtol=1e-10, atol=0)


@pytest.mark.parametrize("kind", ["trackstar", "adam"])
def test_factored_apply_equals_the_explicit_computation(kind):
    model, optimizer = trained()
    exact = tif.Preconditioner.from_optimizer(optimizer, model, kind=kind)
    factored = exact.as_factored()
    g = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    got = factored.apply(g)
    for name, p in model.named_parameters():
        s = exact.state[name]
        if p.dim() == 1:  # vectors keep the exact diagonal
            torch.testing.assert_close(got[name], exact.apply({name: g[name]})[name])
            continue
        t = s.step + 1
        if kind == "trackstar":
            expected = g[name] * explicit_factored(s.exp_avg_sq + s.eps)
        else:
            second = (torch.sqrt(s.beta2 * s.exp_avg_sq / (1 - s.beta2**t)) + s.eps) ** 2
            inverse = explicit_factored(second)
            expected = ((1 - s.beta1) * g[name] + s.beta1 * s.exp_avg) / (1 - s.beta1**t) \
                * inverse
        torch.testing.assert_close(got[name], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["trackstar", "adam"])
def test_factorised_path_equals_explicit_kronecker_of_preconditioned_loop_grads(kind):
    model, optimizer = trained()
    factored = tif.Preconditioner.from_optimizer(optimizer, model, kind=kind).as_factored()
    loss, batch = tif.loss_from_module(model, F.cross_entropy), make_data(5, seed=7)
    params = {name: p.detach() for name, p in model.named_parameters()}
    spec = tif.Projection(dim=16, seed=0, kind="kronecker")
    grads = loop_grads(loss, params, batch)  # {name: [n, *shape]}
    preconditioned = {name: torch.stack([factored.apply({name: g[i]})[name]
                                         for i in range(g.shape[0])])
                      for name, g in grads.items()}
    expected = explicit_kronecker(preconditioned, spec)
    fast = tif.projected_grads(loss, spec, precondition=factored)(params, batch)
    torch.testing.assert_close(fast, expected, rtol=1e-9, atol=1e-11)
    # the generic path (a memory option) applies the same factored map to materialised grads
    generic = tif.projected_grads(loss, spec, precondition=factored,
                                  options=tif.GradientOptions(memory_budget=2**20))(params, batch)
    torch.testing.assert_close(generic, expected, rtol=1e-9, atol=1e-11)


def test_factored_rows_stay_close_to_the_exact_diagonal():
    model, optimizer = trained(steps=20)
    loss, batch = tif.loss_from_module(model, F.cross_entropy), make_data(32, seed=7)
    params = {name: p.detach() for name, p in model.named_parameters()}
    spec = tif.Projection(dim=64, seed=0, kind="kronecker")
    exact = tif.Preconditioner.from_optimizer(optimizer, model, kind="trackstar")
    rows_exact = tif.projected_grads(loss, spec, precondition=exact)(params, batch)
    rows_factored = tif.projected_grads(loss, spec, precondition=exact.as_factored())(
        params, batch)
    cosine = F.cosine_similarity(rows_exact, rows_factored, dim=1)
    assert cosine.median() > 0.5  # an approximation, not a different map


def test_factored_must_be_a_bool():
    model, optimizer = trained(steps=1)
    state = tif.Preconditioner.from_optimizer(optimizer, model).state
    with pytest.raises(tif.errors.InvalidTypeError, match="factored must be True or False"):
        tif.Preconditioner("adam", state, factored="yes")


def test_a_factored_preconditioner_keeps_kronecker_off_the_generic_path(monkeypatch):
    from tracinfunc.grads import transforms

    model, optimizer = trained()
    exact = tif.Preconditioner.from_optimizer(optimizer, model, kind="adam")
    loss, batch = tif.loss_from_module(model, F.cross_entropy), make_data(4, seed=7)
    params = {name: p.detach() for name, p in model.named_parameters()}
    spec = tif.Projection(dim=16, seed=0, kind="kronecker")

    def generic(*args, **kwargs):
        raise AssertionError("materialised per-example gradients")

    monkeypatch.setattr(transforms, "_plain_projected", generic)
    tif.projected_grads(loss, spec, precondition=exact.as_factored())(params, batch)
    with pytest.raises(AssertionError, match="materialised"):
        tif.projected_grads(loss, spec, precondition=exact)(params, batch)


# ---- issue 22: the store records the factored form, so it is told apart from the exact one ----

def _stores(tmp_path, first, second):
    model, optimizer = trained()
    loss = tif.loss_from_module(model, F.cross_entropy)
    checkpoint = tif.Checkpoint.from_module(model, lr=0.1, name="a")
    exact = tif.Preconditioner.from_optimizer(optimizer, model)
    forms = {"exact": exact, "factored": exact.as_factored()}
    projection = tif.Projection(dim=8, seed=1, kind="kronecker")
    build = lambda form, path=None: tif.build_store(  # noqa: E731
        loss, [checkpoint], make_data(6, seed=1), projection=projection,
        preconditioners=[forms[form]], store=None if path is None else str(path))
    return build, build(first, tmp_path / "a.zarr"), second


def test_a_factored_adam_store_records_its_form_through_zarr(tmp_path):
    build, factored, _ = _stores(tmp_path, "factored", None)
    assert factored.meta.preconditioner == "adam-factored"
    assert tif.open_store(tmp_path / "a.zarr").meta.preconditioner == "adam-factored"
    assert build("exact").meta.preconditioner == "adam"
    from tracinfunc.store.meta import describe_preconditioner

    assert describe_preconditioner("adam-factored") == (
        "'adam-factored' (Adam, second moment in factored (Adafactor) form on matrices)")


def test_resuming_an_exact_adam_store_with_the_factored_form_is_refused_naming_both(tmp_path):
    build, exact, _ = _stores(tmp_path, "exact", None)
    assert exact.meta.preconditioner == "adam"
    with pytest.raises(tif.errors.TracInFuncError,
                       match="its preconditioner is 'adam' but this call asks for "
                             "'adam-factored'"):
        build("factored", tmp_path / "a.zarr")


def test_a_factored_test_side_is_refused_naming_the_form(tmp_path):
    build, exact, _ = _stores(tmp_path, "exact", None)
    with pytest.raises(tif.errors.IncompatibleGradientsError,
                       match=r"test gradients were preconditioned \('adam-factored'\) and the "
                             r"store's training gradients were preconditioned \('adam' \(Adam, "
                             "exact diagonal"):
        tif.score(exact, build("factored"))


def test_mixing_exact_and_factored_across_checkpoints_is_refused():
    model, optimizer = trained()
    loss = tif.loss_from_module(model, F.cross_entropy)
    exact = tif.Preconditioner.from_optimizer(optimizer, model)
    checkpoints = [tif.Checkpoint.from_module(model, lr=0.1, name=n) for n in "ab"]
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match=r"mix kinds \['adam', 'adam-factored'\].*as_factored"):
        tif.build_store(loss, checkpoints, make_data(4), projection=tif.Projection(dim=4),
                        preconditioners=[exact, exact.as_factored()])


def test_the_factored_form_of_vectors_only_is_the_exact_one():
    model, optimizer = trained()
    loss = tif.loss_from_module(model, F.cross_entropy)
    biases = [name for name, p in model.named_parameters() if p.dim() == 1]
    factored = tif.Preconditioner.from_optimizer(optimizer, model).as_factored()
    store = tif.build_store(loss, [tif.Checkpoint.from_module(model, lr=0.1)], make_data(4),
                            projection=tif.Projection(dim=4), preconditioners=[factored],
                            options=tif.GradientOptions(select=biases))
    assert store.meta.preconditioner == "adam"  # vectors keep the exact diagonal


# ---- issue 34: embedding tables keep the exact diagonal in the factored form ----

def _trained_gpt2(steps=2):
    from tests.lm_helpers import tiny_gpt2, token_batch

    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=BETAS, eps=EPS)
    for seed in range(steps):
        optimizer.zero_grad()
        ids = token_batch(n=2, seed=seed)["input_ids"]
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        optimizer.step()
    return model.eval(), optimizer


def test_embedding_tables_keep_the_exact_diagonal_and_rows_equal_the_brute_force():
    from tests.lm_helpers import hf_loop_grads, token_batch

    model, optimizer = _trained_gpt2()
    exact = tif.Preconditioner.from_optimizer(optimizer, model)
    assert exact.embeddings == {"transformer.wte.weight", "transformer.wpe.weight"}
    factored = exact.as_factored()
    assert factored.exact == exact.embeddings  # the tied head shares wte's name
    g = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    for name in factored.exact:  # the same map as the exact preconditioner
        torch.testing.assert_close(factored.apply({name: g[name]})[name],
                                   exact.apply({name: g[name]})[name], rtol=0, atol=0)
    params = {name: p.detach() for name, p in model.named_parameters()}
    batch, spec = token_batch(n=3, seed=9), tif.Projection(dim=16, seed=2, kind="kronecker")
    grads = hf_loop_grads(model, params, batch)
    preconditioned = {name: torch.stack([factored.apply({name: x[i]})[name]
                                         for i in range(x.shape[0])])
                      for name, x in grads.items()}
    expected = explicit_kronecker(preconditioned, spec)
    fast = tif.projected_grads(tif.causal_lm_loss(model), spec, precondition=factored)(
        params, batch)
    torch.testing.assert_close(fast, expected, rtol=1e-9, atol=1e-11)
    everything = exact.as_factored(exact=[])  # the old form: every matrix factored
    assert everything.exact == frozenset() and everything.factorises("transformer.wte.weight")
    old = tif.projected_grads(tif.causal_lm_loss(model), spec, precondition=everything)(
        params, batch)
    assert not torch.allclose(old, fast)


def test_exact_names_must_have_state():
    model, optimizer = trained(steps=1)
    exact = tif.Preconditioner.from_optimizer(optimizer, model)
    assert exact.embeddings == frozenset()  # an MLP has no embedding table
    with pytest.raises(tif.errors.InvalidArgumentError, match=r"exact names \['nope'\]"):
        tif.Preconditioner("adam", exact.state, factored=True, exact=["nope"])
    with pytest.raises(tif.errors.InvalidTypeError, match="collection of parameter names"):
        tif.Preconditioner("adam", exact.state, factored=True, exact="0.weight")
