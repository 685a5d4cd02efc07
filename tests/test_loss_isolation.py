"""tracinfunc's forwards run on a private copy of the user's module (``loss.isolated_call``).

``torch.func.functional_call`` swaps a checkpoint's tensors into the module it is given. On the
user's own module, another thread's ``model(x)`` meanwhile ran with the checkpoint's weights
(atk40, 62 of 93 calls). tracinfunc now swaps them into a structural copy (new modules and
attribute containers, the same tensors), so the module itself keeps its own tensors throughout.
These tests check that without threads: a hook inside the forward looks at the user's module.
References are float64 loops of ``torch.autograd.grad`` (tests/reference.py).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracinfunc as tif
from tests.reference import loop_grads
from tracinfunc.loss import isolated_call, original_module

N = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 5)
        self.fc2 = nn.Linear(5, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _data(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 3, generator=g, dtype=dtype), torch.randint(0, 2, (N,), generator=g)


def _checkpoint(model, scale=1.5):
    """Parameters other than the module's own (so a mix-up shows)."""
    return {k: v.detach() * scale + 0.1 for k, v in model.named_parameters()}


def _assert_rows(rows, ref):
    for name, value in ref.items():
        torch.testing.assert_close(rows[name], value, rtol=1e-10, atol=1e-12)


def test_the_users_module_keeps_its_own_tensors_during_a_forward():
    """Inside tracinfunc's forward, the user's modules hold their own parameters (another
    thread calling them meanwhile computes with them), and the rows are the checkpoint's."""
    model = Net().double().eval()
    own = {k: v for k, v in model.named_parameters()}
    seen = []

    def look(module, inputs, output):  # a user's hook: runs on tracinfunc's copy
        seen.append((module is not model.fc1, original_module(module) is model.fc1,
                     model.fc1.weight is own["fc1.weight"], model.fc2.bias is own["fc2.bias"]))

    model.fc1.register_forward_hook(look)
    loss = tif.loss_from_module(model, F.cross_entropy)
    params = _checkpoint(model)
    rows = tif.per_sample_grads(loss)(params, _data())
    assert seen and all(all(flags) for flags in seen), seen
    _assert_rows(rows, loop_grads(loss, params, _data()))
    assert all(model.get_parameter(k) is v for k, v in own.items())


class Routed(Net):
    """A forward that reaches ``fc2`` through a plain list (not the submodule tree), which a
    structural copy cannot redirect."""

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "route", [self.fc2])

    def forward(self, x):
        return self.route[0](torch.tanh(self.fc1(x)))


class Closure(Net):
    """A forward that reaches ``fc2`` through a closure made at construction."""

    def __init__(self):
        super().__init__()
        head = self.fc2
        object.__setattr__(self, "head", lambda h: head(h))

    def forward(self, x):
        return self.head(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("kind", [Routed, Closure])
def test_a_forward_that_leaves_the_copy_still_gets_the_checkpoints_tensors(kind):
    """Such a forward is detected when the original submodule is called, and from there the
    checkpoint's tensors are swapped into the module itself (as before the copy): the rows
    equal the loop's, and the module has its own tensors afterwards."""
    model = kind().double().eval()
    own = {k: v for k, v in model.named_parameters()}
    loss = tif.loss_from_module(model, F.cross_entropy)
    params = _checkpoint(model)
    _assert_rows(tif.per_sample_grads(loss)(params, _data()), loop_grads(loss, params, _data()))
    spec = tif.Projection(dim=8, kind="kronecker", seed=0)
    exact = tif.projected_grads(loss, tif.Projection(dim=None, kind="identity"))(params, _data())
    assert exact.shape == (N, sum(v.numel() for v in own.values()))
    projected = tif.projected_grads(loss, spec)(params, _data())
    assert torch.isfinite(projected).all()
    assert all(model.get_parameter(k) is v for k, v in own.items())


def test_a_compiled_model_gets_the_checkpoints_tensors_without_a_hook_warning():
    """``torch.compile(model)``'s forward is bound to the original module: tracinfunc swaps
    into the module itself (no copy, no global hook, so no torch warning about one)."""
    model = Net().double().eval()
    compiled = torch.compile(model)
    loss = tif.loss_from_module(compiled, F.cross_entropy)
    params = _checkpoint(compiled)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = tif.per_sample_grads(loss)(params, _data())
    _assert_rows(rows, loop_grads(loss, params, _data()))


def test_the_reference_sees_the_checkpoint_in_the_routed_model():
    """Guard for the test above: the loop reference itself differentiates the checkpoint's
    fc2 (a reference that read the module's own fc2 would give fc2 rows of zero)."""
    model = Routed().double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ref = loop_grads(loss, _checkpoint(model), _data())
    assert ref["fc2.weight"].abs().sum() > 0


class Recurrent(nn.Module):
    """nn.LSTM caches its weights in an attribute (``_flat_weights``) that its forward
    refreshes when the parameters changed: the copy's refresh must not reach the original."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.rnn(x)[0][:, -1])


def test_an_lstm_keeps_its_own_flat_weights():
    model = Recurrent().double().eval()
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    params = _checkpoint(model)
    with torch.no_grad():
        expected = torch.func.functional_call(copy.deepcopy(model), params, (x,))
    flat = list(model.rnn._flat_weights)
    inside = []
    model.out.register_forward_hook(
        lambda *_: inside.append(all(a is b for a, b in zip(model.rnn._flat_weights, flat,
                                                             strict=True))))
    with torch.no_grad():
        out = isolated_call(model, params, (x,))
    assert inside == [True]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert all(a is b for a, b in zip(model.rnn._flat_weights, flat, strict=True))


def test_shared_submodules_stay_shared_and_tied_weights_tied():
    """One submodule registered twice is one module in the copy; a tied weight takes the
    checkpoint's value at both places (``functional_call``'s ``tie_weights``)."""
    model = Net().double().eval()
    model.again = model.fc1  # the same module under two names
    model.fc2.weight = nn.Parameter(torch.randn(2, 5, dtype=torch.float64))
    seen = []
    model.fc1.register_forward_hook(lambda m, i, o: seen.append(m))

    class Twice(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner.fc2(torch.tanh(self.inner.again(x)))

    wrapper = Twice(model).eval()
    params = {k: v.detach() * 2 for k, v in wrapper.named_parameters()}
    x = torch.randn(2, 3, dtype=torch.float64)
    out = isolated_call(wrapper, params, (x,))
    torch.testing.assert_close(out, torch.func.functional_call(wrapper, params, (x,)))
    assert len(seen) == 2 and seen[0] is not model.fc1 and original_module(seen[0]) is model.fc1


def test_model_stages_and_the_sampler_run_on_the_copy():
    """The two other places that swap tensors (``model_stages``, the curvature samplers)."""
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double().eval()
    own = {k: v for k, v in model.named_parameters()}
    checks = []
    model[0].register_forward_hook(
        lambda *_: checks.append(all(model.get_parameter(k) is v for k, v in own.items())))
    params = _checkpoint(model)
    loss = tif.loss_from_module(model, F.cross_entropy)
    options = tif.GradientOptions(stages=tif.model_stages(model, F.cross_entropy))
    rows = tif.per_sample_grads(loss, options=options)(params, _data())
    _assert_rows(rows, loop_grads(loss, params, _data()))
    tif.fit_curvature(loss, [tif.Checkpoint(params=params)], [_data()], kind="kfac")
    assert checks and all(checks)
