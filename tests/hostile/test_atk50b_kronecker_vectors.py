"""Outside pass on ``Projection(kind="kronecker", vectors="kronecker")`` (atk50b).

Written from the docs only (Projection docstring, docs/concepts/projection.md "Vectors",
docs/language-models.md "All parameters"). References: a Python loop of
``torch.autograd.grad`` per example in float64, projected by ``tests/numpy_projection.py``
(explicit ``np.kron`` of the side factors).
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

import tracinfunc as tif
from tests import numpy_projection as npp
from tracinfunc.projection import kronecker_factors, make_projector
from tracinfunc.projection.keys import kronecker_view

F64 = 1e-9
F32 = 1e-5

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def kv(dim=24, seed=3, **kw):
    return tif.Projection(dim=dim, seed=seed, kind="kronecker", vectors="kronecker", **kw)


def kd(dim=24, seed=3, **kw):
    return tif.Projection(dim=dim, seed=seed, kind="kronecker", **kw)


class Net(nn.Module):
    """Linear layers, a LayerNorm, and free vectors of size 1 and 2 (read outside layers)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 11)  # bias: prime size
        self.ln = nn.LayerNorm(11)
        self.fc2 = nn.Linear(11, 4)  # bias: perfect square
        self.one = nn.Parameter(torch.tensor([0.3]))
        self.two = nn.Parameter(torch.tensor([0.1, -0.2]))

    def forward(self, x):
        h = torch.tanh(self.ln(self.fc1(x)))
        return self.fc2(h) + self.one + torch.cat([self.two, self.two])


class Vec(nn.Module):
    """A bias of ``n`` entries, optionally a 0-d scalar or an empty parameter beside it."""

    def __init__(self, n, extra=None):
        super().__init__()
        self.fc = nn.Linear(3, max(n, 4))
        self.b = nn.Parameter(torch.randn(n) * 0.1)
        self.n = n
        self.scale = nn.Parameter(torch.tensor(0.7)) if extra == "scalar" else None
        self.e = nn.Parameter(torch.empty(0)) if extra == "empty" else None

    def forward(self, x):
        h = self.fc(x)
        h = torch.tanh(torch.cat([h[..., :self.n] + self.b, h[..., self.n:]], -1))
        if self.scale is not None:
            h = h * self.scale
        if self.e is not None:
            h = h + self.e.sum()
        return h[..., :4]


def net(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return Net().to(dtype).eval()


def data(n=6, seed=1, dtype=torch.float64, d=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=dtype), torch.randint(0, 4, (n,), generator=g)


def params_of(m):
    return {k: v.detach() for k, v in m.named_parameters()}


def grads_loop(m, x, y, names=None):
    """Per-example float64 gradients by a Python loop of autograd.grad."""
    ps = dict(m.named_parameters())
    names = sorted(ps) if names is None else names
    out = []
    for i in range(len(y)):
        loss = F.cross_entropy(m(x[i:i + 1]), y[i:i + 1])
        g = torch.autograd.grad(loss, [ps[n] for n in names])
        out.append({n: gi.detach().double().numpy() for n, gi in zip(names, g, strict=True)})
    return out


def ref(grads, proj):
    return np.stack([npp.project(g, proj.seed, proj.kind, proj.dim, split=proj.split,
                                 vectors=proj.vectors) for g in grads])


def rel(a, b):
    a = a.detach().double().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    return float(np.abs(a - b).max() / np.abs(b).max())


def quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **kw)


# --- exactness through every projecting path ----------------------------------------------


def _aux(loss):
    return lambda p, ex: (loss(p, ex), ex[1])


@pytest.mark.parametrize("path", ["plain", "chunk2", "chunk1", "budget", "has_aux", "hand",
                                  "hand_chunk"])
def test_projected_grads_exact_vs_float64_kron(path):
    m = net()
    x, y = data()
    proj = kv()
    loss = tif.loss_from_module(m, F.cross_entropy)

    def hand(p, ex):
        return F.cross_entropy(functional_call(m, p, (ex[0][None],)), ex[1][None])

    fns = {
        "plain": lambda: tif.projected_grads(loss, proj),
        "chunk2": lambda: tif.projected_grads(loss, proj,
                                              options=tif.GradientOptions(chunk_size=2)),
        "chunk1": lambda: tif.projected_grads(loss, proj,
                                              options=tif.GradientOptions(chunk_size=1)),
        "budget": lambda: tif.projected_grads(loss, proj,
                                              options=tif.GradientOptions(memory_budget=8000)),
        "has_aux": lambda: tif.projected_grads(_aux(loss), proj, has_aux=True),
        "hand": lambda: tif.projected_grads(hand, proj),
        "hand_chunk": lambda: tif.projected_grads(hand, proj,
                                                  options=tif.GradientOptions(chunk_size=4)),
    }
    out = quiet(fns[path](), params_of(m), (x, y))
    if path == "has_aux":
        out = out[0]
    assert out.dtype == torch.float64
    assert rel(out, ref(grads_loop(m, x, y), proj)) < F64
    # and it is really another projection than the default
    dense = quiet(tif.projected_grads(loss, kd()), params_of(m), (x, y))
    assert rel(dense, ref(grads_loop(m, x, y), proj)) > 1e-3


def test_select_vectors_only_and_split_shape_exact():
    m = net()
    x, y = data()
    loss = tif.loss_from_module(m, F.cross_entropy)
    names = ["fc1.bias", "ln.bias", "ln.weight", "two"]
    sel = tif.GradientOptions(select=["fc1.bias", "ln", "two"])
    out = quiet(tif.projected_grads(loss, kv(), options=sel), params_of(m), (x, y))
    assert rel(out, ref(grads_loop(m, x, y, names), kv())) < F64
    shape = kv(split="shape")
    for fn in (tif.projected_grads(loss, shape),
               tif.projected_grads(_aux(loss), shape, has_aux=True)):
        got = quiet(fn, params_of(m), (x, y))
        got = got[0] if isinstance(got, tuple) else got
        assert rel(got, ref(grads_loop(m, x, y), shape)) < F64


def test_stages_and_frozen_prefix_exact():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(5, 9), nn.LayerNorm(9), nn.Tanh(), nn.Linear(9, 4))
    seq = seq.double().eval()
    x, y = data()
    loss = tif.loss_from_module(seq, F.cross_entropy)
    st = tif.model_stages(seq, F.cross_entropy)
    out = quiet(tif.projected_grads(loss, kv(), options=tif.GradientOptions(stages=st)),
                params_of(seq), (x, y))
    assert rel(out, ref(grads_loop(seq, x, y), kv())) < F64
    opts = tif.GradientOptions(stages=st, select=tif.last_layers(1))
    out = quiet(tif.projected_grads(loss, kv(), options=opts), params_of(seq), (x, y))
    assert rel(out, ref(grads_loop(seq, x, y, ["3.bias", "3.weight"]), kv())) < F64


def test_mixed_precision_close_float32_exact():
    m64 = net()
    x, y = data()
    r = ref(grads_loop(m64, x, y), kv())
    m = net(torch.float32)
    loss = tif.loss_from_module(m, F.cross_entropy)
    p = params_of(m)
    out = quiet(tif.projected_grads(loss, kv()), p, (x.float(), y))
    assert out.dtype == torch.float32 and rel(out, r) < F32
    bf = tif.GradientOptions(mixed_precision=torch.bfloat16)
    out = quiet(tif.projected_grads(loss, kv(), options=bf), p, (x.float(), y))
    assert rel(out, r) < 5e-2


@pytest.mark.parametrize("kind", ["adam", "trackstar"])
@pytest.mark.parametrize("factored", [False, True])
def test_preconditioned_exact(kind, factored):
    m = net()
    x, y = data()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    pre = tif.Preconditioner.from_optimizer(opt, m, kind=kind)
    pre = pre.as_factored() if factored else pre
    grads = [{n: v.numpy() for n, v in pre.apply({n: torch.tensor(a) for n, a in g.items()})
              .items()} for g in grads_loop(m, x, y)]
    loss = tif.loss_from_module(m, F.cross_entropy)
    out = quiet(tif.projected_grads(loss, kv(), precondition=pre), params_of(m), (x, y))
    assert rel(out, ref(grads, kv())) < F64


@pytest.mark.parametrize("n,k", [(1, 24), (2, 24), (7, 13), (16, 16), (5, 4096), (5, 1),
                                 (50_000, 64)])
@pytest.mark.parametrize("aux", [False, True])
def test_vector_sizes_exact(n, k, aux):
    torch.manual_seed(0)
    m = Vec(n).double().eval()
    x, y = data(3, d=3)
    loss = tif.loss_from_module(m, F.cross_entropy)
    proj = kv(dim=k, seed=5)
    fn = tif.projected_grads(_aux(loss), proj, has_aux=True) if aux else \
        tif.projected_grads(loss, proj)
    out = quiet(fn, params_of(m), (x, y))
    out = out[0] if aux else out
    assert rel(out, ref(grads_loop(m, x, y), proj)) < F64


def test_scalar_parameter_generic_path_exact():
    torch.manual_seed(0)
    m = Vec(6, "scalar").double().eval()
    x, y = data(3, d=3)
    loss = tif.loss_from_module(m, F.cross_entropy)
    out = quiet(tif.projected_grads(_aux(loss), kv(), has_aux=True), params_of(m), (x, y))[0]
    assert rel(out, ref(grads_loop(m, x, y), kv())) < F64


@pytest.mark.parametrize("vectors", ["kronecker", "dense"])
def test_finding_scalar_parameter_factorised_path(vectors):
    torch.manual_seed(0)
    m = Vec(6, "scalar").double().eval()
    x, y = data(3, d=3)
    loss = tif.loss_from_module(m, F.cross_entropy)
    proj = tif.Projection(dim=24, seed=3, kind="kronecker", vectors=vectors)
    out = quiet(tif.projected_grads(loss, proj), params_of(m), (x, y))
    assert rel(out, ref(grads_loop(m, x, y), proj)) < F64


def test_empty_parameter_generic_path_exact():
    torch.manual_seed(0)
    m = Vec(6, "empty").double().eval()
    x, y = data(3, d=3)
    loss = tif.loss_from_module(m, F.cross_entropy)
    out = quiet(tif.projected_grads(_aux(loss), kv(), has_aux=True), params_of(m), (x, y))[0]
    assert rel(out, ref(grads_loop(m, x, y), kv())) < F64


@pytest.mark.parametrize("vectors", ["kronecker", "dense"])
def test_finding_empty_parameter_factorised_path(vectors):
    torch.manual_seed(0)
    m = Vec(6, "empty").double().eval()
    x, y = data(3, d=3)
    loss = tif.loss_from_module(m, F.cross_entropy)
    proj = tif.Projection(dim=24, seed=3, kind="kronecker", vectors=vectors)
    out = quiet(tif.projected_grads(loss, proj), params_of(m), (x, y))
    assert rel(out, ref(grads_loop(m, x, y), proj)) < F64


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.ln = nn.LayerNorm(5)
        self.out = nn.Linear(5, 4)

    def forward(self, x):
        h = torch.tanh(self.ln(self.fc(x)))
        return self.out(torch.tanh(self.ln(self.fc(h))))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(48, 4)
        self.emb = nn.Embedding(6, 3)

    def forward(self, inp):
        x, t = inp
        return self.fc(torch.relu(self.bn(self.c(x))).flatten(1)) + self.emb(t).sum(-1,
                                                                                 keepdim=True)


def test_shared_layer_and_convnet_vectors_exact():
    proj = kv(dim=20, seed=2)
    torch.manual_seed(0)
    m = Twice().double().eval()
    x, y = data(5)
    out = quiet(tif.projected_grads(tif.loss_from_module(m, F.cross_entropy), proj),
                params_of(m), (x, y))
    assert rel(out, ref(grads_loop(m, x, y), proj)) < F64
    torch.manual_seed(0)
    c = ConvNet().double()
    c.bn.running_mean.uniform_(-1, 1)
    c.bn.running_var.uniform_(0.5, 2)
    c.eval()
    xi = torch.randn(5, 2, 4, 4, dtype=torch.float64)
    ti = torch.randint(0, 6, (5,))
    y = torch.randint(0, 4, (5,))
    r = ref(_conv_grads(c, xi, ti, y), proj)
    out = quiet(tif.projected_grads(tif.loss_from_module(c, F.cross_entropy), proj),
                params_of(c), ((xi, ti), y))
    assert rel(out, r) < F64


def _conv_grads(c, xi, ti, y):
    ps = dict(c.named_parameters())
    names = sorted(ps)
    out = []
    for i in range(len(y)):
        loss = F.cross_entropy(c((xi[i:i + 1], ti[i:i + 1])), y[i:i + 1])
        g = torch.autograd.grad(loss, [ps[n] for n in names])
        out.append({n: gi.numpy() for n, gi in zip(names, g, strict=True)})
    return out


def test_causal_lm_loss_gpt2_exact():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=13, n_positions=8,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    ids = torch.randint(0, 13, (3, 6), generator=torch.Generator().manual_seed(4))
    proj = kv(dim=16, seed=1)
    names = [n for n, _ in model.named_parameters()]
    grads = []
    for i in range(3):
        logits = model(ids[i:i + 1]).logits[0]
        loss = F.cross_entropy(logits[:-1], ids[i, 1:])
        g = torch.autograd.grad(loss, list(model.parameters()))
        grads.append({n: gi.numpy() for n, gi in zip(names, g, strict=True)})
    r = ref(grads, proj)
    p = params_of(model)
    for opts in (None, tif.GradientOptions(chunk_size=2)):
        out = quiet(tif.projected_grads(tif.causal_lm_loss(model), proj, options=opts), p,
                    {"input_ids": ids})
        assert rel(out, r) < F64


def test_per_checkpoint_vectors_drawn_per_checkpoint():
    m = net()
    x, y = data()
    loss = tif.loss_from_module(m, F.cross_entropy)
    pc = kv(per_checkpoint=True)
    ck = [tif.Checkpoint.from_module(m, lr=1.0, name=n) for n in ("a", "b")]
    sel = tif.GradientOptions(select=["fc1.bias", "ln", "two", "one", "fc2.bias"])
    store = quiet(tif.build_store, loss, ck, (x, y), projection=pc, options=sel)
    for i, name in enumerate(("a", "b")):
        direct = quiet(tif.projected_grads(loss, pc.for_checkpoint(name), options=sel),
                       params_of(m), (x, y))
        assert rel(store.read_rows(i, 0, 6), direct.numpy()) < F32
    # vectors only, same weights: the two checkpoints' rows differ (independent matrices)
    assert (store.read_rows(0, 0, 6) - store.read_rows(1, 0, 6)).abs().max() > 1e-2
    a = kronecker_factors(pc.for_checkpoint("a"), "fc1.bias", (11,))
    b = kronecker_factors(pc.for_checkpoint("b"), "fc1.bias", (11,))
    assert not all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


# --- factors, view, unbiasedness --------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (1,), (2,), (3,), (7,), (16,), (17,), (50_000,),
                                   (3, 4)])
def test_factors_and_view_match_numpy_reference(shape):
    n = int(np.prod(shape))
    view = kronecker_view(kv(), shape)
    assert view == (npp.vector_view(n) if len(shape) < 2 else (shape[0], n // shape[0]))
    if len(shape) < 2:
        assert kronecker_view(kd(), shape) is None
        d_out, d_in = view
        assert d_out * d_in >= n and (d_out - 1) * d_in < n and (d_in - 1) ** 2 < n
    a, b = kronecker_factors(kv(), "p.bias", shape)
    ra, rb = npp.kronecker_factors(3, 24, "p.bias", shape)
    assert np.array_equal(a.numpy(), ra) and np.array_equal(b.numpy(), rb)


def test_factors_refusals():
    with pytest.raises(tif.errors.InvalidProjectionError, match="vectors='kronecker'"):
        kronecker_factors(kd(), "b", (7,))
    with pytest.raises(tif.errors.InvalidProjectionError, match="empty"):
        kronecker_factors(kv(), "b", (0,))
    assert kronecker_view(kv(), (0,)) is None


def test_make_projector_on_materialised_grads_exact():
    m = net()
    x, y = data(3)
    grads = grads_loop(m, x, y)
    lay = tuple((n, tuple(g.shape)) for n, g in sorted(grads[0].items()))
    pj = make_projector(kv(dim=13), lay)
    rows = [pj({n: torch.tensor(a) for n, a in g.items()}) for g in grads]
    assert rel(torch.stack(rows), ref(grads, kv(dim=13))) < F64


def test_unbiased_inner_products_over_seeds():
    """E[K K^T] / k = I over seeds for a padded 7-vector (view 3 x 3) at k = 24."""
    n, k, seeds = 7, 24, 1500
    acc = np.zeros((n, n))
    for s in range(seeds):
        po, pi = npp.kronecker_factors(s, k, "v.bias", (n,))
        kr = np.kron(po.astype(np.float64), pi.astype(np.float64))[:n]
        acc += kr @ kr.T / k
    acc /= seeds
    assert np.allclose(np.diag(acc), 1.0)
    assert np.abs(acc - np.eye(n)).max() < 0.06
    # the torch factors are those same matrices for a few seeds
    for s in (0, 7, 1499):
        a, b = kronecker_factors(tif.Projection(dim=k, seed=s, kind="kronecker",
                                                vectors="kronecker"), "v.bias", (n,))
        ra, rb = npp.kronecker_factors(s, k, "v.bias", (n,))
        assert np.array_equal(a.numpy(), ra) and np.array_equal(b.numpy(), rb)


# --- the spec: validation, equality, round trips ---------------------------------------------


@pytest.mark.parametrize("bad", ["Kronecker", "KRONECKER", True, False, None, 1, "", "dense ",
                                 b"kronecker", ["kronecker"]])
def test_bad_vectors_values_refused(bad):
    with pytest.raises(tif.errors.InvalidProjectionError, match="vectors must be one of"):
        tif.Projection(dim=24, kind="kronecker", vectors=bad)


@pytest.mark.parametrize("kind,dim", [("rademacher", 24), ("sjlt", 24), ("identity", None)])
def test_vectors_kronecker_with_other_kinds_refused(kind, dim):
    with pytest.raises(tif.errors.InvalidProjectionError, match="vectors"):
        tif.Projection(dim=dim, kind=kind, vectors="kronecker")
    with pytest.raises(tif.errors.InvalidProjectionError, match="vectors"):
        tif.Projection.from_dict({"dim": dim, "kind": kind, "vectors": "kronecker"})


def test_equality_hash_pickle_and_dict_round_trip():
    p, d = kv(), kd()
    assert p != d and hash(p) != hash(d)
    assert len({p, d, kv(), kd()}) == 2
    assert pickle.loads(pickle.dumps(p)) == p
    assert p.to_dict()["vectors"] == "kronecker" and "vectors" not in d.to_dict()
    assert tif.Projection.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert tif.Projection.from_dict(d.to_dict()) == d
    assert tif.Projection.from_dict({**d.to_dict(), "vectors": "dense"}) == d
    pc = kv(per_checkpoint=True).for_checkpoint("c1")
    assert pc.vectors == "kronecker"
    assert tif.Projection.from_dict(json.loads(json.dumps(pc.to_dict()))) == pc
    assert "vectors='kronecker'" in repr(p)
    with pytest.raises(tif.errors.InvalidProjectionError):
        tif.Projection.from_dict({"dim": 24, "kind": "kronecker", "vectors": "bogus"})


# --- stores: record, refuse mixing, resume, tamper, quantise, threads ---------------------------


def _setup(n=8, dtype=torch.float64):
    m = net(dtype)
    x, y = data(n, dtype=dtype)
    xt, yt = data(3, seed=2, dtype=dtype)
    loss = tif.loss_from_module(m, F.cross_entropy)
    ck = [tif.Checkpoint.from_module(m, lr=0.5, name="c0")]
    return m, loss, ck, (x, y), (xt, yt)


def test_store_scores_exact_memory_and_zarr(tmp_path):
    m, loss, ck, train, test = _setup()
    r, rt = ref(grads_loop(m, *train), kv()), ref(grads_loop(m, *test), kv())
    mem = quiet(tif.build_store, loss, ck, train, projection=kv())
    quiet(tif.build_store, loss, ck, train, projection=kv(), store=str(tmp_path / "g.zarr"))
    disk = tif.GradientStore.open(str(tmp_path / "g.zarr"))
    assert disk.projection == kv() and mem.projection == kv()
    meta = (tmp_path / "g.zarr" / "zarr.json").read_text()
    assert meta.count('"vectors"') == 1
    tg = quiet(tif.build_store, loss, ck, test, projection=disk.projection)
    expect = 0.5 * rt @ r.T
    for st in (mem, disk):
        assert rel(tif.score(st, tg), expect) < F32
        _, idx = tif.top_k(st, tg, k=3)
        assert np.array_equal(idx.numpy(), np.argsort(-expect, 1)[:, :3])
        assert rel(tif.self_influence(st), 0.5 * (r * r).sum(1)) < F32


def test_default_store_has_no_vectors_key(tmp_path):
    _, loss, ck, train, _ = _setup()
    quiet(tif.build_store, loss, ck, train, projection=kd(), store=str(tmp_path / "d.zarr"))
    assert '"vectors"' not in (tmp_path / "d.zarr" / "zarr.json").read_text()
    assert tif.GradientStore.open(str(tmp_path / "d.zarr")).projection == kd()


@pytest.mark.parametrize("store_vec,test_vec", [("kronecker", "dense"), ("dense", "kronecker")])
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_mixing_refused_everywhere(store_vec, test_vec, dtype):
    _, loss, ck, train, test = _setup()
    mk = {"kronecker": kv, "dense": kd}
    st = quiet(tif.build_store, loss, ck, train, projection=mk[store_vec](), dtype=dtype)
    tg = quiet(tif.build_store, loss, ck, test, projection=mk[test_vec]())
    for fn in (lambda: tif.score(st, tg), lambda: tif.top_k(st, tg, k=2)):
        with pytest.raises(tif.errors.IncompatibleGradientsError,
                           match=f"vectors='{test_vec}'.*vectors='{store_vec}'"):
            fn()


def test_resume_with_other_vectors_refused_same_resumes(tmp_path):
    _, loss, ck, (x, y), _ = _setup()
    path = str(tmp_path / "r.zarr")
    writer = functools.partial(tif.store.ZarrWriter, path, chunk_rows=2, shard_rows=2)

    def crashing():
        for i in range(0, 8, 2):
            if i == 4:
                raise RuntimeError("crash")
            yield x[i:i + 2], y[i:i + 2]

    with pytest.raises(RuntimeError, match="crash"):
        quiet(tif.build_store, loss, ck, crashing(), projection=kv(), store=writer)
    batches = [(x[i:i + 2], y[i:i + 2]) for i in range(0, 8, 2)]
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="vectors='dense'"):
        quiet(tif.build_store, loss, ck, batches, projection=kd(), store=writer)
    st = quiet(tif.build_store, loss, ck, batches, projection=kv(), store=writer)
    full = quiet(tif.build_store, loss, ck, (x, y), projection=kv())
    assert torch.equal(st.read_rows(0, 0, 8), full.read_rows(0, 0, 8))
    # a finished store asked for with the other vectors: refused, not overwritten
    with pytest.raises(tif.errors.StoreExistsError, match="vectors"):
        quiet(tif.build_store, loss, ck, batches, projection=kd(), store=path)
    assert tif.GradientStore.open(path).projection == kv()


def test_sharded_part_with_other_vectors_refused_and_save_round_trip(tmp_path):
    _, loss, ck, train, _ = _setup()
    path = str(tmp_path / "s.zarr")
    quiet(tif.build_store, loss, ck, train, projection=kv(), store=path, shard=(0, 2))
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="vectors='dense'"):
        quiet(tif.build_store, loss, ck, train, projection=kd(), store=path, shard=(1, 2))
    mem = quiet(tif.build_store, loss, ck, train, projection=kv())
    tif.save_store(mem, str(tmp_path / "saved.zarr"))
    back = tif.GradientStore.open(str(tmp_path / "saved.zarr"))
    assert back.projection == kv() and tif.to_memory(back).projection == kv()
    assert torch.equal(back.read_rows(0, 0, 8), mem.read_rows(0, 0, 8))


def test_edited_metadata_dropping_vectors_refused(tmp_path):
    _, loss, ck, train, _ = _setup()
    path = tmp_path / "k.zarr"
    quiet(tif.build_store, loss, ck, train, projection=kv(), store=str(path))
    txt = (path / "zarr.json").read_text()
    data_ = json.loads(txt)

    def drop(o):
        if isinstance(o, dict):
            o.pop("vectors", None)
            for v in o.values():
                drop(v)
        elif isinstance(o, list):
            for v in o:
                drop(v)

    drop(data_)
    (path / "zarr.json").write_text(json.dumps(data_))
    with pytest.raises(tif.errors.CorruptStoreError):
        tif.GradientStore.open(str(path))


def test_two_builds_at_once_in_threads():
    _, loss, ck, train, _ = _setup()
    res = {}

    def build(name, proj):
        res[name] = quiet(tif.build_store, loss, ck, train, projection=proj).read_rows(0, 0, 8)

    ths = [threading.Thread(target=build, args=a) for a in (("k", kv()), ("d", kd()))]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert torch.equal(res["k"], quiet(tif.build_store, loss, ck, train,
                                       projection=kv()).read_rows(0, 0, 8))
    assert torch.equal(res["d"], quiet(tif.build_store, loss, ck, train,
                                       projection=kd()).read_rows(0, 0, 8))


# --- curvature, search, JAX, CLI --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_kfac_test_grads_project_vectors_as_spec(kind):
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4)).double().eval()
    x, y = data(10)
    xt, yt = data(3, seed=2)
    loss = tif.loss_from_module(seq, F.cross_entropy)
    ck = [tif.Checkpoint.from_module(seq, lr=0.5, name="c0")]
    cur = quiet(tif.fit_curvature, loss, ck, (x, y), kind=kind, damping=0.1)
    full = quiet(tif.preconditioned_test_grads, loss, ck, (xt, yt), cur,
                 projection=tif.Projection(kind="identity"))
    got = quiet(tif.preconditioned_test_grads, loss, ck, (xt, yt), cur, projection=kv())
    lay = full.layout if hasattr(full, "layout") else full.meta.layout
    items = list(lay.items()) if hasattr(lay, "items") else list(lay)
    grads = []
    for row in full.read_rows(0, 0, 3).double().numpy():
        off, g = 0, {}
        for name, shape in items:
            n = int(np.prod(shape))
            g[name] = row[off:off + n].reshape(shape)
            off += n
        grads.append(g)
    assert rel(got.read_rows(0, 0, 3), ref(grads, kv())) < F64
    dense_store = quiet(tif.build_store, loss, ck, (x, y), projection=kd())
    with pytest.raises(tif.errors.IncompatibleGradientsError):
        tif.score(dense_store, got, curvature=cur)


def test_projected_curvature_bound_to_vectors():
    _, loss, ck, train, test = _setup(dtype=torch.float32)
    cur = quiet(tif.fit_curvature, loss, ck, train, kind="projected", projection=kv(),
                damping=0.1)
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="vectors='kronecker'"):
        quiet(tif.preconditioned_test_grads, loss, ck, test, cur, projection=kd())
    dense_store = quiet(tif.build_store, loss, ck, train, projection=kd())
    with pytest.raises(tif.errors.IncompatibleGradientsError):
        tif.self_influence(dense_store, curvature=cur)


def test_faiss_index_bound_to_vectors(tmp_path):
    pytest.importorskip("faiss")
    _, loss, ck, _, test = _setup(dtype=torch.float32)
    x, y = data(40, dtype=torch.float32)
    path = str(tmp_path / "g.zarr")
    dense = quiet(tif.build_store, loss, ck, (x, y), projection=kd(), store=path)
    index = tif.build_index(dense, kind="ivf_flat", nlist=2)
    tk = quiet(tif.build_store, loss, ck, test, projection=kv())
    with pytest.raises(tif.errors.IncompatibleGradientsError):
        tif.indexed_top_k(dense, tk, 3, index=index)
    import shutil
    shutil.rmtree(path)
    kron = quiet(tif.build_store, loss, ck, (x, y), projection=kv(), store=path)
    with pytest.raises(tif.errors.IncompatibleGradientsError):
        tif.load_index(path + ".faiss", kron)


def test_jax_frontend_matches_torch_and_reference():
    jax = pytest.importorskip("jax")
    fnn = pytest.importorskip("flax.linen")
    import jax.numpy as jnp

    import tracinfunc.jax as tj

    class JM(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            h = jnp.tanh(fnn.LayerNorm()(fnn.Dense(11)(x)))
            return fnn.Dense(4)(h)

    class TM(nn.Module):
        def __init__(self):
            super().__init__()
            self.Dense_0 = nn.Linear(5, 11)
            self.LayerNorm_0 = nn.LayerNorm(11, eps=1e-6)
            self.Dense_1 = nn.Linear(11, 4)

        def forward(self, x):
            return self.Dense_1(torch.tanh(self.LayerNorm_0(self.Dense_0(x))))

    jm = JM()
    x, y = data(dtype=torch.float32)
    xj, yj = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
    variables = jm.init(jax.random.PRNGKey(0), xj)

    def jloss(v, ex):
        return -jax.nn.log_softmax(jm.apply(v, ex[0][None])[0])[ex[1]]

    mapping = tj.ParamMapping.flax(variables)
    tparams = {k: torch.tensor(np.asarray(v)) for k, v in mapping.to_torch(variables).items()}
    t64 = TM().double()
    t64.load_state_dict({k: v.double() for k, v in tparams.items()})
    r = ref(grads_loop(t64, x.double(), y), kv())
    rows = quiet(tj.projected_grads(jloss, kv(), mapping=mapping), variables, (xj, yj))
    assert rel(np.asarray(rows), r) < F32
    t32 = TM().eval()
    t32.load_state_dict(tparams)
    tloss = tif.loss_from_module(t32, F.cross_entropy)
    js = quiet(tj.build_store, jloss, [tj.Checkpoint(variables, lr=0.5, name="c0")], (xj, yj),
               projection=kv(), mapping=mapping)
    assert js.projection == kv()
    tt = quiet(tif.build_store, tloss, [tif.Checkpoint(tparams, lr=0.5, name="c0")], (x, y),
               projection=kv())
    assert rel(tif.score(js, tt), 0.5 * r @ r.T) < F32
    td = quiet(tif.build_store, tloss, [tif.Checkpoint(tparams, lr=0.5, name="c0")], (x, y),
               projection=kd())
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="vectors"):
        tif.score(js, td)
    for shape in [(), (1,), (2,), (11,), (50_000,)]:
        a, b = tj.kronecker_factors(kv(), "x.bias", shape)
        ta, tb = kronecker_factors(kv(), "x.bias", shape)
        assert np.array_equal(np.asarray(a), ta.numpy())
        assert np.array_equal(np.asarray(b), tb.numpy())
    with pytest.raises(tif.errors.InvalidProjectionError):
        tj.kronecker_factors(kd(), "x.bias", (7,))
    with pytest.raises(tif.errors.InvalidProjectionError):
        tj.kronecker_factors(kv(), "x.bias", (0,))


def test_jax_scalar_parameter_exact():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import tracinfunc.jax as tj

    rs = np.random.RandomState(0)
    jp = {"w": jnp.asarray(rs.randn(4, 5).astype(np.float32)), "s": jnp.asarray(np.float32(0.7)),
          "b": jnp.asarray(rs.randn(4).astype(np.float32))}

    def jl(p, ex):
        return -jax.nn.log_softmax(jnp.tanh(p["w"] @ ex[0] + p["b"]) * p["s"])[ex[1]]

    x, y = data(dtype=torch.float32)
    xj, yj = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
    proj = kv(dim=13)
    rows = quiet(tj.projected_grads(jl, proj, mapping=tj.ParamMapping.identity(jp)), jp,
                 (xj, yj))
    gr = jax.vmap(jax.grad(jl), in_axes=(None, 0))(jp, (xj, yj))
    grads = [{n: np.asarray(gr[n][i], dtype=np.float64) for n in gr} for i in range(6)]
    assert rel(np.asarray(rows), ref(grads, proj)) < F32


SPEC = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
import tracinfunc as tif


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Tanh(), nn.Linear(7, 4)).eval()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 5, generator=g), torch.randint(0, 4, (8,), generator=g)
    xt, yt = torch.randn(3, 5, generator=g), torch.randint(0, 4, (3,), generator=g)
    ck = [tif.Checkpoint.from_module(model, lr=0.5, name="c0")]
    return tif.cli.Spec(loss=tif.loss_from_module(model, F.cross_entropy), train=(x, y),
                        test={"test": (xt, yt)}, checkpoints=ck, model=model)
'''


def test_cli_info_and_score_on_vectors_store(tmp_path):
    (tmp_path / "spec.py").write_text(SPEC)
    sys.path.insert(0, str(tmp_path))
    try:
        import importlib
        spec_mod = importlib.import_module("spec")
        spec_mod = importlib.reload(spec_mod)
        s = spec_mod.make()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("spec", None)
    store = str(tmp_path / "g.zarr")
    st = quiet(tif.build_store, s.loss, s.checkpoints, s.train, projection=kv(), store=store)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    info = subprocess.run([sys.executable, "-m", "tracinfunc", "info", store],
                          capture_output=True, text=True, env=env, timeout=120)
    assert info.returncode == 0 and "vectors='kronecker'" in info.stdout
    out = str(tmp_path / "s.npy")
    sc = subprocess.run([sys.executable, "-m", "tracinfunc", "score", store, "--spec",
                         f"{tmp_path / 'spec.py'}:make", "--test", "test", "--output", out],
                        capture_output=True, text=True, env=env, timeout=120)
    assert sc.returncode == 0, sc.stderr
    tg = quiet(tif.build_store, s.loss, s.checkpoints, s.test["test"], projection=kv())
    assert np.array_equal(np.load(out), tif.score(st, tg).numpy())
