"""Attention under ``vmap`` alone (``vmap(loss)`` then one backward): the fused kernel on the
folded batch, ``[B, N, H, L, E] -> [B * N, H, L, E]``.

References are loops over the examples calling ``scaled_dot_product_attention`` itself, in
float64, with gradients from ``torch.autograd.grad``. Under ``grad`` inside ``vmap`` (and for
calls the fold does not cover) the math kernel stays.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

import tracinfunc._attention as attention
from tracinfunc._attention import vmap_attention

B, N, H, L, S, E = 3, 2, 4, 5, 6, 8


def _randn(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def _masks():
    g = torch.Generator().manual_seed(1)
    return {
        "none": (None, None),
        "bool, unbatched [L, S]": (torch.rand(L, S, generator=g) > 0.3, None),
        "float, batched [B, 1, H, L, S]":
            (torch.randn(B, 1, H, L, S, dtype=torch.float64, generator=g), 0),
        "float, unbatched [N, 1, L, S]":
            (torch.randn(N, 1, L, S, dtype=torch.float64, generator=g), None),
        "bool, batched [B, L, S]": (torch.rand(B, L, S, generator=g) > 0.2, 0),
        "float, batched at dim 2 [N, H, B, L, S]":
            (torch.randn(N, H, B, L, S, dtype=torch.float64, generator=g), 2),
    }


@pytest.mark.parametrize("mask_name", list(_masks()))
@pytest.mark.parametrize("key_batched", [True, False])
def test_folded_attention_equals_the_loop_over_examples(mask_name, key_batched):
    torch.manual_seed(0)
    mask, mask_dim = _masks()[mask_name]
    q = _randn(B, N, H, L, E)
    k = _randn(N, H, B, S, E) if key_batched else _randn(N, H, S, E)
    v = _randn(N, H, S, E)

    def attend(q, k, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3)

    def example(i):
        m = mask if mask_dim is None else mask.select(mask_dim, i)
        return attend(q[i], k[:, :, i] if key_batched else k, m)

    reference = torch.stack([example(i) for i in range(B)])
    ref_grads = torch.autograd.grad(reference.square().sum(), [q, k, v])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no batching rule" fallback
        with vmap_attention():
            out = vmap(attend, in_dims=(0, 2 if key_batched else None, mask_dim))(q, k, mask)
    grads = torch.autograd.grad(out.square().sum(), [q, k, v])
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_causal_and_grouped_query_attention_fold():
    torch.manual_seed(1)
    q, k, v = _randn(B, N, H, L, E), _randn(B, N, 2, L, E), _randn(B, N, 2, L, E)

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    reference = torch.stack([attend(q[i], k[i], v[i]) for i in range(B)])
    with vmap_attention():
        out = vmap(attend)(q, k, v)
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    for got, want in zip(torch.autograd.grad(out.sum(), [q, k, v]),
                         torch.autograd.grad(reference.sum(), [q, k, v]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_nested_vmaps_fold_every_level():
    torch.manual_seed(2)
    q, k, v = _randn(2, B, N, H, L, E), _randn(B, N, H, L, E), _randn(N, H, L, E)

    def attend(q, k):
        return F.scaled_dot_product_attention(q, k, v)

    reference = torch.stack([torch.stack([attend(q[i, j], k[j]) for j in range(B)])
                             for i in range(2)])
    calls = []
    fused = attention._fused

    def counted(*args):
        calls.append(args[0].shape)
        return fused(*args)

    attention._fused = counted
    try:
        with vmap_attention():
            out = vmap(vmap(attend), in_dims=(0, None))(q, k)
    finally:
        attention._fused = fused
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    assert calls == [torch.Size([2 * B * N, H, L, E])]  # one kernel call, both levels folded
    torch.testing.assert_close(torch.autograd.grad(out.sum(), q)[0],
                               torch.autograd.grad(reference.sum(), q)[0])


def _kernel_calls(fn):
    """The shapes ``_fused`` (the folded route) was called with while ``fn`` ran."""
    calls = []
    fused = attention._fused

    def counted(*args):
        calls.append(tuple(args[0].shape))
        return fused(*args)

    attention._fused = counted
    try:
        fn()
    finally:
        attention._fused = fused
    return calls


def test_grad_inside_vmap_keeps_the_math_kernel_and_is_exact():
    torch.manual_seed(3)
    q, k, v = _randn(B, N, H, L, E), _randn(N, H, L, E), _randn(N, H, L, E)

    def loss(q):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()

    reference = torch.stack([torch.autograd.grad(loss(q[i]), q)[0][i] for i in range(B)])
    out = {}

    def run():
        with vmap_attention():
            out["grads"] = vmap(grad(loss))(q.detach())

    assert _kernel_calls(run) == []  # the transform above vmap would differentiate the rule
    torch.testing.assert_close(out["grads"], reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["dropout", "3-D inputs", "5-D inputs"])
def test_calls_the_fold_does_not_cover_take_the_math_kernel(case):
    torch.manual_seed(4)
    shape = {"3-D inputs": (B, H, L, E), "5-D inputs": (B, 2, N, H, L, E)}.get(
        case, (B, N, H, L, E))
    q = _randn(*shape)
    k, v = torch.randn_like(q[0]), torch.randn_like(q[0])
    p = 0.5 if case == "dropout" else 0.0

    def attend(q):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p)

    out = {}

    def run():
        with vmap_attention():
            out["rows"] = vmap(attend, randomness="same")(q)

    assert _kernel_calls(run) == []
    if case != "dropout":
        reference = torch.stack([attend(q[i]) for i in range(B)])
        torch.testing.assert_close(out["rows"], reference, rtol=1e-12, atol=1e-12)


def test_outside_vmap_nothing_changes():
    q, k, v = (torch.randn(N, H, L, E) for _ in range(3))
    out = {}

    def run():
        with vmap_attention():
            out["rows"] = F.scaled_dot_product_attention(q, k, v)

    assert _kernel_calls(run) == []
    torch.testing.assert_close(out["rows"], F.scaled_dot_product_attention(q, k, v))


def test_the_function_outside_vmap_differentiates_like_the_kernel():
    """``_FoldedAttention``'s own ``backward`` (reached only without a vmap to fold, e.g. if
    applied directly) recomputes the kernel's gradient."""
    torch.manual_seed(5)
    q, k, v = _randn(N, H, L, E), _randn(N, H, L, E), _randn(N, H, L, E)
    mask = torch.rand(L, L) > 0.3
    out = attention._FoldedAttention.apply(q, k, v, mask, False, None, False)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, reference)
    for got, want in zip(torch.autograd.grad(out.square().sum(), [q, k, v]),
                         torch.autograd.grad(reference.square().sum(), [q, k, v]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_autocast_casts_the_folded_call_as_it_casts_each_example():
    torch.manual_seed(6)
    q, k, v = (torch.randn(B, N, H, L, E) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = torch.stack([F.scaled_dot_product_attention(q[i], k[i], v[i])
                                 for i in range(B)])
        with vmap_attention():
            out = vmap(F.scaled_dot_product_attention)(q, k, v)
    assert out.dtype == reference.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference, rtol=0, atol=0)


def test_a_key_broadcast_over_the_queries_takes_the_math_kernel_and_is_exact():
    """``[1, H, S, E]`` keys against ``[N, H, L, E]`` queries broadcast in one call, but not
    once each is folded with the examples (``[B, ...]`` against ``[B * N, ...]``)."""
    torch.manual_seed(7)
    q, k, v = _randn(B, N, H, L, E), _randn(B, 1, H, S, E), _randn(B, 1, H, S, E)

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    reference = torch.stack([attend(q[i], k[i], v[i]) for i in range(B)])
    out = {}

    def run():
        with vmap_attention():
            out["rows"] = vmap(attend)(q, k, v)

    assert _kernel_calls(run) == []
    torch.testing.assert_close(out["rows"], reference, rtol=1e-12, atol=1e-12)
