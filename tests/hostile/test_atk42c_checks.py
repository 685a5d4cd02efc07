"""atk42c: outside (docs-only) pass over the atk42/atk42b fixes.

Surfaces: checkpoint buffers (shape check, partial-set refusal), checkpoint dtypes and the
cast of ``Checkpoint.load`` / ``from_state_dict``, the one process-wide forward lock, entries
a forward registers, ``model_stages`` of a Sequential applying one layer twice, lazy modules,
the in-place / recurrent messages. Tests marked ``HELD`` guard behaviour that held.
The 6 findings were fixed by the lead at stop 42: stages made by ``model_stages`` read each
checkpoint's buffers (they kept their own copy: silently wrong rows with close statistics);
per-module locks that refuse the wait closing a cycle replace the one process-wide lock (a
forward waiting for tracinfunc in a worker thread hung); the lazy-module refusal names the
module and how to initialise one the forward never calls; ``Checkpoint.from_module`` refuses
lazy modules; a parametrization a forward registers is removed with the module's class.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.errors import TracInFuncError

JOIN_S = 60.0


def _data(n=6, d=4, c=3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=dtype), torch.randint(0, c, (n,), generator=g)


def _bn_model(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))
    m.train()
    with torch.no_grad():
        m(torch.randn(16, 4))  # non-trivial running statistics
    return m.eval()


def _ref_rows(model, x, y):
    """float64 loop of torch.autograd.grad over a deepcopy of ``model``: {name: [b, *shape]}."""
    import copy

    m = copy.deepcopy(model).double().eval()
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    rows = {n: [] for n in names}
    for i in range(len(x)):
        out = m(x[i : i + 1].double())
        loss = F.cross_entropy(out, y[i : i + 1])
        gs = torch.autograd.grad(loss, [dict(m.named_parameters())[n] for n in names])
        for n, g in zip(names, gs, strict=False):
            rows[n].append(g)
    return {n: torch.stack(v) for n, v in rows.items()}


def _psg_at(model, ckpt, x, y):
    loss = tif.checkpoint.loss_at(tif.loss_from_module(model, F.cross_entropy), ckpt)
    return tif.per_sample_grads(loss)(dict(ckpt.params), (x, y))


def _assert_rows(got, ref, tol=1e-5):
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n].double(), ref[n], atol=tol, rtol=tol)


# ---------------------------------------------------------------- checkpoint buffers


def test_held_bn_from_module_rows_match_float64_loop():
    """HELD: from_module of a BatchNorm model, rows equal the float64 loop."""
    m = _bn_model()
    x, y = _data()
    _assert_rows(_psg_at(m, tif.Checkpoint.from_module(m), x, y), _ref_rows(m, x, y))


def test_held_bn_from_state_dict_with_int_num_batches_tracked():
    """HELD: a real state dict (integer num_batches_tracked included) is accepted."""
    m = _bn_model()
    x, y = _data()
    ckpt = tif.Checkpoint.from_state_dict(m.state_dict(), m)
    _assert_rows(_psg_at(m, ckpt, x, y), _ref_rows(m, x, y))


def test_hand_checkpoint_without_buffers_is_not_a_partial_set():
    """A hand-built ``Checkpoint(params=...)`` (buffers empty, the constructor's default) for a
    BatchNorm model holds none of its buffers, not some: build_store uses the loss's own."""
    m = _bn_model()
    x, y = _data()
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    ckpt = tif.Checkpoint(params=params, lr=1.0)
    loss = tif.loss_from_module(m, F.cross_entropy)
    store = tif.build_store(loss, [ckpt], (x, y), projection=tif.Projection(dim=8, seed=0))
    assert store.n == len(x) if hasattr(store, "n") else True


def test_hand_checkpoint_float_buffers_without_int_counter_accepted():
    """running_mean and running_var given, num_batches_tracked (integer, unused in eval) not:
    every floating-point buffer is there, so it is not a partial set."""
    m = _bn_model()
    x, y = _data()
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    bufs = {n: b.clone() for n, b in m.named_buffers() if b.is_floating_point()}
    ckpt = tif.Checkpoint(params=params, buffers=bufs)
    _assert_rows(_psg_at(m, ckpt, x, y), _ref_rows(m, x, y))


def test_held_partial_float_buffers_refused_by_name():
    """HELD: only running_mean of a BatchNorm model: refused naming the missing buffer."""
    m = _bn_model()
    x, y = _data()
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    ckpt = tif.Checkpoint(params=params, buffers={"1.running_mean": m[1].running_mean.clone()})
    loss = tif.loss_from_module(m, F.cross_entropy)
    with pytest.raises(TracInFuncError, match="running_var"):
        tif.build_store(loss, [ckpt], (x, y), projection=tif.Projection(dim=8, seed=0))


def test_held_buffer_of_wrong_shape_refused_by_name():
    """HELD: a running_var of another shape is named with both shapes."""
    m = _bn_model()
    x, y = _data()
    ck = tif.Checkpoint.from_module(m)
    bufs = dict(ck.buffers)
    bufs["1.running_var"] = torch.ones(7)
    ckpt = tif.Checkpoint(params=dict(ck.params), buffers=bufs)
    loss = tif.loss_from_module(m, F.cross_entropy)
    with pytest.raises(TracInFuncError, match="running_var"):
        tif.build_store(loss, [ckpt], (x, y), projection=tif.Projection(dim=8, seed=0))


class _NonPersistent(nn.Module):
    """A float non-persistent buffer used in forward (like a rotary embedding's inv_freq)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0, 4.0]), persistent=False)
        self.register_buffer("shift", torch.tensor([0.5, -0.5, 0.25, 0.0]))

    def forward(self, x):
        return self.fc(x * self.scale + self.shift)


def test_held_non_persistent_buffer_state_dict_checkpoint():
    """HELD: a state dict (no non-persistent ``scale``) gives the right rows."""
    torch.manual_seed(0)
    m = _NonPersistent().eval()
    x, y = _data()
    ckpt = tif.Checkpoint.from_state_dict(m.state_dict(), m)
    _assert_rows(_psg_at(m, ckpt, x, y), _ref_rows(m, x, y))


def test_hand_checkpoint_with_persistent_buffers_only_accepted():
    """A hand-built checkpoint carrying exactly the state dict's buffers (the persistent ones,
    as ``from_state_dict`` does) is not a partial set either."""
    torch.manual_seed(0)
    m = _NonPersistent().eval()
    x, y = _data()
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    ckpt = tif.Checkpoint(params=params, buffers={"shift": m.shift.clone()})
    _assert_rows(_psg_at(m, ckpt, x, y), _ref_rows(m, x, y))


class _NoneBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("mask", None)
        self.register_buffer("shift", torch.full((4,), 0.1))

    def forward(self, x):
        return self.fc(x + self.shift)


def test_held_buffer_registered_as_none():
    """HELD: a buffer registered as None; from_module / from_state_dict and rows."""
    torch.manual_seed(0)
    m = _NoneBuffer().eval()
    x, y = _data()
    ref = _ref_rows(m, x, y)
    _assert_rows(_psg_at(m, tif.Checkpoint.from_module(m), x, y), ref)
    _assert_rows(_psg_at(m, tif.Checkpoint.from_state_dict(m.state_dict(), m), x, y), ref)


# ---------------------------------------------------------------- dtypes and the cast


def test_load_casts_float32_state_dict_to_float64_model(tmp_path):
    """Checkpoint.load of a float32 state dict onto a float64 model: params and float buffers
    float64 (as load_state_dict), num_batches_tracked stays int64, rows right."""
    m32 = _bn_model()
    torch.save(m32.state_dict(), tmp_path / "c.pt")
    m64 = _bn_model(seed=1).double()
    ckpt = tif.Checkpoint.load(tmp_path / "c.pt", m64)
    assert all(t.dtype == torch.float64 for t in ckpt.params.values())
    for n, b in ckpt.buffers.items():
        assert b.dtype == (torch.int64 if n.endswith("num_batches_tracked") else torch.float64), n
    x, y = _data(dtype=torch.float64)
    _assert_rows(_psg_at(m64, ckpt, x, y), _ref_rows(m32, x, y), tol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_from_state_dict_casts_to_half_model(dtype):
    """A float32 state dict onto a bfloat16/float16 model: tensors in the model's dtype and the
    fingerprint equal to from_module's of the same model after load_state_dict."""
    m32 = _bn_model()
    mh = _bn_model(seed=1).to(dtype)
    ckpt = tif.Checkpoint.from_state_dict(m32.state_dict(), mh)
    assert all(t.dtype == dtype for t in ckpt.params.values())
    mh.load_state_dict(m32.state_dict())
    fp = tif.checkpoint.params_fingerprint
    assert fp(ckpt.params) == fp(tif.Checkpoint.from_module(mh).params)


def test_held_hand_checkpoint_of_other_float_dtype_named():
    """HELD: float64 params by hand for a float32 model: an error naming the dtype."""
    m = _bn_model()
    x, y = _data()
    params = {n: p.detach().double() for n, p in m.named_parameters()}
    ckpt = tif.Checkpoint(params=params)
    with pytest.raises(TracInFuncError, match="float64"):
        _psg_at(m, ckpt, x, y)


def test_state_dict_on_meta_device_refused_clearly():
    """A state dict whose tensors hold no data (meta device) is refused by tracinfunc's error,
    not a bare torch failure, and not accepted as zeros."""
    m = _bn_model()
    sd = {k: torch.empty_like(v, device="meta") for k, v in m.state_dict().items()}
    with pytest.raises(TracInFuncError):
        tif.Checkpoint.from_state_dict(sd, m)


# ---------------------------------------------------------------- the one lock


def _mlp(seed, d=4, h=6, c=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, c)).eval()


def test_held_two_threads_two_models_each_gets_its_rows():
    """HELD: two models in two threads started by one barrier, each equals its serial rows."""
    ms = [_mlp(1), _mlp(2)]
    x, y = _data()
    serial = [_psg_at(m, tif.Checkpoint.from_module(m), x, y) for m in ms]
    out, errs = [None, None], []
    bar = threading.Barrier(2)

    def work(i):
        try:
            bar.wait(timeout=JOIN_S)
            for _ in range(3):
                out[i] = _psg_at(ms[i], tif.Checkpoint.from_module(ms[i]), x, y)
        except Exception as e:
            errs.append(e)

    ts = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in ts) and not errs, errs
    for i in range(2):
        _assert_rows(out[i], {k: v.double() for k, v in serial[i].items()}, tol=0)


class _CallsTracin(nn.Module):
    """A forward that itself calls tracinfunc on another model (nested)."""

    def __init__(self, inner):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.inner = [inner]  # not a submodule
        self.seen = None

    def forward(self, x):
        inner = self.inner[0]
        xi, yi = _data(n=2)
        self.seen = _psg_at(inner, tif.Checkpoint.from_module(inner), xi, yi)
        return self.fc(x)


def test_held_nested_call_and_exception_release_lock():
    """HELD: a nested tracinfunc call inside a forward does not deadlock; a loss that raises
    leaves the lock free (another thread's call then finishes) and the weights restored."""
    inner = _mlp(3)
    outer = _CallsTracin(inner).eval()
    x, y = _data(n=2)
    done = threading.Event()

    def nested():
        loss = tif.loss_from_module(outer, F.cross_entropy)
        w = {n: p.detach() + 1.0 for n, p in outer.named_parameters()}
        try:
            loss(w, (x[0], y[0]))
        finally:
            done.set()

    t = threading.Thread(target=nested, daemon=True)
    t.start()
    t.join(JOIN_S)
    assert done.is_set() and not t.is_alive()
    assert outer.seen is not None

    def bad(out, tgt):
        raise RuntimeError("boom")

    m = _mlp(4)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    with pytest.raises(RuntimeError, match="boom"):
        tif.per_sample_grads(tif.loss_from_module(m, bad))(
            {n: p.detach() * 2 for n, p in m.named_parameters()}, _data())
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    res = []
    t2 = threading.Thread(target=lambda: res.append(_psg_at(m, tif.Checkpoint.from_module(m), *_data())),
                          daemon=True)
    t2.start()
    t2.join(JOIN_S)
    assert res, "the lock was left held after an exception"


# ---------------------------------------------------------------- entries a forward registers


class _RegistersBuffer(nn.Module):
    """Registers a cache buffer on its first forward (a lazily built mask)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        if not hasattr(self, "cache"):
            self.register_buffer("cache", torch.ones(4), persistent=False)
        return self.fc(x * self.cache)


class _Fc(nn.Module):
    """Just the linear layer the model under test uses: the reference model."""

    def __init__(self, fc):
        super().__init__()
        self.fc = fc

    def forward(self, x):
        return self.fc(x)


def test_held_registered_buffer_removed_and_model_still_runs():
    """HELD-or-not: after a tracinfunc call the module has no escaped vmap tensor; it still runs
    by itself, and a second tracinfunc call gives the same rows."""
    torch.manual_seed(0)
    m = _RegistersBuffer().eval()
    x, y = _data()
    ck = tif.Checkpoint.from_module(m)
    r1 = _psg_at(m, ck, x, y)
    for n, b in m.named_buffers():
        assert type(b) is torch.Tensor and torch.is_tensor(b + 1), n
    m(x)  # its own forward works
    r2 = _psg_at(m, ck, x, y)
    _assert_rows(r1, {k: v.double() for k, v in r2.items()}, tol=0)
    _assert_rows(r1, _ref_rows(_Fc(m.fc), x, y))


class _NoneThenAssigned(nn.Module):
    """Buffer registered as None in __init__, assigned in forward (a KV-style cache)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("last", None, persistent=False)

    def forward(self, x):
        self.last = x.detach() * 0 + 1
        return self.fc(x)


def test_buffer_registered_none_in_init_and_assigned_in_forward_not_left_escaped():
    """A forward assigning a buffer registered (as None) in __init__: after a tracinfunc call the
    module holds no escaped vmap tensor there (None again, or a plain tensor), and the module's
    own forward and a state_dict still work."""
    torch.manual_seed(0)
    m = _NoneThenAssigned().eval()
    x, y = _data()
    _psg_at(m, tif.Checkpoint.from_module(m), x, y)
    last = m.last
    if last is not None:
        assert torch.is_tensor(last + 1)
        assert not torch._C._functorch.is_batchedtensor(last)
        assert not torch._C._functorch.is_gradtrackingtensor(last)
    m(x)
    m.state_dict()


class _LazyParametrized(nn.Module):
    """Registers a parametrization on its first forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        from torch.nn.utils import parametrize

        if not parametrize.is_parametrized(self.fc):
            parametrize.register_parametrization(self.fc, "weight", _Double())
        return self.fc(x)


class _Double(nn.Module):
    def forward(self, w):
        return 2 * w


def test_lazily_registered_parametrization_left_registered_after_refusal():
    """FINDING. A forward registering a parametrization on its first call: torch.func itself
    cannot run it (KeyError "attribute 'weight' already exists"), so a refusal is fair; but
    the docs promise that after each forward no entry the forward registered is left. Observed:
    the refusal blames the batch's structure and ``fc`` is left a ``ParametrizedLinear`` with
    its ``parametrizations`` registered (in a pytest run, holding a GradTrackingTensor)."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    m = _LazyParametrized().eval()
    x, y = _data()
    ck = tif.Checkpoint.from_module(m)
    with contextlib.suppress(TracInFuncError):
        _psg_at(m, ck, x, y)
    for n, p in list(m.named_parameters()) + list(m.named_buffers()):
        assert not torch._C._functorch.is_batchedtensor(p), n
        assert not torch._C._functorch.is_gradtrackingtensor(p), n
    assert not parametrize.is_parametrized(m.fc), "the forward's parametrization was left registered"
    assert type(m.fc) is nn.Linear


class _HookRegisters(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

        def hook(mod, args):
            if "hbuf" not in mod._buffers:
                mod.register_buffer("hbuf", torch.zeros(3))

        self.fc.register_forward_pre_hook(hook)

    def forward(self, x):
        return self.fc(x)


def test_held_hook_registering_buffer_removed():
    """HELD-or-not: a forward pre-hook that registers a buffer; afterwards no vmap tensor."""
    torch.manual_seed(0)
    m = _HookRegisters().eval()
    x, y = _data()
    _psg_at(m, tif.Checkpoint.from_module(m), x, y)
    for n, b in m.named_buffers():
        assert not torch._C._functorch.is_batchedtensor(b), n
        assert not torch._C._functorch.is_gradtrackingtensor(b), n
    m(x)


# ---------------------------------------------------------------- lazy modules


def test_held_lazy_refused_with_way_out_then_accepted_once_run():
    """HELD: LazyLinear not yet run is refused naming the way out; after one forward it runs."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.LazyLinear(5), nn.ReLU(), nn.Linear(5, 3)).eval()
    x, y = _data()
    with pytest.raises(TracInFuncError, match="(?i)lazy"):
        tif.per_sample_grads(tif.loss_from_module(m, F.cross_entropy))(
            {n: p for n, p in m.named_parameters() if not isinstance(p, nn.parameter.UninitializedParameter)},
            (x, y))
    m(x)
    _assert_rows(_psg_at(m, tif.Checkpoint.from_module(m), x, y), _ref_rows(m, x, y))


def test_lazy_bn_materialised_before_the_loss_runs():
    """LazyBatchNorm1d materialised by a forward before loss_from_module: accepted."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 5), nn.LazyBatchNorm1d(), nn.ReLU(), nn.Linear(5, 3))
    m.train()
    with torch.no_grad():
        m(torch.randn(16, 4))
    m.eval()
    x, y = _data()
    _assert_rows(_psg_at(m, tif.Checkpoint.from_module(m), x, y), _ref_rows(m, x, y))


# ---------------------------------------------------------------- model_stages, one layer twice


def test_model_stages_sequential_applying_one_layer_twice():
    """nn.Sequential(l1, tanh, l2, tanh, l2, tanh, l3) with l2 one object: staged rows equal
    the float64 loop (l2's gradient the sum of both uses)."""
    torch.manual_seed(0)
    l2 = nn.Linear(5, 5)
    m = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), l2, nn.Tanh(), l2, nn.Tanh(), nn.Linear(5, 3)).eval()
    x, y = _data()
    stages = tif.model_stages(m, F.cross_entropy)
    loss = tif.loss_from_module(m, F.cross_entropy)
    params = {n: p.detach() for n, p in m.named_parameters()}
    got = tif.per_sample_grads(loss, options=tif.GradientOptions(stages=stages))(params, (x, y))
    _assert_rows(got, _ref_rows(m, x, y))


# ---------------------------------------------------------------- in-place / recurrent


class _Rec(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(4, 5, batch_first=True)
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        out = self.rnn(x)[0]
        return self.fc(out[:, -1])


@pytest.mark.parametrize("cell,name", [(nn.GRU, "GRUCell"), (nn.RNN, "RNNCell")])
def test_held_recurrent_refused_naming_its_cell(cell, name):
    """HELD: nn.GRU / nn.RNN under vmap: the error names the matching cell."""
    torch.manual_seed(0)
    m = _Rec(cell).eval()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 4, generator=g), torch.randint(0, 3, (4,), generator=g)
    with pytest.raises(Exception, match=name):
        _psg_at(m, tif.Checkpoint.from_module(m), x, y)


def test_float32_lstm_rows_match_float64_loop():
    """float32 nn.LSTM 'runs': its rows equal the float64 loop's within float32 rounding."""
    torch.manual_seed(0)
    m = _Rec(nn.LSTM).eval()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 4, generator=g), torch.randint(0, 3, (4,), generator=g)
    _assert_rows(_psg_at(m, tif.Checkpoint.from_module(m), x, y), _ref_rows(m, x, y), tol=1e-4)


class _ShapeBug(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x.reshape(x.shape[0], 2, 2))  # plain shape bug


def test_held_plain_shape_bug_not_sent_to_vmap_or_lstm_advice():
    """HELD: a plain shape bug's message does not blame vmap or recommend LSTM cells."""
    m = _ShapeBug().eval()
    x, y = _data()
    with pytest.raises(Exception) as ei:
        _psg_at(m, tif.Checkpoint.from_module(m), x, y)
    msg = str(ei.value)
    assert "LSTMCell" not in msg and "GRUCell" not in msg


# ---------------------------------------------------------------- more: lock across threads


class _HandsOffToWorker(nn.Module):
    """A forward that runs tracinfunc on another model in a worker thread and waits for it
    (a thread pool inside a forward). With one lock per model this finished; with one
    process-wide lock held by the outer forward the worker can never get it."""

    def __init__(self, inner):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.inner = [inner]

    def forward(self, x):
        inner, res = self.inner[0], []
        done = threading.Event()

        def work():
            try:
                res.append(_psg_at(inner, tif.Checkpoint.from_module(inner), *_data(n=2)))
            finally:
                done.set()

        threading.Thread(target=work, daemon=True).start()
        if not done.wait(JOIN_S / 3):  # a deadlock detector, not a timing assumption
            raise RuntimeError("worker's tracinfunc call never got the forward lock: deadlock")
        return self.fc(x)


def test_forward_waiting_on_worker_thread_tracinfunc_call_does_not_deadlock():
    """FINDING. docs/language-models.md: forwards 'take turns, on one model or on two' and the
    process lock fixed a nested call deadlocking. A forward that waits on a worker thread's
    tracinfunc call on another model hangs for ever (here: detected and raised after 20 s).
    Expected: the rows, or a clear TracInFuncError at once naming the nested-thread use."""
    inner = _mlp(3)
    outer = _HandsOffToWorker(inner).eval()
    x, y = _data(n=2)
    loss = tif.loss_from_module(outer, F.cross_entropy)
    params = {n: p.detach() for n, p in outer.named_parameters()}
    try:
        loss(params, (x[0], y[0]))
    except TracInFuncError:
        return  # a clear refusal is acceptable
    except RuntimeError as e:
        assert "deadlock" not in str(e), str(e)


def test_held_streaming_data_waiting_on_other_thread_call():
    """HELD: build_store over a generator that waits for another thread's tracinfunc call
    between batches finishes (the lock is held per forward, not across the build)."""
    a, b = _mlp(1), _mlp(2)
    x, y = _data(n=8)
    first, bdone, out = threading.Event(), threading.Event(), []

    def gen():
        yield (x[:4], y[:4])
        first.set()
        assert bdone.wait(JOIN_S)
        yield (x[4:], y[4:])

    def run_a():
        out.append(tif.build_store(tif.loss_from_module(a, F.cross_entropy), [tif.Checkpoint.from_module(a)],
                                   gen(), projection=tif.Projection(dim=8, seed=0)))

    def run_b():
        first.wait(JOIN_S)
        _psg_at(b, tif.Checkpoint.from_module(b), x, y)
        bdone.set()

    ts = [threading.Thread(target=f, daemon=True) for f in (run_a, run_b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(JOIN_S)
    assert out and bdone.is_set()


def test_held_two_threads_one_model_two_checkpoints():
    """HELD: one model, two checkpoints, two threads: each thread gets its checkpoint's rows."""
    m = _mlp(5)
    x, y = _data()
    cks = [tif.Checkpoint.from_module(m), tif.Checkpoint.from_module(_mlp(6))]
    serial = [_psg_at(m, c, x, y) for c in cks]
    out, bar = [None, None], threading.Barrier(2)

    def work(i):
        bar.wait(timeout=JOIN_S)
        for _ in range(3):
            out[i] = _psg_at(m, cks[i], x, y)

    ts = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(JOIN_S)
    for i in range(2):
        _assert_rows(out[i], {k: v.double() for k, v in serial[i].items()}, tol=0)


# ---------------------------------------------------------------- more: buffers and casts


def test_held_state_dict_missing_one_buffer_refused_by_name():
    """HELD: a state dict lacking running_var: refused naming it (at the first forward)."""
    m = _bn_model()
    x, y = _data()
    sd = dict(m.state_dict())
    del sd["1.running_var"]
    with pytest.raises(TracInFuncError, match="running_var"):
        _psg_at(m, tif.Checkpoint.from_state_dict(sd, m), x, y)


@pytest.mark.parametrize("cast", ["float64", "int32_counter", "float_counter"])
def test_held_state_dict_dtypes_cast_like_load_state_dict(cast):
    """HELD: float64 tensors / an int32 or float num_batches_tracked in a float32 model's state
    dict land in the model's dtypes, rows right."""
    m = _bn_model()
    x, y = _data()
    sd = dict(m.state_dict())
    if cast == "float64":
        sd = {k: v.double() if v.is_floating_point() else v for k, v in sd.items()}
    else:
        sd["1.num_batches_tracked"] = sd["1.num_batches_tracked"].to(
            torch.int32 if cast == "int32_counter" else torch.float32)
    ck = tif.Checkpoint.from_state_dict(sd, m)
    assert ck.buffers["1.num_batches_tracked"].dtype == torch.int64
    assert all(t.dtype == torch.float32 for t in ck.params.values())
    _assert_rows(_psg_at(m, ck, x, y), _ref_rows(m, x, y))


class _BNLazyCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.bn, self.o = nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)

    def forward(self, x):
        if not hasattr(self, "cache"):
            self.register_buffer("cache", torch.ones(5), persistent=False)
        return self.o(torch.relu(self.bn(self.l(x)) * self.cache))


def test_held_checkpoint_before_a_lazily_registered_cache():
    """HELD: from_module taken before the model's first forward registered a non-persistent
    cache: the checkpoint lacks only a non-persistent buffer, which is not a partial set."""
    torch.manual_seed(0)
    m = _BNLazyCache()
    m.train()
    with torch.no_grad():
        m(torch.randn(16, 4))
    m.eval()
    del m._buffers["cache"]
    ck = tif.Checkpoint.from_module(m)
    x, y = _data()
    m(x)
    _psg_at(m, ck, x, y)


def test_held_llama_state_dict_and_bf16_cast():
    """HELD: a 1-layer HF Llama (inv_freq non-persistent): from_state_dict and a float32 state
    dict onto a bfloat16 copy give a store, the params in the model's dtype."""
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(vocab_size=30, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    m = tr.LlamaForCausalLM(cfg).eval()
    batch = {"input_ids": torch.randint(0, 30, (3, 6), generator=torch.Generator().manual_seed(0))}
    proj = tif.Projection(dim=8, seed=0)
    ck = tif.Checkpoint.from_state_dict(m.state_dict(), m)
    a = tif.build_store(tif.causal_lm_loss(m), [ck], batch, projection=proj)
    b = tif.build_store(tif.causal_lm_loss(m), [tif.Checkpoint.from_module(m)], batch, projection=proj)
    torch.testing.assert_close(tif.self_influence(a), tif.self_influence(b))
    mb = tr.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ckb = tif.Checkpoint.from_state_dict(m.state_dict(), mb)
    assert {t.dtype for t in ckb.params.values()} == {torch.bfloat16}
    tif.build_store(tif.causal_lm_loss(mb), [ckb], batch, projection=proj)


def test_held_model_stages_names_repeating_a_submodule():
    """HELD: names=["a", tanh, "b", tanh, "b", tanh, "c"]: rows equal the float64 loop."""

    class Rep(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)

        def forward(self, x):
            return self.c(torch.tanh(self.b(torch.tanh(self.b(torch.tanh(self.a(x)))))))

    torch.manual_seed(0)
    m = Rep().eval()
    x, y = _data()
    st = tif.model_stages(m, F.cross_entropy, names=["a", torch.tanh, "b", torch.tanh, "b", torch.tanh, "c"])
    got = tif.per_sample_grads(tif.loss_from_module(m, F.cross_entropy), options=tif.GradientOptions(stages=st))(
        {n: p.detach() for n, p in m.named_parameters()}, (x, y))
    _assert_rows(got, _ref_rows(m, x, y))


# ---------------------------------------------------------------- more: stages and checkpoint buffers


def _two_bn_checkpoints():
    import copy

    torch.manual_seed(0)
    m1 = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))
    m1.train()
    with torch.no_grad():
        m1(torch.randn(16, 4))
    m1.eval()
    m2 = copy.deepcopy(m1)
    m2.train()
    with torch.no_grad():
        m2(torch.randn(16, 4) * 3 + 1)  # other running statistics, same weights
    m2.eval()
    return m1, m2, [tif.Checkpoint.from_module(m1, name="a"), tif.Checkpoint.from_module(m2, name="b")]


def test_stages_use_each_checkpoints_buffers_in_build_store():
    """FINDING. docs: build_store differentiates a ModuleLoss with each checkpoint's own buffers.
    With stages= (model_stages of a BatchNorm Sequential, the memory page's own use), a second
    checkpoint whose running statistics differ is refused with StageMismatchError ('list every
    submodule that model.forward uses') although the stages are right: they keep the buffers
    taken at model_stages time. Expected: the staged store equals the unstaged one."""
    m1, _, cks = _two_bn_checkpoints()
    x, y = _data(n=8)
    loss = tif.loss_from_module(m1, F.cross_entropy)
    proj = tif.Projection(dim=16, seed=0)
    plain = tif.build_store(loss, cks, (x, y), projection=proj)
    staged = tif.build_store(loss, cks, (x, y), projection=proj,
                             options=tif.GradientOptions(stages=tif.model_stages(m1, F.cross_entropy)))
    torch.testing.assert_close(tif.self_influence(staged), tif.self_influence(plain), rtol=1e-4, atol=1e-5)


def test_stages_with_loss_at_use_the_checkpoints_buffers():
    """FINDING (same cause): per_sample_grads(loss_at(loss, ckpt), stages=...) for a checkpoint
    with other BatchNorm statistics: StageMismatchError instead of the float64 loop's rows."""
    m1, m2, cks = _two_bn_checkpoints()
    x, y = _data(n=8)
    loss = tif.checkpoint.loss_at(tif.loss_from_module(m1, F.cross_entropy), cks[1])
    opts = tif.GradientOptions(stages=tif.model_stages(m1, F.cross_entropy))
    _assert_rows(tif.per_sample_grads(loss, options=opts)(dict(cks[1].params), (x, y)), _ref_rows(m2, x, y))


def test_held_fit_curvature_uses_each_checkpoints_buffers():
    """HELD: fit_curvature(kind='projected') of checkpoint b is the same whichever model's
    buffers the loss was built with (the checkpoint's are used)."""
    m1, m2, cks = _two_bn_checkpoints()
    x, y = _data(n=8)
    proj = tif.Projection(dim=16, seed=0)
    la, lb = tif.loss_from_module(m1, F.cross_entropy), tif.loss_from_module(m2, F.cross_entropy)
    store = tif.build_store(la, [cks[1]], (x, y), projection=proj)
    c1 = tif.fit_curvature(la, [cks[1]], (x, y), projection=proj, damping=0.1)
    c2 = tif.fit_curvature(lb, [cks[1]], (x, y), projection=proj, damping=0.1)
    torch.testing.assert_close(tif.score(store, store, curvature=c1), tif.score(store, store, curvature=c2))


def test_held_shared_submodule_and_shared_buffer_checkpoints():
    """HELD: a BatchNorm held under two names (self.b = self.a) and one buffer tensor under
    two names: from_module / from_state_dict give the float64 loop's rows."""

    class Sh(nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.a, self.o = nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)
            self.b = self.a
            t = torch.full((5,), 0.3)
            self.o.register_buffer("sh", t)
            self.l.register_buffer("sh2", t)

        def forward(self, x):
            return self.o(self.b(self.a(self.l(x))) + self.l.sh2)

    torch.manual_seed(0)
    m = Sh()
    m.train()
    with torch.no_grad():
        m(torch.randn(16, 4))
    m.eval()
    x, y = _data()
    ref = _ref_rows(m, x, y)
    _assert_rows(_psg_at(m, tif.Checkpoint.from_module(m), x, y), ref)
    _assert_rows(_psg_at(m, tif.Checkpoint.from_state_dict(m.state_dict(), m), x, y), ref)


def test_held_forward_reassigning_its_buffer_leaves_module_own():
    """HELD: a forward that reassigns a registered float buffer (an EMA): afterwards the module
    holds its own value, a plain tensor."""

    class EMA(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.register_buffer("ema", torch.zeros(4))

        def forward(self, x):
            self.ema = 0.5 * self.ema + 0.5 * x.detach().mean(0)
            return self.fc(x)

    torch.manual_seed(0)
    m = EMA().eval()
    before = m.ema.clone()
    _psg_at(m, tif.Checkpoint.from_module(m), *_data())
    assert not torch._C._functorch.is_batchedtensor(m.ema)
    assert torch.equal(m.ema, before)


def test_stages_silently_use_model_stages_buffers_when_checkpoint_stats_are_close():
    """FINDING (silent wrong rows). A checkpoint whose BatchNorm statistics differ by 0.3% from
    those model_stages copied passes the stages' loss check (relative 1e-3), and its staged rows
    are those of the stale statistics: 3e-3 off the float64 loop's, 7e-8 from the stale ones."""
    import copy

    torch.manual_seed(0)
    m1 = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))
    m1.train()
    with torch.no_grad():
        m1(torch.randn(16, 4))
    m1.eval()
    m2 = copy.deepcopy(m1)
    with torch.no_grad():
        m2[1].running_mean += 0.003 * torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
        m2[1].running_var *= 1.003
    ck = tif.Checkpoint.from_module(m2)
    x, y = _data(n=8)
    loss = tif.checkpoint.loss_at(tif.loss_from_module(m1, F.cross_entropy), ck)
    opts = tif.GradientOptions(stages=tif.model_stages(m1, F.cross_entropy))
    _assert_rows(tif.per_sample_grads(loss, options=opts)(dict(ck.params), (x, y)), _ref_rows(m2, x, y))


# ---------------------------------------------------------------- more: lazy modules the forward never runs


class _UnusedLazyHead(nn.Module):
    """A model with an auxiliary LazyLinear head its forward (this loss) never calls."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.aux = nn.LazyLinear(2)

    def forward(self, x):
        return self.fc(x)


def test_unused_lazy_head_not_refused_after_running_the_model():
    """FINDING (false refusal, way out that cannot work). The refusal said 'run the model once
    on an example batch before making the loss'; for a lazy head the forward never calls, running
    the model changes nothing and it is refused again. Fixed (lead): the refusal names the lazy
    module and says how to initialise an unused one (a call of its own); done, the rows are the
    used parameters' (a lazy module the forward never ran is refused, not guessed at: run
    inside tracinfunc's transforms it would initialise itself with random weights)."""
    torch.manual_seed(0)
    m = _UnusedLazyHead().eval()
    x, y = _data()
    m(x)  # the first way out: not enough for a head the forward never calls
    with pytest.raises(TracInFuncError, match=r"\['aux'\].*call of its own"):
        tif.loss_from_module(m, F.cross_entropy)
    m.aux(x)  # the second: its own call
    params = {n: p.detach() for n, p in m.named_parameters()}
    got = tif.per_sample_grads(tif.loss_from_module(m, F.cross_entropy))(params, (x, y))
    _assert_rows({n: v for n, v in got.items() if n.startswith("fc.")}, _ref_rows(_Fc(m.fc), x, y))
    assert all(float(got[n].abs().max()) == 0.0 for n in got if n.startswith("aux."))


def test_from_module_with_lazy_module_raises_tracinfunc_error():
    """FINDING. Checkpoint.from_module of a model holding a not-yet-run lazy module raises
    torch's bare ValueError ('Attempted to use an uninitialized parameter in detach'), not a
    TracInFuncError naming the parameters and the way out (as loss_from_module does)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.LazyLinear(5), nn.ReLU(), nn.Linear(5, 3)).eval()
    with pytest.raises(TracInFuncError, match="0.weight"):
        tif.Checkpoint.from_module(m)


def test_held_kronecker_and_kfac_use_each_checkpoints_buffers():
    """HELD: kind='kronecker' stores and K-FAC preconditioned test gradients of checkpoint b are
    the same whichever model's buffers the loss was built with."""
    m1, m2, cks = _two_bn_checkpoints()
    x, y = _data(n=8)
    la, lb = tif.loss_from_module(m1, F.cross_entropy), tif.loss_from_module(m2, F.cross_entropy)
    kron = tif.Projection(dim=16, seed=0, kind="kronecker")
    with pytest.warns(Warning):
        a = tif.build_store(la, [cks[1]], (x, y), projection=kron)
    with pytest.warns(Warning):
        b = tif.build_store(lb, [cks[1]], (x, y), projection=kron)
    torch.testing.assert_close(tif.self_influence(a), tif.self_influence(b))
    o = tif.GradientOptions(select=["0.weight", "0.bias", "3.weight", "3.bias"])
    pr = tif.Projection(dim=16, seed=0)
    c1 = tif.fit_curvature(la, [cks[1]], (x, y), kind="kfac", damping=0.1, options=o)
    c2 = tif.fit_curvature(lb, [cks[1]], (x, y), kind="kfac", damping=0.1, options=o)
    t1 = tif.preconditioned_test_grads(la, [cks[1]], (x, y), c1, projection=pr, options=o)
    t2 = tif.preconditioned_test_grads(la, [cks[1]], (x, y), c2, projection=pr, options=o)
    torch.testing.assert_close(tif.self_influence(t1), tif.self_influence(t2))


# ---------------------------------------------------------------- more held guards


@pytest.mark.parametrize("sel", [None, ["2.weight", "2.bias"], ["4.weight"], ["8.weight", "2.bias"]])
def test_held_model_stages_layer_applied_twice_with_selection(sel):
    """HELD: l2 applied at positions 2 and 6 of a Sequential, with selections that start at,
    skip or straddle its uses: staged rows equal the float64 loop."""
    torch.manual_seed(0)
    l2 = nn.Linear(5, 5)
    m = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), l2, nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), l2, nn.Tanh(),
                      nn.Linear(5, 3)).eval()
    x, y = _data()
    opts = tif.GradientOptions(stages=tif.model_stages(m, F.cross_entropy), select=sel)
    got = tif.per_sample_grads(tif.loss_from_module(m, F.cross_entropy), options=opts)(
        {n: p.detach() for n, p in m.named_parameters()}, (x, y))
    _assert_rows(got, {k: v for k, v in _ref_rows(m, x, y).items() if k in got})
    assert sel is None or set(got) == set(sel)


def test_held_keyboard_interrupt_in_forward_releases_lock():
    """HELD: a KeyboardInterrupt inside a forward propagates and leaves the lock free."""

    def kb(out, tgt):
        raise KeyboardInterrupt

    m = _mlp(1)
    x, y = _data()
    with pytest.raises(KeyboardInterrupt):
        tif.per_sample_grads(tif.loss_from_module(m, kb))({n: p.detach() for n, p in m.named_parameters()}, (x, y))
    res = []
    t = threading.Thread(target=lambda: res.append(_psg_at(m, tif.Checkpoint.from_module(m), x, y)), daemon=True)
    t.start()
    t.join(JOIN_S)
    assert res
