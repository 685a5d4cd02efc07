"""atk50: outside pass on scaled_dot_product_attention folded into the batch under vmap.

Attacked from the docs only (docs/language-models.md, "Attention kernels" and "Which loss
form is fastest"). Each reference is a float64 Python loop: ``torch.autograd.grad`` of the
loss on one example, then the explicit projector from ``make_projector``.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import _get_current_function_mode_stack

import tracinfunc as tif
from tracinfunc.projection import canonical_layout, make_projector

D, H, E, L = 8, 2, 4, 5
KRON = tif.Projection(dim=36, kind="kronecker")
F64_TOL = 1e-9
F32_TOL = 1e-4


# --------------------------------------------------------------------------- helpers


class Attn(nn.Module):
    """A hand-written attention block calling SDPA in one of many forms."""

    def __init__(self, variant: str, hkv: int = H) -> None:
        super().__init__()
        self.variant = variant
        self.hkv = hkv
        self.q = nn.Linear(D, H * E)
        self.k = nn.Linear(D, hkv * E)
        self.v = nn.Linear(D, hkv * E)
        self.o = nn.Linear(H * E, D)
        self.bias = nn.Parameter(torch.randn(H, L, L) * 0.5)
        self.mem = nn.Parameter(torch.randn(3, D))
        shared = torch.rand(L, L) > 0.3
        shared[:, 0] = True
        self.register_buffer("shared", shared)

    def forward(self, x, mask=None, mem=None):
        b, var = x.shape[0], self.variant
        src = x if mem is None else mem
        if var == "parammem":
            src = self.mem.expand(b, -1, -1)
        s = src.shape[1]
        q = self.q(x).view(b, L, H, E).transpose(1, 2)
        k = self.k(src).view(b, s, self.hkv, E).transpose(1, 2)
        v = self.v(src).view(b, s, self.hkv, E).transpose(1, 2)
        kw = {}
        if var == "causal":
            kw["is_causal"] = True
        if var == "scale":
            kw["scale"] = 0.3
        if var in ("bool2d", "float5d", "fullmask"):
            kw["attn_mask"] = mask
        if var == "shared":
            kw["attn_mask"] = self.shared
        if var == "sharedH":
            kw["attn_mask"] = torch.where(self.shared, 0.0, -1e4).to(x.dtype).expand(1, H, L, L)
        if var == "learnedbias":
            kw["attn_mask"] = self.bias
        if var == "gqa":
            kw["enable_gqa"] = True
        if var == "causalmask":
            kw["attn_mask"] = self.shared
            kw["is_causal"] = True
        if var == "noncontig":
            q = q.transpose(2, 3).contiguous().transpose(2, 3)
            k = k.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)
        if var == "3d":
            out = F.scaled_dot_product_attention(
                q.reshape(b * H, L, E), k.reshape(b * H, s, E), v.reshape(b * H, s, E))
            out = out.view(b, H, L, E)
        elif var == "5d":
            out = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
        else:
            out = F.scaled_dot_product_attention(q, k, v, **kw)
        return self.o(out.transpose(1, 2).reshape(b, L, H * E))


def make(variant="plain", dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return Attn(variant, 1 if variant == "gqa" else H).to(dtype).eval()


def data(variant, n, dtype=torch.float64, seed=1, per_example=None):
    g = torch.Generator().manual_seed(seed)
    shape = (n, L, D) if per_example is None else (n, per_example, L, D)
    batch = {"x": torch.randn(*shape, generator=g, dtype=dtype),
             "y": torch.randn(*shape, generator=g, dtype=dtype)}
    if variant in ("bool2d", "fullmask"):
        m = torch.rand(n, L, L, generator=g) > 0.4
        m[..., 0] = True
        if variant == "fullmask":
            m[:, 2, :] = False  # one query row attends to nothing
        batch["mask"] = m
    if variant == "float5d":
        batch["mask"] = torch.randn(n, 1, 1, L, L, generator=g, dtype=dtype)
    if variant == "cross":
        batch["mem"] = torch.randn(n, 7, D, generator=g, dtype=dtype)
    return batch


def make_loss(model, per_example=False):
    def loss(p, ex):
        x = ex["x"] if per_example else ex["x"][None]
        y = ex["y"] if per_example else ex["y"][None]
        kw = {}
        if "mask" in ex:
            kw["mask"] = ex["mask"]
        if "mem" in ex:
            kw["mem"] = ex["mem"][None]
        return ((functional_call(model, p, (x,), kw) - y) ** 2).mean()

    return loss


def params_of(model):
    return {k: v.detach() for k, v in model.named_parameters()}


def loop_grads(loss, params, batch, n):
    out = []
    for i in range(n):
        pp = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        ex = {k: v[i] for k, v in batch.items()}
        g = torch.autograd.grad(loss(pp, ex), list(pp.values()), allow_unused=True)
        out.append({k: torch.zeros_like(pp[k]) if gg is None else gg
                    for k, gg in zip(pp, g, strict=True)})
    return out


def loop_rows(loss, params, batch, proj, n):
    dtype = next(iter(params.values())).dtype
    project = make_projector(proj, canonical_layout(params), dtype=dtype)
    return torch.stack([project(g) for g in loop_grads(loss, params, batch, n)])


def relerr(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def quiet_rows(loss, params, batch, proj=KRON, options=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = tif.projected_grads(loss, proj, options=options)(params, batch)
    others = [str(w.message) for w in caught if type(w.category) is type
              and w.category.__name__ != "LossFormWarning"]
    return rows, others


def sdpa_ops(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        fn()
    return {(e.name, str(e.input_shapes[:1])) for e in prof.events()
            if "flash" in e.name or "attention_math" in e.name}


def flags():
    b = torch.backends.cuda
    return (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled())


# ---------------------------------------------------- exactness of the folded rows

VARIANTS = ["plain", "causal", "scale", "bool2d", "float5d", "shared", "sharedH", "learnedbias",
            "gqa", "noncontig", "3d", "5d", "cross", "parammem", "fullmask"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_kronecker_fold_rows_equal_float64_loop(variant):
    model = make(variant)
    params, loss = params_of(model), make_loss(model)
    fn = tif.projected_grads(loss, KRON)
    for seed, n in ((1, 6), (2, 6), (3, 1)):  # later calls are not proved again
        batch = data(variant, n, seed=seed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = fn(params, batch)
        assert relerr(rows, loop_rows(loss, params, batch, KRON, n)) < F64_TOL
        assert not [w for w in caught if "performance drop" in str(w.message)]


def test_kronecker_fold_example_with_its_own_batch_of_two():
    model = make("plain")
    params, loss = params_of(model), make_loss(model, per_example=True)
    batch = data("plain", 5, per_example=2)
    rows, _ = quiet_rows(loss, params, batch)
    assert relerr(rows, loop_rows(loss, params, batch, KRON, 5)) < F64_TOL


def test_kronecker_fold_unbatched_kv_broadcast_over_batch():
    class Bcast(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.o = nn.Linear(D, H * E), nn.Linear(H * E, D)
            self.kv = nn.Parameter(torch.randn(1, H, 3, E))
            self.mb = nn.Parameter(torch.randn(1, 1, 1, 3))

        def forward(self, x):
            b = x.shape[0]
            q = self.q(x).view(b, L, H, E).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, self.kv, self.kv,
                                                 attn_mask=self.mb.expand(1, 1, L, 3))
            return self.o(out.transpose(1, 2).reshape(b, L, H * E))

    torch.manual_seed(0)
    model = Bcast().double()
    params, loss = params_of(model), make_loss(model, per_example=True)
    batch = data("plain", 5, per_example=2)
    rows, _ = quiet_rows(loss, params, batch)
    assert relerr(rows, loop_rows(loss, params, batch, KRON, 5)) < F64_TOL


@pytest.mark.parametrize("chunk", [None, 2, 3])
@pytest.mark.parametrize("variant", ["bool2d", "gqa"])
def test_kronecker_fold_float32_chunk_size(variant, chunk):
    model = make(variant, dtype=torch.float32)
    params, loss = params_of(model), make_loss(model)
    batch = data(variant, 7, dtype=torch.float32)
    rows = tif.projected_grads(loss, KRON, options=tif.GradientOptions(chunk_size=chunk))(
        params, batch)
    assert relerr(rows, loop_rows(loss, params, batch, KRON, 7)) < F32_TOL


def test_mixed_precision_bf16_within_bf16_rounding():
    model = make("plain", dtype=torch.float32)
    params, loss = params_of(model), make_loss(model)
    batch = data("plain", 6, dtype=torch.float32)
    opts = tif.GradientOptions(mixed_precision=torch.bfloat16)
    rows = tif.projected_grads(loss, KRON, options=opts)(params, batch)

    def autocast_loss(p, ex):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss(p, ex)

    assert rows.dtype == torch.float32
    assert relerr(rows, loop_rows(autocast_loss, params, batch, KRON, 6)) < 3e-2


@pytest.mark.parametrize("variant", ["bool2d", "float5d", "gqa", "cross", "learnedbias"])
def test_per_sample_grads_math_path_equals_loop(variant):
    model = make(variant)
    params, loss = params_of(model), make_loss(model)
    batch = data(variant, 4)
    got = tif.per_sample_grads(loss)(params, batch)
    for i, ref in enumerate(loop_grads(loss, params, batch, 4)):
        flat_got = torch.cat([got[k][i].reshape(-1) for k in ref])
        assert relerr(flat_got, torch.cat([g.reshape(-1) for g in ref.values()])) < F64_TOL


# ----------------------------------------------------- which kernel, flags, modes


def test_fold_runs_fused_kernel_once_and_psg_runs_math():
    model = make("plain")
    params, loss = params_of(model), make_loss(model)
    batch = data("plain", 6)
    fn = tif.projected_grads(loss, KRON)
    fn(params, batch)  # the first call also proves the path
    ops = sdpa_ops(lambda: fn(params, batch))
    assert ("aten::_scaled_dot_product_flash_attention_for_cpu", "[[6, 2, 5, 4]]") in ops
    assert not any("math" in name for name, _ in ops)
    ops = sdpa_ops(lambda: tif.per_sample_grads(loss)(params, batch))
    assert ops and all("math" in name for name, _ in ops)


def test_user_sdpa_kernel_math_context_respected_and_not_changed():
    model = make("plain")
    params, loss = params_of(model), make_loss(model)
    batch = data("plain", 6)
    with sdpa_kernel([SDPBackend.MATH]):
        inside = flags()
        ops = sdpa_ops(lambda: tif.projected_grads(loss, KRON)(params, batch))
        assert flags() == inside
        rows = tif.projected_grads(loss, KRON)(params, batch)
    assert not any("flash" in name for name, _ in ops)
    assert relerr(rows, loop_rows(loss, params, batch, KRON, 6)) < F64_TOL


def test_user_global_flags_survive_calls_including_mha():
    model = make("plain")
    params, loss = params_of(model), make_loss(model)
    batch = data("plain", 6)
    before = flags()
    try:
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        tif.projected_grads(loss, KRON)(params, batch)
        tif.per_sample_grads(loss)(params, batch)
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True).double()
        layer.eval()
        lloss = make_loss(layer)
        tif.projected_grads(lloss, KRON)(params_of(layer), batch)
        assert flags() == (False, False, True)
    finally:
        torch.backends.cuda.enable_flash_sdp(before[0])
        torch.backends.cuda.enable_mem_efficient_sdp(before[1])


def test_multihead_attention_and_encoder_layer_rows():
    class MHA(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = nn.Linear(D, D), nn.Linear(D, D)
            self.mha = nn.MultiheadAttention(D, 2, batch_first=True)
            self.enc = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)

        def forward(self, x):
            h = self.inp(x)
            a, _ = self.mha(h, h, h, need_weights=False)
            return self.out(self.enc(a))

    torch.manual_seed(0)
    model = MHA().double().eval()
    params, loss = params_of(model), make_loss(model)
    batch = data("plain", 6)
    before = flags()
    rows, _ = quiet_rows(loss, params, batch)
    assert flags() == before
    assert relerr(rows, loop_rows(loss, params, batch, KRON, 6)) < F64_TOL


def test_exception_inside_loss_leaves_no_mode_and_next_call_is_right():
    model = make("plain")
    params, loss = params_of(model), make_loss(model)
    batch = data("plain", 6)
    calls = {"n": 0}

    def flaky(p, ex):
        out = loss(p, ex)
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("boom inside attention's forward")
        return out

    before = flags()
    with pytest.raises(Exception, match="boom"):
        tif.projected_grads(flaky, KRON)(params, batch)
    assert _get_current_function_mode_stack() == []
    assert flags() == before
    q = torch.randn(2, 2, 5, 4)
    ops = sdpa_ops(lambda: F.scaled_dot_product_attention(q, q, q))
    assert any("flash" in name for name, _ in ops)  # plain calls keep the fused kernel
    rows = tif.projected_grads(flaky, KRON)(params, batch)
    assert relerr(rows, loop_rows(loss, params, batch, KRON, 6)) < F64_TOL


def test_other_thread_sees_no_mode_and_no_flag_change_during_a_call():
    model = make("plain")
    params, base = params_of(model), make_loss(model)
    batch = data("plain", 6)
    seen, entered, done = {}, threading.Event(), threading.Event()

    def other():
        entered.wait(10)
        seen["stack"] = list(_get_current_function_mode_stack())
        seen["flags"] = flags()
        q = torch.randn(2, 2, 5, 4, dtype=torch.float64)
        with sdpa_kernel([SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(q, q, q)
        seen["err"] = (F.scaled_dot_product_attention(q, q, q) - ref).abs().max().item()
        done.set()

    def loss(p, ex):
        entered.set()
        done.wait(10)
        return base(p, ex)

    thread = threading.Thread(target=other)
    thread.start()
    rows = tif.projected_grads(loss, KRON)(params, batch)
    thread.join()
    assert seen["stack"] == [] and seen["flags"] == (True, True, True)
    assert seen["err"] < 1e-12
    assert relerr(rows, loop_rows(base, params, batch, KRON, 6)) < F64_TOL


def test_dropout_under_vmap_is_a_clear_error():
    class Drop(Attn):
        def forward(self, x, mask=None, mem=None):
            b = x.shape[0]
            q = self.q(x).view(b, L, H, E).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5 if self.training else 0.0)
            return self.o(out.transpose(1, 2).reshape(b, L, H * E))

    torch.manual_seed(0)
    model = Drop("plain").double().train()
    with pytest.raises(tif.errors.LossFunctionError, match=r"eval\(\)"):
        tif.projected_grads(make_loss(model), KRON)(params_of(model), data("plain", 4))


def test_is_causal_with_mask_is_a_clear_error_as_math_kernel():
    # Plain torch's fused CPU kernel accepts attn_mask with is_causal=True; its math kernel
    # refuses it. Under tracinfunc the math rule applies (the proof is per-example): an error
    # that names the problem, never other values.
    model = make("causalmask")
    with pytest.raises(RuntimeError, match="is_causal"):
        tif.projected_grads(make_loss(model), KRON)(params_of(model), data("plain", 4))


# ---------------------------------------------------- Hugging Face models


def _hf(kind):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=37, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg).double().eval()
    cfg = LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=16,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg).double().eval()


def _lm_batch(n=6, t=8):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 37, (n, t), generator=g)
    am = torch.ones(n, t, dtype=torch.long)
    am[1, :3] = 0  # left padding: fully masked query rows
    am[3, 5:] = 0  # right padding
    return {"input_ids": ids, "attention_mask": am, "labels": ids.masked_fill(am == 0, -100)}


def _mask4d_loss(model, t=8):
    def loss(p, ex):
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        m4 = (causal & ex["attention_mask"].bool()[None, :])[None, None]
        kw = {"input_ids": ex["input_ids"][None], "attention_mask": m4,
              "labels": ex["labels"][None]}
        return functional_call(model, p, (), kw).loss

    return loss


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_padded_4d_mask_rows_and_causal_lm_loss(kind):
    model = _hf(kind)
    assert model.config._attn_implementation == "sdpa"
    params, batch = params_of(model), _lm_batch()
    loss = _mask4d_loss(model)
    proj = tif.Projection(dim=64, kind="kronecker")
    rows, _ = quiet_rows(loss, params, batch, proj)
    ref = loop_rows(loss, params, batch, proj, 6)
    assert relerr(rows, ref) < F64_TOL
    clm = tif.projected_grads(tif.causal_lm_loss(model), proj)(params, batch)
    assert relerr(clm, ref) < 1e-5  # HF's .loss is computed in float32


def test_gpt2_build_store_score_and_token_scores_vs_loop():
    model = _hf("gpt2")
    params = params_of(model)
    g = torch.Generator().manual_seed(5)
    ids, tids = torch.randint(1, 37, (6, 8), generator=g), torch.randint(1, 37, (3, 8), generator=g)

    def hw(p, ex):
        kw = {"input_ids": ex["input_ids"][None], "labels": ex["input_ids"][None]}
        return functional_call(model, p, (), kw).loss

    proj = tif.Projection(dim=64, kind="kronecker")
    ckpts = [tif.Checkpoint.from_module(model, lr=0.5)]
    ref = 0.5 * (loop_rows(hw, params, {"input_ids": tids}, proj, 3)
                 @ loop_rows(hw, params, {"input_ids": ids}, proj, 6).T)
    train = [{"input_ids": ids[:4]}, {"input_ids": ids[4:]}]
    kw = {"projection": proj, "dtype": torch.float64, "progress": False}
    store = tif.build_store(hw, ckpts, train, **kw)
    test = tif.build_store(hw, ckpts, {"input_ids": tids}, **kw)
    assert relerr(tif.score(store, test, progress=False), ref) < F64_TOL
    clm = tif.causal_lm_loss(model)
    store = tif.build_store(clm, ckpts, train, **kw)
    test = tif.build_store(clm, ckpts, {"input_ids": tids}, **kw)
    scores = tif.score(store, test, progress=False)
    assert relerr(scores, ref) < 1e-5
    tok = tif.token_scores(store, test, clm, ckpts, {"input_ids": ids}, rows=list(range(6)))
    assert relerr(tok.values.sum(-1), scores) < F64_TOL


# ---------------------------------------------------- FINDINGS


def _gp_loss(model, loss):
    def gp(p, ex):
        x = ex["x"][None]
        gx = torch.func.grad(lambda xx: functional_call(model, p, (xx,)).pow(2).sum())(x)
        return loss(p, ex) + 0.1 * gx.pow(2).sum()

    return gp


def _jvp_loss(model, loss):
    def jl(p, ex):
        x = ex["x"][None]
        _, t = torch.func.jvp(lambda xx: functional_call(model, p, (xx,)), (x,),
                              (torch.ones_like(x),))
        return loss(p, ex) + 0.1 * t.pow(2).sum()

    return jl


@pytest.mark.parametrize("form", ["grad", "jvp"])
def test_loss_with_inner_transform_other_kinds_hold(form):
    model = make("plain")
    params, base = params_of(model), make_loss(model)
    loss = (_gp_loss if form == "grad" else _jvp_loss)(model, base)
    batch = data("plain", 4)
    proj = tif.Projection(dim=36)
    rows = tif.projected_grads(loss, proj)(params, batch)
    with sdpa_kernel([SDPBackend.MATH]):  # plain torch's fused kernel has no double/fwd AD
        ref = loop_rows(loss, params, batch, proj, 4)
    assert relerr(rows, ref) < F64_TOL


def test_FINDING_kronecker_loss_with_inner_grad():
    model = make("plain")
    params = params_of(model)
    loss = _gp_loss(model, make_loss(model))
    batch = data("plain", 4)
    rows = tif.projected_grads(loss, KRON)(params, batch)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = loop_rows(loss, params, batch, KRON, 4)
    assert relerr(rows, ref) < F64_TOL


def test_FINDING_kronecker_loss_with_inner_jvp():
    model = make("plain")
    params = params_of(model)
    loss = _jvp_loss(model, make_loss(model))
    batch = data("plain", 4)
    rows = tif.projected_grads(loss, KRON)(params, batch)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = loop_rows(loss, params, batch, KRON, 4)
    assert relerr(rows, ref) < F64_TOL


def _nested_vmap_loss(model):
    def loss(p, ex):
        scale = torch.tensor([1.0, 0.5], dtype=ex["x"].dtype).view(2, 1, 1)
        xs = ex["x"][None] * scale
        outs = torch.func.vmap(lambda xx: functional_call(model, p, (xx[None],))[0])(xs)
        return ((outs - ex["y"]) ** 2).mean()

    return loss


def test_nested_vmap_loss_other_kinds_hold():
    model = make("plain")
    params, loss = params_of(model), _nested_vmap_loss(model)
    batch = data("plain", 4)
    proj = tif.Projection(dim=36)
    rows = tif.projected_grads(loss, proj)(params, batch)
    assert relerr(rows, loop_rows(loss, params, batch, proj, 4)) < F64_TOL


def test_FINDING_kronecker_nested_vmap_in_user_loss():
    model = make("plain")
    params, loss = params_of(model), _nested_vmap_loss(model)
    batch = data("plain", 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = tif.projected_grads(loss, KRON)(params, batch)
    assert relerr(rows, loop_rows(loss, params, batch, KRON, 4)) < F64_TOL
    assert not [w for w in caught if "performance drop" in str(w.message)]


def test_FINDING_kronecker_user_autocast_in_loss():
    model = make("plain", dtype=torch.float32)
    params, base = params_of(model), make_loss(model)

    def loss(p, ex):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return base(p, ex)

    batch = data("plain", 6, dtype=torch.float32)
    rows = tif.projected_grads(loss, KRON)(params, batch)
    assert relerr(rows, loop_rows(loss, params, batch, KRON, 6)) < 3e-2


def _two_threads(fn, trials=12):
    """Run fn(i) in two threads at once, ``trials`` times; the results of every run."""
    runs = []
    for _ in range(trials):
        res, bar = {}, threading.Barrier(2)

        def work(i, res=res, bar=bar):
            bar.wait()
            try:
                res[i] = fn(i)
            except Exception as error:  # recorded, asserted on below
                res[i] = error
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        runs.append(res)
    return runs


def test_FINDING_two_threads_one_model_per_sample_grads():
    model = make("plain")
    params, loss = params_of(model), make_loss(model)
    batch = data("plain", 6)
    ref = tif.per_sample_grads(loss)(params, batch)
    for res in _two_threads(lambda i: tif.per_sample_grads(loss)(params, batch)):
        for got in res.values():
            assert isinstance(got, dict), got
            for k in ref:
                assert torch.allclose(got[k], ref[k], rtol=1e-12, atol=1e-14), k


def test_FINDING_two_threads_one_model_kronecker():
    model = make("plain")
    params = params_of(model)
    batch = data("plain", 6)
    ref = loop_rows(make_loss(model), params, batch, KRON, 6)

    def call(i):
        return tif.projected_grads(make_loss(model), KRON)(params, batch)

    for res in _two_threads(call, trials=6):
        for got in res.values():
            assert torch.is_tensor(got), repr(got)[:300]
            assert relerr(got, ref) < F64_TOL
