"""Attention under tracinfunc's vmaps: the math kernel, chosen for the calling thread only.

A hand-written ``functional_call(model, params, ...).loss`` (the form the docs show) must not
send flash attention through functorch's per-example fallback, and choosing the math kernel
must not flip torch's process-global SDPA flags (another thread's attention would change
kernel meanwhile, and two overlapping uses could leave the fused kernels off for good).
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

import tracinfunc as tif
from tests.lm_helpers import explicit_kronecker, params_of, tiny_gpt2
from tests.reference import loop_grads
from tracinfunc._attention import vmap_attention

SPEC = tif.Projection(dim=16, seed=3, kind="kronecker")


def hand_written(model, seen: list | None = None):
    """The docs' functional loss on a tuple example ``(ids,)``; ``seen`` collects, at each
    call, whether another thread finds the fused kernels enabled."""

    def loss(params, example):
        if seen is not None:
            other = threading.Thread(
                target=lambda: seen.append(torch.backends.cuda.flash_sdp_enabled()))
            other.start()
            other.join()
        ids = example[0][None]
        return functional_call(model, params, (), {"input_ids": ids, "labels": ids}).loss

    return loss


def ids_batch(n: int = 3, length: int = 9):
    return (torch.randint(0, 97, (n, length), generator=torch.Generator().manual_seed(5)),)


def fallback_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught
            if "batching rule" in str(w.message) or "performance drop" in str(w.message)]


def test_functional_call_rows_equal_the_loop_without_the_per_example_fallback():
    model = tiny_gpt2()  # float64
    loss, params, batch = hand_written(model), params_of(model), ids_batch()
    reference = loop_grads(loss, params, batch)  # default kernel, one example at a time
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = tif.per_sample_grads(loss)(params, batch)
        rows = tif.projected_grads(loss, SPEC)(params, batch)
    assert not fallback_warnings(caught)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(rows, explicit_kronecker(reference, SPEC), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("make", [
    lambda loss: tif.per_sample_grads(loss),
    lambda loss: tif.projected_grads(loss, tif.Projection(dim=16, kind="sjlt")),
    lambda loss: tif.projected_grads(loss, SPEC),
], ids=["per_sample_grads", "sjlt", "kronecker"])
def test_other_threads_keep_the_fused_kernels_meanwhile(make):
    model, seen = tiny_gpt2(dtype=torch.float32), []
    loss, params = hand_written(model, seen), params_of(model)
    assert torch.backends.cuda.flash_sdp_enabled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make(loss)(params, ids_batch())
    assert seen and all(seen), "the global SDPA flags were flipped while tracinfunc computed"
    assert torch.backends.cuda.flash_sdp_enabled()
    assert not fallback_warnings(caught)


def test_a_module_loss_leaves_the_global_flags_alone():
    model, seen = tiny_gpt2(dtype=torch.float32), []
    hook = model.transformer.h[0].register_forward_pre_hook(  # runs inside the loss's forward
        lambda module, args: seen.append(torch.backends.cuda.flash_sdp_enabled()))
    try:
        example = {"input_ids": ids_batch()[0][0]}
        tif.causal_lm_loss(model)(params_of(model), example)
        tif.per_sample_grads(tif.causal_lm_loss(model))(params_of(model), {
            "input_ids": ids_batch()[0]})
    finally:
        hook.remove()
    assert seen and all(seen), "a ModuleLoss flipped the global SDPA flags while it ran"


MASKS = {
    "none": {},
    "causal": {"is_causal": True},
    "boolean mask": {"attn_mask": torch.rand(2, 1, 6, 6,
                                             generator=torch.Generator().manual_seed(1)) > 0.4},
    "float mask, scale": {"attn_mask": torch.randn(2, 1, 6, 6), "scale": 0.3},
}


@pytest.mark.parametrize("kwargs", MASKS.values(), ids=MASKS.keys())
@pytest.mark.parametrize("gqa", [False, True])
def test_math_attention_is_the_math_backend_bit_for_bit(kwargs, gqa):
    g = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 6, 8, generator=g)
    key, value = (torch.randn(2, 2 if gqa else 4, 6, 8, generator=g) for _ in range(2))
    kwargs = {**kwargs, **({"enable_gqa": True} if gqa else {})}
    if "attn_mask" in kwargs and kwargs["attn_mask"].dtype == torch.bool:
        kwargs["attn_mask"][..., 0] = True  # every query attends somewhere
    with sdpa_kernel([SDPBackend.MATH]):
        expected = F.scaled_dot_product_attention(query, key, value, **kwargs)
    with vmap_attention():
        got = F.scaled_dot_product_attention(query, key, value, **kwargs)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kwargs", MASKS.values(), ids=MASKS.keys())
def test_math_attention_under_vmap_with_per_example_masks(kwargs):
    g = torch.Generator().manual_seed(2)
    query, key, value = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.dtype == torch.bool:
        mask[..., 0] = True
    rest = {k: v for k, v in kwargs.items() if k != "attn_mask"}

    def attend(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, **rest)

    mapped = torch.func.vmap(attend, in_dims=(0, 0, 0, None if mask is None else 0))
    with sdpa_kernel([SDPBackend.MATH]):
        expected = mapped(query, key, value, mask)
    with warnings.catch_warnings(record=True) as caught, vmap_attention():
        warnings.simplefilter("always")
        got = mapped(query, key, value, mask)
    assert torch.equal(got, expected)
    assert not fallback_warnings(caught)


def test_a_torch_transformer_layer_batches_its_attention_and_equals_the_loop():
    """``nn.TransformerEncoderLayer`` reaches SDPA through ``F.multi_head_attention_forward``,
    a Python function the mode cannot look inside: that call takes the shared math kernel."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32,
                                             dropout=0.0, batch_first=True).double().eval()
    loss = tif.loss_from_module(layer, criterion=lambda out, y: ((out.sum(-1) - y) ** 2).mean())
    params = {name: p.detach() for name, p in layer.named_parameters()}
    g = torch.Generator().manual_seed(4)
    batch = (torch.randn(3, 5, 16, generator=g, dtype=torch.float64),
             torch.randn(3, 5, generator=g, dtype=torch.float64))
    reference = loop_grads(loss, params, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = tif.per_sample_grads(loss)(params, batch)
    assert not fallback_warnings(caught)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-9, atol=1e-11)
    assert torch.backends.cuda.flash_sdp_enabled()  # restored after the calls


def test_overlapping_multi_head_calls_in_two_threads_restore_the_flags():
    from tracinfunc._attention import _process_math_kernel

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    held = []

    def first():  # enters first, leaves first: the order that breaks plain sdpa_kernel
        with _process_math_kernel():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def second():
        a_in.wait(10)
        with _process_math_kernel():
            b_in.set()
            a_out.wait(10)
            held.append(not torch.backends.cuda.flash_sdp_enabled())  # still math here

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert held == [True]
    assert torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.math_sdp_enabled()


def test_a_causal_bias_subclass_keeps_its_own_meaning():
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator().manual_seed(3)
    query = torch.randn(2, 2, 4, 8, generator=g)
    key, value = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(2))
    bias = causal_lower_right(4, 6)  # a Tensor subclass that dispatches SDPA itself
    with sdpa_kernel([SDPBackend.MATH]):
        expected = F.scaled_dot_product_attention(query, key, value, attn_mask=bias)
    with vmap_attention():
        got = F.scaled_dot_product_attention(query, key, value, attn_mask=bias)
    assert torch.equal(got, expected)
    assert torch.backends.cuda.flash_sdp_enabled()
