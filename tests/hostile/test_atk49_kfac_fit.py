"""Attack 49: K-FAC / EK-FAC fits through the batched capture of a ``ModuleLoss``.

Every factor is checked against a float64 reference built here by a Python loop over examples
and classes (forward hooks on a plain per-example forward, ``torch.autograd.grad`` for the
output gradients), with the capture whole and streamed layer by layer
(``capture_batched._STREAM_BYTES = -1``) and slices of one example (``kfac._TEMP_BYTES = 1``).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
import tracinfunc.curvature.capture_batched as capture_batched
import tracinfunc.curvature.kfac as kfac
from tracinfunc.curvature import classification_sampler, fit_curvature
from tracinfunc.errors import LossFunctionError

EXACT = classification_sampler(exact=True)
MODES = ["whole", "stream", "stream_sliced", "whole_sliced"]


def _mode(monkeypatch, mode: str) -> None:
    if "stream" in mode:
        monkeypatch.setattr(capture_batched, "_STREAM_BYTES", -1)
    else:
        monkeypatch.setattr(capture_batched, "_STREAM_BYTES", 2**62)
    if "sliced" in mode:
        monkeypatch.setattr(kfac, "_TEMP_BYTES", 1)


def _ckpts(model, n=1):
    """``n`` checkpoints of ``model`` with perturbed weights (the module itself unchanged)."""
    out = []
    for c in range(n):
        g = torch.Generator().manual_seed(100 + c)
        params = {k: (v.detach() + 0.3 * c * torch.randn(v.shape, generator=g, dtype=v.dtype))
                  for k, v in model.named_parameters()}
        out.append(tif.Checkpoint(name=f"c{c}", params=params, lr=1.0))
    return out


def _reference(model, layers, xs, params=None, *, n_classes, ekfac_from=None):
    """float64 ``A``, ``S`` (and EK-FAC eigenvalues in ``ekfac_from``'s bases) per layer.

    ``layers``: ``{name: module}`` (Linear only; A gets a ones column when it has a bias).
    Exact-sampler Fisher: each class weighted by the model's probability.
    """
    model = _copy_with(model, params)
    layers = {n: model.get_submodule(n) for n in layers}
    a = {n: 0.0 for n in layers}
    s = {n: 0.0 for n in layers}
    eig = {n: 0.0 for n in layers}
    for i in range(xs.shape[0]):
        seen: dict[str, tuple] = {}
        handles = [mod.register_forward_hook(
            lambda m, inp, out, n=n, seen=seen: seen.__setitem__(n, (inp[0].detach(), out)))
            for n, mod in layers.items()]
        try:
            logits = model(xs[i:i + 1])
        finally:
            for h in handles:
                h.remove()
        probs = logits.softmax(-1)[0].detach()
        rows = {}
        for n, (inp, _) in seen.items():
            r = inp.reshape(-1, inp.shape[-1]).double()
            if layers[n].bias is not None:
                r = torch.cat([r, torch.ones(r.shape[0], 1, dtype=r.dtype)], 1)
            rows[n] = r
            a[n] = a[n] + r.T @ r / r.shape[0]
        names = list(seen)
        for label in range(n_classes):
            lo = F.cross_entropy(logits, torch.tensor([label]))
            grads = torch.autograd.grad(lo, [seen[n][1] for n in names], retain_graph=True,
                                        allow_unused=True)
            for n, d in zip(names, grads, strict=True):
                d_out = layers[n].out_features
                d = torch.zeros(1, d_out, dtype=torch.float64) if d is None else \
                    d.reshape(-1, d_out).double()
                s[n] = s[n] + probs[label] * d.T @ d
                if ekfac_from is not None:
                    g = d.T @ rows[n] if d.shape[0] == rows[n].shape[0] else \
                        torch.zeros(d_out, rows[n].shape[1], dtype=torch.float64)
                    qs, qa = ekfac_from[f"{n}.weight:QS"], ekfac_from[f"{n}.weight:QA"]
                    eig[n] = eig[n] + probs[label] * (qs.T @ g @ qa) ** 2
    n = xs.shape[0]
    return ({k: v / n for k, v in a.items()}, {k: v / n for k, v in s.items()},
            {k: (v / n if torch.is_tensor(v) else v) for k, v in eig.items()})


def _copy_with(model, params):
    import copy

    clone = copy.deepcopy(model)
    if params is not None:
        with torch.no_grad():
            for k, v in clone.named_parameters():
                v.copy_(params[k])
    return clone


def _check(curv, model, layers, xs, ckpts, n_classes, kind, rtol=1e-9, atol=1e-12):
    for c, ck in enumerate(ckpts):
        est = curv.estimates[c]
        a, s, e = _reference(model, layers, xs, dict(ck.params), n_classes=n_classes,
                             ekfac_from=est if kind == "ekfac" else None)
        for n in layers:
            torch.testing.assert_close(est[f"{n}.weight:A"], a[n], rtol=rtol, atol=atol,
                                       msg=lambda m, n=n, c=c: f"A {n} ckpt {c}: {m}")
            torch.testing.assert_close(est[f"{n}.weight:S"], s[n], rtol=rtol, atol=atol,
                                       msg=lambda m, n=n, c=c: f"S {n} ckpt {c}: {m}")
            if kind == "ekfac":
                torch.testing.assert_close(est[f"{n}.weight:eigen"], e[n], rtol=rtol,
                                           atol=atol,
                                           msg=lambda m, n=n, c=c: f"eigen {n} ckpt {c}: {m}")


# --- models -----------------------------------------------------------------------------------

class QKV(nn.Module):
    """q (bias), k (no bias) and v (bias) read one ``x [b, T, 4]``; ``o`` a row per example."""

    def __init__(self, bias_k=False):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(4, 4), nn.Linear(4, 4, bias=bias_k), nn.Linear(4, 4)
        self.o = nn.Linear(12, 3)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        mixed = torch.softmax(q @ k.transpose(1, 2), -1) @ v
        return self.o(mixed.flatten(1))


class Residual(nn.Module):
    """``a``'s output used twice (residual and ``b``'s input); ``dead`` never reaches the loss."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.dead, self.c = (nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 2),
                                             nn.Linear(5, 3))

    def forward(self, x):
        h = self.a(x)
        h = h + torch.tanh(self.b(h))
        self.dead(x)
        return self.c(h)


def _qkv_data(n=9):
    g = torch.Generator().manual_seed(7)
    return (torch.randn(n, 3, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g))


# --- 1. exactness against the float64 reference ----------------------------------------------

@pytest.mark.parametrize(("mode", "kind", "bias_k"), [
    *((m, k, False) for m in MODES for k in ("kfac", "ekfac")),
    ("stream_sliced", "kfac", True), ("stream_sliced", "ekfac", True), ("whole", "ekfac", True)])
def test_qkv_shared_input_exact_over_batches(mode, kind, bias_k, monkeypatch):
    _mode(monkeypatch, mode)
    torch.manual_seed(0)
    model = QKV(bias_k).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    x, y = _qkv_data()
    ckpts = _ckpts(model, 2)
    curv = fit_curvature(loss, ckpts, (x, y), kind=kind, sampler=EXACT, batch_size=4)
    layers = {n: getattr(model, n) for n in "qkvo"}
    _check(curv, model, layers, x, ckpts, 3, kind)


@pytest.mark.parametrize("mode", ["whole", "stream_sliced"])
@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_residual_and_dead_output_exact(mode, kind, monkeypatch):
    _mode(monkeypatch, mode)
    torch.manual_seed(1)
    model = Residual().double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (7,))
    ckpts = _ckpts(model, 1)
    curv = fit_curvature(loss, ckpts, (x, y), kind=kind, sampler=EXACT, batch_size=3)
    layers = {n: getattr(model, n) for n in ("a", "b", "dead", "c")}
    _check(curv, model, layers, x, ckpts, 3, kind)
    dead = curv.estimates[0]["dead.weight:S"]
    assert torch.equal(dead, torch.zeros_like(dead))


@pytest.mark.parametrize("mode", ["whole", "stream_sliced"])
@pytest.mark.parametrize("batch_size", [1, 5, None])
def test_batch_sizes_one_uneven_and_whole(mode, batch_size, monkeypatch):
    _mode(monkeypatch, mode)
    torch.manual_seed(0)
    model = QKV().double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    x, y = _qkv_data(7)
    ckpts = _ckpts(model, 1)
    curv = fit_curvature(loss, ckpts, (x, y), kind="ekfac", sampler=EXACT,
                         batch_size=batch_size)
    _check(curv, model, {n: getattr(model, n) for n in "qkvo"}, x, ckpts, 3, "ekfac")


# --- 2. outputs and inputs written in place ---------------------------------------------------

class InPlace(nn.Module):
    """``a``'s output (or the logits) written in place after ``a`` wrote it."""

    def __init__(self, op):
        super().__init__()
        self.a, self.b, self.c, self.op = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3), op
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        h, u = self.a(x), self.b(x)
        if self.op == "mul_":
            h.mul_(2)
        elif self.op == "setitem":
            h[:, 0] = 0
        elif self.op == "iadd":
            h += 2 * u
        elif self.op == "relu_inplace":
            h = self.relu(h)
        elif self.op == "logits":
            return self.c(torch.tanh(h)).add_(u[:, :3])
        return self.c(torch.tanh(h) + u)


def _bias_reference(model, x, names, params, n_classes=3):
    """``S`` of one-row-per-example layers from true per-example bias gradients (which are
    exactly the output gradients, whatever the forward wrote in place)."""
    model = _copy_with(model, params)
    s = {n: 0.0 for n in names}
    for i in range(x.shape[0]):
        logits = model(x[i:i + 1])
        probs = logits.softmax(-1)[0].detach()
        for label in range(n_classes):
            grads = torch.autograd.grad(F.cross_entropy(logits, torch.tensor([label])),
                                        [model.get_submodule(n).bias for n in names],
                                        retain_graph=True)
            for n, gb in zip(names, grads, strict=True):
                s[n] = s[n] + probs[label] * torch.outer(gb, gb)
    return {n: v / x.shape[0] for n, v in s.items()}


@pytest.mark.parametrize("mode", ["whole", "stream_sliced"])
@pytest.mark.parametrize("op", ["mul_", "setitem", "iadd", "relu_inplace", "logits"])
def test_outputs_written_in_place_give_the_true_gradients_factors(op, mode, monkeypatch):
    _mode(monkeypatch, mode)
    torch.manual_seed(0)
    model = InPlace(op).double().eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 4, generator=g, dtype=torch.float64)
    y = torch.zeros(9, dtype=torch.long)
    ckpts = _ckpts(model)
    curv = fit_curvature(tif.loss_from_module(model, F.cross_entropy), ckpts, (x, y),
                         kind="kfac", sampler=EXACT, batch_size=4)
    want = _bias_reference(model, x, ["a", "b", "c"], dict(ckpts[0].params))
    for n in "abc":
        torch.testing.assert_close(curv.estimates[0][f"{n}.weight:S"], want[n], rtol=1e-9,
                                   atol=1e-13)


class InputWrittenAfterRead(nn.Module):
    """``b`` reads ``h``; then ``h`` is written in place (torch's own backward refuses this
    model: per_sample_grads raises)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.a(x)
        out = self.b(h)
        h.add_(1.0)
        return self.c(torch.tanh(out) + h)


@pytest.mark.parametrize("mode", ["whole", "stream"])
def test_finding_layer_input_written_in_place_after_read(mode, monkeypatch):
    _mode(monkeypatch, mode)
    torch.manual_seed(0)
    model = InputWrittenAfterRead().double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(9, 4, generator=g, dtype=torch.float64), torch.zeros(9, dtype=torch.long)
    ckpts = _ckpts(model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        tif.per_sample_grads(loss)(dict(ckpts[0].params), (x[:2], y[:2]))  # torch refuses
    try:
        curv = fit_curvature(loss, ckpts, (x, y), kind="kfac", sampler=EXACT, batch_size=4)
    except LossFunctionError:
        return  # refused: held
    with torch.no_grad():  # or b's A of the values b read (before the write)
        h = _copy_with(model, dict(ckpts[0].params)).a(x)
    rows = torch.cat([h, torch.ones(9, 1, dtype=torch.float64)], 1)
    torch.testing.assert_close(curv.estimates[0]["b.weight:A"], rows.T @ rows / 9)


# --- 3. layers called twice, unreached, expanded, mixed dtypes --------------------------------

class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.c(self.a(torch.tanh(self.a(x))))


@pytest.mark.parametrize("mode", ["whole", "stream"])
def test_the_same_linear_called_twice_is_refused_by_name(mode, monkeypatch):
    _mode(monkeypatch, mode)
    model = Twice().double().eval()
    data = (torch.randn(6, 4, dtype=torch.float64), torch.zeros(6, dtype=torch.long))
    with pytest.raises(tif.errors.InvalidArgumentError, match=r"'a\.weight'"):
        fit_curvature(tif.loss_from_module(model, F.cross_entropy), _ckpts(model), data,
                      kind="kfac")


class Odd(nn.Module):
    """``ng`` runs under no_grad; ``ex`` reads an expanded (stride-0) input; ``q`` float64 and
    ``k`` float32 read one input; ``c`` reads them all."""

    def __init__(self):
        super().__init__()
        self.ng, self.ex = nn.Linear(4, 4), nn.Linear(4, 4)
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4).float()
        self.c = nn.Linear(3 * 4 + 12, 3)

    def forward(self, x):
        with torch.no_grad():
            n = self.ng(x)
        e = torch.tanh(self.ex(x[:, None, :].expand(-1, 3, -1))).flatten(1)
        q, k = self.q(x), self.k(x.float()).double()
        return self.c(torch.cat([x + n, q, torch.tanh(k), e], -1))


@pytest.mark.parametrize("mode", ["whole", "stream_sliced"])
@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_no_grad_expanded_and_mixed_dtype_layers_exact(kind, mode, monkeypatch):
    _mode(monkeypatch, mode)
    torch.manual_seed(0)
    model = Odd().eval()
    model.ng.double(), model.ex.double(), model.q.double(), model.c.double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(7, 4, generator=g, dtype=torch.float64), torch.zeros(7, dtype=torch.long)
    ckpts = _ckpts(model)
    curv = fit_curvature(tif.loss_from_module(model, F.cross_entropy), ckpts, (x, y),
                         kind=kind, sampler=EXACT, batch_size=3)
    est = curv.estimates[0]
    assert torch.equal(est["ng.weight:S"], torch.zeros(4, 4, dtype=torch.float64))
    layers = {n: model.get_submodule(n) for n in ("ex", "q", "c")}
    _check(curv, model, layers, x, ckpts, 3, kind, rtol=1e-6, atol=1e-9)  # k's float32 rounding
    k_ref = _reference(model, {"k": model.k}, x, dict(ckpts[0].params), n_classes=3)
    torch.testing.assert_close(est["k.weight:A"], k_ref[0]["k"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(est["k.weight:S"], k_ref[1]["k"], rtol=1e-5, atol=1e-8)


def test_selecting_some_readers_of_a_shared_input(monkeypatch):
    _mode(monkeypatch, "stream_sliced")
    torch.manual_seed(0)
    model = QKV().double().eval()
    x, y = _qkv_data()
    ckpts = _ckpts(model, 2)
    select = ["k.weight", "v.weight", "v.bias"]
    curv = fit_curvature(tif.loss_from_module(model, F.cross_entropy), ckpts, (x, y),
                         kind="ekfac", sampler=EXACT, batch_size=4,
                         options=tif.GradientOptions(select=select))
    assert {key.split(".")[0] for key in curv.estimates[0]} == {"k", "v"}
    _check(curv, model, {"k": model.k, "v": model.v}, x, ckpts, 3, "ekfac")


def test_noncontiguous_data_gives_the_same_factors(monkeypatch):
    _mode(monkeypatch, "stream_sliced")
    torch.manual_seed(0)
    model = QKV().double().eval()
    x, y = _qkv_data()
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous() and torch.equal(strided, x)
    loss, ckpts = tif.loss_from_module(model, F.cross_entropy), _ckpts(model)
    one = fit_curvature(loss, ckpts, (x, y), kind="ekfac", sampler=EXACT, batch_size=4)
    two = fit_curvature(loss, ckpts, (strided, y), kind="ekfac", sampler=EXACT, batch_size=4)
    for key in one.estimates[0]:
        if key.endswith((":A", ":S", ":eigen")):
            torch.testing.assert_close(one.estimates[0][key], two.estimates[0][key],
                                       rtol=1e-12, atol=1e-15)


# --- 4. Conv2d + Linear, Embedding (padding_idx) + Linear, streamed and sliced -----------------

@pytest.mark.parametrize("mode", ["whole", "stream_sliced"])
def test_conv2d_and_linear_exact_streamed(mode, monkeypatch):
    from tests.curvature.test_kfac_layers import _conv_factors, _conv_model

    _mode(monkeypatch, mode)
    model = _conv_model()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 2, 4, 4, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (9,), generator=g)
    curv = fit_curvature(tif.loss_from_module(model, F.cross_entropy),
                         [tif.Checkpoint.from_module(model)], (x, y), kind="kfac",
                         sampler=EXACT, batch_size=4)
    a, s = _conv_factors(model, x)
    torch.testing.assert_close(curv.estimates[0]["0.weight:A"], a, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(curv.estimates[0]["0.weight:S"], s, rtol=1e-10, atol=1e-13)
    lin = _reference(model, {"3": model[3]}, x, n_classes=3)
    torch.testing.assert_close(curv.estimates[0]["3.weight:A"], lin[0]["3"], rtol=1e-10,
                               atol=1e-13)
    torch.testing.assert_close(curv.estimates[0]["3.weight:S"], lin[1]["3"], rtol=1e-10,
                               atol=1e-13)


@pytest.mark.parametrize("mode", ["whole", "stream_sliced"])
def test_embedding_padding_idx_and_linear_exact_streamed(mode, monkeypatch):
    from tests.curvature.test_kfac_layers import LENGTH, VOCAB, _embedding_factors

    _mode(monkeypatch, mode)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 3, padding_idx=0), nn.Tanh(), nn.Flatten(),
                          nn.Linear(LENGTH * 3, 3)).double().eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (9, LENGTH), generator=g)
    ids[0, 0] = ids[1, 2] = ids[8, :] = 0  # padding positions; example 8 all padding
    y = torch.randint(0, 3, (9,), generator=g)
    curv = fit_curvature(tif.loss_from_module(model, F.cross_entropy),
                         [tif.Checkpoint.from_module(model)], (ids, y), kind="kfac",
                         sampler=EXACT, batch_size=4)
    a, s = _embedding_factors(model, ids)
    torch.testing.assert_close(curv.estimates[0]["0.weight:A"], a, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(curv.estimates[0]["0.weight:S"], s, rtol=1e-10, atol=1e-13)


# --- 5. float32, default sampler, checkpoints, max_examples, LM ---------------------------------

def _estimates_equal(one, two, rtol=0.0, atol=0.0):
    for c1, c2 in zip(one.estimates, two.estimates, strict=True):
        assert set(c1) == set(c2)
        for key in c1:
            if key.endswith((":A", ":S", ":eigen")):
                torch.testing.assert_close(c1[key], c2[key], rtol=rtol, atol=atol,
                                           msg=lambda m, key=key: f"{key}: {m}")


def test_float32_model_exact_sampler_matches_the_float64_reference(monkeypatch):
    _mode(monkeypatch, "stream_sliced")
    torch.manual_seed(0)
    model = QKV().float().eval()
    x, y = _qkv_data()
    ckpts = _ckpts(model, 2)
    curv = fit_curvature(tif.loss_from_module(model, F.cross_entropy), ckpts, (x.float(), y),
                         kind="kfac", sampler=EXACT, batch_size=4)
    assert curv.estimates[0]["q.weight:A"].dtype == torch.float64
    twin = QKV().double().eval()
    for c, ck in enumerate(ckpts):
        params = {k: v.double() for k, v in ck.params.items()}
        a, s, _ = _reference(twin, {n: getattr(twin, n) for n in "qkvo"}, x.float().double(),
                             params, n_classes=3)
        for n in "qkvo":
            for side, ref in (("A", a[n]), ("S", s[n])):
                got = curv.estimates[c][f"{n}.weight:{side}"]
                assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5, (n, side, c)


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_default_sampler_streamed_equals_whole_bit_for_bit(kind, monkeypatch):
    torch.manual_seed(0)
    model = QKV().float().eval()
    x, y = _qkv_data(11)
    loss, ckpts = tif.loss_from_module(model, F.cross_entropy), _ckpts(model, 2)
    _mode(monkeypatch, "whole")
    whole = fit_curvature(loss, ckpts, (x.float(), y), kind=kind, batch_size=4)
    _mode(monkeypatch, "stream_sliced")
    streamed = fit_curvature(loss, ckpts, (x.float(), y), kind=kind, batch_size=4)
    _estimates_equal(whole, streamed, rtol=1e-12, atol=1e-15)
    assert whole.damping == pytest.approx(streamed.damping, rel=1e-12)


def test_max_examples_equals_the_sliced_data(monkeypatch):
    _mode(monkeypatch, "stream_sliced")
    torch.manual_seed(0)
    model = QKV().double().eval()
    x, y = _qkv_data(11)
    loss, ckpts = tif.loss_from_module(model, F.cross_entropy), _ckpts(model)
    cut = fit_curvature(loss, ckpts, [(x[:4], y[:4]), (x[4:], y[4:])], kind="ekfac",
                        sampler=EXACT, max_examples=6)
    assert cut.info["n_examples"] == 6
    _check(cut, model, {n: getattr(model, n) for n in "qkvo"}, x[:6], ckpts, 3, "ekfac")


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=11, hidden_size=8, intermediate_size=8,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double().eval()


def test_causal_lm_streamed_sliced_equals_whole(monkeypatch):
    model = _tiny_llama()
    loss = tif.causal_lm_loss(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 11, (5, 6), generator=g)
    mask = torch.ones(5, 6, dtype=torch.long)
    mask[2, 4:] = 0
    select = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    opts = tif.GradientOptions(select=select)
    ckpts = [tif.Checkpoint.from_module(model)]
    data = {"input_ids": ids, "attention_mask": mask}
    _mode(monkeypatch, "whole")
    whole = fit_curvature(loss, ckpts, data, kind="ekfac", options=opts, batch_size=2)
    _mode(monkeypatch, "stream_sliced")
    streamed = fit_curvature(loss, ckpts, data, kind="ekfac", options=opts, batch_size=2)
    _estimates_equal(whole, streamed, rtol=1e-10, atol=1e-14)
    est = streamed.estimates[0]
    q, k, v = (est[f"model.layers.0.self_attn.{p}_proj.weight:A"] for p in "qkv")
    assert torch.equal(q, k) and torch.equal(k, v)
    assert len({t.data_ptr() for t in (q, k, v)}) == 3


# --- 6. failures mid-fit, user state, threads ---------------------------------------------------

class _RaiseInBackward(torch.autograd.Function):
    armed = False
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        if _RaiseInBackward.armed:
            raise ValueError("boom in backward")
        return grad


class Bomb(QKV):
    """Raises in the forward (``where="forward"``) or in the middle of the backward, between
    the taps of ``o`` and of ``q``/``k``/``v``, from the third call on while armed."""

    calls = 0
    armed = ""

    def forward(self, x):
        Bomb.calls += 1
        if Bomb.armed == "forward" and Bomb.calls > 2:
            raise ValueError("boom in forward")
        _RaiseInBackward.armed = Bomb.armed == "backward" and Bomb.calls > 2
        q, k, v = self.q(x), self.k(x), self.v(x)
        mixed = _RaiseInBackward.apply(torch.softmax(q @ k.transpose(1, 2), -1) @ v)
        return self.o(mixed.flatten(1))


def _hooks(model):
    import torch.nn.modules.module as module

    local = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
                + len(m._backward_pre_hooks) for m in model.modules())
    return local, len(module._global_forward_hooks), len(module._global_forward_pre_hooks), \
        len(module._global_backward_hooks)


@pytest.mark.parametrize("mode", ["whole", "stream_sliced"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_failure_mid_fit_leaves_nothing_behind(where, mode, monkeypatch):
    _mode(monkeypatch, mode)
    torch.manual_seed(0)
    model = Bomb().double().eval()
    x, y = _qkv_data(12)
    before = (x.clone(), {k: v.clone() for k, v in model.state_dict().items()},
              {k: v.requires_grad for k, v in model.named_parameters()}, _hooks(model))
    loss, ckpts = tif.loss_from_module(model, F.cross_entropy), _ckpts(model, 2)
    ck_before = [{k: v.clone() for k, v in c.params.items()} for c in ckpts]
    Bomb.armed = ""
    fresh = fit_curvature(loss, ckpts, (x, y), kind="ekfac", sampler=EXACT, batch_size=4)
    Bomb.calls, Bomb.armed = 0, where
    try:
        with pytest.raises(ValueError, match="boom"):
            fit_curvature(loss, ckpts, (x, y), kind="ekfac", sampler=EXACT, batch_size=4)
    finally:
        Bomb.armed, _RaiseInBackward.armed = "", False
    assert _hooks(model) == before[3]
    again = fit_curvature(loss, ckpts, (x, y), kind="ekfac", sampler=EXACT, batch_size=4)
    assert again.digest == fresh.digest
    assert torch.equal(x, before[0]) and not x.requires_grad
    assert all(torch.equal(before[1][k], v) for k, v in model.state_dict().items())
    assert {k: v.requires_grad for k, v in model.named_parameters()} == before[2]
    assert all(p.grad is None for p in model.parameters()) and not model.training
    for c, want in zip(ckpts, ck_before, strict=True):
        assert all(torch.equal(c.params[k], v) and not c.params[k].requires_grad
                   for k, v in want.items())


def test_two_fits_in_two_threads_at_once(monkeypatch):
    _mode(monkeypatch, "stream_sliced")
    torch.manual_seed(0)
    models = [QKV().double().eval(), Residual().double().eval()]
    datas = [_qkv_data(16), (torch.randn(16, 5, dtype=torch.float64),
                             torch.zeros(16, dtype=torch.long))]
    args = [(tif.loss_from_module(m, F.cross_entropy), _ckpts(m, 2), d)
            for m, d in zip(models, datas, strict=True)]
    alone = [fit_curvature(*a, kind="ekfac", sampler=EXACT, batch_size=3) for a in args]
    barrier, got, errors = threading.Barrier(2), [None, None], []

    def work(i):
        try:
            barrier.wait()
            for _ in range(2):
                got[i] = fit_curvature(*args[i], kind="ekfac", sampler=EXACT, batch_size=3)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [g.digest for g in got] == [a.digest for a in alone]


# --- 7. proof failing on a later, larger batch while streaming -----------------------------------

class MixesLargeBatches(nn.Module):
    """Examples interact only in a batched forward of more than 6 rows."""

    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.a(x)
        # a batch of one sees h + 0.5 h; more than 6 rows mix
        h = h + 0.5 * (h.mean(0, keepdim=True) if x.shape[0] > 6 else h)
        return self.c(torch.tanh(h))


@pytest.mark.parametrize("mode", ["whole", "stream_sliced"])
def test_a_later_larger_batch_that_mixes_falls_back_exactly(mode, monkeypatch):
    _mode(monkeypatch, mode)
    torch.manual_seed(0)
    model = MixesLargeBatches().double().eval()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 4, generator=g, dtype=torch.float64)
    y = torch.zeros(9, dtype=torch.long)
    data = [(x[:1], y[:1]), (x[1:3], y[1:3]), (x[3:], y[3:])]  # 1, 2, then 6 examples
    with pytest.warns(UserWarning, match="vmap"):
        curv = fit_curvature(tif.loss_from_module(model, F.cross_entropy), _ckpts(model), data,
                             kind="ekfac", sampler=EXACT)
    _check(curv, model, {"a": model.a, "c": model.c}, x, _ckpts(model), 3, "ekfac")


# --- 8. saved and loaded, then scored ------------------------------------------------------------

@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_streamed_fit_saved_loaded_and_scored(kind, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = QKV().double().eval()
    x, y = _qkv_data(10)
    loss, ckpts = tif.loss_from_module(model, F.cross_entropy), _ckpts(model, 2)
    _mode(monkeypatch, "whole")
    whole = fit_curvature(loss, ckpts, (x, y), kind=kind, sampler=EXACT, batch_size=4)
    _mode(monkeypatch, "stream_sliced")
    streamed = fit_curvature(loss, ckpts, (x, y), kind=kind, sampler=EXACT, batch_size=4)
    tif.save_curvature(streamed, tmp_path / "c.zarr")
    loaded = tif.load_curvature(tmp_path / "c.zarr")
    assert loaded.digest == streamed.digest
    store = tif.build_store(loss, ckpts, (x[:6], y[:6]), projection=tif.Projection(dim=16))
    scores = []
    for curv in (whole, streamed, loaded):
        tests = tif.preconditioned_test_grads(loss, ckpts, (x[6:], y[6:]), curv,
                                              projection=store.projection)
        scores.append(torch.as_tensor(tif.score(store, tests, curvature=curv)))
    torch.testing.assert_close(scores[1], scores[0], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(scores[2], scores[1], rtol=1e-12, atol=1e-15)  # equal digests


# --- 9. streaming reached naturally: a wide model and a large batch ------------------------------

class Wide(nn.Module):
    """Long sequences: 16 examples x 2 labels x 2080 positions x (64 + 64 + 2) outputs x 8 B
    = 34.6 MB of output gradients per batch, above the 32 MiB threshold."""

    def __init__(self, width=64):
        super().__init__()
        self.a, self.b, self.o = nn.Linear(8, width), nn.Linear(width, width), nn.Linear(width, 2)

    def forward(self, x):
        return self.o(torch.tanh(self.b(torch.tanh(self.a(x))))).mean(1)


def test_natural_streaming_on_a_wide_model_equals_the_whole_capture(monkeypatch):
    tapped: list[int] = []
    tap = capture_batched._Tap

    class Counted(tap):
        @staticmethod
        def backward(ctx, delta):
            tapped.append(ctx.index)
            return tap.backward(ctx, delta)

    monkeypatch.setattr(capture_batched, "_Tap", Counted)
    torch.manual_seed(0)
    model = Wide().double().eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 2080, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (32,), generator=g)
    loss, ckpts = tif.loss_from_module(model, F.cross_entropy), [tif.Checkpoint.from_module(model)]
    natural = fit_curvature(loss, ckpts, (x, y), kind="kfac", sampler=EXACT, batch_size=16)
    assert sorted(set(tapped)) == [0, 1, 2]  # the second batch was streamed
    tapped.clear()
    _mode(monkeypatch, "whole")
    whole = fit_curvature(loss, ckpts, (x, y), kind="kfac", sampler=EXACT, batch_size=16)
    assert not tapped
    _estimates_equal(natural, whole, rtol=1e-12, atol=1e-15)


# --- 10. a weight used outside its one layer call (tied heads, penalties) -------------------------

class _UsedOutside(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.a, self.c, self.how = nn.Linear(4, 4), nn.Linear(4, 3), how

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.how == "tied_matmul":  # a's weight also read by a matmul (a tied projection)
            return self.c(h @ self.a.weight)
        if self.how == "penalty":  # a weight penalty inside the forward
            return self.c(h) + (self.a.weight ** 2).sum() * x[:, :3]
        return self.c(h)


@pytest.mark.parametrize("how", ["tied_matmul", "penalty"])
def test_finding_weight_used_outside_its_layer_call(how):
    torch.manual_seed(0)
    model = _UsedOutside(how).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(10, 4, generator=g, dtype=torch.float64), torch.zeros(10, dtype=torch.long)
    ckpts, opts = _ckpts(model), tif.GradientOptions(select=["a.weight", "a.bias"])
    once = tif.curvature.Damping(1.0)
    try:
        ekfac = fit_curvature(loss, ckpts, (x, y), kind="ekfac", sampler=EXACT, damping=once,
                              options=opts)
    except tif.errors.InvalidArgumentError as e:
        assert "a.weight" in str(e)
        return  # refused by name, as docs/curvature.md says of tied weights: held
    dense = fit_curvature(loss, ckpts, (x, y), kind="dense", sampler=EXACT, damping=once,
                          options=opts)
    order = [4 + o * 4 + i if i < 4 else o for o in range(4) for i in range(5)]  # bias, weight
    est = ekfac.estimates[0]
    basis = torch.kron(est["a.weight:QS"], est["a.weight:QA"])
    fisher = dense.estimates[0]["matrix"][order][:, order]
    want = (basis.T @ fisher @ basis).diagonal().reshape(4, 5)
    torch.testing.assert_close(est["a.weight:eigen"], want)


def test_plain_model_ekfac_eigenvalues_are_the_dense_diagonal_streamed(monkeypatch):
    _mode(monkeypatch, "stream_sliced")  # the control of the finding above
    torch.manual_seed(0)
    model = _UsedOutside("none").double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(10, 4, generator=g, dtype=torch.float64), torch.zeros(10, dtype=torch.long)
    ckpts, opts = _ckpts(model), tif.GradientOptions(select=["a.weight", "a.bias"])
    once = tif.curvature.Damping(1.0)
    ekfac = fit_curvature(loss, ckpts, (x, y), kind="ekfac", sampler=EXACT, damping=once,
                          options=opts, batch_size=3)
    dense = fit_curvature(loss, ckpts, (x, y), kind="dense", sampler=EXACT, damping=once,
                          options=opts)
    order = [4 + o * 4 + i if i < 4 else o for o in range(4) for i in range(5)]
    est = ekfac.estimates[0]
    basis = torch.kron(est["a.weight:QS"], est["a.weight:QA"])
    fisher = dense.estimates[0]["matrix"][order][:, order]
    want = (basis.T @ fisher @ basis).diagonal().reshape(4, 5)
    torch.testing.assert_close(est["a.weight:eigen"], want)


class _TiedEmbeddingHead(nn.Module):
    """The embedding's table is also the output head (``F.linear(h, emb.weight)``)."""

    def __init__(self):
        super().__init__()
        self.e, self.h = nn.Embedding(5, 4), nn.Linear(4, 4)

    def forward(self, ids):
        return F.linear(torch.tanh(self.h(self.e(ids).mean(1))), self.e.weight)


def test_finding_embedding_tied_to_a_functional_head_is_refused():
    torch.manual_seed(0)
    model = _TiedEmbeddingHead().double().eval()
    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 5, (10, 3), generator=g), torch.randint(0, 5, (10,), generator=g)
    with pytest.raises(tif.errors.InvalidArgumentError, match=r"e\.weight"):
        fit_curvature(tif.loss_from_module(model, F.cross_entropy), _ckpts(model), (ids, y),
                      kind="kfac", sampler=EXACT)


class _SeqFirst(nn.Module):
    """The layer sees ``[T, b, d]`` (sequence first)."""

    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Linear(4, 4), nn.Linear(4 * 12, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.a(x.transpose(0, 1))).transpose(0, 1).flatten(1))


@pytest.mark.parametrize("mode", ["whole", "stream_sliced"])
def test_sequence_first_and_4d_layer_inputs_exact(mode, monkeypatch):
    _mode(monkeypatch, mode)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = _SeqFirst().double().eval()
    x, y = torch.randn(10, 12, 4, generator=g, dtype=torch.float64), torch.zeros(10).long()
    ckpts = _ckpts(model)
    curv = fit_curvature(tif.loss_from_module(model, F.cross_entropy), ckpts, (x, y),
                         kind="ekfac", sampler=EXACT, batch_size=4)
    _check(curv, model, {"a": model.a, "c": model.c}, x, ckpts, 3, "ekfac")
    model4 = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Flatten(), nn.Linear(24, 3))
    model4 = model4.double().eval()
    x4 = torch.randn(10, 2, 3, 4, generator=g, dtype=torch.float64)
    ckpts = _ckpts(model4)
    curv = fit_curvature(tif.loss_from_module(model4, F.cross_entropy), ckpts, (x4, y),
                         kind="ekfac", sampler=EXACT, batch_size=4)
    _check(curv, model4, {"0": model4[0], "3": model4[3]}, x4, ckpts, 3, "ekfac")


# --- 11. layers of other geometry reading one input (Inception-style branches) -----------------

class _Branches(nn.Module):
    """Two convolutions of different strides (or a conv and a Linear) read one input
    ``[b, 2, 4, 4]``; examples never interact."""

    def __init__(self, second):
        super().__init__()
        self.p = nn.Conv2d(2, 3, 2, stride=2, padding=1)  # 3 x 3 outputs, patches of 8
        self.q = {"stride": nn.Conv2d(2, 3, 2, stride=1), "same": nn.Conv2d(2, 3, 2, stride=2,
                  padding=1), "linear": nn.Linear(4, 3)}[second]
        self.c = nn.Linear(27 + (24 if second == "linear" else 27), 3)

    def forward(self, x):
        return self.c(torch.cat([torch.tanh(self.p(x)).flatten(1),
                                 torch.tanh(self.q(x)).flatten(1)], 1))


def _branch_fit(second):
    import warnings

    torch.manual_seed(0)
    model = _Branches(second).double().eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 2, 4, 4, generator=g, dtype=torch.float64)
    y = torch.zeros(10, dtype=torch.long)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        curv = fit_curvature(tif.loss_from_module(model, F.cross_entropy), _ckpts(model),
                             (x, y), kind="kfac", sampler=EXACT, batch_size=3)
    return model, x, curv, [str(w.message) for w in caught
                            if type(w.message).__name__ == "BatchedPathWarning"]


def test_two_convs_of_one_geometry_reading_one_input_stay_batched():
    _model, x, curv, warned = _branch_fit("same")  # the control of the finding below
    assert warned == []
    patches = F.unfold(x, 2, padding=1, stride=2).transpose(1, 2)
    rows = torch.cat([patches, torch.ones(10, 9, 1, dtype=torch.float64)], -1)
    a = torch.einsum("bli,blj->ij", rows, rows) / 9 / 10
    for name in ("p", "q"):
        torch.testing.assert_close(curv.estimates[0][f"{name}.weight:A"], a)


@pytest.mark.parametrize("second", ["stride", "linear"])
def test_finding_layers_of_other_geometry_reading_one_input_fall_off_the_batched_path(second):
    _model, x, curv, warned = _branch_fit(second)
    patches = F.unfold(x, 2, padding=1, stride=2).transpose(1, 2)
    rows = torch.cat([patches, torch.ones(10, 9, 1, dtype=torch.float64)], -1)
    a = torch.einsum("bli,blj->ij", rows, rows) / 9 / 10
    torch.testing.assert_close(curv.estimates[0]["p.weight:A"], a)  # right, via the fallback
    assert warned == [], warned  # but the examples never interact


# --- 12. batches of different sequence lengths; LM labels ignored --------------------------------

class _Pool(nn.Module):
    """Any sequence length: ``a`` reads ``[b, T, 4]``, ``c`` the mean over positions."""

    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.a(x)).mean(1))


@pytest.mark.parametrize("mode", ["whole", "stream_sliced"])
def test_batches_of_different_sequence_lengths(mode, monkeypatch):
    _mode(monkeypatch, mode)
    torch.manual_seed(0)
    model = _Pool().double().eval()
    g = torch.Generator().manual_seed(0)
    lengths, sizes = (2, 7, 1), (4, 3, 2)
    xs = [torch.randn(n, t, 4, generator=g, dtype=torch.float64)
          for n, t in zip(sizes, lengths, strict=True)]
    data = [(x, torch.zeros(x.shape[0], dtype=torch.long)) for x in xs]
    ckpts = _ckpts(model)
    curv = fit_curvature(tif.loss_from_module(model, F.cross_entropy), ckpts, data,
                         kind="ekfac", sampler=EXACT)
    est = curv.estimates[0]
    layers = {"a": model.a, "c": model.c}
    refs = [_reference(model, layers, x, dict(ckpts[0].params), n_classes=3, ekfac_from=est)
            for x in xs]
    n = sum(sizes)
    for name in layers:
        for side, i in (("A", 0), ("S", 1), ("eigen", 2)):
            want = sum(r[i][name] * k for r, k in zip(refs, sizes, strict=True)) / n
            torch.testing.assert_close(est[f"{name}.weight:{side}"], want, rtol=1e-9,
                                       atol=1e-13)


def test_causal_lm_ignored_labels_streamed_equals_per_example(monkeypatch):
    import tracinfunc.curvature.fit as fit_module

    model = _tiny_llama()
    loss = tif.causal_lm_loss(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 11, (5, 6), generator=g)
    labels = ids.clone()
    labels[0, :3] = labels[3, 2:] = -100  # prompt-only and mostly ignored rows
    select = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    opts, ckpts = tif.GradientOptions(select=select), [tif.Checkpoint.from_module(model)]
    data = {"input_ids": ids, "labels": labels}
    _mode(monkeypatch, "stream_sliced")
    streamed = fit_curvature(loss, ckpts, data, kind="kfac", options=opts, batch_size=2)
    monkeypatch.setattr(fit_module, "batched_io", lambda *args: None)  # per-example capture
    per_example = fit_curvature(loss, ckpts, data, kind="kfac", options=opts, batch_size=2)
    _estimates_equal(streamed, per_example, rtol=1e-10, atol=1e-14)


# --- 13. the user's own forward hooks -----------------------------------------------------------

def _hooked_fit(register, mode, monkeypatch):
    """Layer 0's output doubled by a user hook; returns the fit's and the true ``S`` (from the
    per-example bias gradients: the gradient at the layer's own output)."""
    _mode(monkeypatch, mode)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double().eval()
    handle = register(model)
    try:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(9, 4, generator=g, dtype=torch.float64), torch.zeros(9).long()
        ckpts = _ckpts(model)
        curv = fit_curvature(tif.loss_from_module(model, F.cross_entropy), ckpts, (x, y),
                             kind="kfac", sampler=EXACT, batch_size=4)
        want = _bias_reference(model, x, ["0", "2"], dict(ckpts[0].params))
    finally:
        handle.remove()
    return curv.estimates[0], want


def _double_first_layer(module, inputs, output):
    return output * 2 if isinstance(module, nn.Linear) and module.out_features == 4 else None


@pytest.mark.parametrize("mode", ["whole", "stream"])
@pytest.mark.parametrize("where", ["local", "local_prepend", "local_pre"])
def test_local_user_hooks_are_respected(where, mode, monkeypatch):
    def register(model):
        if where == "local_pre":
            return model[0].register_forward_pre_hook(lambda m, i: (i[0] * 3,))
        return model[0].register_forward_hook(_double_first_layer,
                                              prepend=where == "local_prepend")

    est, want = _hooked_fit(register, mode, monkeypatch)
    for n in "02":
        torch.testing.assert_close(est[f"{n}.weight:S"], want[n], rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("mode", ["whole", "stream"])
def test_finding_global_forward_hook_replacing_an_output(mode, monkeypatch):
    import torch.nn.modules.module as module

    def register(model):
        return module.register_module_forward_hook(_double_first_layer)

    est, want = _hooked_fit(register, mode, monkeypatch)
    torch.testing.assert_close(est["0.weight:S"], want["0"], rtol=1e-9, atol=1e-13)


# --- 14. the JAX frontend on a Flax twin ---------------------------------------------------------

def test_jax_fit_equals_the_streamed_sliced_torch_fit(monkeypatch):
    jax = pytest.importorskip("jax")
    fnn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")
    import numpy as np

    import tracinfunc.jax as tj

    class MLP(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            hidden = jax.numpy.tanh(fnn.Dense(6)(x))  # Dense_0, then Dense_1
            return fnn.Dense(3)(hidden)

    module = MLP()
    params = module.init(jax.random.PRNGKey(0), jax.numpy.zeros((1, 4)))["params"]

    def logits(p, x):
        return module.apply({"params": p}, x[None])[0]

    def jloss(p, example):
        return optax.softmax_cross_entropy_with_integer_labels(logits(p, example[0]),
                                                               example[1])

    mapping = tj.ParamMapping.flax(
        params, rename=lambda n: n.replace("Dense_0", "0").replace("Dense_1", "2"))
    ckpts = [tj.Checkpoint(params, lr=1.0, name="c0")]
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((10, 4)).astype(np.float32), rng.integers(0, 3, 10)
    jc = tj.fit_curvature(jloss, ckpts, (jax.numpy.asarray(x), jax.numpy.asarray(y)),
                          kind="ekfac", mapping=mapping,
                          sampler=tj.classification_sampler(logits, exact=True))
    _mode(monkeypatch, "stream_sliced")
    twin = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).eval()
    tc = fit_curvature(tif.loss_from_module(twin, F.cross_entropy),
                       [c.to_torch(mapping) for c in ckpts],
                       (torch.from_numpy(x), torch.from_numpy(y)), kind="ekfac",
                       sampler=EXACT, batch_size=3)
    assert tc.checkpoints == jc.checkpoints
    for key, value in tc.estimates[0].items():
        if key.endswith((":A", ":S", ":eigen")):
            other = torch.as_tensor(np.asarray(jc.estimates[0][key]))
            assert float((value - other).abs().max() / value.abs().max()) < 1e-5, key


# --- 15. readers of one input with and without their bias selected --------------------------------

@pytest.mark.parametrize("mode", ["whole", "stream_sliced"])
def test_shared_input_readers_with_and_without_selected_bias(mode, monkeypatch):
    _mode(monkeypatch, mode)
    torch.manual_seed(0)
    model = QKV().double().eval()
    x, y = _qkv_data(11)
    ckpts = _ckpts(model, 2)
    select = ["q.weight", "k.weight", "v.weight", "v.bias"]  # q's bias exists, not selected
    curv = fit_curvature(tif.loss_from_module(model, F.cross_entropy), ckpts, (x, y),
                         kind="ekfac", sampler=EXACT, batch_size=4,
                         options=tif.GradientOptions(select=select))
    rows = torch.cat([x, torch.ones(11, 3, 1, dtype=torch.float64)], -1)
    a = sum(rows[i].T @ rows[i] / 3 for i in range(11)) / 11
    for c in range(2):
        est = curv.estimates[c]
        torch.testing.assert_close(est["v.weight:A"], a)
        torch.testing.assert_close(est["q.weight:A"], a[:4, :4])
        torch.testing.assert_close(est["k.weight:A"], a[:4, :4])
        assert len({est[f"{n}.weight:A"].data_ptr() for n in "qkv"}) == 3
        ref = _reference(model, {"v": model.v}, x, dict(ckpts[c].params), n_classes=3,
                         ekfac_from=est)
        torch.testing.assert_close(est["v.weight:S"], ref[1]["v"])
        torch.testing.assert_close(est["v.weight:eigen"], ref[2]["v"])


# --- 16. bfloat16 models and autocast ------------------------------------------------------------

class _Autocast(QKV):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(x).float()


def _low_precision_fit(which):
    import warnings

    torch.manual_seed(0)
    model = (QKV().to(torch.bfloat16) if which == "bf16" else _Autocast()).eval()
    x, y = _qkv_data(9)
    x = x.to(torch.bfloat16 if which == "bf16" else torch.float32)
    ckpts = _ckpts(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        curv = fit_curvature(tif.loss_from_module(model, F.cross_entropy), ckpts, (x, y),
                             kind="kfac", sampler=EXACT, batch_size=4)
    twin = QKV().double().eval()
    _, s, _ = _reference(twin, {n: getattr(twin, n) for n in "qkvo"}, x.double(),
                         {k: v.double() for k, v in ckpts[0].params.items()}, n_classes=3)
    for n in "qkvo":  # right to bfloat16 rounding (the per-example fallback)
        got = curv.estimates[0][f"{n}.weight:S"]
        assert float((got - s[n]).abs().max() / s[n].abs().max()) < 5e-2, n
    return [str(w.message) for w in caught if type(w.message).__name__ == "BatchedPathWarning"]


@pytest.mark.parametrize("which", ["bf16", "autocast"])
def test_finding_bfloat16_models_fall_off_the_batched_path(which):
    warned = _low_precision_fit(which)
    assert warned == [], warned


# --- 17. a generator as data with several checkpoints --------------------------------------------

def test_ekfac_generator_is_refused_with_the_fix():
    torch.manual_seed(0)
    model = QKV().double().eval()
    x, y = _qkv_data(9)
    gen = ((x[i:i + 3], y[i:i + 3]) for i in range(0, 9, 3))
    with pytest.raises(tif.errors.InvalidArgumentError, match="generator"):
        fit_curvature(tif.loss_from_module(model, F.cross_entropy), _ckpts(model), gen,
                      kind="ekfac", sampler=EXACT)


def test_finding_kfac_generator_with_several_checkpoints_names_the_generator():
    torch.manual_seed(0)
    model = QKV().double().eval()
    x, y = _qkv_data(9)
    gen = ((x[i:i + 3], y[i:i + 3]) for i in range(0, 9, 3))
    with pytest.raises(tif.errors.InvalidArgumentError, match="generator"):
        fit_curvature(tif.loss_from_module(model, F.cross_entropy), _ckpts(model, 2), gen,
                      kind="kfac", sampler=EXACT)
