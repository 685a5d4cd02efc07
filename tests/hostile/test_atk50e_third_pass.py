"""atk50e: third pass on the loss locks (fit_curvature, choose_damping) and the shape split.

Written from the docs only (docs/language-models.md "Threads and one module",
docs/concepts/faults.md rows atk50c/atk50d).
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call

import tracinfunc as tif
from tracinfunc.curvature import choose_damping
from tracinfunc.errors import LossFunctionError
from tracinfunc.grads.factorized_batched import LossFormWarning

JOIN = 120.0  # a hang detector only: generous, so machine load never trips it


class Net(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _ckpt(model: nn.Module, scale: float, name: str) -> tif.Checkpoint:
    params = {k: (v.detach().clone() * scale) for k, v in model.named_parameters()}
    return tif.Checkpoint(params, lr=1.0, name=name)


@functools.cache
def _data(n: int = 24, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = torch.randint(0, 2, (n,), generator=g)
    return [(x[i:i + 4], y[i:i + 4]) for i in range(0, n, 4)]


def _ce(logits, y):
    return nn.functional.cross_entropy(logits.unsqueeze(0), y.unsqueeze(0))


def _closure_loss(model: nn.Module):
    def loss(params, ex):
        x, y = ex
        return _ce(functional_call(model, params, (x.unsqueeze(0),))[0], y)
    return loss


def _run_threads(targets):
    errors: list[BaseException | None] = [None] * len(targets)
    results: list[object] = [None] * len(targets)

    def wrap(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:  # collected for the assertion
            errors[i] = e

    threads = [threading.Thread(target=wrap, args=(i, f), daemon=True)
               for i, f in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN)
    assert not any(t.is_alive() for t in threads), "a thread hung (deadlock)"
    return results, errors


def _own_sampler(loss, params, batch, generator):
    x, y = batch
    return (x, y), torch.ones(x.shape[0], dtype=torch.float64)


def _fit(loss, ckpts, kind, *, by_keyword=False, projection=None):
    kw = dict(kind=kind, sampler=_own_sampler, seed=3, damping=0.1)
    if kind == "projected":
        kw["projection"] = projection or tif.Projection(dim=8, seed=1)
    if by_keyword:
        return tif.fit_curvature(loss=loss, checkpoints=ckpts, data=_data(), **kw)
    return tif.fit_curvature(loss, ckpts, _data(), **kw)


def _assert_same_curv(c1, c2):
    assert len(c1.estimates) == len(c2.estimates)
    for e1, e2 in zip(c1.estimates, c2.estimates, strict=True):
        assert sorted(e1) == sorted(e2)
        for k in e1:
            torch.testing.assert_close(e1[k], e2[k], rtol=1e-9, atol=1e-12)


def _psg_loop(loss, params, reps=40):
    fn = tif.per_sample_grads(loss)
    out = []
    for _ in range(reps):
        for xb, yb in _data():
            out.append({k: v.clone() for k, v in fn(params, (xb, yb)).items()})
    return out


def _assert_rows_same(r1, r2):
    assert len(r1) == len(r2)
    for a, b in zip(r1, r2, strict=True):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- (b) correctness in threads

@pytest.mark.parametrize("kind", ["kfac", "ekfac", "projected", "dense"])
def test_fit_in_thread_beside_per_sample_grads_equals_alone(kind):
    model = Net()
    loss = _closure_loss(model)
    ck_fit = [_ckpt(model, 1.0, "A")]
    other = _ckpt(model, -2.0, "B").params
    alone = _fit(loss, ck_fit, kind)
    rows_alone = _psg_loop(loss, other, reps=10)
    res, errs = _run_threads([lambda: _fit(loss, ck_fit, kind),
                              lambda: _psg_loop(loss, other, reps=10)])
    assert errs == [None, None], errs
    _assert_same_curv(alone, res[0])
    _assert_rows_same(rows_alone, res[1])


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_two_fits_two_checkpoints_in_threads_keyword_loss(kind):
    model = Net()
    loss = _closure_loss(model)
    ca, cb = [_ckpt(model, 1.0, "A")], [_ckpt(model, 3.0, "B")]
    alone_a, alone_b = _fit(loss, ca, kind), _fit(loss, cb, kind)
    res, errs = _run_threads([lambda: _fit(loss, ca, kind, by_keyword=True),
                              lambda: _fit(loss, cb, kind, by_keyword=True)])
    assert errs == [None, None], errs
    _assert_same_curv(alone_a, res[0])
    _assert_same_curv(alone_b, res[1])


MODEL_G = Net(seed=5)


def _global_helper(params, x):
    return functional_call(MODEL_G, params, (x,))


def _global_loss(params, ex):
    x, y = ex
    return _ce(_global_helper(params, x.unsqueeze(0))[0], y)


def _partial_loss(model, params, ex):
    x, y = ex
    return _ce(functional_call(model, params, (x.unsqueeze(0),))[0], y)


class _Holder:
    def __init__(self, model):
        self.model = model

    def loss(self, params, ex):
        x, y = ex
        return _ce(functional_call(self.model, params, (x.unsqueeze(0),))[0], y)


def _default_loss_factory(model):
    def loss(params, ex, m=model):
        x, y = ex
        return _ce(functional_call(m, params, (x.unsqueeze(0),))[0], y)
    return loss


@pytest.mark.parametrize("how", ["global_via_helper", "partial", "bound_method", "default"])
def test_fit_kfac_loss_naming_styles_threads(how):
    model = MODEL_G
    loss = {"global_via_helper": _global_loss,
            "partial": functools.partial(_partial_loss, model),
            "bound_method": _Holder(model).loss,
            "default": _default_loss_factory(model)}[how]
    ck = [_ckpt(model, 1.0, "A")]
    other = _ckpt(model, -1.5, "B").params
    alone = _fit(loss, ck, "kfac")
    rows_alone = _psg_loop(loss, other, reps=10)
    res, errs = _run_threads([lambda: _fit(loss, ck, "kfac"),
                              lambda: _psg_loop(loss, other, reps=10)])
    assert errs == [None, None], errs
    _assert_same_curv(alone, res[0])
    _assert_rows_same(rows_alone, res[1])


def test_submodule_loss_fit_vs_whole_model_rows():
    model = Net()
    sub = model.b

    def sub_loss(params, ex):
        x, y = ex
        return _ce(functional_call(sub, params, (x.unsqueeze(0)[:, :3],))[0], y)

    whole = _closure_loss(model)
    ck_sub = [tif.Checkpoint({k: v.detach().clone() * 2 for k, v in sub.named_parameters()},
                             name="S")]
    other = _ckpt(model, -1.0, "B").params
    alone = _fit(sub_loss, ck_sub, "kfac")
    rows_alone = _psg_loop(whole, other, reps=10)
    res, errs = _run_threads([lambda: _fit(sub_loss, ck_sub, "kfac"),
                              lambda: _psg_loop(whole, other, reps=10)])
    assert errs == [None, None], errs
    _assert_same_curv(alone, res[0])
    _assert_rows_same(rows_alone, res[1])


def test_module_loss_fit_beside_hand_written_rows():
    model = Net()
    mloss = tif.loss_from_module(model, nn.functional.cross_entropy)
    hand = _closure_loss(model)
    ck = [_ckpt(model, 1.0, "A")]
    other = _ckpt(model, 2.5, "B").params
    alone = _fit(mloss, ck, "ekfac")
    rows_alone = _psg_loop(hand, other, reps=10)
    res, errs = _run_threads([lambda: _fit(mloss, ck, "ekfac"),
                              lambda: _psg_loop(hand, other, reps=10)])
    assert errs == [None, None], errs
    _assert_same_curv(alone, res[0])
    _assert_rows_same(rows_alone, res[1])


def test_choose_damping_threads_equal_alone_and_scores():
    model = Net()
    loss = _closure_loss(model)
    ck = [_ckpt(model, 1.0, "A")]
    other = _ckpt(model, -2.0, "B").params
    curv = _fit(loss, ck, "kfac")
    tr, va = _data(12, seed=7), _data(12, seed=8)
    alone = choose_damping(curv, loss, ck, tr, va, scales=(0.1, 1.0, 10.0))
    rows_alone = _psg_loop(loss, other, reps=10)
    res, errs = _run_threads([
        lambda: choose_damping(curv, loss=loss, checkpoints=ck, train_data=tr,
                               validation_data=va, scales=(0.1, 1.0, 10.0)),
        lambda: _psg_loop(loss, other, reps=10)])
    assert errs == [None, None], errs
    assert res[0].scale == alone.scale
    _assert_rows_same(rows_alone, res[1])
    proj = tif.Projection(dim=8, seed=2)
    store = tif.build_store(loss, ck, _data(), projection=proj)
    t1 = tif.preconditioned_test_grads(loss, ck, _data(8, 9), alone.curvature, projection=proj)
    t2 = tif.preconditioned_test_grads(loss, ck, _data(8, 9), res[0].curvature, projection=proj)
    torch.testing.assert_close(tif.score(store, t1, progress=False),
                               tif.score(store, t2, progress=False))


# ---------------------------------------------------------------- (c) exceptions, no lock leaked

@pytest.mark.parametrize("where", ["fit", "choose_damping"])
def test_exception_in_loss_releases_locks(where):
    model = Net()
    good = _closure_loss(model)
    state = {"n": 0}

    def bad(params, ex):
        state["n"] += 1
        if state["n"] > 2:
            raise RuntimeError("boom in loss")
        return good(params, ex)

    ck = [_ckpt(model, 1.0, "A")]
    curv = _fit(good, ck, "kfac")

    def failing():
        if where == "fit":
            return _fit(bad, ck, "kfac")
        return choose_damping(curv, bad, ck, _data(8), _data(8, 4), scales=(1.0,))

    _res, errs = _run_threads([failing])
    assert errs[0] is not None
    assert "boom in loss" in repr(errs[0]) or "boom in loss" in repr(errs[0].__cause__)
    alone = _fit(good, ck, "ekfac")
    res, errs = _run_threads([lambda: _fit(good, ck, "ekfac"),
                              lambda: _psg_loop(good, ck[0].params, reps=2)])
    assert errs == [None, None], errs
    _assert_same_curv(alone, res[0])


# ---------------------------------------------------------------- (a) nesting, deadlocks

def _nested_same_thread(outer_kind, inner_kind, same_model=True, warm=True):
    """A fit inside a loss being differentiated (under vmap, or by another fit) is refused
    with a LossFunctionError that says to fit before (review of atk50e's findings: it ran
    only when the checkpoint happened to be fingerprinted already, and K-FAC never)."""
    model = Net()
    inner_model = model if same_model else Net(1)
    inner = _closure_loss(inner_model)
    own = _closure_loss(model)
    ck = [_ckpt(model, 1.0, "A")]
    ck_in = ck if same_model else [_ckpt(inner_model, 1.0, "B")]
    if warm:  # the inner checkpoint's fingerprint is then computed outside any transform
        _fit(inner, ck_in, inner_kind)

    def outer(params, ex):
        _fit(inner, ck_in, inner_kind)
        return own(params, ex)

    if outer_kind == "psg":
        _, errs = _run_threads([lambda: _psg_loop(outer, ck[0].params, reps=1)])
    else:
        _, errs = _run_threads([lambda: _fit(outer, ck, outer_kind)])
    assert isinstance(errs[0], LossFunctionError), errs
    assert "fit_curvature: called inside a loss that is being differentiated" in str(errs[0])
    # nothing left behind: the same fits and gradients afterwards equal fresh ones
    _assert_same_curv(_fit(inner, ck_in, inner_kind), _fit(inner, ck_in, inner_kind))
    _assert_rows_same(_psg_loop(own, ck[0].params, reps=1), _psg_loop(own, ck[0].params, reps=1))


@pytest.mark.parametrize("outer_kind", ["psg", "dense", "kfac"])
@pytest.mark.parametrize("same_model", [True, False])
def test_nested_dense_fit_inside_loss_same_thread(outer_kind, same_model):
    _nested_same_thread(outer_kind, "dense", same_model)


@pytest.mark.parametrize("outer_kind", ["psg", "dense"])
@pytest.mark.parametrize("same_model", [True, False])
def test_FINDING_nested_kfac_fit_inside_vmapped_loss(outer_kind, same_model):
    _nested_same_thread(outer_kind, "kfac", same_model)


@pytest.mark.parametrize("outer_kind,same_model", [("psg", True), ("psg", False),
                                                   ("dense", False)])
@pytest.mark.parametrize("inner_kind", ["dense", "kfac"])
def test_FINDING_nested_fit_fresh_checkpoint_inside_vmapped_loss(outer_kind, same_model,
                                                                 inner_kind):
    _nested_same_thread(outer_kind, inner_kind, same_model, warm=False)


def test_FINDING_nested_kfac_fit_inside_kfac_fit_loss_same_model():
    _nested_same_thread("kfac", "kfac", True)


def test_nested_fit_inside_psg_loss_cross_thread_waits_not_hangs():
    """Thread 1's fit loss calls fit_curvature on model M while thread 2 fits M: the nested
    fit is refused, the other fit finishes exact, nothing hangs."""
    model = Net()
    inner = _closure_loss(model)
    ck = [_ckpt(model, 1.0, "A")]
    alone = _fit(inner, ck, "ekfac")
    alone_d = _fit(inner, ck, "dense")
    got = {}

    def outer(params, ex):
        if "c" not in got:
            got["c"] = _fit(inner, ck, "dense")
        return inner(params, ex)

    res, errs = _run_threads([lambda: _fit(outer, ck, "dense"),
                              lambda: _fit(inner, ck, "ekfac")])
    assert isinstance(errs[0], LossFunctionError), errs  # a fit inside a fit's loss: refused
    assert "called inside a loss that is being differentiated" in str(errs[0])
    assert errs[1] is None, errs
    assert "c" not in got and alone_d is not None
    _assert_same_curv(alone, res[1])


@pytest.mark.parametrize("outer_fn", ["fit", "choose_damping"])
def test_opposite_order_nesting_two_models_error_not_hang(outer_fn):
    ma, mb = Net(0), Net(1)
    la, lb = _closure_loss(ma), _closure_loss(mb)
    cka, ckb = [_ckpt(ma, 1.0, "A")], [_ckpt(mb, 1.0, "B")]
    curv_a, curv_b = _fit(la, cka, "kfac"), _fit(lb, ckb, "kfac")
    barrier = threading.Barrier(2, timeout=JOIN)  # generous: load must not break it

    def nester(own, other_loss, other_ck):
        flag = {}
        box = [other_loss]  # a list item: not walked, so the outer call locks `own` only

        def outer(params, ex):
            if not flag:
                flag["x"] = 1
                barrier.wait()
                if outer_fn == "fit":
                    _fit(box[0], other_ck, "dense")
                else:  # choose_damping vmaps the loss at once: nest a per-batch call
                    tif.per_sample_grads(box[0])(other_ck[0].params, _data()[0])
            return own(params, ex)
        return outer

    oa, ob = nester(la, lb, ckb), nester(lb, la, cka)

    def run(loss, ck, curv):
        if outer_fn == "fit":
            return _fit(loss, ck, "kfac")
        return choose_damping(curv, loss, ck, _data(8), _data(8, 4), scales=(1.0,))

    _res, errs = _run_threads([lambda: run(oa, cka, curv_a), lambda: run(ob, ckb, curv_b)])
    failed = [e for e in errs if e is not None]
    if outer_fn == "fit":  # a fit inside a fit's loss is refused at once, in both threads
        assert len(failed) == 2, errs
        assert all("called inside a loss that is being differentiated" in str(e)
                   for e in failed), errs
        return
    assert len(failed) == 1, errs

    def chain(e):
        while e is not None:
            yield e
            e = e.__cause__ or e.__context__

    assert any(isinstance(x, LossFunctionError) for x in chain(failed[0])), failed
    assert not any(isinstance(x, threading.BrokenBarrierError) for x in chain(failed[0]))


def test_loss_waiting_on_fit_of_submodule_in_other_thread_no_hang_if_not_locked():
    """A loss over model.a only (fit on it) and a thread fitting the whole model: both finish."""
    model = Net()
    sub = model.a

    def sub_loss(params, ex):
        x, y = ex
        return _ce(functional_call(sub, params, (x.unsqueeze(0),))[0][:2], y)

    ck_sub = [tif.Checkpoint({k: v.detach().clone() for k, v in sub.named_parameters()},
                             name="S")]
    whole = _closure_loss(model)
    ck = [_ckpt(model, 1.0, "A")]
    a1, a2 = _fit(sub_loss, ck_sub, "ekfac"), _fit(whole, ck, "ekfac")
    res, errs = _run_threads([lambda: _fit(sub_loss, ck_sub, "ekfac"),
                              lambda: _fit(whole, ck, "ekfac"),
                              lambda: _fit(sub_loss, ck_sub, "ekfac")])
    assert errs == [None, None, None], errs
    _assert_same_curv(a1, res[0])
    _assert_same_curv(a2, res[1])
    _assert_same_curv(a1, res[2])


# ---------------------------------------------------------------- (d) split="shape", empty sides

class EmptySides(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(4, 3)
        with pytest.warns(UserWarning):
            self.e0 = nn.Linear(0, 3)  # weight [3, 0]
        with pytest.warns(UserWarning):
            self.e1 = nn.Linear(4, 0)  # weight [0, 4], bias [0]
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        h = self.a(x) + self.e0(x[..., :0]) + self.e1(x).sum(-1, keepdim=True)
        return self.b(torch.tanh(h))


def _empty_setup():
    model = EmptySides()
    with torch.no_grad():
        model.e0.bias.mul_(0.5)
    ck = _ckpt(model, 1.0, "A")
    return model, ck


def _np_rows(loss, params, batch, proj):
    import numpy_projection as npp  # tests/numpy_projection.py

    grads = tif.per_sample_grads(loss)(params, batch)
    n = next(iter(grads.values())).shape[0]
    return np.stack([npp.project({k: v[i].double().numpy() for k, v in grads.items()},
                                 proj.seed, "kronecker", proj.dim, split=proj.split,
                                 vectors=proj.vectors) for i in range(n)])


@pytest.fixture(autouse=False)
def _np_path(monkeypatch):
    import os
    import sys

    monkeypatch.setattr(sys, "path", [os.path.join(os.path.dirname(__file__), ".."), *sys.path])


@pytest.mark.parametrize("dim", [1, 7, 12, 64])
@pytest.mark.parametrize("vectors", ["dense", "kronecker"])
@pytest.mark.parametrize("module_loss", [False, True])
def test_shape_split_empty_sides_rows_equal_numpy(_np_path, dim, vectors, module_loss):
    model, ck = _empty_setup()
    loss = (tif.loss_from_module(model, nn.functional.cross_entropy) if module_loss
            else _closure_loss(model))
    proj = tif.Projection(dim=dim, seed=5, kind="kronecker", split="shape", vectors=vectors)
    batch = _data()[0]
    rows = tif.projected_grads(loss, proj)(ck.params, batch)
    ref = _np_rows(_closure_loss(model), ck.params, batch, proj)
    np.testing.assert_allclose(rows.double().numpy(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 0), (0, 4), (0, 0), (5, 0, 3, 3), (2, 3, 0)])
@pytest.mark.parametrize("dim", [6, 12])
def test_kronecker_factors_empty_side_jax_equals_torch_square_split(shape, dim):
    jtif = pytest.importorskip("tracinfunc.jax")
    from tracinfunc.projection import kronecker_factors
    from tracinfunc.projection.keys import kronecker_split

    proj = tif.Projection(dim=dim, seed=9, kind="kronecker", split="shape")
    po, pi = kronecker_factors(proj, "w", shape)
    jo, ji = jtif.kronecker_factors(proj, "w", shape)
    k_out, k_in = kronecker_split(dim)
    assert tuple(po.shape) == (shape[0], k_out)
    assert tuple(pi.shape[1:]) == (k_in,)
    np.testing.assert_array_equal(po.numpy(), np.asarray(jo))
    np.testing.assert_array_equal(pi.numpy(), np.asarray(ji))
    assert kronecker_split(dim, shape) == (k_out, k_in)


def test_shape_split_empty_sides_store_round_trip_and_scores(tmp_path):
    model, ck = _empty_setup()
    loss = _closure_loss(model)
    proj = tif.Projection(dim=12, seed=5, kind="kronecker", split="shape")
    path = tmp_path / "s.zarr"
    tif.build_store(loss, [ck], _data(), projection=proj, store=str(path), batch_size=4)
    store = tif.open_store(str(path))
    assert store.meta.projection == proj
    assert store.meta.projection.split == "shape"
    fn = tif.projected_grads(loss, proj)
    expect = torch.cat([fn(ck.params, b) for b in _data()])
    torch.testing.assert_close(store.read_rows(0, 0, 24), expect, rtol=1e-5, atol=1e-6)
    tests = tif.build_store(loss, [ck], _data(8, 9), projection=store.meta.projection)
    s = tif.score(store, tests, progress=False)
    mem = tif.build_store(loss, [ck], _data(), projection=proj, batch_size=4)
    torch.testing.assert_close(s, tif.score(mem, tests, progress=False))


def test_shape_split_empty_sides_projected_fit_in_threads():
    model, ck = _empty_setup()
    loss = _closure_loss(model)
    proj = tif.Projection(dim=12, seed=5, kind="kronecker", split="shape")
    alone = _fit(loss, [ck], "projected", projection=proj)
    other = _ckpt(model, -1.0, "B").params
    res, errs = _run_threads([lambda: _fit(loss, [ck], "projected", projection=proj),
                              lambda: _psg_loop(loss, other, reps=5)])
    assert errs == [None, None], errs
    _assert_same_curv(alone, res[0])
    for e in alone.estimates:
        for v in e.values():
            assert torch.isfinite(v).all()


@pytest.mark.parametrize("module_loss", [False, True])
def test_FINDING_shape_split_empty_layer_knocks_model_off_factorised_path(module_loss):
    import warnings

    model, ck = _empty_setup()
    loss = (tif.loss_from_module(model, nn.functional.cross_entropy) if module_loss
            else _closure_loss(model))
    proj = tif.Projection(dim=12, seed=5, kind="kronecker", split="shape")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tif.projected_grads(loss, proj)(ck.params, _data()[0])
    msgs = [str(w.message)[:200] for w in caught if ("tracinfunc" in w.filename
            or "projected_grads" in str(w.message))
            and not issubclass(w.category, LossFormWarning)]  # the documented note
    if module_loss:  # the real layers stay factorised; the batched forward has no rule for
        # an empty layer's bias, so that mode says so and the vmap mode (same rows) runs
        assert tif.grads.factorized_weights(loss, ck.params, (_data()[0][0][0],
                                                              _data()[0][1][0])) \
            == ["a.weight", "b.weight"]
        msgs = [m for m in msgs if "because one batched forward of the module" not in m]
    assert msgs == []


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_FINDING_kfac_random_op_in_loss_raw_error(kind):
    model = Net()
    base = _closure_loss(model)

    def noisy(params, ex):
        return base(params, ex) + 0.0 * torch.randn(())

    with pytest.raises(LossFunctionError):
        _fit(noisy, [_ckpt(model, 1.0, "A")], kind)


@pytest.mark.parametrize("kind", ["dense", "projected"])
def test_random_op_in_loss_gives_loss_function_error(kind):
    model = Net()
    base = _closure_loss(model)

    def noisy(params, ex):
        return base(params, ex) + 0.0 * torch.randn(())

    with pytest.raises(LossFunctionError):
        _fit(noisy, [_ckpt(model, 1.0, "A")], kind)
    # and the model's lock was let go
    _res, errs = _run_threads([lambda: _fit(base, [_ckpt(model, 1.0, "A")], kind)])
    assert errs == [None]


def test_choose_damping_whole_model_vs_submodule_fit_threads():
    model = Net()
    whole = _closure_loss(model)
    sub = model.b

    def sub_loss(params, ex):
        x, y = ex
        return _ce(functional_call(sub, params, (x.unsqueeze(0)[:, :3],))[0], y)

    ck = [_ckpt(model, 1.0, "A")]
    ck_sub = [tif.Checkpoint({k: v.detach().clone() * -3 for k, v in sub.named_parameters()},
                             name="S")]
    curv = _fit(whole, ck, "ekfac")
    tr, va = _data(12, seed=7), _data(12, seed=8)
    alone_cd = choose_damping(curv, whole, ck, tr, va, scales=(0.1, 1.0, 10.0))
    alone_fit = _fit(sub_loss, ck_sub, "ekfac")
    res, errs = _run_threads([
        lambda: choose_damping(curv, whole, ck, tr, va, scales=(0.1, 1.0, 10.0)),
        lambda: _fit(sub_loss, ck_sub, "ekfac"),
        lambda: _fit(sub_loss, ck_sub, "ekfac")])
    assert errs == [None, None, None], errs
    assert res[0].scale == alone_cd.scale
    np.testing.assert_allclose(np.asarray(res[0].values, dtype=float),
                               np.asarray(alone_cd.values, dtype=float), rtol=1e-9)
    _assert_same_curv(alone_fit, res[1])
    _assert_same_curv(alone_fit, res[2])
