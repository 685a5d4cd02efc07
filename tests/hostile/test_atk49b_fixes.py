"""Attack 49b: the atk49 fixes to ``fit_curvature(kind="kfac"|"ekfac")`` (and the kronecker
build's shared capture hook).

1. a layer input written after the layer read it; 2. a weight read outside its layer's call;
3. layers of other geometry reading one input; 4. the capture's hook first among global hooks;
5. bf16/f16 proved within four units of the last place; 6. one-pass iterators; 7. zarr imported
lazily. Factors are checked against float64 per-example loops (``_reference`` of atk49 for
Linear layers, ``_geometry_reference`` here for Conv2d and Linear readers of one input).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
import tracinfunc.curvature.capture_batched as capture_batched
import tracinfunc.curvature.fit as fit_module
from tests.hostile.test_atk49_kfac_fit import EXACT, _bias_reference, _ckpts, _copy_with, _reference
from tracinfunc.curvature import fit_curvature
from tracinfunc.errors import InvalidArgumentError, LossFunctionError


def _data(n=9, d=4, classes=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, d, generator=g, dtype=dtype), torch.randint(0, classes, (n,), generator=g))


def _fit(model, data, *, kind="kfac", n=1, batch_size=4, **kw):
    """The fit and the messages of its BatchedPathWarnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        curv = fit_curvature(tif.loss_from_module(model, F.cross_entropy), _ckpts(model, n), data,
                             kind=kind, sampler=EXACT, batch_size=batch_size, **kw)
    return curv, [str(w.message) for w in caught if type(w.message).__name__ == "BatchedPathWarning"]


def _close(one, two, rtol=1e-10, atol=1e-13):
    for c, est in enumerate(one.estimates):
        for k, v in est.items():
            if torch.is_tensor(v) and v.is_floating_point():
                torch.testing.assert_close(v, two.estimates[c][k], rtol=rtol, atol=atol,
                                           msg=lambda m, k=k, c=c: f"{k} ckpt {c}: {m}")


def _stream(monkeypatch, on):
    monkeypatch.setattr(capture_batched, "_STREAM_BYTES", -1 if on else 2**62)


# --- 1. a layer's input written in place after the layer read it ---------------------------------

class _Writes(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.how = how

    def forward(self, x):
        h, how = self.a(x), self.how
        if how == "clone_then_add":
            o = self.b(h)
            h = h.clone()
            h.add_(1)
            return self.c(torch.tanh(o) + h)
        if how == "residual":
            return self.c(h + torch.tanh(self.b(h)))
        if how == "other_tensor":
            t = torch.zeros_like(h)
            t.add_(1)
            return self.c(torch.tanh(self.b(h)) + t)
        if how == "copy_then_write":
            o = self.b(h)
            hh = h * 1
            hh.add_(1)
            return self.c(torch.tanh(o) + hh)
        if how == "written_before_read":
            h = h * 2
            h.add_(1)
            return self.c(torch.tanh(self.b(h)))
        o = self.b(h)
        if how == "view":
            h.view(-1).add_(1)
        elif how == "setitem":
            h[:, 0] = 0
        elif how == "copy_":
            h.copy_(h * 2)
        elif how == "tanh_":
            h.tanh_()
        elif how == "detach_alias":
            h.detach().add_(1)
        elif how == "no_grad":
            with torch.no_grad():
                h.mul_(3)
        return self.c(torch.tanh(o) + h)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("how", ["clone_then_add", "residual", "other_tensor", "copy_then_write",
                                 "written_before_read"])
def test_valid_in_place_models_are_fitted_exactly_and_batched(how, stream, monkeypatch):
    _stream(monkeypatch, stream)
    torch.manual_seed(0)
    model = _Writes(how).double().eval()
    x, y = _data()
    curv, warned = _fit(model, (x, y), kind="ekfac")
    assert warned == []
    ck = _ckpts(model)[0]
    layers = {n: getattr(model, n) for n in "abc"}
    a, s, e = _reference(model, layers, x, dict(ck.params), n_classes=3,
                         ekfac_from=curv.estimates[0])
    for n in "abc":
        for side, want in (("A", a), ("S", s), ("eigen", e)):
            torch.testing.assert_close(curv.estimates[0][f"{n}.weight:{side}"], want[n],
                                       rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("how", ["view", "setitem", "copy_", "tanh_", "detach_alias", "no_grad"])
def test_writes_through_aliases_after_the_read_are_refused(how, stream, monkeypatch):
    _stream(monkeypatch, stream)
    torch.manual_seed(0)
    model = _Writes(how).double().eval()
    with pytest.raises(LossFunctionError, match="wrote into a layer's input in place"):
        _fit(model, _data())


class _WritesLater(nn.Module):
    """``b``'s input written after ``b`` read it from the ``after``-th forward call on, or only
    in batches of fewer than three examples (the last, uneven batch)."""

    def __init__(self, after=None):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.after, self.calls = after, 0

    def forward(self, x):
        self.calls += 1
        h = self.a(x)
        o = self.b(h)
        if (self.after is None and x.shape[0] < 3) or (self.after is not None
                                                       and self.calls > self.after):
            h.mul_(2)
        return self.c(torch.tanh(o) + h)


@pytest.mark.parametrize("after", [None, 1, 4, 5])
def test_writes_only_on_later_batches_or_checkpoints_are_refused(after):
    torch.manual_seed(0)
    model = _WritesLater(after).double().eval()
    with pytest.raises(LossFunctionError, match="wrote into a layer's input in place"):
        _fit(model, _data(10), n=2)


class _WritesBatchInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.a(x)
        x.add_(1)  # the first layer's input, the caller's batch, written after a read it
        return self.c(torch.tanh(self.b(h)))


def test_first_layer_input_written_after_read_is_refused():
    torch.manual_seed(0)
    model = _WritesBatchInput().double().eval()
    x, y = _data()
    with pytest.raises(LossFunctionError, match="wrote into a layer's input in place"):
        _fit(model, (x.clone(), y))


class _OutputWrittenLater(nn.Module):
    """``a``'s output doubled: out of place for the first ``after`` calls, in place after.
    The same function throughout; an output written before any layer reads it is valid."""

    def __init__(self, after):
        super().__init__()
        self.a, self.c = nn.Linear(4, 4), nn.Linear(4, 3)
        self.after, self.calls = after, 0

    def forward(self, x):
        self.calls += 1
        h = self.a(x)
        if self.calls > self.after:
            h.mul_(2)
        else:
            h = h * 2
        return self.c(torch.tanh(h))


def test_output_written_in_place_from_the_first_call_is_exact():
    x, y = _data(10)
    torch.manual_seed(0)
    never, warned = _fit(_OutputWrittenLater(10**6).double().eval(), (x, y))
    assert warned == []
    torch.manual_seed(0)
    always, _ = _fit(_OutputWrittenLater(0).double().eval(), (x, y))  # per-example fallback
    _close(always, never)


def test_finding_output_written_in_place_on_a_later_batch_crashes():
    x, y = _data(10)
    torch.manual_seed(0)
    never, _ = _fit(_OutputWrittenLater(10**6).double().eval(), (x, y))
    torch.manual_seed(0)
    later, _ = _fit(_OutputWrittenLater(5).double().eval(), (x, y))
    _close(later, never)


def test_inference_mode_data_and_relu_inplace_are_fitted():
    x, y = _data(8)
    with torch.inference_mode():
        xi = x.clone()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 3)).double().eval()
    one, _ = _fit(model, (xi, y), kind="ekfac", batch_size=3)
    two, _ = _fit(model, (x, y), kind="ekfac", batch_size=3)
    _close(one, two, rtol=0, atol=0)


# --- 2. a weight read outside its own layer call ---------------------------------------------------

class _Reads(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.how = how

    def forward(self, x):
        w, how, extra = self.a.weight, self.how, 0
        if how == "metadata":
            assert (w.dtype, w.device, tuple(w.shape), w.size(0), w.numel(), w.dim(), w.ndim) == (
                x.dtype, x.device, (4, 4), 4, 16, 2, 2)
            assert w.requires_grad is not None and w.is_contiguous() and w.is_floating_point()
            x = x.to(w.dtype)
        elif how == "no_grad_log":
            with torch.no_grad():
                self.logged = w.norm().item()
        elif how == "cat":
            extra = torch.cat([w, w]).sum() * x[:, :1]
        elif how == "transpose":
            extra = (x @ w.T)[:, :1]
        elif how == "getitem":
            extra = w[0].sum() * x[:, :1]
        elif how == "clone":
            extra = (x @ w.clone())[:, :1]
        elif how == "einsum":
            extra = torch.einsum("bi,oi->bo", x, w)[:, :1]
        elif how == "functional_call":
            extra = torch.func.functional_call(self.a, {"weight": w, "bias": self.a.bias},
                                               (x,))[:, :1]
        elif how == "bias":
            extra = (x + self.a.bias)[:, :1]
        elif how == "parameters":
            extra = sum(p.sum() for p in self.a.parameters()) * x[:, :1]
        elif how == "unselected":
            extra = self.c.weight.sum() * x[:, :1]
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) + extra


def test_weight_metadata_reads_are_accepted_exactly():
    torch.manual_seed(0)
    model = _Reads("metadata").double().eval()
    x, y = _data()
    curv, warned = _fit(model, (x, y))
    assert warned == []
    torch.manual_seed(0)
    plain, _ = _fit(_Reads("none").double().eval(), (x, y))
    _close(curv, plain, rtol=0, atol=0)


def test_unselected_parameter_read_outside_is_accepted():
    torch.manual_seed(0)
    model = _Reads("unselected").double().eval()
    opts = tif.GradientOptions(select=["a.weight", "a.bias", "b.weight", "b.bias"])
    curv, _ = _fit(model, _data(), options=opts)
    assert "a.weight:A" in curv.estimates[0]


@pytest.mark.parametrize("how", ["cat", "transpose", "getitem", "clone", "einsum",
                                 "functional_call", "bias", "parameters"])
def test_weight_or_bias_read_outside_is_refused_by_name(how):
    torch.manual_seed(0)
    model = _Reads(how).double().eval()
    name = "a.bias" if how == "bias" else "a.weight"
    with pytest.raises(InvalidArgumentError, match=rf"read outside their layer's call.*'{name}'"):
        _fit(model, _data())


def test_finding_weight_logged_under_no_grad_is_refused():
    x, y = _data()
    torch.manual_seed(0)
    logged, _ = _fit(_Reads("no_grad_log").double().eval(), (x, y))
    torch.manual_seed(0)
    plain, _ = _fit(_Reads("none").double().eval(), (x, y))
    _close(logged, plain, rtol=0, atol=0)


def _suggested_select(loss, ckpts, data):
    import ast
    import re

    with pytest.raises(InvalidArgumentError) as e:
        fit_curvature(loss, ckpts, data, kind="kfac", batch_size=2)
    return ast.literal_eval(re.search(r"select=(\[.*?\])", str(e.value)).group(1))


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "gpt2"])
def test_hf_models_fit_with_the_suggested_selection(arch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=11, n_embd=8, n_layer=1, n_head=2, n_positions=16, bos_token_id=0,
            eos_token_id=0))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
            tie_word_embeddings=arch == "llama_tied"))
    model.eval()
    ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(0))
    loss, ckpts = tif.causal_lm_loss(model), [tif.Checkpoint.from_module(model)]
    data = {"input_ids": ids, "labels": ids}
    select = _suggested_select(loss, ckpts, data)
    if arch == "llama":  # untied: the embedding and the head are both covered
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(select)
    else:  # tied: neither
        assert not {"lm_head.weight", "model.embed_tokens.weight",
                    "transformer.wte.weight"} & set(select)
    curv = fit_curvature(loss, ckpts, data, kind="ekfac", batch_size=2,
                         options=tif.GradientOptions(select=select))
    assert all(f"{s}:A" in curv.estimates[0] for s in select if s.endswith(".weight"))


# --- 3. layers of other geometry reading one input -------------------------------------------------

_SECOND = {
    "dilation": lambda: nn.Conv2d(2, 3, 2, stride=2, padding=1, dilation=2),
    "kernel3": lambda: nn.Conv2d(2, 3, 3, padding=1),
    "no_bias": lambda: nn.Conv2d(2, 3, 2, stride=2, padding=1, bias=False),
    "same": lambda: nn.Conv2d(2, 3, 2, stride=2, padding=1),
    "anisotropic": lambda: nn.Conv2d(2, 3, 2, stride=(2, 1), padding=(1, 0)),
    "linear": lambda: nn.Linear(4, 3),
}


class _Readers(nn.Module):
    """``p`` (or ``q`` first when ``swap``) and ``q`` read one ``x [b, 2, 4, 4]``."""

    def __init__(self, second, swap):
        super().__init__()
        self.p, self.q, self.swap = nn.Conv2d(2, 3, 2, stride=2, padding=1), _SECOND[second](), swap
        self.c = nn.Linear(6, 3)

    def forward(self, x):
        if self.swap:
            qo = torch.tanh(self.q(x))
            po = torch.tanh(self.p(x))
        else:
            po = torch.tanh(self.p(x))
            qo = torch.tanh(self.q(x))
        qo = qo.mean((1, 2)) if isinstance(self.q, nn.Linear) else qo.mean((2, 3))
        return self.c(torch.cat([po.mean((2, 3)), qo], 1))


def _geometry_reference(model, x, params, names):
    """float64 ``A`` (patches / positions) and exact-sampler ``S`` per layer, one example at a
    time."""
    model = _copy_with(model, params)
    a, s = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    for i in range(x.shape[0]):
        seen = {}
        handles = [model.get_submodule(n).register_forward_hook(
            lambda m, inp, out, n=n, seen=seen: seen.__setitem__(n, (inp[0], out)))
            for n in names]
        try:
            logits = model(x[i:i + 1])
        finally:
            for h in handles:
                h.remove()
        probs = logits.softmax(-1)[0].detach()
        for n in names:
            m, inp = model.get_submodule(n), seen[n][0].detach()
            if isinstance(m, nn.Conv2d):
                r = F.unfold(inp, m.kernel_size, dilation=m.dilation, padding=m.padding,
                             stride=m.stride)[0].T
            else:
                r = inp.reshape(-1, inp.shape[-1])
            if m.bias is not None:
                r = torch.cat([r, torch.ones(r.shape[0], 1, dtype=r.dtype)], 1)
            a[n] = a[n] + r.T @ r / r.shape[0]
        for label in range(3):
            grads = torch.autograd.grad(F.cross_entropy(logits, torch.tensor([label])),
                                        [seen[n][1] for n in names], retain_graph=True)
            for n, d in zip(names, grads, strict=True):
                d = (d[0].reshape(d.shape[1], -1).T if isinstance(model.get_submodule(n), nn.Conv2d)
                     else d.reshape(-1, d.shape[-1]))
                s[n] = s[n] + probs[label] * d.T @ d
    k = x.shape[0]
    return {n: v / k for n, v in a.items()}, {n: v / k for n, v in s.items()}


@pytest.mark.parametrize(("second", "swap", "stream"), [
    ("dilation", False, False), ("dilation", True, True), ("kernel3", False, True),
    ("no_bias", True, False), ("same", False, True), ("anisotropic", True, False),
    ("linear", False, False), ("linear", True, True)])
def test_readers_of_other_geometry_stay_batched_and_exact(second, swap, stream, monkeypatch):
    _stream(monkeypatch, stream)
    torch.manual_seed(0)
    model = _Readers(second, swap).double().eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 2, 4, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (10,), generator=g)
    curv, warned = _fit(model, (x, y), n=2, batch_size=3)
    assert warned == []
    for c, ck in enumerate(_ckpts(model, 2)):
        a, s = _geometry_reference(model, x, dict(ck.params), ["p", "q", "c"])
        for n in "pqc":
            torch.testing.assert_close(curv.estimates[c][f"{n}.weight:A"], a[n], rtol=1e-9,
                                       atol=1e-12)
            torch.testing.assert_close(curv.estimates[c][f"{n}.weight:S"], s[n], rtol=1e-9,
                                       atol=1e-12)


# --- 4. the capture's hook first among the user's global hooks -------------------------------------

def _global_state():
    import torch.nn.modules.module as module

    return (list(module._global_forward_hooks.items()),
            list(module._global_forward_pre_hooks.items()),
            dict(module._global_forward_hooks_always_called))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double().eval()


def _first_layer(module):
    return isinstance(module, nn.Linear) and module.out_features == 4


def test_global_hooks_kept_in_order_after_fits_and_builds():
    import torch.nn.modules.module as module

    handles = [module.register_module_forward_hook(lambda m, i, o: None) for _ in range(3)]
    handles.append(module.register_module_forward_hook(lambda m, a, k, o: None, with_kwargs=True,
                                                       always_call=True))
    handles.append(module.register_module_forward_pre_hook(lambda m, i: None))
    try:
        before = _global_state()
        model = _mlp()
        _fit(model, _data(), kind="ekfac", n=2)
        tif.build_store(tif.loss_from_module(model, F.cross_entropy), _ckpts(model, 2), _data(),
                        projection=tif.Projection(kind="kronecker", dim=16, seed=0))
        assert _global_state() == before
    finally:
        for h in handles:
            h.remove()


def test_global_hooks_removed_or_added_during_a_fit_stay_so():
    import torch.nn.modules.module as module

    added, box = [], {}

    def once(m, i, o):  # removes itself on its first call
        box["once"].remove()

    def adder(m, i, o):  # registers another global hook on its first call
        if not added:
            added.append(module.register_module_forward_hook(lambda m, i, o: None))

    box["once"] = module.register_module_forward_hook(once)
    keep = module.register_module_forward_hook(adder)
    try:
        _fit(_mlp(), _data(), n=2)
        keys = [k for k, _ in _global_state()[0]]
        assert box["once"].id not in keys
        assert keep.id in keys and added and added[0].id in keys
        assert keys.index(keep.id) < keys.index(added[0].id)
    finally:
        keep.remove()
        for h in added:
            h.remove()


def test_global_hook_that_raises_leaves_the_hooks_as_they_were():
    import torch.nn.modules.module as module

    def bad(m, i, o):
        raise ValueError("boom")

    h = module.register_module_forward_hook(bad)
    try:
        before = _global_state()
        with pytest.raises(ValueError, match="boom"):
            _fit(_mlp(), _data())
        assert _global_state() == before
    finally:
        h.remove()


@pytest.mark.parametrize("kind", ["pre_triples_input", "kwargs_always_doubles_output"])
def test_global_pre_hooks_and_kwargs_hooks_give_the_true_factors(kind):
    import torch.nn.modules.module as module

    if kind == "pre_triples_input":
        h = module.register_module_forward_pre_hook(
            lambda m, i: (i[0] * 3,) if _first_layer(m) else None)
    else:
        h = module.register_module_forward_hook(
            lambda m, a, k, o: o * 2 if _first_layer(m) else None, with_kwargs=True,
            always_call=True)
    try:
        model = _mlp()
        x, y = _data()
        curv, warned = _fit(model, (x, y))
        assert warned == []
        want = _bias_reference(model, x, ["0", "2"], dict(_ckpts(model)[0].params))
    finally:
        h.remove()
    for n in "02":
        torch.testing.assert_close(curv.estimates[0][f"{n}.weight:S"], want[n], rtol=1e-9,
                                   atol=1e-13)
    if kind == "pre_triples_input":
        rows = torch.cat([3 * x, torch.ones(9, 1, dtype=torch.float64)], 1)
        torch.testing.assert_close(curv.estimates[0]["0.weight:A"], rows.T @ rows / 9)


def _threaded_trial(ref):
    """Three fits of one architecture in threads while a fourth registers global hooks and runs
    its own model; the largest relative error against ``ref`` and the hooks seen out of order."""
    import torch.nn.modules.module as module

    stop, bad, results, errors = threading.Event(), [], [], []
    other_model = _mlp()

    def other():
        g = torch.Generator().manual_seed(1)
        while not stop.is_set():
            hs = [module.register_module_forward_hook(lambda m, i, o: None) for _ in range(2)]
            try:
                other_model(torch.randn(2, 4, dtype=torch.float64, generator=g))
                keys = [k for k in module._global_forward_hooks if k in (hs[0].id, hs[1].id)]
                if keys != [hs[0].id, hs[1].id]:
                    bad.append(keys)
            finally:
                for h in hs:
                    h.remove()

    # The models are built here: _mlp() seeds torch's global generator and draws the
    # initial weights from it, which threads building models at once interleave (the cause of
    # this test's first failures: another model, not wrong factors).
    models = [_mlp() for _ in range(3)]

    def fitter(model):
        try:
            results.append(_fit(model, _data(), n=2)[0])
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=other)] + [threading.Thread(target=fitter, args=(m,))
                                                  for m in models]
    for t in threads[1:]:
        t.start()
    threads[0].start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert errors == [], errors
    worst = max(float((r.estimates[c][k] - v).abs().max() / v.abs().max())
                for r in results for c, est in enumerate(ref.estimates) for k, v in est.items()
                if k.endswith((":A", ":S")))
    return worst, bad


def test_fits_in_threads_with_global_hooks_elsewhere_are_exact():
    ref = _fit(_mlp(), _data(), n=2)[0]
    for _ in range(40):  # 20-60% of trials go wrong; stop at the first
        worst, bad = _threaded_trial(ref)
        assert bad == []  # the other thread's hooks always kept their order: held
        assert _global_state() == ([], [], {})  # nothing left behind: held
        assert worst < 1e-12, worst


# --- 5. low precision models that really mix examples ----------------------------------------------

class _Mix(nn.Module):
    """Every hidden value moved by ``eps`` of the previous example's (``roll``)."""

    def __init__(self, eps):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 3)
        self.eps = eps

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = h + self.eps * h.roll(1, 0)
        return self.c(torch.tanh(self.b(h)))


def _mix_fit(eps, dtype, monkeypatch=None):
    torch.manual_seed(0)
    model = _Mix(eps).to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=g).to(dtype)
    y = torch.randint(0, 3, (16,), generator=g)
    curv, warned = _fit(model, (x, y), batch_size=8)
    per_example = None
    if monkeypatch is not None:
        with monkeypatch.context() as mp:
            mp.setattr(fit_module, "batched_io", lambda *args: None)
            per_example = _fit(model, (x, y), batch_size=8)[0]
    return curv, warned, per_example


@pytest.mark.parametrize(("eps", "dtype"), [(0.1, torch.bfloat16), (0.03, torch.bfloat16),
                                            (0.01, torch.float16), (1e-3, torch.float32)])
def test_low_precision_models_mixing_examples_are_detected(eps, dtype):
    assert _mix_fit(eps, dtype)[1] != []


def test_bfloat16_model_that_does_not_mix_stays_batched_within_rounding(monkeypatch):
    curv, warned, per_example = _mix_fit(0.0, torch.bfloat16, monkeypatch)
    assert warned == []
    for k, v in per_example.estimates[0].items():
        if k.endswith((":A", ":S")):
            assert float((curv.estimates[0][k] - v).abs().max() / v.abs().max()) < 3e-3, k


@pytest.mark.xfail(strict=True, reason="open (documented limit, stop 49): in bfloat16 the proof "
                   "allows four units of the last place (~3% relative), so a model mixing every "
                   "value by 1% of another example's passes it; docs/curvature.md says so")
def test_finding_bfloat16_one_percent_mixing_is_accepted(monkeypatch):
    curv, warned, per_example = _mix_fit(0.01, torch.bfloat16, monkeypatch)
    errs = {k: float((curv.estimates[0][k] - v).abs().max() / v.abs().max())
            for k, v in per_example.estimates[0].items() if k.endswith((":A", ":S"))}
    assert warned != [] or max(errs.values()) < 3e-3, errs


# --- 6. one-pass iterators ---------------------------------------------------------------------------

def _batches():
    x, y = _data()
    return [(x[i:i + 3], y[i:i + 3]) for i in range(0, 9, 3)]


class _Reiterable:
    def __iter__(self):
        return iter(_batches())


class _OnePass:
    def __init__(self):
        self.it = iter(_batches())

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.it)


_ONE_PASS = {"generator": lambda: (b for b in _batches()), "chain": lambda: itertools.chain(
    _batches()), "islice": lambda: itertools.islice(_batches(), 3), "list_iterator":
    lambda: iter(_batches()), "_OnePass": _OnePass, "map": lambda: map(lambda b: b, _batches()),
    "zip": lambda: zip(*zip(*_batches(), strict=True), strict=True)}


def _reiterables():
    from torch.utils.data import DataLoader, TensorDataset

    return {"list": _batches(), "dataloader": DataLoader(TensorDataset(*_data()), batch_size=3),
            "reiterable": _Reiterable()}


@pytest.mark.parametrize(("kind", "n"), [("kfac", 1), ("ekfac", 1), ("kfac", 2), ("dense", 2),
                                         ("projected", 2)])
def test_reiterables_are_fitted_and_equal_the_list(kind, n):
    model = _mlp()
    kw = {"projection": tif.Projection(kind="rademacher", dim=8, seed=0)} if kind == "projected" \
        else {}
    loss, ckpts = tif.loss_from_module(model, F.cross_entropy), _ckpts(model, n)
    ref = fit_curvature(loss, ckpts, _batches(), kind=kind, sampler=EXACT, **kw)
    for data in _reiterables().values():
        _close(fit_curvature(loss, ckpts, data, kind=kind, sampler=EXACT, **kw), ref, rtol=0,
               atol=0)
    _close(fit_curvature(loss, ckpts, _data(), kind=kind, sampler=EXACT, **kw), ref)  # one batch


@pytest.mark.parametrize("which", list(_ONE_PASS))
@pytest.mark.parametrize("kind", ["kfac", "dense", "projected"])
def test_one_pass_iterators_with_one_checkpoint_are_fitted(kind, which):
    model = _mlp()
    kw = {"projection": tif.Projection(kind="rademacher", dim=8, seed=0)} if kind == "projected" \
        else {}
    loss, ckpts = tif.loss_from_module(model, F.cross_entropy), _ckpts(model)
    ref = fit_curvature(loss, ckpts, _batches(), kind=kind, sampler=EXACT, **kw)
    got = fit_curvature(loss, ckpts, _ONE_PASS[which](), kind=kind, sampler=EXACT, **kw)
    _close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("which", list(_ONE_PASS))
@pytest.mark.parametrize(("kind", "n"), [("ekfac", 1), ("kfac", 2), ("dense", 2),
                                         ("projected", 2)])
def test_one_pass_iterators_read_twice_are_refused_by_name(kind, n, which):
    model = _mlp()
    kw = {"projection": tif.Projection(kind="rademacher", dim=8, seed=0)} if kind == "projected" \
        else {}
    with pytest.raises(InvalidArgumentError, match=rf"one-pass iterator \({which}\)"):
        fit_curvature(tif.loss_from_module(model, F.cross_entropy), _ckpts(model, n),
                      _ONE_PASS[which](), kind=kind, sampler=EXACT, **kw)


def test_jax_generator_with_two_checkpoints_is_refused_by_name():
    jax = pytest.importorskip("jax")
    fnn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")
    import numpy as np

    import tracinfunc.jax as tj

    class MLP(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            return fnn.Dense(3)(jax.numpy.tanh(fnn.Dense(4)(x)))

    module = MLP()
    params = module.init(jax.random.PRNGKey(0), jax.numpy.zeros((1, 4)))["params"]

    def logits(p, x):
        return module.apply({"params": p}, x[None])[0]

    def jloss(p, example):
        return optax.softmax_cross_entropy_with_integer_labels(logits(p, example[0]), example[1])

    mapping = tj.ParamMapping.flax(params)
    ckpts = [tj.Checkpoint(params, lr=1.0, name=f"c{i}") for i in range(2)]
    x = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    y = np.arange(6) % 3
    gen = ((jax.numpy.asarray(x[i:i + 3]), jax.numpy.asarray(y[i:i + 3])) for i in (0, 3))
    with pytest.raises(InvalidArgumentError, match="generator"):
        tj.fit_curvature(jloss, ckpts, gen, kind="kfac", mapping=mapping,
                         sampler=tj.classification_sampler(logits, exact=True))


def test_finding_tuple_of_batches_is_not_named():
    model = _mlp()
    with pytest.raises(InvalidArgumentError, match="list"):
        fit_curvature(tif.loss_from_module(model, F.cross_entropy), _ckpts(model),
                      tuple(_batches()), kind="kfac", sampler=EXACT)


# --- 7. zarr imported on first use, in a fresh interpreter, from threads --------------------------

_CHILD = r"""
import sys, threading, torch, torch.nn.functional as F
from torch import nn
import tracinfunc as tif
assert "zarr" not in sys.modules
root, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double().eval()
x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
loss, ck = tif.loss_from_module(m, F.cross_entropy), [tif.Checkpoint.from_module(m)]
errors = []
def job(i):
    try:
        if mode == "write":
            st = tif.build_store(loss, ck, (x, y), store=f"{root}/s{i}.zarr",
                                 projection=tif.Projection(kind="kronecker", dim=16, seed=0))
            tif.save_curvature(tif.fit_curvature(loss, ck, (x, y), kind="kfac"), f"{root}/c{i}")
            assert tif.score(tif.open_store(f"{root}/s{i}.zarr"), st).shape[0] == 6
        else:
            import tracinfunc.store as ts
            st = ts.open_store(f"{root}/s0.zarr") if i % 2 else tif.GradientStore.open(
                f"{root}/s0.zarr")
            tif.load_curvature(f"{root}/c{i % 2}")
            assert tif.score(st, st).shape[0] == 6
    except Exception:
        import traceback
        errors.append(traceback.format_exc())
ts_ = [threading.Thread(target=job, args=(i,)) for i in range(int(sys.argv[3]))]
[t.start() for t in ts_]
[t.join() for t in ts_]
assert not errors, errors
print("OK", "zarr" in sys.modules)
"""


def test_zarr_functions_work_in_a_fresh_interpreter_from_threads(tmp_path):
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    for mode, threads in (("write", 2), ("read", 4)):
        out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), mode, str(threads)],
                             capture_output=True, text=True, timeout=120, env=env, check=False)
        assert out.returncode == 0 and "OK True" in out.stdout, out.stderr[-3000:]
