"""atk50d: a second adversarial pass over the atk50/atk50b/atk50c fixes.

Surfaces: the per-batch module locks of hand-written losses (threads), the half-precision
tolerance of the batched proof, ``kind="kronecker"`` with 0-d and empty parameters, and
projection fields given as NumPy scalars. Written from the docs only.
"""

from __future__ import annotations

import functools
import json
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call

import tracinfunc as tif
from tests.numpy_projection import project
from tracinfunc.errors import InvalidProjectionError, LossFunctionError, TracInFuncError
from tracinfunc.grads.factorized_batched import BatchedPathWarning

JOIN = 120.0  # a hang detector only: generous, so machine load never trips it


# --------------------------------------------------------------------------- helpers


class Two(nn.Module):
    def __init__(self, d_in=5, d_hid=6, d_out=3):
        super().__init__()
        self.a = nn.Linear(d_in, d_hid)
        self.b = nn.Linear(d_hid, d_out)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        time.sleep(0.002)  # hold the swapped-in tensors long enough for a race to show
        return self.b(h)


def _params(model, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g, dtype=dtype) for n, p in model.named_parameters()}


def _data(n=6, d_in=5, d_out=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g, dtype=dtype), torch.randint(0, d_out, (n,),
                                                                         generator=g)


def _loop_ref(fn, params, batch):
    """Per-example gradients by a plain autograd loop: ``fn(params, x, y) -> scalar``."""
    x, y = batch
    names = sorted(params)
    out = {n: [] for n in names}
    for i in range(x.shape[0]):
        ps = {n: params[n].detach().clone().requires_grad_(True) for n in names}
        gs = torch.autograd.grad(fn(ps, x[i], y[i]), [ps[n] for n in names], allow_unused=True)
        for n, g in zip(names, gs, strict=False):
            out[n].append(torch.zeros_like(ps[n]) if g is None else g)
    return {n: torch.stack(v) for n, v in out.items()}


def _close(got, want, atol=1e-10):
    assert set(got) == set(want), (sorted(got), sorted(want))
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=atol, rtol=1e-8, msg=n)


def _run_threads(targets):
    results, errors = {}, {}

    def wrap(key, fn):
        try:
            results[key] = fn()
        except BaseException as e:
            errors[key] = e

    threads = [threading.Thread(target=wrap, args=(k, f), daemon=True) for k, f in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN)
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads hung: {alive}"
    return results, errors


# --------------------------------------------------------------------------- 1. locks

_GLOBAL_MODEL = Two().double()


def _global_loss(p, ex):
    x, y = ex
    out = functional_call(_GLOBAL_MODEL, p, (x[None],))
    return nn.functional.cross_entropy(out, y[None])


def _ref_whole(model):
    def f(p, x, y):
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])
    return f


@pytest.mark.parametrize("n_threads", [2, 4])
def test_closure_loss_many_threads_exact(n_threads):
    model = Two().double()

    def loss(p, ex):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    psg = tif.grads.per_sample_grads(loss)
    batch = _data()
    ckpts = [_params(model, s) for s in range(n_threads)]
    refs = [_loop_ref(_ref_whole(model), c, batch) for c in ckpts]

    def work(i):
        return [psg(ckpts[i], batch) for _ in range(8)]

    res, err = _run_threads([(i, functools.partial(work, i)) for i in range(n_threads)])
    assert not err, err
    for i in range(n_threads):
        for got in res[i]:
            _close(got, refs[i])


@pytest.mark.parametrize("form", ["global", "partial", "bound", "helper", "partial_kw",
                                  "nested_partial", "lambda", "wraps"])
def test_lookup_forms_threads_projected_exact(form):
    """Every documented way a loss names its module, two threads, kronecker + rademacher."""
    if form == "global":
        model, loss = _GLOBAL_MODEL, _global_loss
    else:
        model = Two().double()

        def plain(m, p, ex):
            x, y = ex
            return nn.functional.cross_entropy(functional_call(m, p, (x[None],)), y[None])

        if form == "partial":
            loss = functools.partial(plain, model)
        elif form == "bound":
            class Holder(nn.Module):  # the bound method's object is a module holding model
                def __init__(self, m):
                    super().__init__()
                    self.m = m

                def loss(self, p, ex):
                    return plain(self.m, p, ex)
            loss = Holder(model).loss
        elif form == "helper":
            def loss(p, ex):  # names `model` via a helper that names it
                return helper(p, ex)

            def helper(p, ex):
                return plain(model, p, ex)
        elif form == "partial_kw":
            loss = functools.partial(lambda p, ex, m: plain(m, p, ex), m=model)
        elif form == "nested_partial":
            loss = functools.partial(functools.partial(plain, model))
        elif form == "lambda":
            loss = lambda p, ex: plain(model, p, ex)  # noqa: E731
        else:
            inner = functools.partial(plain, model)

            @functools.wraps(plain)
            def loss(p, ex):
                return inner(p, ex)
    batch = _data()
    ckpts = [_params(model, 10), _params(model, 11)]
    for proj in (tif.Projection(dim=12, kind="kronecker"), tif.Projection(dim=12)):
        fn = tif.projected_grads(loss, proj)
        want = [fn(c, batch) for c in ckpts]

        def work(i, fn=fn):
            return [fn(ckpts[i], batch) for _ in range(6)]

        res, err = _run_threads([(i, functools.partial(work, i)) for i in range(2)])
        assert not err, err
        for i in range(2):
            for got in res[i]:
                torch.testing.assert_close(got, want[i], atol=1e-10, rtol=1e-8)


def test_overlapping_module_sets_three_threads():
    """model vs model.a vs model.b in three threads, with different checkpoints."""
    model = Two().double()
    batch = _data()

    def whole(p, ex):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    def only_b(p, ex):
        x, y = ex
        h = torch.tanh(x[:6] if x.shape[0] >= 6 else torch.cat([x, x])[:6])
        return nn.functional.cross_entropy(functional_call(model.b, p, (h[None],)), y[None])

    def only_a(p, ex):
        x, _ = ex
        return functional_call(model.a, p, (x[None],)).pow(2).sum()

    pw = _params(model, 1)
    pb = {k[2:]: v for k, v in _params(model, 2).items() if k.startswith("b.")}
    pa = {k[2:]: v for k, v in _params(model, 3).items() if k.startswith("a.")}
    cases = {"whole": (whole, pw), "b": (only_b, pb), "a": (only_a, pa)}
    want = {k: tif.grads.per_sample_grads(f)(p, batch) for k, (f, p) in cases.items()}
    fns = {k: tif.grads.per_sample_grads(f) for k, (f, _) in cases.items()}

    def work(k):
        return [fns[k](cases[k][1], batch) for _ in range(10)]

    res, err = _run_threads([(k, functools.partial(work, k)) for k in cases])
    assert not err, err
    for k in cases:
        for got in res[k]:
            _close(got, want[k])
    _close(want["whole"], _loop_ref(_ref_whole(model), pw, batch))


def test_two_models_sharing_a_submodule():
    """m1 = (shared, h1), m2 = (shared, h2): the shared layer is swapped by both."""
    shared = nn.Linear(5, 6).double()
    m1 = nn.Sequential(shared, nn.Tanh(), nn.Linear(6, 3)).double()
    m2 = nn.Sequential(shared, nn.Tanh(), nn.Linear(6, 3)).double()
    batch = _data()

    def l1(p, ex):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(m1, p, (x[None],)), y[None])

    def l2(p, ex):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(m2, p, (x[None],)), y[None])

    p1, p2 = _params(m1, 4), _params(m2, 5)
    want1 = _loop_ref(_ref_whole(m1), p1, batch)
    want2 = _loop_ref(_ref_whole(m2), p2, batch)
    f1, f2 = tif.grads.per_sample_grads(l1), tif.grads.per_sample_grads(l2)
    res, err = _run_threads([(1, lambda: [f1(p1, batch) for _ in range(10)]),
                             (2, lambda: [f2(p2, batch) for _ in range(10)])])
    assert not err, err
    for got in res[1]:
        _close(got, want1)
    for got in res[2]:
        _close(got, want2)


def test_nested_call_same_thread_reentrant():
    """A loss that itself calls per_sample_grads on its own model: no self-deadlock."""
    model = Two().double()
    batch = _data(n=4)
    const = _params(model, 7)
    inner_batch = _data(n=2, seed=3)

    def inner(p, ex):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    scale = 1.0 + float(sum(v.pow(2).sum() for v in
                            tif.grads.per_sample_grads(inner)(const, inner_batch).values()))

    def outer(p, ex):
        g = tif.grads.per_sample_grads(inner)(const, inner_batch)
        s = 1.0 + sum(v.pow(2).sum() for v in g.values())
        x, y = ex
        return s * nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    p = _params(model, 8)
    res, err = _run_threads([(0, lambda: tif.grads.per_sample_grads(outer)(p, batch))])
    assert not err, err
    want = {k: v * scale for k, v in _loop_ref(_ref_whole(model), p, batch).items()}
    _close(res[0], want, atol=1e-9)


def test_loss_naming_both_models_locks_both_no_cycle():
    """The outer loss's closure reaches the inner loss, which names the other model: both
    locks are taken at once, so two threads nesting the other way round simply take turns."""
    m1, m2 = Two().double(), Two().double()
    batch = _data(n=2)
    p1, p2 = _params(m1, 1), _params(m2, 2)
    entered = {1: threading.Event(), 2: threading.Event()}
    overlapped = {}

    def make(own, other, me, you, p_other):
        def inner(p, ex):
            x, y = ex
            return nn.functional.cross_entropy(functional_call(other, p, (x[None],)), y[None])

        def outer(p, ex):
            x, y = ex
            entered[me].set()
            overlapped[me] = entered[you].wait(2)
            tif.grads.per_sample_grads(inner)(p_other, batch)
            return nn.functional.cross_entropy(functional_call(own, p, (x[None],)), y[None])
        return outer

    o1 = make(m1, m2, 1, 2, p2)
    o2 = make(m2, m1, 2, 1, p1)
    res, err = _run_threads([(1, lambda: tif.grads.per_sample_grads(o1)(p1, batch)),
                             (2, lambda: tif.grads.per_sample_grads(o2)(p2, batch))])
    assert not err, err
    assert False in overlapped.values()  # they took turns
    _close(res[1], _loop_ref(_ref_whole(m1), p1, batch))
    _close(res[2], _loop_ref(_ref_whole(m2), p2, batch))


def test_opposite_order_nesting_is_an_error_not_a_hang():
    """The other model is reached through a list (not found by the walk), so each outer loss
    holds only its own model and the nested calls close a cycle: a LossFunctionError for one
    thread, never a hang; the other thread finishes with exact rows."""
    models = [Two().double(), Two().double()]
    batch = _data(n=2)
    ps = [_params(models[0], 1), _params(models[1], 2)]
    entered = [threading.Event(), threading.Event()]

    def make_inner(m):
        def inner(q, e):
            x, y = e
            return nn.functional.cross_entropy(functional_call(m, q, (x[None],)), y[None])
        return inner

    inners = [make_inner(models[0]), make_inner(models[1])]  # reached via a list: not walked

    def make(me):
        own, you = models[me], 1 - me

        def outer(p, ex):
            x, y = ex
            entered[me].set()
            entered[you].wait(10)
            tif.grads.per_sample_grads(inners[you])(ps[you], batch)
            return nn.functional.cross_entropy(functional_call(own, p, (x[None],)), y[None])
        return outer

    outers = [make(0), make(1)]
    res, err = _run_threads([(i, functools.partial(
        lambda i: tif.grads.per_sample_grads(outers[i])(ps[i], batch), i)) for i in range(2)])
    assert err, "no cycle formed (test premise)"
    assert len(err) == 1, err
    for e in err.values():
        assert isinstance(e, LossFunctionError), repr(e)
    (ok,) = res
    _close(res[ok], _loop_ref(_ref_whole(models[ok]), ps[ok], batch))
    # No lock leaked: the failed side runs again from a fresh thread.
    (bad,) = err
    res2, err2 = _run_threads([(bad, lambda: tif.grads.per_sample_grads(outers[bad])(
        ps[bad], batch))])
    assert not err2, err2
    _close(res2[bad], _loop_ref(_ref_whole(models[bad]), ps[bad], batch))


class _MyBase(BaseException):
    pass


@pytest.mark.parametrize("exc", [ValueError("boom"), _MyBase("base"), SystemExit(3),
                                 KeyboardInterrupt()])
def test_exception_in_loss_leaks_no_lock(exc):
    model = Two().double()
    batch = _data(n=3)
    p = _params(model, 1)

    def bad(p, ex):
        _x, _y = ex
        functional_call(model.b, {k[2:]: v for k, v in p.items() if k.startswith("b.")},
                        (torch.zeros(1, 6, dtype=torch.float64),))
        raise exc

    def good(p, ex):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    res, err = _run_threads([(0, lambda: tif.grads.per_sample_grads(bad)(p, batch))])
    assert 0 in err
    res, err = _run_threads([(1, lambda: tif.grads.per_sample_grads(good)(p, batch)),
                             (2, lambda: tif.projected_grads(good, tif.Projection(
                                 dim=8, kind="kronecker"))(p, batch))])
    assert not err, err
    _close(res[1], _loop_ref(_ref_whole(model), p, batch))
    # The module holds its own parameters again.
    for n, t in model.named_parameters():
        assert isinstance(t, nn.Parameter) and t.dtype == torch.float64, n


def test_loss_waiting_on_other_thread_submodule_call():
    """A loss joins a thread whose tracinfunc call names model.b: that call waits for the lock
    (documented), so the join times out; afterwards both finish with exact rows."""
    model = Two().double()
    batch = _data(n=3)
    p = _params(model, 1)
    pb = {k[2:]: v for k, v in _params(model, 2).items() if k.startswith("b.")}

    def on_b(q, ex):
        x, _y = ex
        return functional_call(model.b, q, (x[:1].expand(6)[None],)).pow(2).sum()

    want_b = tif.grads.per_sample_grads(on_b)(pb, batch)
    out_b, state = {}, {"joined_early": None}

    def run_b():
        out_b["g"] = tif.grads.per_sample_grads(on_b)(pb, batch)

    def whole(q, ex):
        x, y = ex
        if state["joined_early"] is None:
            t = threading.Thread(target=run_b, daemon=True)
            t.start()
            t.join(1.0)
            state["joined_early"] = not t.is_alive()
            state["t"] = t
        return nn.functional.cross_entropy(functional_call(model, q, (x[None],)), y[None])

    got = tif.grads.per_sample_grads(whole)(p, batch)
    state["t"].join(JOIN)
    assert not state["t"].is_alive()
    assert state["joined_early"] is False  # model.b waited for the whole-model lock
    _close(got, _loop_ref(_ref_whole(model), p, batch))
    _close(out_b["g"], want_b)


def test_two_different_models_run_concurrently():
    """Locks of two unrelated models never serialise: each loss sees the other running."""
    m1, m2 = Two().double(), Two().double()
    batch = _data(n=2)
    ev = {1: threading.Event(), 2: threading.Event()}
    seen = {}

    def make(m, me, you):
        def loss(p, ex):
            x, y = ex
            ev[me].set()
            seen[me] = ev[you].wait(15)
            return nn.functional.cross_entropy(functional_call(m, p, (x[None],)), y[None])
        return loss

    l1, l2 = make(m1, 1, 2), make(m2, 2, 1)
    p1, p2 = _params(m1, 1), _params(m2, 2)
    res, err = _run_threads([(1, lambda: tif.grads.per_sample_grads(l1)(p1, batch)),
                             (2, lambda: tif.grads.per_sample_grads(l2)(p2, batch))])
    assert not err, err
    assert seen == {1: True, 2: True}
    _close(res[1], _loop_ref(_ref_whole(m1), p1, batch))


def test_build_store_threads_partial_loss_kronecker():
    model = Two().double()

    def plain(m, p, ex):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(m, p, (x[None],)), y[None])

    loss = functools.partial(plain, model)
    batch = _data(n=8)
    proj = tif.Projection(dim=12, kind="kronecker", vectors="kronecker")
    cks = {i: [tif.Checkpoint(_params(model, 20 + i))] for i in range(3)}
    want = {i: tif.projected_grads(loss, proj)(_params(model, 20 + i), batch) for i in range(3)}

    def work(i):
        return tif.build_store(loss, cks[i], batch, projection=proj, batch_size=3,
                               dtype=torch.float64, progress=False)

    res, err = _run_threads([(i, functools.partial(work, i)) for i in range(3)])
    assert not err, err
    for i in range(3):
        s = tif.score(res[i], want[i][None])
        torch.testing.assert_close(s, want[i] @ want[i].T, atol=1e-9, rtol=1e-9)


# --------------------------------------------------------------------------- 2. half precision


class Mix(nn.Module):
    """Linear -> mix each example with the batch mean by ``alpha`` -> Linear."""

    def __init__(self, alpha, d_in=8, d_hid=8, d_out=4):
        super().__init__()
        self.alpha = alpha
        self.fc1 = nn.Linear(d_in, d_hid)
        self.fc2 = nn.Linear(d_hid, d_out)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = h + self.alpha * (h.mean(0, keepdim=True) - h)
        return self.fc2(h)


def _mix_setup(alpha, dtype, n=8):
    torch.manual_seed(0)
    model = Mix(alpha).to(dtype).eval()
    loss = tif.loss.loss_from_module(model, nn.functional.cross_entropy)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g).to(dtype)
    y = torch.randint(0, 4, (n,), generator=g)
    return model, loss, params, (x, y)


def _per_example_rows(loss, params, batch, proj):
    """Rows of each example alone (batch of one): no batch mixing possible."""
    fn = tif.projected_grads(loss, tif.Projection(dim=proj.dim, seed=proj.seed, kind="rademacher"))
    x, y = batch
    return torch.cat([fn(params, (x[i:i + 1], y[i:i + 1])) for i in range(x.shape[0])])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_mlp_module_loss_no_warning_and_close(dtype):
    _model, loss, params, batch = _mix_setup(0.0, dtype)
    proj = tif.Projection(dim=16, kind="kronecker")
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchedPathWarning)
        rows = tif.projected_grads(loss, proj)(params, batch)
    assert rows.dtype == dtype
    p64 = {k: v.double() for k, v in params.items()}
    m64 = Mix(0.0).double()
    ref = np.stack([project({k: v[i].numpy() for k, v in _loop_ref(
        _ref_whole(m64), p64, (batch[0].double(), batch[1])).items()}, 0, "kronecker", 16)
        for i in range(batch[0].shape[0])])
    err = np.abs(rows.double().numpy() - ref).max() / np.abs(ref).max()
    assert err < 0.05, err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32,
                                   torch.float64])
def test_strong_mixing_detected_in_every_precision(dtype):
    """10% batch-mean mixing: must be refused by the proof and the slow path used."""
    _model, loss, params, batch = _mix_setup(0.1, dtype)
    proj = tif.Projection(dim=16, kind="kronecker")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        rows = tif.projected_grads(loss, proj)(params, batch)
    assert any(issubclass(w.category, BatchedPathWarning) for w in rec), [str(w.message)
                                                                         for w in rec]
    # With the slow mode the rows equal those of each example alone.
    alone = torch.cat([tif.projected_grads(loss, proj)(params, (batch[0][i:i + 1],
                                                                 batch[1][i:i + 1]))
                       for i in range(batch[0].shape[0])])
    tol = {torch.bfloat16: 0.05, torch.float16: 0.01, torch.float32: 1e-4,
           torch.float64: 1e-9}[dtype]
    scale = alone.double().abs().max()
    assert (rows.double() - alone.double()).abs().max() / scale < tol


@pytest.mark.parametrize("dtype,alpha", [(torch.float32, 0.01), (torch.float64, 1e-4)])
def test_weak_mixing_detected_full_precision(dtype, alpha):
    """float32 keeps 1e-3, float64 keeps 1e-6: mixing above those is still caught."""
    _model, loss, params, batch = _mix_setup(alpha, dtype)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        tif.projected_grads(loss, tif.Projection(dim=16, kind="kronecker"))(params, batch)
    assert any(issubclass(w.category, BatchedPathWarning) for w in rec)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_hand_written_loss_kronecker_close(dtype):
    model = Two().to(dtype).eval()
    params = {k: v.detach().clone() for k, v in _params(model, 3, torch.float32).items()}
    params = {k: v.to(dtype) for k, v in params.items()}
    x, y = _data(n=6, dtype=torch.float32)
    batch = (x.to(dtype), y)

    def loss(p, ex):
        xx, yy = ex
        return nn.functional.cross_entropy(functional_call(model, p, (xx[None],)).float(),
                                           yy[None])

    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchedPathWarning)
        rows = tif.projected_grads(loss, tif.Projection(dim=12, kind="kronecker"))(params, batch)
    m64 = Two().double()
    p64 = {k: v.double() for k, v in params.items()}
    g = _loop_ref(_ref_whole(m64), p64, (batch[0].double(), y))
    ref = np.stack([project({k: v[i].numpy() for k, v in g.items()}, 0, "kronecker", 12)
                    for i in range(6)])
    err = np.abs(rows.double().numpy() - ref).max() / np.abs(ref).max()
    assert err < 0.05, err


def _tiny_gpt2(dtype):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_gpt2_causal_lm_no_spurious_fallback(dtype):
    from tracinfunc.lm import causal_lm_loss

    model = _tiny_gpt2(dtype)
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 50, (4, 10), generator=g)}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        rows = tif.projected_grads(causal_lm_loss(model), tif.Projection(dim=64, kind="kronecker"),
                                   options=tif.GradientOptions(select=["transformer.h.*"]))(
            params, batch)
    assert not [w for w in rec if issubclass(w.category, BatchedPathWarning)], \
        [str(w.message) for w in rec]
    # Against the float32 model's rows (same weights): within half-precision rounding.
    m32 = _tiny_gpt2(torch.float32)
    m32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    p32 = {k: v.detach() for k, v in m32.named_parameters()}
    ref = tif.projected_grads(causal_lm_loss(m32), tif.Projection(dim=64, kind="kronecker"),
                              options=tif.GradientOptions(select=["transformer.h.*"]))(p32, batch)
    cos = nn.functional.cosine_similarity(rows.float(), ref, dim=1)
    assert cos.min() > 0.95, cos


# --------------------------------------------------------------------------- 3. 0-d / empty


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.empty = nn.Parameter(torch.zeros(0))
        self.empty2 = nn.Parameter(torch.zeros(0, 3))

    def forward(self, x):
        return self.scale * self.fc(x) + self.empty.sum() + self.empty2.sum()


def _odd_setup():
    torch.manual_seed(0)
    model = Odd().double().eval()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (5,), generator=g)
    return model, params, (x, y)


def _odd_ref(model, params, batch, names, vectors, dim=12):
    g = _loop_ref(_ref_whole(model), params, batch)
    return np.stack([project({k: g[k][i].numpy() for k in names}, 0, "kronecker", dim,
                             vectors=vectors) for i in range(batch[0].shape[0])])


@pytest.mark.parametrize("vectors", ["dense", "kronecker"])
@pytest.mark.parametrize("form", ["module", "hand"])
@pytest.mark.parametrize("chunk", [None, 2])
def test_kronecker_scalar_and_empty_params(vectors, form, chunk):
    model, params, batch = _odd_setup()
    if form == "module":
        loss = tif.loss.loss_from_module(model, nn.functional.cross_entropy)
    else:
        def loss(p, ex):
            x, y = ex
            return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])
    proj = tif.Projection(dim=12, kind="kronecker", vectors=vectors)
    rows = tif.projected_grads(loss, proj, options=tif.GradientOptions(chunk_size=chunk))(
        params, batch)
    ref = _odd_ref(model, params, batch, sorted(params), vectors)
    np.testing.assert_allclose(rows.numpy(), ref, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("vectors", ["dense", "kronecker"])
@pytest.mark.parametrize("select", [["scale", "fc.weight"], ["scale", "empty"], ["scale"],
                                    ["empty2", "fc.bias"]])
def test_kronecker_select_scalar_and_empty(vectors, select):
    model, params, batch = _odd_setup()
    loss = tif.loss.loss_from_module(model, nn.functional.cross_entropy)
    proj = tif.Projection(dim=12, kind="kronecker", vectors=vectors)
    rows = tif.projected_grads(loss, proj, options=tif.GradientOptions(select=select))(
        params, batch)
    ref = _odd_ref(model, params, batch, sorted(select), vectors)
    np.testing.assert_allclose(rows.numpy(), ref, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("vectors", ["dense", "kronecker"])
def test_kronecker_scalar_empty_build_store_and_score(vectors):
    model, params, batch = _odd_setup()
    loss = tif.loss.loss_from_module(model, nn.functional.cross_entropy)
    proj = tif.Projection(dim=12, kind="kronecker", vectors=vectors)
    ck = [tif.Checkpoint(params, lr=0.5)]
    store = tif.build_store(loss, ck, batch, projection=proj, dtype=torch.float64,
                            batch_size=2, progress=False)
    test = tif.build_store(loss, ck, (batch[0][:2], batch[1][:2]), projection=store.projection,
                           dtype=torch.float64, progress=False)
    s = tif.score(store, test)
    ref = _odd_ref(model, params, batch, sorted(params), vectors)
    np.testing.assert_allclose(s.numpy(), 0.5 * ref[:2] @ ref.T, atol=1e-8, rtol=1e-6)


# --------------------------------------------------------------------------- 4. NumPy fields


def _np_proj():
    return tif.Projection(dim=np.int64(12), seed=np.int32(3), kind=np.str_("kronecker"),
                          nnz=np.int64(1), split=np.str_("shape"),
                          vectors=np.str_("kronecker"))


def test_numpy_fields_equal_hash_and_json():
    a = _np_proj()
    b = tif.Projection(dim=12, seed=3, kind="kronecker", split="shape", vectors="kronecker")
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    d = a.to_dict()
    text = json.dumps(d)
    for k, v in d.items():
        assert type(v) in (int, str, bool, float, type(None)), (k, type(v))
    assert tif.Projection.from_dict(json.loads(text)) == b
    assert repr(a) == repr(b)


def test_numpy_per_checkpoint_bool_refused_clearly():
    with pytest.raises(InvalidProjectionError, match="per_checkpoint must be True or False"):
        tif.Projection(dim=16, per_checkpoint=np.bool_(True))


def test_numpy_sjlt_nnz_and_checkpoint_name():
    a = tif.Projection(dim=np.uint16(16), kind=np.str_("sjlt"), nnz=np.int8(4),
                       per_checkpoint=True)
    b = tif.Projection(dim=16, kind="sjlt", nnz=4, per_checkpoint=True)
    assert a == b and hash(a) == hash(b)
    json.dumps(a.to_dict())
    assert a.for_checkpoint(np.str_("c0")) == b.for_checkpoint("c0")
    json.dumps(a.for_checkpoint(np.str_("c0")).to_dict())


@pytest.mark.parametrize("bad", [dict(dim=np.float64(12.0)), dict(dim=12.0),
                                 dict(seed=np.float32(1.0)), dict(dim=np.bool_(True)),
                                 dict(dim=np.int64(-4)), dict(kind=np.bytes_(b"sjlt"))])
def test_numpy_non_int_fields_refused(bad):
    with pytest.raises((InvalidProjectionError, TracInFuncError)):
        tif.Projection(**bad)


def test_numpy_projection_store_metadata_roundtrip(tmp_path):
    model, params, batch = _odd_setup()
    loss = tif.loss.loss_from_module(model, nn.functional.cross_entropy)
    ck = [tif.Checkpoint(params, name=np.str_("c0"))]
    path = str(tmp_path / "s.zarr")
    store = tif.build_store(loss, ck, batch, projection=_np_proj(), store=path,
                            dtype=torch.float64, progress=False)
    plain = tif.Projection(dim=12, seed=3, kind="kronecker", split="shape", vectors="kronecker")
    reopened = tif.GradientStore.open(path)
    assert reopened.projection == plain == store.projection
    meta = tif.store.read_store_meta(path)
    assert meta.projection == plain
    test = tif.build_store(loss, [tif.Checkpoint(params, name="c0")], batch, projection=plain,
                           dtype=torch.float64, progress=False)
    s = tif.score(reopened, test)
    assert s.shape == (5, 5)


# --------------------------------------------------------------------------- more


def test_threads_with_chunk_size_and_select_exact():
    model = Two().double()

    def loss(p, ex, m=model):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(m, p, (x[None],)), y[None])

    batch = _data(n=7)
    ckpts = [_params(model, 30 + i) for i in range(3)]
    opts = [tif.GradientOptions(chunk_size=2), tif.GradientOptions(select=["b.*"]),
            tif.GradientOptions(chunk_size=3, select=["a.weight", "b.bias"])]
    fns = [tif.grads.per_sample_grads(loss, options=o) for o in opts]
    kfn = tif.projected_grads(loss, tif.Projection(dim=12, kind="kronecker"),
                              options=tif.GradientOptions(chunk_size=2))
    want = [fns[i](ckpts[i], batch) for i in range(3)]
    kwant = [kfn(c, batch) for c in ckpts]
    full = [_loop_ref(_ref_whole(model), c, batch) for c in ckpts]
    for i in range(3):
        _close(want[i], {k: full[i][k] for k in want[i]})

    def work(i):
        return [(fns[i](ckpts[i], batch), kfn(ckpts[i], batch)) for _ in range(5)]

    res, err = _run_threads([(i, functools.partial(work, i)) for i in range(3)])
    assert not err, err
    for i in range(3):
        for g, k in res[i]:
            _close(g, want[i])
            torch.testing.assert_close(k, kwant[i], atol=1e-10, rtol=1e-8)


def test_half_reproof_when_a_later_call_has_more_examples():
    """A first call of one example cannot show mixing; the 8-example call must be proved."""
    _model, loss, params, batch = _mix_setup(0.1, torch.bfloat16)
    fn = tif.projected_grads(loss, tif.Projection(dim=16, kind="kronecker"))
    fn(params, (batch[0][:1], batch[1][:1]))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        rows = fn(params, batch)
    assert any(issubclass(w.category, BatchedPathWarning) for w in rec)
    alone = torch.cat([fn(params, (batch[0][i:i + 1], batch[1][i:i + 1])) for i in range(8)])
    assert ((rows.double() - alone.double()).abs().max() / alone.double().abs().max()) < 0.05


def test_half_hand_written_loss_two_threads_kronecker():
    model = Two().to(torch.bfloat16).eval()

    def loss(p, ex):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)).float(),
                                           y[None])

    x, y = _data(n=6, dtype=torch.float32)
    batch = (x.bfloat16(), y)
    ckpts = [{k: v.bfloat16() for k, v in _params(model, s, torch.float32).items()}
             for s in (40, 41)]
    fn = tif.projected_grads(loss, tif.Projection(dim=12, kind="kronecker"))
    want = [fn(c, batch) for c in ckpts]

    def work(i):
        return [fn(ckpts[i], batch) for _ in range(6)]

    res, err = _run_threads([(i, functools.partial(work, i)) for i in range(2)])
    assert not err, err
    for i in range(2):
        for got in res[i]:
            torch.testing.assert_close(got, want[i], atol=0, rtol=0)


def test_nested_parent_then_submodule_same_thread():
    """Outer loss names model, a nested call names model.b: re-entrant across parent/child."""
    model = Two().double()
    batch = _data(n=3)
    p = _params(model, 1)
    pb = {k[2:]: v for k, v in _params(model, 2).items() if k.startswith("b.")}

    def on_b(q, ex):
        x, _y = ex
        return functional_call(model.b, q, (x[:1].expand(6)[None],)).pow(2).sum()

    want_b = _loop_ref(lambda q, x, y: on_b(q, (x, y)), pb, batch)
    seen = []

    def outer(q, ex):
        seen.append(tif.grads.per_sample_grads(on_b)(pb, batch))
        x, y = ex
        return nn.functional.cross_entropy(functional_call(model, q, (x[None],)), y[None])

    res, err = _run_threads([(0, lambda: tif.grads.per_sample_grads(outer)(p, batch))])
    assert not err, err
    _close(res[0], _loop_ref(_ref_whole(model), p, batch))
    _close(seen[0], want_b)


@pytest.mark.parametrize("shape", ["a_b", "child_parent"])
def test_opposite_nesting_over_submodules_no_hang(shape):
    """Thread 1 holds model.a and nests a call on model.b (or the whole model); thread 2 the
    other way round: one LossFunctionError, never a hang, no lock leaked."""
    model = Two().double()
    batch = _data(n=2)
    subs = {"a": model.a, "b": model.b}
    prm = {s: {k[2:]: v for k, v in _params(model, 3).items() if k.startswith(s + ".")}
           for s in "ab"}
    whole_p = _params(model, 4)

    def make_leaf(m):
        def leaf(q, e):
            x, _ = e
            return functional_call(m, q, (x[None, : m.in_features],)).pow(2).sum()
        return leaf

    def whole(q, e):
        x, y = e
        return nn.functional.cross_entropy(functional_call(model, q, (x[None],)), y[None])

    leaves = {"a": make_leaf(subs["a"]), "b": make_leaf(subs["b"])}
    wide = _data(n=2, d_in=6)
    entered = {"a": threading.Event(), "b": threading.Event()}

    def make(me, you):
        own = subs[me]
        if shape == "a_b":
            table = [(leaves[you], prm[you], batch if you == "a" else wide)]
        else:
            table = [(whole, whole_p, batch)]

        def outer(q, e):
            x, _ = e
            entered[me].set()
            entered[you].wait(10)
            f, pp, dd = table[0]
            tif.grads.per_sample_grads(f)(pp, dd)
            return functional_call(own, q, (x[None, : own.in_features],)).pow(2).sum()
        return outer

    outers = {"a": make("a", "b"), "b": make("b", "a")}
    data = {"a": batch, "b": wide}
    res, err = _run_threads([(s, functools.partial(
        lambda s: tif.grads.per_sample_grads(outers[s])(prm[s], data[s]), s)) for s in "ab"])
    assert len(err) == 1, (err, list(res))
    assert all(isinstance(e, LossFunctionError) for e in err.values()), err
    # A fresh thread on the whole model proceeds.
    res2, err2 = _run_threads([(0, lambda: tif.grads.per_sample_grads(whole)(whole_p, batch))])
    assert not err2, err2
    _close(res2[0], _loop_ref(_ref_whole(model), whole_p, batch))


class _Weird:
    """Unhashable, with raising comparisons and truth value."""

    __hash__ = None

    def __eq__(self, other):
        raise RuntimeError("no eq")

    def __bool__(self):
        raise RuntimeError("no bool")


_NP_DEFAULT = np.ones(3)
_T_DEFAULT = torch.ones(2)
_WEIRD = _Weird()
_DICT_DEFAULT = {"k": [1]}


def _mutual_a(model, p, ex, depth=0):
    if depth > 5:
        return _mutual_b(model, p, ex, depth + 1)
    x, y = ex
    return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])


def _mutual_b(model, p, ex, depth):
    return _mutual_a(model, p, ex, depth)


def test_walk_survives_odd_closures_and_defaults():
    """Empty cells, unhashable/raising defaults, NumPy defaults, mutual recursion, a name
    never defined: the walk neither crashes nor loops, and rows are exact in threads."""
    model = Two().double()
    batch = _data(n=4)

    def build():
        def loss(p, ex, w=_NP_DEFAULT, t=_T_DEFAULT, odd=_WEIRD, d=_DICT_DEFAULT):
            if ex[0].shape[0] < 0:
                return later + _NEVER_DEFINED  # noqa: F821
            return _mutual_a(model, p, ex)
        lossp = loss
        later = None
        return lossp, later

    loss, _ = build()
    ckpts = [_params(model, 50), _params(model, 51)]
    fn = tif.grads.per_sample_grads(loss)
    kfn = tif.projected_grads(loss, tif.Projection(dim=12, kind="kronecker"))
    res, err = _run_threads([(i, functools.partial(
        lambda i: [(fn(ckpts[i], batch), kfn(ckpts[i], batch)) for _ in range(5)], i))
        for i in range(2)])
    assert not err, err
    for i in range(2):
        want = _loop_ref(_ref_whole(model), ckpts[i], batch)
        for g, _k in res[i]:
            _close(g, want)


def test_walk_empty_cell_at_call_time():
    model = Two().double()
    batch = _data(n=3)

    def build():
        def loss(p, ex):
            if ex[0].shape[0] < 0:
                return unset
            x, y = ex
            return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])
        got = tif.grads.per_sample_grads(loss)(_params(model, 1), batch)
        unset = 0
        return got

    res, err = _run_threads([(0, build)])
    assert not err, err
    _close(res[0], _loop_ref(_ref_whole(model), _params(model, 1), batch))


@pytest.mark.parametrize("data,ok", [
    ({"dim": np.int64(12), "seed": np.uint32(3), "kind": np.str_("kronecker")}, True),
    ({"dim": 12.0, "kind": "kronecker"}, False),
    ({"dim": 12, "seed": np.uint64(2 ** 63)}, False),
    ({"dim": 12, "seed": np.int64(-1)}, False),
    ({"dim": 12, "nnz": np.float64(1.0)}, False),
])
def test_from_dict_numpy_and_float_values(data, ok):
    if ok:
        got = tif.Projection.from_dict(data)
        assert got == tif.Projection(dim=12, seed=3, kind="kronecker")
        assert json.loads(json.dumps(got.to_dict())) == got.to_dict()
    else:
        with pytest.raises(InvalidProjectionError):
            tif.Projection.from_dict(data)


def test_build_store_after_failed_build_in_other_thread():
    model = Two().double()
    batch = _data(n=4)
    calls = {"n": 0}

    def bad(p, ex):
        calls["n"] += 1
        x, _y = ex
        functional_call(model, p, (x[None],))
        raise _MyBase("stop")

    def good(p, ex):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    proj = tif.Projection(dim=12, kind="kronecker")
    ck = [tif.Checkpoint(_params(model, 1))]
    _, err = _run_threads([(0, lambda: tif.build_store(bad, ck, batch, projection=proj,
                                                       dtype=torch.float64, progress=False))])
    assert 0 in err and calls["n"] >= 1
    res, err = _run_threads([(i, lambda: tif.build_store(good, ck, batch, projection=proj,
                                                         dtype=torch.float64, progress=False))
                             for i in range(2)])
    assert not err, err
    want = tif.projected_grads(good, proj)(_params(model, 1), batch)
    for i in range(2):
        torch.testing.assert_close(tif.score(res[i], want[None]), want @ want.T)


def test_submodule_shared_after_first_call():
    """model.b is replaced by another model's layer after the functions were built and used."""
    model, other = Two().double(), Two().double()

    def l1(p, ex):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    def l2(p, ex):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(other, p, (x[None],)), y[None])

    batch = _data(n=4)
    f1, f2 = tif.grads.per_sample_grads(l1), tif.grads.per_sample_grads(l2)
    f1(_params(model, 1), batch)
    f2(_params(other, 2), batch)
    model.b = other.b
    p1, p2 = _params(model, 3), _params(other, 4)
    w1 = _loop_ref(_ref_whole(model), p1, batch)
    w2 = _loop_ref(_ref_whole(other), p2, batch)
    res, err = _run_threads([(1, lambda: [f1(p1, batch) for _ in range(10)]),
                             (2, lambda: [f2(p2, batch) for _ in range(10)])])
    assert not err, err
    for g in res[1]:
        _close(g, w1)
    for g in res[2]:
        _close(g, w2)


class TwoWithLoss(Two):
    def loss(self, p, ex):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(self, p, (x[None],)), y[None])


def test_model_method_as_loss_threads():
    model = TwoWithLoss().double()
    batch = _data(n=5)
    ck = [_params(model, 60), _params(model, 61)]
    fn = tif.grads.per_sample_grads(model.loss)
    res, err = _run_threads([(i, functools.partial(
        lambda i: [fn(ck[i], batch) for _ in range(8)], i)) for i in range(2)])
    assert not err, err
    for i in range(2):
        want = _loop_ref(_ref_whole(model), ck[i], batch)
        for g in res[i]:
            _close(g, want)


class OutsideUse(nn.Module):
    """fc.weight also used outside fc's forward (strongly)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        return self.fc(x) + 0.5 * (self.fc.weight ** 2).sum(1) * x[..., :4]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["module", "hand"])
def test_half_weight_used_outside_layer_detected(dtype, form):
    torch.manual_seed(0)
    model = OutsideUse().to(dtype).eval()
    if form == "module":
        loss = tif.loss.loss_from_module(model, nn.functional.cross_entropy)
    else:
        def loss(p, ex):
            x, y = ex
            return nn.functional.cross_entropy(functional_call(model, p, (x[None],)).float(),
                                               y[None])
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 6, generator=g)
    y = torch.randint(0, 4, (6,), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = tif.projected_grads(loss, tif.Projection(dim=12, kind="kronecker"))(
            params, (x.to(dtype), y))
    m64 = OutsideUse().double()
    p64 = {k: v.double() for k, v in params.items()}
    gr = _loop_ref(_ref_whole(m64), p64, (x.to(dtype).double(), y))
    ref = np.stack([project({k: v[i].numpy() for k, v in gr.items()}, 0, "kronecker", 12)
                    for i in range(6)])
    err = np.abs(rows.double().numpy() - ref).max() / np.abs(ref).max()
    assert err < 0.05, err


def _fit_curvature_threads(kind, attempts=1):
    """fit_curvature at checkpoint A in one thread, per_sample_grads at B in another, both
    with one hand-written loss on one model; returns the problems seen."""
    model = Two().double()

    def loss(p, ex):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    batch = _data(n=8)
    pa, pb = _params(model, 1), _params(model, 2)

    def sampler(loss_, params, b, generator):
        return b, torch.ones(b[0].shape[0], dtype=torch.float64)

    kw = dict(kind=kind, damping=0.1, sampler=sampler)
    if kind == "projected":
        kw["projection"] = tif.Projection(dim=8)
    psg = tif.grads.per_sample_grads(loss)
    want_b = _loop_ref(_ref_whole(model), pb, batch)
    want = tif.curvature.fit.fit_curvature(loss, [tif.Checkpoint(pa)], batch, **kw).digest
    problems = []
    for _ in range(attempts):
        stop = threading.Event()

        def other(stop=stop):
            out = []
            while not stop.is_set() and len(out) < 100:
                out.append(psg(pb, batch))
            return out

        def cur(stop=stop):
            try:
                return [tif.curvature.fit.fit_curvature(loss, [tif.Checkpoint(pa)], batch,
                                                        **kw).digest for _ in range(3)]
            finally:
                stop.set()

        res, err = _run_threads([(0, cur), (1, other)])
        problems += [f"{k}: {type(e).__name__}: {str(e)[:120]}" for k, e in err.items()]
        problems += ["curvature digest differs" for d in res.get(0, []) if d != want]
        problems += ["per_sample_grads rows wrong" for g in res.get(1, [])
                     if any(not torch.allclose(g[n], want_b[n]) for n in g)]
    return problems


@pytest.mark.parametrize("kind", ["dense", "projected"])
def test_fit_curvature_hand_written_loss_in_threads(kind):
    assert _fit_curvature_threads(kind, attempts=2) == []


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_FINDING_fit_curvature_kfac_hand_written_loss_threads(kind):
    assert _fit_curvature_threads(kind, attempts=3) == []


class EmptyLayers(nn.Module):
    """A real layer beside a Linear with no inputs and a Linear with no outputs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.no_in = nn.Linear(0, 3)
        self.no_out = nn.Linear(4, 0)
        self.scale = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        return (self.scale * self.fc(x) + self.no_in(x[..., :0])
                + self.no_out(x).sum(-1, keepdim=True))


def _empty_layers_rows(split, vectors, form, select=None):
    torch.manual_seed(0)
    model = EmptyLayers().double().eval()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    if form == "module":
        loss = tif.loss.loss_from_module(model, nn.functional.cross_entropy)
    else:
        def loss(p, ex):
            x, y = ex
            return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])
    g = torch.Generator().manual_seed(2)
    batch = (torch.randn(5, 4, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (5,), generator=g))
    proj = tif.Projection(dim=12, kind="kronecker", vectors=vectors, split=split)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = tif.projected_grads(loss, proj, options=tif.GradientOptions(
            chunk_size=2, select=select))(params, batch)
    gr = _loop_ref(_ref_whole(model), params, batch)
    names = sorted(gr) if select is None else sorted(select)
    ref = np.stack([project({k: gr[k][i].numpy() for k in names}, 0, "kronecker", 12,
                            split=split, vectors=vectors) for i in range(5)])
    return rows, ref


@pytest.mark.parametrize("vectors", ["dense", "kronecker"])
@pytest.mark.parametrize("form", ["module", "hand"])
def test_kronecker_empty_layers_square_split(vectors, form):
    rows, ref = _empty_layers_rows("square", vectors, form)
    np.testing.assert_allclose(rows.numpy(), ref, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("layer", ["no_in", "no_out"])
@pytest.mark.parametrize("form", ["module", "hand"])
def test_FINDING_kronecker_shape_split_empty_layer(layer, form):
    select = ["fc.weight", "fc.bias", layer + ".weight", layer + ".bias"]
    rows, ref = _empty_layers_rows("shape", "dense", form, select=select)
    np.testing.assert_allclose(rows.numpy(), ref, atol=1e-9, rtol=1e-7)


def test_FINDING_build_store_shape_split_empty_layer_blames_batch():
    torch.manual_seed(0)
    model = EmptyLayers().double().eval()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    loss = tif.loss.loss_from_module(model, nn.functional.cross_entropy)
    g = torch.Generator().manual_seed(2)
    batch = (torch.randn(5, 4, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (5,), generator=g))
    proj = tif.Projection(dim=12, kind="kronecker", split="shape")
    try:
        store = tif.build_store(loss, [tif.Checkpoint(params)], batch, projection=proj,
                                dtype=torch.float64, progress=False)
    except InvalidProjectionError:
        return
    except LossFunctionError as e:
        pytest.fail(f"blames the batch: {e}")
    gr = _loop_ref(_ref_whole(model), params, batch)
    ref = torch.as_tensor(np.stack([project({k: v[i].numpy() for k, v in gr.items()}, 0,
                                            "kronecker", 12, split="shape") for i in range(5)]))
    torch.testing.assert_close(tif.score(store, ref[None]), ref @ ref.T)


def test_numpy_fields_same_rows_and_per_checkpoint_name():
    model, params, batch = _odd_setup()
    loss = tif.loss.loss_from_module(model, nn.functional.cross_entropy)
    a = tif.Projection(dim=np.int64(12), seed=np.int64(2 ** 63 - 1), kind=np.str_("kronecker"),
                       per_checkpoint=True)
    b = tif.Projection(dim=12, seed=2 ** 63 - 1, kind="kronecker", per_checkpoint=True)
    ra = tif.projected_grads(loss, a.for_checkpoint(np.str_("c0")))(params, batch)
    rb = tif.projected_grads(loss, b.for_checkpoint("c0"))(params, batch)
    torch.testing.assert_close(ra, rb, atol=0, rtol=0)
    sa = tif.build_store(loss, [tif.Checkpoint(params, name=np.str_("c0"))], batch,
                         projection=a, dtype=torch.float64, progress=False)
    sb = tif.build_store(loss, [tif.Checkpoint(params, name="c0")], batch, projection=b,
                         dtype=torch.float64, progress=False)
    assert sa.projection == sb.projection
    torch.testing.assert_close(tif.score(sa, rb[None]), tif.score(sb, rb[None]), atol=0,
                               rtol=0)
    torch.testing.assert_close(tif.score(sa, rb[None]), rb @ rb.T)
    json.dumps(sa.projection.to_dict())


class Thin(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 1)
        self.one = nn.Linear(1, 1)
        self.wide = nn.Linear(1, 7)
        self.head = nn.Linear(7, 3)
        self.gain = nn.Parameter(torch.tensor(1.2))

    def forward(self, idx):
        h = self.gain * self.one(self.emb(idx))
        return self.head(torch.tanh(self.wide(h))).mean(-2)


@pytest.mark.parametrize("split", ["square", "shape"])
@pytest.mark.parametrize("vectors", ["dense", "kronecker"])
@pytest.mark.parametrize("dim", [12, 7, 1])
def test_kronecker_thin_layers_match_numpy(split, vectors, dim):
    torch.manual_seed(0)
    model = Thin().double().eval()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    loss = tif.loss.loss_from_module(model, nn.functional.cross_entropy)
    g = torch.Generator().manual_seed(4)
    batch = (torch.randint(0, 5, (4, 3), generator=g), torch.randint(0, 3, (4,), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = tif.projected_grads(loss, tif.Projection(dim=dim, kind="kronecker", split=split,
                                                        vectors=vectors))(params, batch)

    def f(p, x, y):
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    gr = _loop_ref(f, params, batch)
    ref = np.stack([project({k: v[i].numpy() for k, v in gr.items()}, 0, "kronecker", dim,
                            split=split, vectors=vectors) for i in range(4)])
    np.testing.assert_allclose(rows.numpy(), ref, atol=1e-9, rtol=1e-7)


def test_preconditioned_test_grads_kfac_hand_written_loss_in_threads():
    """Using a K-FAC curvature (fitted alone) is safe beside another thread's calls."""
    model = Two().double()

    def loss(p, ex):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    batch = _data(n=8)
    pa, pb = _params(model, 1), _params(model, 2)
    ck = [tif.Checkpoint(pa)]
    proj = tif.Projection(dim=8)
    curv = tif.curvature.fit.fit_curvature(
        loss, ck, batch, kind="kfac", damping=0.1,
        sampler=lambda lo, p, b, g: (b, torch.ones(b[0].shape[0], dtype=torch.float64)))
    train = tif.build_store(loss, ck, batch, projection=proj, dtype=torch.float64,
                            progress=False)
    want = tif.score(train, tif.curvature.test_grads.preconditioned_test_grads(
        loss, ck, batch, curv, projection=proj))
    psg = tif.grads.per_sample_grads(loss)
    want_b = _loop_ref(_ref_whole(model), pb, batch)
    stop = threading.Event()

    def other():
        out = []
        while not stop.is_set() and len(out) < 50:
            out.append(psg(pb, batch))
        return out

    def cur():
        try:
            return [tif.score(train, tif.curvature.test_grads.preconditioned_test_grads(
                loss, ck, batch, curv, projection=proj)) for _ in range(3)]
        finally:
            stop.set()

    res, err = _run_threads([(0, cur), (1, other)])
    assert not err, err
    for s in res[0]:
        torch.testing.assert_close(s, want)
    for g in res[1]:
        _close(g, want_b)


def test_FINDING_choose_damping_hand_written_loss_threads():
    model = Two().double()

    def loss(p, ex):
        x, y = ex
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    batch, held = _data(n=8), _data(n=4, seed=5)
    pa, pb = _params(model, 1), _params(model, 2)
    ck = [tif.Checkpoint(pa)]
    curv = tif.curvature.fit.fit_curvature(
        loss, ck, batch, kind="dense", damping=0.1,
        sampler=lambda lo, p, b, g: (b, torch.ones(b[0].shape[0], dtype=torch.float64)))
    want = tif.curvature.heldout.choose_damping(curv, loss, ck, batch, held)
    psg = tif.grads.per_sample_grads(loss)
    want_b = _loop_ref(_ref_whole(model), pb, batch)
    problems = []
    for _ in range(3):
        stop = threading.Event()

        def other(stop=stop):
            out = []
            while not stop.is_set() and len(out) < 50:
                out.append(psg(pb, batch))
            return out

        def cur(stop=stop):
            try:
                return [tif.curvature.heldout.choose_damping(curv, loss, ck, batch, held)
                        for _ in range(3)]
            finally:
                stop.set()

        res, err = _run_threads([(0, cur), (1, other)])
        problems += [f"{type(e).__name__}: {str(e)[:100]}" for e in err.values()]
        problems += ["choice differs" for r in res.get(0, []) if r.values != want.values]
        problems += ["per_sample_grads rows wrong" for g in res.get(1, [])
                     if any(not torch.allclose(g[n], want_b[n]) for n in g)]
    assert problems == []


def test_output_token_grads_hand_written_lm_loss_in_threads():
    model = _tiny_gpt2(torch.float64)
    block = model.transformer.h[0]
    orig = block.forward

    def slow(*a, **k):
        time.sleep(0.002)
        return orig(*a, **k)

    block.forward = slow

    def loss(p, ex):
        ids = ex["input_ids"]
        logits = functional_call(model, p, (ids[None],)).logits[0, :-1]
        return nn.functional.cross_entropy(logits, ids[1:])

    g = torch.Generator().manual_seed(0)
    seq = {"input_ids": torch.randint(0, 50, (8,), generator=g)}
    batch = {"input_ids": torch.randint(0, 50, (3, 8), generator=g)}
    pa = {k: v.detach().clone() for k, v in model.named_parameters()}
    pb = {k: v + 0.1 for k, v in pa.items()}
    proj = tif.Projection(dim=16)
    ck = [tif.Checkpoint(pa)]
    train = tif.build_store(loss, ck, batch, projection=proj, dtype=torch.float64,
                            progress=False)
    want = tif.score(train, tif.lm.outputs.output_token_grads(loss, ck, seq,
                                                              projection=proj).grads)
    pg = tif.projected_grads(loss, proj)
    want_b = pg(pb, batch)
    stop = threading.Event()

    def other():
        out = []
        while not stop.is_set() and len(out) < 30:
            out.append(pg(pb, batch))
        return out

    def cur():
        try:
            return [tif.score(train, tif.lm.outputs.output_token_grads(
                loss, ck, seq, projection=proj).grads) for _ in range(3)]
        finally:
            stop.set()

    res, err = _run_threads([(0, cur), (1, other)])
    assert not err, err
    for s in res[0]:
        torch.testing.assert_close(s, want)
    for r in res[1]:
        torch.testing.assert_close(r, want_b)
