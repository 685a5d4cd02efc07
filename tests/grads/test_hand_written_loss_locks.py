"""Which modules a hand-written loss's batches lock (``tracinfunc.loss.modules_reached``), and
that two threads on one model with such a loss each get their own rows."""

from __future__ import annotations

import functools
import sys
import threading

import torch
from torch import nn
from torch.func import functional_call

import tracinfunc as tif
from tracinfunc.loss import modules_reached

GLOBAL_MODEL = nn.Linear(3, 2).double()


def _global_loss(params, example):
    return functional_call(GLOBAL_MODEL, params, (example[None],)).square().sum()


def _through_helper(params, example):
    return _helper(params, example)


def _helper(params, example):
    return _global_loss(params, example)


class _Holder:
    def __init__(self, model):
        self.model = model

    def loss(self, params, example):
        return functional_call(self.model, params, (example[None],)).square().sum()


class _Callable:
    def __init__(self, model):
        self.model = model

    def __call__(self, params, example):
        return functional_call(self.model, params, (example[None],)).square().sum()


def test_modules_named_directly_are_found_and_others_are_not():
    model = nn.Linear(3, 2)
    other = nn.Linear(2, 2)

    def closure(params, example):
        return functional_call(model, params, (example[None],)).sum() + other.weight.sum()

    assert [id(m) for m in modules_reached(closure)] == sorted([id(model), id(other)])
    assert modules_reached(_global_loss) == [GLOBAL_MODEL]
    assert modules_reached(_through_helper) == [GLOBAL_MODEL]  # a function of the same module
    assert modules_reached(functools.partial(_helper, {})) == [GLOBAL_MODEL]
    assert modules_reached(lambda p, e: closure(p, e)) == modules_reached(closure)
    holder = _Holder(model)
    assert modules_reached(holder.loss) == [model]  # a bound method's self.model
    assert modules_reached(functools.partial(holder.loss)) == [model]
    config = _Holder(_Holder(model))  # an attribute of an attribute: not found
    assert modules_reached(config.loss) == []
    assert modules_reached(_Callable(model)) == [model]  # a callable object's own attribute
    in_list = [model]
    assert modules_reached(lambda p, e: functional_call(in_list[0], p, (e,)).sum()) == []
    assert modules_reached(tif.loss_from_module(model, nn.functional.mse_loss)) == []


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):  # [b, T, 8], two heads
        b, t, _ = x.shape
        q, k, v = (layer(x).view(b, t, 2, 4).transpose(1, 2) for layer in (self.q, self.k,
                                                                           self.v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, 8))


def test_two_threads_with_one_model_and_a_hand_written_loss_get_their_own_rows():
    """The threads switch every microsecond (``sys.setswitchinterval``), so without the lock
    one thread's forward reads the other's swapped-in weights in nearly every trial."""
    torch.manual_seed(0)
    model = _Attention().double()

    def loss(params, example):
        return functional_call(model, params, (example[None],)).square().sum()

    params = {k: v.detach() for k, v in model.named_parameters()}
    shifted = {k: v + 0.5 for k, v in params.items()}
    batch = torch.randn(6, 5, 8, dtype=torch.float64)
    expected = [tif.per_sample_grads(loss)(p, batch) for p in (params, shifted)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        _race(loss, (params, shifted), batch, expected)
    finally:
        sys.setswitchinterval(interval)


def _race(loss, params, batch, expected):
    for _ in range(10):
        results, barrier = {}, threading.Barrier(2)

        def work(i, results=results, barrier=barrier):
            barrier.wait()
            results[i] = tif.per_sample_grads(loss)(params[i], batch)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
            assert not thread.is_alive()
        for i in range(2):
            for name, value in expected[i].items():
                torch.testing.assert_close(results[i][name], value, rtol=0, atol=0)
