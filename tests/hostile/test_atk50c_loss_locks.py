"""atk50c: outside pass on hand-written losses' module locks, kronecker fallbacks, autocast sides.

Written from docs/language-models.md ("Threads and one module", "Attention kernels", the
kronecker paragraphs) only. Every result is compared with a float64 loop of
``torch.autograd.grad`` per example (projected with ``make_projector`` where projected).
"""

from __future__ import annotations

import functools
import threading
import time
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

import tracinfunc as tif
from tracinfunc.errors import LossFunctionError
from tracinfunc.grads.factorized_batched import LossFormWarning
from tracinfunc.projection import make_projector

JOIN_S = 120  # a hang detector only: generous, so machine load never trips it
N = 6


class Slow(nn.Module):
    """Linear-tanh-Linear whose forward sleeps between layers, so unlocked swaps interleave."""

    def __init__(self, sleep: float = 0.002) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)
        self.sleep = sleep

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.sleep:
            time.sleep(self.sleep)
        return self.b(h)

    def loss(self, p, ex):  # a bound method of an nn.Module subclass
        return F.cross_entropy(functional_call(self, p, (ex[0][None],)), ex[1][None])


def _model(seed: int = 0, sleep: float = 0.002) -> Slow:
    torch.manual_seed(seed)
    return Slow(sleep).double().eval()


def _params(model, scale: float = 1.0, shift: float = 0.0):
    return {k: (v.detach() * scale + shift).clone() for k, v in model.named_parameters()}


def _batch(seed: int = 1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 5, generator=g, dtype=dtype), torch.randint(0, 3, (N,), generator=g)


def _ce(model, p, ex):
    return F.cross_entropy(functional_call(model, p, (ex[0][None],)), ex[1][None])


def loop_grads(loss, p, batch):
    """The reference: one torch.autograd.grad per example."""
    names = list(p)
    out = {k: [] for k in names}
    n = batch[0].shape[0]
    for i in range(n):
        pp = {k: v.detach().clone().requires_grad_() for k, v in p.items()}
        val = loss(pp, tuple(t[i] for t in batch))
        gs = torch.autograd.grad(val, [pp[k] for k in names], allow_unused=True)
        for k, g in zip(names, gs, strict=True):
            out[k].append(torch.zeros_like(pp[k]) if g is None else g)
    return {k: torch.stack(v) for k, v in out.items()}


def loop_rows(loss, p, batch, projection):
    g = loop_grads(loss, p, batch)
    proj = make_projector(projection, {k: v for k, v in p.items()}, dtype=g[next(iter(g))].dtype)
    return torch.func.vmap(proj)(g)


def _flat(g: dict, names) -> torch.Tensor:
    return torch.cat([g[k].reshape(g[k].shape[0], -1) for k in names], 1)


def _threads(calls, join_s: float = JOIN_S):
    """Run each ``call`` in its own thread; fail (never hang) if one does not finish."""
    res: dict[int, object] = {}

    def run(i, c):
        try:
            res[i] = c()
        except BaseException as e:
            res[i] = e

    ts = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in ts:
        t.start()
    deadline = time.monotonic() + join_s
    for t in ts:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [i for i, t in enumerate(ts) if t.is_alive()]
    assert not alive, f"threads {alive} still running after {join_s} s (deadlock/hang)"
    return [res[i] for i in range(len(calls))]


def _ok(r):
    if isinstance(r, BaseException):
        raise r
    return r


# --------------------------------------------------------------------------------------------
# 1. Locks of the modules a hand-written loss names directly
# --------------------------------------------------------------------------------------------

_G_MODEL = _model(10)
_G_MODEL2 = _model(11)
_G_MODEL3 = _model(12)


def _global_loss(p, ex):
    return F.cross_entropy(functional_call(_G_MODEL, p, (ex[0][None],)), ex[1][None])


def _nested_global_loss(p, ex):
    f = lambda q: functional_call(_G_MODEL2, q, (ex[0][None],))  # noqa: E731

    def inner(q):
        return F.cross_entropy(f(q), ex[1][None])

    return inner(p)


def _partial_target(model, p, ex):
    return _ce(model, p, ex)


class _Holder:
    def __init__(self, model):
        self.model = model

    def loss(self, p, ex):
        return _ce(self.model, p, ex)

    __call__ = loss


def _closure(model):
    def loss(p, ex):
        return _ce(model, p, ex)

    return loss


def _closure_lambda(model):
    return lambda p, ex: F.cross_entropy(functional_call(model, p, (ex[0][None],)), ex[1][None])


def _kw_target(p, ex, *, model):
    return _ce(model, p, ex)


class _LossModule(nn.Module):
    """The loss is itself an nn.Module holding the model as a child."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, p, ex):
        return _ce(self.m, p, ex)


class _ClassHeld:
    model = None

    @classmethod
    def loss(cls, p, ex):
        return _ce(cls.model, p, ex)


def _default_arg(model):
    def loss(p, ex, m=model):
        return _ce(m, p, ex)

    return loss


FOUND = {
    "partial_keyword": lambda m: functools.partial(_kw_target, model=m),
    "partial_of_partial": lambda m: functools.partial(functools.partial(_partial_target, m)),
    "partial_of_bound_method": lambda m: functools.partial(m.loss),
    "loss_is_a_module_holding_model": lambda m: _LossModule(m),
    "closure": lambda m: _closure(m),
    "closure_lambda": lambda m: _closure_lambda(m),
    "partial": lambda m: functools.partial(_partial_target, m),
    "module_bound_method": lambda m: m.loss,
}


def _two_ckpt_race(loss, model, trials: int = 2, nthreads: int = 4):
    """Threads with two different checkpoints on one model; each must get its own rows."""
    batch = _batch()
    pa, pb = _params(model), _params(model, 1.7, 0.1)
    names = list(pa)
    refs = [_flat(loop_grads(loss, p, batch), names) for p in (pa, pb)]
    psg = tif.per_sample_grads(loss)
    for _ in range(trials):
        ps = [(pa, pb)[i % 2] for i in range(nthreads)]
        out = _threads([functools.partial(psg, p, batch) for p in ps])
        for i, r in enumerate(out):
            torch.testing.assert_close(_flat(_ok(r), names), refs[i % 2], rtol=0, atol=1e-12)


@pytest.mark.parametrize("form", sorted(FOUND))
def test_found_forms_give_each_thread_its_rows(form):
    model = _model()
    _two_ckpt_race(FOUND[form](model), model)


@pytest.mark.parametrize(
    "form,model",
    [("global", _G_MODEL), ("nested_lambda_reading_global", _G_MODEL2)],
    ids=["global", "nested_lambda_reading_global"],
)
def test_globals_give_each_thread_its_rows(form, model):
    loss = _global_loss if form == "global" else _nested_global_loss
    _two_ckpt_race(loss, model)


@pytest.mark.parametrize("kind", ["rademacher", "sjlt", "kronecker", "identity"])
def test_projected_kinds_threads_equal_loop(kind):
    model = _model()
    loss = _closure(model)
    projection = tif.Projection(dim=None if kind == "identity" else 16, kind=kind,
                                nnz=2 if kind == "sjlt" else 1)
    batch = _batch()
    pa, pb = _params(model), _params(model, 1.7, 0.1)
    refs = [loop_rows(loss, p, batch, projection) for p in (pa, pb)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossFormWarning)
        fn = tif.projected_grads(loss, projection)
        fn(pa, batch)  # the kronecker proof, single-threaded first
        for _ in range(2):
            out = _threads([functools.partial(fn, (pa, pb)[i % 2], batch) for i in range(4)])
            for i, r in enumerate(out):
                torch.testing.assert_close(_ok(r), refs[i % 2], rtol=0, atol=1e-10)


def test_projected_kronecker_threads_fresh_functions():
    """Each thread builds its own kronecker function (proof inside the race)."""
    model = _model()
    loss = _closure(model)
    projection = tif.Projection(dim=16, kind="kronecker")
    batch = _batch()
    pa, pb = _params(model), _params(model, 1.7, 0.1)
    refs = [loop_rows(loss, p, batch, projection) for p in (pa, pb)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossFormWarning)
        for _ in range(2):
            out = _threads([
                (lambda p=p: tif.projected_grads(loss, projection)(p, batch))
                for p in (pa, pb, pa, pb)
            ])
            for i, r in enumerate(out):
                torch.testing.assert_close(_ok(r), refs[i % 2], rtol=0, atol=1e-10)


@pytest.mark.parametrize("form", [
    "closure",
    "module_loss",
])
def test_build_store_threads_two_checkpoints(form):
    model = _model()
    loss = _closure(model) if form == "closure" else tif.loss_from_module(model, F.cross_entropy)
    batch = _batch()
    projection = tif.Projection(dim=12, kind="rademacher")
    pa, pb = _params(model), _params(model, 1.7, 0.1)
    refs = [loop_rows(loss, p, batch, projection) for p in (pa, pb)]
    data = [tuple(t[:3] for t in batch), tuple(t[3:] for t in batch)]

    def build(p):
        st = tif.build_store(loss, [tif.Checkpoint(p, lr=1.0)], data, projection=projection,
                             dtype=torch.float64, progress=False)
        return st.read_rows(0, 0, N)

    for _ in range(3):
        out = _threads([functools.partial(build, p) for p in (pa, pb, pa)])
        for i, r in enumerate(out):
            torch.testing.assert_close(_ok(r), refs[i % 2], rtol=0, atol=1e-10)


@pytest.mark.parametrize("form", ["plain_object_bound_method", "callable_instance", "list",
                                  "dict", "classmethod_class_attribute"])
def test_documented_not_found_forms_do_not_hang_and_copies_work(form):
    """Docs: a model reached through a list/dict/another object is not found; give each
    thread its own copy. Check nothing hangs and the documented fix gives exact rows."""
    batch = _batch()
    models = [_model(), _model()]
    models[1].load_state_dict(models[0].state_dict())

    def make(m):
        if form == "plain_object_bound_method":
            return _Holder(m).loss
        if form == "callable_instance":
            return _Holder(m)
        if form == "classmethod_class_attribute":
            held = type("Held", (_ClassHeld,), {"model": m})
            return held.loss
        if form == "list":
            box = [m]
            return lambda p, ex: _ce(box[0], p, ex)
        box = {"m": m}
        return lambda p, ex: _ce(box["m"], p, ex)

    pa, pb = _params(models[0]), _params(models[0], 1.7, 0.1)
    names = list(pa)
    refs = [_flat(loop_grads(_closure(models[0]), p, batch), names) for p in (pa, pb)]
    # shared model: must finish (values documented as unprotected)
    shared = tif.per_sample_grads(make(models[0]))
    _threads([functools.partial(shared, p, batch) for p in (pa, pb)])
    # the documented fix: one copy per thread
    fns = [tif.per_sample_grads(make(m)) for m in models]
    out = _threads([functools.partial(fns[i], (pa, pb)[i], batch) for i in range(2)])
    for i, r in enumerate(out):
        torch.testing.assert_close(_flat(_ok(r), names), refs[i], rtol=0, atol=1e-12)


def test_default_argument_model_threads():
    model = _model()
    _two_ckpt_race(_default_arg(model), model, trials=3)


def test_module_loss_and_hand_written_loss_threads_one_model():
    model = _model()
    batch = _batch()
    pa, pb = _params(model), _params(model, 1.7, 0.1)
    names = list(pa)
    refs = [_flat(loop_grads(_closure(model), p, batch), names) for p in (pa, pb)]
    f_mod = tif.per_sample_grads(tif.loss_from_module(model, F.cross_entropy))
    f_hand = tif.per_sample_grads(_closure(model), options=tif.GradientOptions(chunk_size=2))
    for _ in range(2):
        out = _threads([functools.partial(f_mod, pa, batch), functools.partial(f_hand, pb, batch),
                        functools.partial(f_hand, pa, batch), functools.partial(f_mod, pb, batch)])
        for r, ref in zip(out, (refs[0], refs[1], refs[0], refs[1]), strict=True):
            torch.testing.assert_close(_flat(_ok(r), names), ref, rtol=0, atol=1e-12)


def test_has_aux_threads():
    model = _model()
    batch = _batch()
    pa, pb = _params(model), _params(model, 1.7, 0.1)
    names = list(pa)

    def loss(p, ex):
        out = functional_call(model, p, (ex[0][None],))
        return F.cross_entropy(out, ex[1][None]), out[0].detach()

    plain = _closure(model)
    refs = [_flat(loop_grads(plain, p, batch), names) for p in (pa, pb)]
    outs = [torch.stack([functional_call(model, p, (x[None],))[0] for x in batch[0]]).detach()
            for p in (pa, pb)]
    fn = tif.per_sample_grads(loss, has_aux=True)
    res = _threads([functools.partial(fn, (pa, pb)[i % 2], batch) for i in range(4)])
    for i, r in enumerate(res):
        g, aux = _ok(r)
        torch.testing.assert_close(_flat(g, names), refs[i % 2], rtol=0, atol=1e-12)
        torch.testing.assert_close(aux, outs[i % 2], rtol=0, atol=1e-12)


class _SlowLinear(nn.Linear):
    def forward(self, x):
        time.sleep(0.003)
        return super().forward(x)


def test_submodule_named_by_loss_vs_whole_model_in_other_thread():
    """Thread 1 differentiates the whole model; thread 2 a loss naming only ``model.b`` (one
    model, two tracinfunc calls). Docs: two tracinfunc calls on one model give each its rows."""
    model = _model()
    model.b = _SlowLinear(7, 3).double()
    sub = model.b
    batch = _batch()
    h = torch.randn(N, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def sub_loss(p, ex):
        return F.cross_entropy(functional_call(sub, p, (ex[0][None],)), ex[1][None])

    loss = _closure(model)
    pa = _params(model)
    psub = {k: (v.detach() * -2.0 + 0.5).clone() for k, v in sub.named_parameters()}
    names = list(pa)
    ref = _flat(loop_grads(loss, pa, batch), names)
    ref_sub = _flat(loop_grads(sub_loss, psub, (h, batch[1])), list(psub))
    f1, f2 = tif.per_sample_grads(loss), tif.per_sample_grads(sub_loss)
    calls = [functools.partial(f1, pa, batch), functools.partial(f2, psub, (h, batch[1]))] * 2
    for _ in range(5):
        out = _threads(calls)
        for i, r in enumerate(out):
            if i % 2:
                torch.testing.assert_close(_flat(_ok(r), list(psub)), ref_sub, rtol=0, atol=1e-12)
            else:
                torch.testing.assert_close(_flat(_ok(r), names), ref, rtol=0, atol=1e-12)


def test_global_rebound_after_function_built():
    """A global the loss reads is rebound to another model after ``per_sample_grads``: the lock
    must follow what the code reads at call time."""
    global _G_MODEL3
    old = _G_MODEL3
    try:
        fn = tif.per_sample_grads(_rebound_loss)
        _G_MODEL3 = _model(13)
        _two_ckpt_race(_rebound_loss, _G_MODEL3)
        del fn
    finally:
        _G_MODEL3 = old


def _rebound_loss(p, ex):
    return _ce(_G_MODEL3, p, ex)


def test_recursive_loss_and_self_referencing_closure():
    model = _model()

    def rec(p, ex, depth=3):
        if depth:
            return rec(p, ex, depth - 1)
        return _ce(model, p, ex)

    def loss(p, ex):
        return rec(p, ex)

    _two_ckpt_race(loss, model, trials=1, nthreads=2)


def test_nested_tracinfunc_call_on_same_model_inside_loss():
    """A loss that calls tracinfunc on the same model (re-entrant lock in one thread)."""
    model = _model(sleep=0.0)
    batch = _batch()
    fixed = _params(model, 0.5)
    inner = tif.per_sample_grads(_closure(model))

    def loss(p, ex):
        g = inner(fixed, batch)  # constant w.r.t. p
        return _ce(model, p, ex) + 0.0 * g["a.weight"].sum()

    pa = _params(model)
    names = list(pa)
    ref = _flat(loop_grads(_closure(model), pa, batch), names)
    out = _threads([functools.partial(tif.per_sample_grads(loss), pa, batch)])
    torch.testing.assert_close(_flat(_ok(out[0]), names), ref, rtol=0, atol=1e-12)


def test_loss_waiting_for_other_thread_on_same_model_does_not_hang_forever():
    """A's loss starts B (tracinfunc on the same model) and waits for it with a timeout; the
    library cannot see a join. After A's wait times out both must finish with exact rows."""
    model = _model(sleep=0.0)
    batch = _batch()
    pa, pb = _params(model), _params(model, 1.7, 0.1)
    names = list(pa)
    plain = _closure(model)
    refs = [_flat(loop_grads(plain, p, batch), names) for p in (pa, pb)]
    fb = tif.per_sample_grads(plain)
    box: dict = {}
    state = {"started": False}

    def loss(p, ex):
        if not state["started"]:
            state["started"] = True
            t = threading.Thread(target=lambda: box.setdefault("b", fb(pb, batch)), daemon=True)
            box["t"] = t
            t.start()
            t.join(2.0)
        return _ce(model, p, ex)

    out = _threads([functools.partial(tif.per_sample_grads(loss), pa, batch)])
    box["t"].join(JOIN_S)
    assert not box["t"].is_alive()
    torch.testing.assert_close(_flat(_ok(out[0]), names), refs[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(_flat(box["b"], names), refs[1], rtol=0, atol=1e-12)


def _opposite(reach_inner_through_list: bool, use_barrier: bool):
    m1, m2 = _model(sleep=0.0), _model(1, sleep=0.0)
    batch = _batch()
    p1, p2 = _params(m1), _params(m2)
    # Through a list each thread holds only its own model, so both reach the barrier: a
    # generous timeout, load must not break it. Named in the closure, one thread holds both
    # models at once and the other waits for them before its barrier: the barrier must
    # break (a short timeout), and nothing may hang.
    barrier = threading.Barrier(2, timeout=JOIN_S / 4 if reach_inner_through_list else 3)
    first = {"t1": True, "t2": True}
    broken: list = []

    def outer(me, other, p_other, key):
        inner = tif.per_sample_grads(_closure(other))
        box = [inner]

        def sync():
            if use_barrier:
                try:
                    barrier.wait()
                except threading.BrokenBarrierError:
                    broken.append(key)

        def loss_list(p, ex):
            if first[key]:
                first[key] = False
                sync()
                box[0](p_other, batch)
            return _ce(me, p, ex)

        def loss_named(p, ex):
            if first[key]:
                first[key] = False
                sync()
                inner(p_other, batch)
            return _ce(me, p, ex)

        return loss_list if reach_inner_through_list else loss_named

    f1 = tif.per_sample_grads(outer(m1, m2, p2, "t1"))
    f2 = tif.per_sample_grads(outer(m2, m1, p1, "t2"))
    out = first_out = _threads([functools.partial(f1, p1, batch),
                                functools.partial(f2, p2, batch)])
    refs = [_flat(loop_grads(_closure(m), p, batch), list(p)) for m, p in ((m1, p1), (m2, p2))]
    for r, ref in zip(out, refs, strict=True):
        if isinstance(r, BaseException):
            assert isinstance(r, LossFunctionError), repr(r)
        else:
            torch.testing.assert_close(_flat(r, list(p1)), ref, rtol=0, atol=1e-12)
    # nothing leaked: both work afterwards, in threads
    out = _threads([functools.partial(tif.per_sample_grads(_closure(m1)), p1, batch),
                    functools.partial(tif.per_sample_grads(_closure(m2)), p2, batch)])
    for r in out:
        _ok(r)
    return first_out, broken


def test_opposite_order_nested_calls_error_instead_of_deadlock():
    """Inner call reached through a list (so only the outer model is locked up front), both
    threads hold their outer lock (barrier) then call into the other's model: one cycle."""
    out, broken = _opposite(reach_inner_through_list=True, use_barrier=True)
    assert not broken, "both threads must hold their outer lock at once"
    errs = [r for r in out if isinstance(r, BaseException)]
    assert len(errs) == 1, out
    msg = str(errs[0]).lower()
    assert "wait" in msg or "cycle" in msg or "deadlock" in msg, msg


@pytest.mark.parametrize("barrier", [False, True], ids=["free", "barrier"])
def test_opposite_order_nested_named_in_closure_never_hangs(barrier):
    """The inner function named in the closure (its model may be found through it)."""
    _opposite(reach_inner_through_list=False, use_barrier=barrier)


@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt, SystemExit])
def test_exception_inside_loss_releases_lock(exc):
    model = _model(sleep=0.0)
    batch = _batch()
    pa = _params(model)

    def bad(p, ex):
        out = _ce(model, p, ex)
        raise exc("boom")
        return out

    out = _threads([functools.partial(tif.per_sample_grads(bad), pa, batch)])
    assert isinstance(out[0], (exc, LossFunctionError)), repr(out[0])
    names = list(pa)
    ref = _flat(loop_grads(_closure(model), pa, batch), names)
    out = _threads([functools.partial(tif.per_sample_grads(_closure(model)), pa, batch)] * 2)
    for r in out:
        torch.testing.assert_close(_flat(_ok(r), names), ref, rtol=0, atol=1e-12)


def test_generator_loss_clear_error_and_no_leak():
    model = _model(sleep=0.0)
    batch = _batch()
    pa = _params(model)

    def gen_loss(p, ex):
        yield _ce(model, p, ex)

    out = _threads([functools.partial(tif.per_sample_grads(gen_loss), pa, batch)])
    assert isinstance(out[0], (RuntimeError, tif.TracInFuncError)), repr(out[0])
    assert "generator" in str(out[0])
    with pytest.raises(LossFunctionError, match="generator"):
        tif.build_store(gen_loss, [tif.Checkpoint(pa)], batch, progress=False,
                        projection=tif.Projection(dim=4), dtype=torch.float64)
    out = _threads([functools.partial(tif.per_sample_grads(_closure(model)), pa, batch)])
    _ok(out[0])


# --------------------------------------------------------------------------------------------
# 2. kronecker: losses with their own transforms fall back; autocast inside the loss
# --------------------------------------------------------------------------------------------

KRON = tif.Projection(dim=16, kind="kronecker")


def _fc(model, p, x):
    return functional_call(model, p, (x,))


def _inner_transform_loss(model, form):
    def l_vmap(p, ex):
        out = torch.func.vmap(lambda xx: _fc(model, p, xx[None])[0])(ex[0][None])
        return F.cross_entropy(out, ex[1][None])

    def l_jvp(p, ex):
        x = ex[0][None]
        out, t = torch.func.jvp(lambda xx: _fc(model, p, xx), (x,), (torch.ones_like(x),))
        return F.cross_entropy(out, ex[1][None]) + 0.1 * t.pow(2).sum()

    def l_grad(p, ex):
        x = ex[0][None]
        gx = torch.func.grad(lambda xx: _fc(model, p, xx).logsumexp(-1).sum())(x)
        return _ce(model, p, ex) + 0.1 * gx.pow(2).sum()

    return {"vmap": l_vmap, "jvp": l_jvp, "grad": l_grad}[form]


def _record(fn, *args):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [x for x in w if not issubclass(x.category, LossFormWarning)]


@pytest.mark.parametrize("form", ["vmap", "jvp", "grad"])
def test_kronecker_own_transform_falls_back_exactly_with_warning(form):
    model = _model(sleep=0.0)
    loss = _inner_transform_loss(model, form)
    batch, pa = _batch(), _params(model)
    ref = loop_rows(loss, pa, batch, KRON)
    rows, ws = _record(tif.projected_grads(loss, KRON), pa, batch)
    torch.testing.assert_close(rows, ref, rtol=0, atol=1e-9)
    assert ws, "a fallback must say why"


@pytest.mark.parametrize("form", ["vmap", "jvp", "grad"])
def test_kronecker_own_transform_threads_two_checkpoints(form):
    model = _model(sleep=0.0)
    loss = _inner_transform_loss(model, form)
    batch = _batch()
    pa, pb = _params(model), _params(model, 1.7, 0.1)
    refs = [loop_rows(loss, p, batch, KRON) for p in (pa, pb)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn = tif.projected_grads(loss, KRON)
        out = _threads([functools.partial(fn, (pa, pb)[i % 2], batch) for i in range(4)])
    for i, r in enumerate(out):
        torch.testing.assert_close(_ok(r), refs[i % 2], rtol=0, atol=1e-9)


def test_plain_losses_do_not_fall_back():
    model = _model(sleep=0.0)
    batch, pa = _batch(), _params(model)
    for loss in (_closure(model), tif.loss_from_module(model, F.cross_entropy)):
        rows, ws = _record(tif.projected_grads(loss, KRON), pa, batch)
        assert not ws, [str(w.message)[:200] for w in ws]
        torch.testing.assert_close(rows, loop_rows(loss, pa, batch, KRON), rtol=0, atol=1e-10)
        assert tif.grads.factorized_weights(loss, pa, (batch[0][0], batch[1][0])) == [
            "a.weight", "b.weight"]


@pytest.mark.parametrize("broken", ["shape", "keyerror"])
def test_broken_loss_errors_not_silent_fallback(broken):
    model = _model(sleep=0.0)
    pa = _params(model)
    x, y = _batch()

    def shape_loss(p, ex):
        return F.cross_entropy(_fc(model, p, ex[0][None] @ torch.ones(4, 2).double()), ex[1][None])

    def key_loss(p, ex):
        return F.cross_entropy(_fc(model, p, ex["x"][None]), ex["missing_label"][None])

    loss, batch = (shape_loss, (x, y)) if broken == "shape" else (key_loss, {"x": x, "y": y})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception) as ei:
            tif.projected_grads(loss, KRON)(pa, batch)
    msg = f"{type(ei.value).__name__}: {ei.value}"
    assert ("missing_label" in msg) if broken == "keyerror" else ("shape" in msg or "mat" in msg)


def _autocast_loss(model, dtype, part):
    def sub(p, prefix):
        return {k[len(prefix):]: v for k, v in p.items() if k.startswith(prefix)}

    def loss(p, ex):
        x = ex[0][None]
        with torch.autocast("cpu", dtype=dtype):
            h = torch.tanh(functional_call(model.a, sub(p, "a."), (x,)))
            if not part:
                out = functional_call(model.b, sub(p, "b."), (h,))
        if part:
            out = functional_call(model.b, sub(p, "b."), (h.float(),))
        return F.cross_entropy(out.float(), ex[1][None])

    return loss


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


AUTOCASTS = [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)]
AC_IDS = ["bf16", "fp16", "bf16_first_layer_only"]


@pytest.mark.parametrize("dtype,part", AUTOCASTS, ids=AC_IDS)
def test_kronecker_autocast_in_loss_rows_match_loop(dtype, part):
    model = _model(sleep=0.0).float()
    p = _params(model)
    x, y = _batch()
    batch = (x.float(), y)
    loss = _autocast_loss(model, dtype, part)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = tif.projected_grads(loss, KRON)(p, batch)
    assert rows.dtype == torch.float32
    assert _rel(rows, loop_rows(loss, p, batch, KRON)) < 2e-2


@pytest.mark.parametrize("dtype,part", [
    (torch.bfloat16, False),
    (torch.float16, False),
    (torch.bfloat16, True),
], ids=AC_IDS)
def test_kronecker_autocast_in_loss_stays_factorised(dtype, part):
    model = _model(sleep=0.0).float()
    p = _params(model)
    x, y = _batch()
    loss = _autocast_loss(model, dtype, part)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tif.grads.factorized_weights(loss, p, (x[0].float(), y[0]))
    assert got == ["a.weight", "b.weight"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_model_kronecker_rows_match_loop(dtype):
    model = _model(sleep=0.0).to(dtype)
    p = _params(model)
    x, y = _batch()
    batch = (x.to(dtype), y)
    for loss in (_closure(model), tif.loss_from_module(model, F.cross_entropy)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows = tif.projected_grads(loss, KRON)(p, batch)
        assert rows.dtype == dtype
        assert _rel(rows, loop_rows(loss, p, batch, KRON)) < 3e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_model_module_loss_no_spurious_fallback(dtype):
    model = _model(sleep=0.0).to(dtype)
    p = _params(model)
    x, y = _batch()
    loss = tif.loss_from_module(model, F.cross_entropy)
    _, ws = _record(tif.projected_grads(loss, KRON), p, (x.to(dtype), y))
    assert not ws, [str(w.message)[:200] for w in ws]


# --------------------------------------------------------------------------------------------
# 3. Attention under vmap: tiny HF GPT-2 / Llama from configs, padding, user's SDPA settings
# --------------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
T = 8


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).double().eval()


def _lm_batch(padded=True):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 40, (4, T), generator=g)
    am = torch.ones(4, T, dtype=torch.long)
    if padded:
        am[1, 5:] = 0
        am[3, 3:] = 0
    return {"input_ids": ids, "attention_mask": am, "labels": ids.masked_fill(am == 0, -100)}


def _hf_loss(model):
    def loss(p, ex):
        return functional_call(model, p, (), {k: v[None] for k, v in ex.items()}).loss

    return loss


def _dict_loop(loss, p, batch):
    n = next(iter(batch.values())).shape[0]
    names = list(p)
    rows = []
    for i in range(n):
        pp = {k: v.detach().clone().requires_grad_() for k, v in p.items()}
        val = loss(pp, {k: v[i] for k, v in batch.items()})
        gs = torch.autograd.grad(val, [pp[k] for k in names], allow_unused=True)
        rows.append({k: torch.zeros_like(pp[k]) if g is None else g
                     for k, g in zip(names, gs, strict=True)})
    return {k: torch.stack([r[k] for r in rows]) for k in names}


class _UserFlags:
    """The user's own process-global SDPA flags (CPU: these are the flags torch has)."""

    def __enter__(self):
        b = torch.backends.cuda
        self.saved = (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled())
        b.enable_flash_sdp(False)
        b.enable_mem_efficient_sdp(False)
        return self

    def __exit__(self, *exc):
        b = torch.backends.cuda
        b.enable_flash_sdp(self.saved[0])
        b.enable_mem_efficient_sdp(self.saved[1])
        b.enable_math_sdp(self.saved[2])


def _ctx(name):
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return {"none": nullcontext(), "math": sdpa_kernel([SDPBackend.MATH]),
            "flags": _UserFlags()}[name]


@pytest.mark.parametrize("ctx", ["none", "math", "flags"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_padded_causal_lm_loss_equals_hf_loop(arch, ctx):
    model = _gpt2() if arch == "gpt2" else _llama()
    p = {k: v.detach().clone() for k, v in model.named_parameters()}
    batch = _lm_batch()
    ref = _dict_loop(_hf_loss(model), p, batch)
    with _ctx(ctx):
        flags = (torch.backends.cuda.flash_sdp_enabled(),
                 torch.backends.cuda.mem_efficient_sdp_enabled())
        got, ws = _record(tif.per_sample_grads(tif.causal_lm_loss(model)), p, batch)
        assert flags == (torch.backends.cuda.flash_sdp_enabled(),
                         torch.backends.cuda.mem_efficient_sdp_enabled()), "user flags changed"
    assert not ws, [str(w.message)[:200] for w in ws]
    names = list(p)
    # HF computes its .loss in float32 (docs), the causal_lm_loss in the model's float64
    torch.testing.assert_close(_flat(got, names), _flat(ref, names), rtol=0, atol=1e-6)


@pytest.mark.parametrize("ctx", ["none", "math", "flags"])
def test_gpt2_hand_written_and_causal_kronecker_rows(ctx):
    model = _gpt2()
    p = {k: v.detach().clone() for k, v in model.named_parameters()}
    unpadded = _lm_batch(padded=False)
    unpadded = {"input_ids": unpadded["input_ids"], "labels": unpadded["labels"]}
    hand = _hf_loss(model)
    ref_hand = _dict_loop(hand, p, unpadded)
    proj = make_projector(KRON, dict(p), dtype=torch.float64)
    with _ctx(ctx):
        g = tif.per_sample_grads(hand)(p, unpadded)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LossFormWarning)
            rows_hand = tif.projected_grads(hand, KRON)(p, unpadded)
        rows_causal, ws = _record(tif.projected_grads(tif.causal_lm_loss(model), KRON), p,
                                  _lm_batch())
    names = list(p)
    torch.testing.assert_close(_flat(g, names), _flat(ref_hand, names), rtol=0, atol=1e-12)
    torch.testing.assert_close(rows_hand, torch.func.vmap(proj)(ref_hand), rtol=0, atol=1e-10)
    assert not ws, [str(w.message)[:200] for w in ws]
    ref_causal = torch.func.vmap(proj)(_dict_loop(_hf_loss(model), p, _lm_batch()))
    torch.testing.assert_close(rows_causal, ref_causal, rtol=0, atol=1e-6)


def test_gpt2_hand_written_threads_one_model():
    model = _gpt2()
    pa = {k: v.detach().clone() for k, v in model.named_parameters()}
    pb = {k: v * 1.3 for k, v in pa.items()}
    batch = _lm_batch(padded=False)
    batch = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    hand = _hf_loss(model)
    proj = make_projector(KRON, dict(pa), dtype=torch.float64)
    refs = [torch.func.vmap(proj)(_dict_loop(hand, p, batch)) for p in (pa, pb)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossFormWarning)
        fn = tif.projected_grads(hand, KRON)
        fn(pa, batch)
        out = _threads([functools.partial(fn, (pa, pb)[i % 2], batch) for i in range(3)])
    for i, r in enumerate(out):
        torch.testing.assert_close(_ok(r), refs[i % 2], rtol=0, atol=1e-10)
