"""atk48b: outside attacks on build_store's in-place-loss refusal, kronecker re-proof,
per-checkpoint-buffer proofs and tuple-of-batches errors (docs only, black box)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracinfunc as tif
from tracinfunc import errors

torch.manual_seed(0)
X = torch.randn(12, 5)
Y = torch.randint(0, 3, (12,))
KINDS = [
    tif.Projection(kind="identity"),
    tif.Projection(dim=8, seed=0),
    tif.Projection(dim=8, kind="sjlt", seed=0),
    tif.Projection(dim=4, kind="kronecker", seed=0),
]


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).eval()


M = mlp()
CK = [tif.Checkpoint.from_module(M, lr=0.1, name="a")]
LOSS = tif.loss_from_module(M, F.cross_entropy)


def rows(store) -> torch.Tensor:
    return torch.stack([store.read_rows(c, 0, store.n_train) for c in range(store.n_ckpt)])


def build(loss, data, proj=None, ckpts=None, **kw):
    kw.setdefault("progress", False)
    return tif.build_store(loss, CK if ckpts is None else ckpts, data,
                           projection=proj or tif.Projection(dim=8, seed=0), **kw)


def writer_loss(write):
    """A raw loss(params, example) that calls write(example) first."""

    def loss(params, example):
        write(example)
        return LOSS(params, example)

    return loss


def batches():
    return [(X[i:i + 4].clone(), Y[i:i + 4].clone()) for i in range(0, 12, 4)]


# ---------------------------------------------------------------- 1. in-place refusals


@pytest.mark.parametrize("proj", KINDS, ids=lambda p: p.kind)
@pytest.mark.parametrize("form", ["one", "list", "gen", "loader", "bs"])
def test_mul_inplace_refused_every_kind_and_form(proj, form):
    data = {
        "one": (X.clone(), Y.clone()),
        "list": batches(),
        "gen": (b for b in batches()),
        "loader": torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(X.clone(), Y.clone()), batch_size=4),
        "bs": batches(),
    }[form]
    kw = {"batch_size": 3} if form == "bs" else {}
    with pytest.raises(errors.LossFunctionError, match="in place"):
        build(writer_loss(lambda e: e[0].mul_(2)), data, proj, **kw)


@pytest.mark.parametrize("write", [
    lambda e: e[1].add_(1),
    lambda e: e[0].__setitem__(0, 0.0),
    lambda e: e[0].copy_(torch.zeros_like(e[0])),
    lambda e: torch.add(e[0], 1, out=e[0]),
    lambda e: e[0].clamp_(max=0.1),
], ids=["labels", "setitem", "copy_", "out=", "clamp_"])
def test_other_inplace_writes_refused(write):
    with pytest.raises(errors.LossFunctionError, match="in place"):
        build(writer_loss(write), batches())


def test_error_names_the_written_tensor():
    with pytest.raises(errors.LossFunctionError) as ei:
        build(writer_loss(lambda e: e[1].add_(1)), batches())
    assert "tensor 1" in str(ei.value), str(ei.value)


def test_finding_inplace_error_names_rows_on_default_merge():
    """Expected (docstring: LossFunctionError "names the failing batch and its data rows"):
    the in-place refusal says which rows. Observed with default merging: no rows, and the
    shape given is the merged call's ([12, 5]), not any batch the caller passed ([4, 5])."""
    with pytest.raises(errors.LossFunctionError, match="in place") as ei:
        build(writer_loss(lambda e: e[0].mul_(2)), batches())
    assert re.search(r"rows \d+-\d+", str(ei.value)), str(ei.value)


def test_zarr_refusal_mid_build_then_resume_with_fixed_loss(tmp_path):
    path = str(tmp_path / "m.zarr")
    calls = {"n": 0}

    def write(e):
        calls["n"] += 1
        if calls["n"] > 3:
            e[0].mul_(2)

    with pytest.raises(errors.LossFunctionError, match="in place"):
        build(writer_loss(write), batches(), store=path, batch_size=4)
    good = build(LOSS, batches(), store=path, batch_size=4)
    ref = build(LOSS, batches(), batch_size=4)
    torch.testing.assert_close(rows(good), rows(ref))


def test_dict_leaf_write_refused():
    m = mlp()

    def loss(params, ex):
        ex["w"].mul_(3)
        out = torch.func.functional_call(m, params, (ex["x"].unsqueeze(0),))
        return F.cross_entropy(out, ex["y"].unsqueeze(0)) * ex["w"].sum()

    data = [{"x": X[i:i + 4].clone(), "y": Y[i:i + 4].clone(), "w": torch.ones(4)}
            for i in range(0, 12, 4)]
    with pytest.raises(errors.LossFunctionError, match="in place"):
        build(loss, data, ckpts=[tif.Checkpoint.from_module(m, lr=0.1)])


def test_write_only_on_later_calls_refused():
    """The loss starts writing only after its first few calls (e.g. third batch)."""
    calls = {"n": 0}

    def write(e):
        calls["n"] += 1
        if calls["n"] > 3:
            e[0].mul_(2)

    with pytest.raises(errors.LossFunctionError, match="in place"):
        build(writer_loss(write), batches(), batch_size=4)


def test_write_only_at_second_checkpoint_refused():
    def loss(params, e):
        if float(params["0.bias"].detach().sum()) > 100:
            e[0].mul_(2)
        return LOSS(params, e)

    p2 = {k: v.clone() for k, v in CK[0].params.items()}
    p2["0.bias"] = p2["0.bias"] + 1000
    ck = [CK[0], tif.Checkpoint(p2, lr=0.1, name="b")]
    with pytest.raises(errors.LossFunctionError, match="in place"):
        build(loss, batches(), ckpts=ck)


def test_zarr_refusal_leaves_path_rebuildable(tmp_path):
    path = tmp_path / "g.zarr"
    with pytest.raises(errors.LossFunctionError):
        build(writer_loss(lambda e: e[0].mul_(2)), batches(), store=str(path))
    good = build(LOSS, batches(), store=str(path))
    ref = build(LOSS, batches())
    torch.testing.assert_close(rows(good), rows(ref))


@pytest.mark.parametrize("proj", KINDS, ids=lambda p: p.kind)
@pytest.mark.parametrize("name,fn", [
    ("float", lambda e: (e[0].float(), e[1])),
    ("to", lambda e: (e[0].to(torch.float32), e[1])),
    ("contig", lambda e: (e[0].contiguous(), e[1])),
    ("clone_write", lambda e: (e[0].clone().mul_(1.0), e[1])),
    ("outofplace", lambda e: (e[0] * 1.0, e[1])),
    ("index", lambda e: (e[0][:], e[1])),
    ("view_reshape", lambda e: (e[0].reshape(-1), e[1])),
])
def test_valid_losses_not_refused(proj, name, fn):
    data = batches()
    before = [tuple(t.clone() for t in b) for b in data]

    def loss(params, e):
        return LOSS(params, fn(e))

    s = build(loss, data, proj)
    ref = build(LOSS, batches(), proj)
    torch.testing.assert_close(rows(s), rows(ref))
    for a, b in zip(data, before, strict=True):
        for u, v in zip(a, b, strict=True):
            assert torch.equal(u, v)


def test_no_grad_block_not_refused():
    def loss(params, e):
        with torch.no_grad():
            _ = e[0].sum() * 2
        return LOSS(params, e)

    s = build(loss, batches())
    torch.testing.assert_close(rows(s), rows(build(LOSS, batches())))


def test_global_tensor_write_refused_as_state_update():
    """torch.func forbids writing a captured tensor; refused as a state update, by class."""
    glob = torch.zeros(3)

    def loss(params, e):
        glob.add_(1)
        return LOSS(params, e)

    with pytest.raises(errors.TrainModeError):
        build(loss, batches())


def test_write_only_on_first_call_refused():
    calls = {"n": 0}

    def write(e):
        calls["n"] += 1
        if calls["n"] == 1:
            e[0].mul_(2)

    with pytest.raises(errors.LossFunctionError, match="in place"):
        build(writer_loss(write), batches())


def test_data_attribute_write_refused_or_caller_unchanged():
    """x.data.mul_(): either refused, or the caller's batch is unchanged and rows correct."""
    data = batches()
    before = [tuple(t.clone() for t in b) for b in data]
    try:
        s = build(writer_loss(lambda e: e[0].data.mul_(2)), data)
    except errors.LossFunctionError:
        return
    for a, b in zip(data, before, strict=True):
        for u, v in zip(a, b, strict=True):
            assert torch.equal(u, v)
    torch.testing.assert_close(rows(s), rows(build(LOSS, batches())))


def test_requires_grad_in_loss_is_a_clear_loss_error():
    """torch.func forbids requires_grad_() in a transformed function: a LossFunctionError."""

    def loss(params, e):
        x = e[0].detach().clone().requires_grad_()
        return LOSS(params, (x, e[1]))

    with pytest.raises(errors.LossFunctionError, match="requires_grad_"):
        build(loss, batches())


def test_float64_batch_cast_then_write_copy_not_refused():
    data = [(X[i:i + 4].double(), Y[i:i + 4]) for i in range(0, 12, 4)]

    def loss(params, e):
        x = e[0].float()
        x.mul_(1.0)
        return LOSS(params, (x, e[1]))

    s = build(loss, data)
    torch.testing.assert_close(rows(s), rows(build(LOSS, batches())))


def test_loader_pin_memory_false_not_refused():
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=5,
                                     pin_memory=False, shuffle=False)
    s = build(LOSS, dl)
    torch.testing.assert_close(rows(s), rows(build(LOSS, batches())))


def test_loader_inplace_refused_with_zarr(tmp_path):
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X.clone(), Y.clone()),
                                     batch_size=5)
    with pytest.raises(errors.LossFunctionError, match="in place"):
        build(writer_loss(lambda e: e[0].mul_(2)), dl, store=str(tmp_path / "z.zarr"))


def test_shared_memory_batches_not_refused():
    b = (X[:4].clone(), Y[:4].clone())
    s = build(LOSS, [b, b, b])
    assert s.n_train == 12
    r = rows(s)[0]
    torch.testing.assert_close(r[:4], r[4:8])


def test_inference_mode_data_not_refused():
    with torch.inference_mode():
        xi = X.clone()
        yi = Y.clone()
    s = build(LOSS, [(xi[:6], yi[:6]), (xi[6:], yi[6:])])
    torch.testing.assert_close(rows(s), rows(build(LOSS, batches())))


def test_batchnorm_eval_buffer_write_not_refused():
    torch.manual_seed(3)
    m = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).eval()
    loss = tif.loss_from_module(m, F.cross_entropy)
    s = build(loss, batches(), ckpts=[tif.Checkpoint.from_module(m, lr=0.1)])
    assert s.n_train == 12


def test_view_batches_of_one_tensor_unchanged():
    """Batches that are views of one caller tensor: merged by default, data unchanged."""
    x = X.clone()
    y = Y.clone()
    data = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 12, 4)]
    build(LOSS, data, tif.Projection(dim=4, kind="kronecker"))
    assert torch.equal(x, X) and torch.equal(y, Y)


def test_refused_write_leaves_caller_list_unchanged():
    """Claim: with default merging of a list, the caller's data stays unchanged."""
    data = batches()
    before = [tuple(t.clone() for t in b) for b in data]
    with pytest.raises(errors.LossFunctionError):
        build(writer_loss(lambda e: e[0].mul_(2)), data)
    for a, b in zip(data, before, strict=True):
        for u, v in zip(a, b, strict=True):
            assert torch.equal(u, v)


@pytest.mark.parametrize("proj", KINDS, ids=lambda p: p.kind)
@pytest.mark.parametrize("form", ["list_batch_size", "one_batch_zarr"])
def test_finding_refused_write_changes_caller_data(proj, form, tmp_path):
    """Expected: a refused in-place loss leaves the caller's tensors as they were (as with
    one in-memory batch, a DataLoader, or a list under default merging), or the error says
    they were changed. Observed: a list with batch_size=4, or one batch built into a Zarr
    path, is refused but the caller's x is left partly doubled, and the error does not say."""
    x, y = X.clone(), Y.clone()
    if form == "list_batch_size":
        data, kw = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 12, 4)], {"batch_size": 4}
    else:
        data, kw = (x, y), {"store": str(tmp_path / "o.zarr")}
    with pytest.raises(errors.LossFunctionError, match="in place") as refused:
        build(writer_loss(lambda e: e[0].mul_(2)), data, proj, **kw)
    if not (torch.equal(x, X) and torch.equal(y, Y)):  # fixed: the error says so
        assert "may have been changed" in str(refused.value), str(refused.value)


def test_refused_write_one_batch_and_loader_leave_caller_data():
    for proj in KINDS:
        x, y = X.clone(), Y.clone()
        dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
        for data in [(x, y), dl]:
            with pytest.raises(errors.LossFunctionError, match="in place"):
                build(writer_loss(lambda e: e[0].mul_(2)), data, proj)
            assert torch.equal(x, X) and torch.equal(y, Y)


def test_refused_write_leaves_caller_generator_batches_unchanged():
    data = batches()
    before = [tuple(t.clone() for t in b) for b in data]
    with pytest.raises(errors.LossFunctionError):
        build(writer_loss(lambda e: e[0].mul_(2)), (b for b in data))
    for a, b in zip(data, before, strict=True):
        for u, v in zip(a, b, strict=True):
            assert torch.equal(u, v)


# ---------------------------------------------------------------- 2. kronecker re-proof


class BatchMix(nn.Module):
    """Normalises over the batch dimension when the batch has more than `over` rows."""

    def __init__(self, over: int = 0):
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(5, 6)
        self.b = nn.Linear(6, 3)
        self.over = over

    def forward(self, x):
        h = self.a(x)
        if h.shape[0] > self.over:
            h = h - h.mean(0, keepdim=True)
        return self.b(torch.tanh(h))


def kron_ref(m, data_flat):
    """Each example alone (batches of one)."""
    loss = tif.loss_from_module(m, F.cross_entropy)
    ck = [tif.Checkpoint.from_module(m, lr=0.1)]
    x, y = data_flat
    one = [(x[i:i + 1], y[i:i + 1]) for i in range(len(x))]
    return rows(build(loss, one, tif.Projection(dim=4, kind="kronecker"), ckpts=ck,
                      batch_size=1))


def kron_build(m, data, **kw):
    loss = tif.loss_from_module(m, F.cross_entropy)
    ck = [tif.Checkpoint.from_module(m, lr=0.1)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return rows(build(loss, data, tif.Projection(dim=4, kind="kronecker"), ckpts=ck, **kw))


@pytest.mark.parametrize("over", [0, 1, 4])
def test_kron_singletons_then_large_batch(over):
    m = BatchMix(over)
    data = [(X[i:i + 1], Y[i:i + 1]) for i in range(3)] + [(X[3:12], Y[3:12])]
    got = kron_build(m, data, batch_size=None, options=tif.GradientOptions(chunk_size=64))
    torch.testing.assert_close(got, kron_ref(m, (X, Y)), atol=1e-5, rtol=1e-4)


def test_kron_identical_first_batch():
    m = BatchMix(0)
    x = torch.cat([X[:1].repeat(4, 1), X[4:]])
    y = torch.cat([Y[:1].repeat(4), Y[4:]])
    data = [(x[:4], y[:4]), (x[4:], y[4:])]
    got = kron_build(m, data, options=tif.GradientOptions(chunk_size=64))
    torch.testing.assert_close(got, kron_ref(m, (x, y)), atol=1e-5, rtol=1e-4)


def test_kron_identical_first_batch_warns():
    m = BatchMix(0)
    x = torch.cat([X[:1].repeat(4, 1), X[4:]])
    y = torch.cat([Y[:1].repeat(4), Y[4:]])
    loss = tif.loss_from_module(m, F.cross_entropy)
    with pytest.warns(UserWarning, match="kronecker"):
        build(loss, [(x[:4], y[:4]), (x[4:], y[4:])], tif.Projection(dim=4, kind="kronecker"),
              ckpts=[tif.Checkpoint.from_module(m, lr=0.1)],
              options=tif.GradientOptions(chunk_size=64))


@pytest.mark.parametrize("chunk", [2, 3])
def test_kron_chunk_smaller_than_batch(chunk):
    m = BatchMix(2)
    data = [(X[:1], Y[:1]), (X[1:12], Y[1:12])]
    got = kron_build(m, data, options=tif.GradientOptions(chunk_size=chunk))
    torch.testing.assert_close(got, kron_ref(m, (X, Y)), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("bs", [1, 2, 5])
def test_kron_batch_size(bs):
    m = BatchMix(1)
    data = [(X[:1], Y[:1]), (X[1:12], Y[1:12])]
    got = kron_build(m, data, batch_size=bs)
    torch.testing.assert_close(got, kron_ref(m, (X, Y)), atol=1e-5, rtol=1e-4)


def test_kron_second_build_larger_batches_same_model():
    m = BatchMix(3)
    kron_build(m, [(X[:2], Y[:2])], options=tif.GradientOptions(chunk_size=64))
    got = kron_build(m, [(X, Y)], options=tif.GradientOptions(chunk_size=64))
    torch.testing.assert_close(got, kron_ref(m, (X, Y)), atol=1e-5, rtol=1e-4)


def test_kron_two_checkpoints_mixing():
    m = BatchMix(2)
    m2 = BatchMix(2)
    with torch.no_grad():
        for p in m2.parameters():
            p.mul_(0.5)
    loss = tif.loss_from_module(m, F.cross_entropy)
    ck = [tif.Checkpoint.from_module(m, lr=0.1, name="a"),
          tif.Checkpoint.from_module(m2, lr=0.1, name="b")]
    data = [(X[:1], Y[:1]), (X[1:2], Y[1:2]), (X[2:], Y[2:])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = rows(build(loss, data, tif.Projection(dim=4, kind="kronecker"), ckpts=ck,
                         options=tif.GradientOptions(chunk_size=64)))
    one = [(X[i:i + 1], Y[i:i + 1]) for i in range(12)]
    ref = rows(build(loss, one, tif.Projection(dim=4, kind="kronecker"), ckpts=ck,
                     batch_size=1))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_kron_matches_bruteforce_identity():
    """Non-mixing model: kronecker-with-identity-like check via the identity kind."""
    m = BatchMix(100)  # never mixes at these sizes
    loss = tif.loss_from_module(m, F.cross_entropy)
    ck = [tif.Checkpoint.from_module(m, lr=0.1)]
    s = build(loss, [(X[:1], Y[:1]), (X[1:], Y[1:])], tif.Projection(kind="identity"), ckpts=ck)
    params = {k: v.detach() for k, v in m.named_parameters()}
    for i in (0, 5, 11):
        ps = {k: v.clone().requires_grad_() for k, v in params.items()}
        out = torch.func.functional_call(m, ps, (X[i:i + 1],))
        g = torch.autograd.grad(F.cross_entropy(out, Y[i:i + 1]), list(ps.values()))
        flat = torch.cat([t.reshape(-1) for t in g])
        row = s.read_rows(0, i, i + 1)[0]
        assert torch.allclose(torch.sort(row.abs()).values, torch.sort(flat.abs()).values,
                              atol=1e-5)


class TailMix(nn.Module):
    """Mixes only the examples at positions >= 4 of a batch (the first rows look fine)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(5, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        h = self.a(x)
        h = torch.cat([h[:4], h[4:] - h[4:].mean(0, keepdim=True)])
        return self.b(torch.tanh(h))


def test_finding_kron_proof_checks_first_rows_only():
    """Expected: rows equal each example's own gradient (proof on all examples of the call,
    as fit_curvature's). Observed: a model mixing only rows >= 4 of a batch of 12 passes
    the proof; rows 4-11 silently wrong (abs diff ~0.5), no BatchedPathWarning."""
    m = TailMix()
    got = kron_build(m, [(X, Y)], options=tif.GradientOptions(chunk_size=64))
    torch.testing.assert_close(got, kron_ref(m, (X, Y)), atol=1e-5, rtol=1e-4)


def test_kron_copies_first_then_small_distinct_batches():
    """First call: 8 copies of one example (1 distinct); later calls: 3 distinct examples."""
    m = BatchMix(0)
    x = torch.cat([X[:1].repeat(8, 1), X[1:10]])
    y = torch.cat([Y[:1].repeat(8), Y[1:10]])
    data = [(x[:8], y[:8])] + [(x[i:i + 3], y[i:i + 3]) for i in range(8, 17, 3)]
    got = kron_build(m, data, options=tif.GradientOptions(chunk_size=64))
    torch.testing.assert_close(got, kron_ref(m, (x, y)), atol=1e-5, rtol=1e-4)


class GatedMix(nn.Module):
    """Mixes examples by a term scaled by x[:, 0]: zero on a first batch whose x[:, 0] is 0."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(5, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        h = self.a(x)
        h = h + x[:, :1] * h.mean(0, keepdim=True)
        return self.b(torch.tanh(h))


@pytest.mark.xfail(strict=True, reason=(
    "open (documented limit, stop 48): the batched kronecker path is proved on a sample (the "
    "first call of each larger run of distinct examples, four rows of it); a model that mixes "
    "examples only for some inputs can pass it on a batch where it does not. Documented in "
    "docs/language-models.md (project such a model with kind='rademacher' or 'sjlt')."))
def test_finding_kron_data_dependent_mixing_after_same_size_proof():
    """Expected: rows equal each example's own gradient (or a documented limit of the proof).
    Observed: the first batch (x[:, 0] == 0) proves the batched path; a later batch of the
    same size that mixes is not proved again, rows silently differ."""
    m = GatedMix()
    x = X.clone()
    x[:4, 0] = 0.0
    data = [(x[i:i + 4], Y[i:i + 4]) for i in range(0, 12, 4)]
    got = kron_build(m, data, options=tif.GradientOptions(chunk_size=64))
    torch.testing.assert_close(got, kron_ref(m, (x, Y)), atol=1e-5, rtol=1e-4)


def test_inplace_relu_on_input_module_caller_data():
    """A model whose first layer is ReLU(inplace=True) writes into the batch: refused, or
    rows right and caller data unchanged; never the caller's data silently changed."""
    torch.manual_seed(5)
    m = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(5, 3)).eval()
    loss = tif.loss_from_module(m, F.cross_entropy)
    for proj in KINDS:
        data = batches()
        before = [tuple(t.clone() for t in b) for b in data]
        try:
            build(loss, data, proj, ckpts=[tif.Checkpoint.from_module(m, lr=0.1)])
        except errors.LossFunctionError as e:
            assert "in place" in str(e)
        for a, b in zip(data, before, strict=True):
            for u, v in zip(a, b, strict=True):
                assert torch.equal(u, v), proj.kind


def test_finding_docs_language_models_proof_scope():
    """Expected: docs/language-models.md describes the re-proof on larger runs of distinct
    examples and per checkpoint buffers. Observed: it says the first batch proves it, once
    per loss and parameter layout."""
    import pathlib

    page = (pathlib.Path(__file__).parents[2] / "docs" / "language-models.md").read_text()
    para = page[page.index("The first batch"):page.index("**Which loss form")]
    assert "distinct" in para or "larger" in para, para
    assert "buffer" in para, para


# ---------------------------------------------------------------- 3. per-checkpoint buffers


class Flagged(nn.Module):
    """A buffer `mix` switches on mixing over the batch; `order` swaps two layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)
        self.c = nn.Linear(5, 3)
        self.register_buffer("mix", torch.tensor(0.0))
        self.register_buffer("order", torch.tensor(0.0))

    def forward(self, x):
        first, second = (self.a, self.b) if bool(self.order > 0) else (self.b, self.a)
        h = second(torch.tanh(first(x)))
        if bool(self.mix > 0):
            h = h - h.mean(0, keepdim=True)
        return self.c(torch.tanh(h))


def flagged_ckpt(m, name, **bufs):
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    b = {k: v.clone() for k, v in m.named_buffers()}
    for k, v in bufs.items():
        b[k] = torch.tensor(float(v))
    return tif.Checkpoint(params, lr=0.1, name=name, buffers=b)


@pytest.mark.parametrize("proj", [tif.Projection(dim=4, kind="kronecker"),
                                  tif.Projection(dim=8, seed=0)], ids=["kron", "rad"])
@pytest.mark.parametrize("flags", [{"mix": 1}, {"order": 1}, {"mix": 1, "order": 1}])
def test_checkpoint_buffers_get_own_proof(proj, flags):
    m = Flagged()
    loss = tif.loss_from_module(m, F.cross_entropy)
    c0 = flagged_ckpt(m, "c0")
    c1 = flagged_ckpt(m, "c1", **flags)
    data = [(X[:6], Y[:6]), (X[6:], Y[6:])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        both = rows(build(loss, data, proj, ckpts=[c0, c1]))
        fresh = Flagged()
        alone = rows(build(tif.loss_from_module(fresh, F.cross_entropy), data, proj,
                           ckpts=[flagged_ckpt(m, "c1", **flags)]))
        one = [(X[i:i + 1], Y[i:i + 1]) for i in range(12)]
        ref = rows(build(tif.loss_from_module(Flagged(), F.cross_entropy), one, proj,
                         ckpts=[flagged_ckpt(m, "c1", **flags)], batch_size=1))
    torch.testing.assert_close(both[1], alone[0], atol=1e-5, rtol=1e-4)
    if proj.kind == "kronecker":
        torch.testing.assert_close(both[1], ref[0], atol=1e-5, rtol=1e-4)


class BoolFlagged(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.a = nn.Linear(5, 6)
        self.c = nn.Linear(6, 3)
        self.register_buffer("mix", torch.tensor(False))

    def forward(self, x):
        h = self.a(x)
        if bool(self.mix):
            h = h - h.mean(0, keepdim=True)
        return self.c(torch.tanh(h))


def test_bool_buffer_flag_third_checkpoint_chunked():
    m = BoolFlagged()
    loss = tif.loss_from_module(m, F.cross_entropy)
    proj = tif.Projection(dim=4, kind="kronecker")
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    cks = [tif.Checkpoint(params, lr=0.1, name=f"c{i}",
                          buffers={"mix": torch.tensor(i == 2)}) for i in range(3)]
    data = [(X[:1], Y[:1]), (X[1:], Y[1:])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = rows(build(loss, data, proj, ckpts=cks, options=tif.GradientOptions(chunk_size=3)))
        one = [(X[i:i + 1], Y[i:i + 1]) for i in range(12)]
        ref = rows(build(tif.loss_from_module(BoolFlagged(), F.cross_entropy), one, proj,
                         ckpts=cks, batch_size=1))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


class Skipper(nn.Module):
    """Buffer `skip` drops layer b (its gradient is then 0); `mix` mixes the batch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)
        self.c = nn.Linear(5, 3)
        self.register_buffer("skip", torch.tensor(1.0))
        self.register_buffer("mix", torch.tensor(1.0))

    def forward(self, x):
        h = self.a(x)
        if not bool(self.skip > 0):
            h = self.b(torch.tanh(h))
        if bool(self.mix > 0):
            h = h - h.mean(0, keepdim=True)
        return self.c(torch.tanh(h))


@pytest.mark.parametrize("flags", [({"skip": 1, "mix": 1}, {"skip": 0, "mix": 0}),
                                   ({"skip": 0, "mix": 1}, {"skip": 1, "mix": 0}),
                                   ({"skip": 1, "mix": 0}, {"skip": 0, "mix": 1})])
def test_reverse_and_skip_flags_per_checkpoint(flags):
    m = Skipper()
    loss = tif.loss_from_module(m, F.cross_entropy)
    proj = tif.Projection(dim=4, kind="kronecker")
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    cks = [tif.Checkpoint(params, lr=0.1, name=f"c{i}",
                          buffers={k: torch.tensor(float(v)) for k, v in f.items()})
           for i, f in enumerate(flags)]
    data = [(X[:6], Y[:6]), (X[6:], Y[6:])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = rows(build(loss, data, proj, ckpts=cks))
        for i, ck in enumerate(cks):
            alone = rows(build(tif.loss_from_module(Skipper(), F.cross_entropy), data, proj,
                               ckpts=[ck]))
            torch.testing.assert_close(got[i], alone[0], atol=1e-5, rtol=1e-4)
        one = [(X[i:i + 1], Y[i:i + 1]) for i in range(12)]
        ref = rows(build(tif.loss_from_module(Skipper(), F.cross_entropy), one, proj,
                         ckpts=cks, batch_size=1))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_consecutive_builds_same_model_do_not_interfere():
    m = Flagged()
    loss = tif.loss_from_module(m, F.cross_entropy)
    proj = tif.Projection(dim=4, kind="kronecker")
    data = [(X[:6], Y[:6]), (X[6:], Y[6:])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build(loss, data, proj, ckpts=[flagged_ckpt(m, "c0")])
        second = rows(build(loss, data, proj, ckpts=[flagged_ckpt(m, "c1", mix=1)]))
        fresh = Flagged()
        ref = rows(build(tif.loss_from_module(fresh, F.cross_entropy), data, proj,
                         ckpts=[flagged_ckpt(m, "c1", mix=1)]))
    torch.testing.assert_close(second, ref, atol=1e-5, rtol=1e-4)
    assert float(m.mix) == 0.0 and float(m.order) == 0.0


def test_same_buffer_values_different_objects():
    m = Flagged()
    loss = tif.loss_from_module(m, F.cross_entropy)
    proj = tif.Projection(dim=4, kind="kronecker")
    c0 = flagged_ckpt(m, "c0")
    c1 = flagged_ckpt(m, "c1")
    s = rows(build(loss, [(X, Y)], proj, ckpts=[c0, c1]))
    torch.testing.assert_close(s[0], s[1])


def test_buffer_changed_in_place_between_builds():
    m = Flagged()
    loss = tif.loss_from_module(m, F.cross_entropy)
    proj = tif.Projection(dim=4, kind="kronecker")
    c = flagged_ckpt(m, "c0")
    data = [(X[:1], Y[:1]), (X[1:], Y[1:])]
    build(loss, data, proj, ckpts=[c])
    c.buffers["mix"].fill_(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = rows(build(loss, data, proj, ckpts=[c]))
        one = [(X[i:i + 1], Y[i:i + 1]) for i in range(12)]
        ref = rows(build(tif.loss_from_module(Flagged(), F.cross_entropy), one, proj,
                         ckpts=[c], batch_size=1))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_batchnorm_eval_per_checkpoint_running_stats():
    torch.manual_seed(4)
    m = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).eval()
    loss = tif.loss_from_module(m, F.cross_entropy)
    proj = tif.Projection(dim=4, kind="kronecker")
    c0 = tif.Checkpoint.from_module(m, lr=0.1, name="c0")
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    bufs = {k: v.clone() for k, v in m.named_buffers()}
    bufs["1.running_mean"] = torch.randn(6)
    bufs["1.running_var"] = torch.rand(6) + 0.5
    c1 = tif.Checkpoint(params, lr=0.1, name="c1", buffers=bufs)
    both = rows(build(loss, [(X, Y)], proj, ckpts=[c0, c1]))
    torch.manual_seed(4)
    m2 = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).eval()
    alone = rows(build(tif.loss_from_module(m2, F.cross_entropy), [(X, Y)], proj, ckpts=[c1]))
    torch.testing.assert_close(both[1], alone[0], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(both[0], both[1])


# ---------------------------------------------------------------- 4. tuple of batches


def test_tuple_of_tuples_error_says_tuple_is_one_batch():
    data = tuple(batches())
    with pytest.raises(errors.InvalidArgumentError, match="(?i)tuple.*one batch|list"):
        build(LOSS, data)


def test_tuple_of_dicts_error_says_tuple_is_one_batch():
    data = ({"x": X[:6]}, {"x": X[6:]})

    def loss(params, ex):
        return LOSS(params, (ex["x"], Y[0]))

    with pytest.raises(errors.InvalidArgumentError, match="(?i)tuple"):
        build(loss, data)


def test_tuple_of_lists_error():
    data = ([X[:6], Y[:6]], [X[6:], Y[6:]])
    with pytest.raises(errors.InvalidArgumentError, match="(?i)list"):
        build(LOSS, data)


@pytest.mark.parametrize("data", [((X, Y),), ([X, Y],), ({"x": X, "y": Y},)],
                         ids=["tuple", "list", "dict"])
def test_finding_tuple_of_one_batch_lacks_hint(data):
    """Expected: InvalidArgumentError saying a tuple is read as one batch (use a list).
    Observed: a 1-element tuple of a batch gets a bare LossFunctionError without the hint."""
    with pytest.raises(errors.InvalidArgumentError, match="(?i)tuple.*ONE batch"):
        build(LOSS, data)


def test_tuple_of_batches_of_different_sizes():
    data = ((X[:4], Y[:4]), (X[4:], Y[4:]))
    with pytest.raises(errors.InvalidArgumentError, match="(?i)tuple|list"):
        build(LOSS, data)


def test_tuple_of_tensor_batches_mismatched_lengths():
    with pytest.raises(errors.InvalidArgumentError):
        build(LOSS, (X, Y[:6]))


def test_plain_tuple_batch_still_works():
    s = build(LOSS, (X, Y))
    assert s.n_train == 12


def test_list_of_batches_works_after_advice():
    s = build(LOSS, list(batches()))
    assert s.n_train == 12
