"""atk42b: an outside (docs-only) pass over the atk42 fixes (CHANGELOG "Fixes from the atk42 pass").

Surfaces: (1) every submodule holds its own parameters and buffers after tracinfunc's forwards,
(2) wrong-shaped checkpoint tensors are refused naming the parameter and both shapes,
(3) ``kind="kronecker"`` with only vectors selected, (4) nn.LSTM/GRU/RNN under vmap.

Tests named ``test_finding_*`` fail on the code they were written against (2d0eb6a): each asserts
the behaviour a demanding user expects, not the bug. Tests named ``test_held_*`` passed there and
guard the fixes against regressions. Every reference is a float64 loop of torch.autograd.grad.
All 12 findings were fixed by the lead at stop 42 (one process-wide forward lock; entries a
forward registers removed; checkpoint buffers checked; dtypes named; Checkpoint.load casts as
load_state_dict does; model_stages over a Sequential applying a layer twice; the in-place and
recurrent messages split), so every test here passes now.
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracinfunc as tif
from tracinfunc.errors import LossFunctionError, TracInFuncError

X = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
Y = torch.tensor([0, 1, 2, 0, 1, 2])


def _registered(module: nn.Module) -> dict:
    """Every (submodule name, tensor name) -> the tensor object registered there (duplicates kept)."""
    out = {}
    for sub_name, sub in module.named_modules(remove_duplicate=False):
        for name, tensor in list(sub._parameters.items()) + list(sub._buffers.items()):
            out[(sub_name, name)] = tensor
    return out


def _same_objects(before: dict, after: dict) -> bool:
    return before.keys() == after.keys() and all(before[k] is after[k] for k in before)


def _loop_grads(model: nn.Module, params: dict, x, y, buffers: dict | None = None) -> list[dict]:
    """Float64 reference: one torch.autograd.grad per example at ``params``."""
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(params[name].double())
        for name, b in ref.named_buffers():
            if buffers is not None and name in buffers:
                b.copy_(buffers[name])
    named = dict(ref.named_parameters())
    rows = []
    for i in range(len(x)):
        loss = F.cross_entropy(ref(x[i : i + 1].double()), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(named.values()))
        rows.append(dict(zip(named, grads, strict=True)))
    return rows


def _assert_rows_equal(grads: dict, ref: list[dict], atol: float = 1e-6) -> None:
    for i, row in enumerate(ref):
        for name, g in row.items():
            torch.testing.assert_close(grads[name][i].double(), g, atol=atol, rtol=1e-5)


def _params(model: nn.Module, shift: float = 0.1) -> dict:
    return {n: p.detach().clone() + shift for n, p in model.named_parameters()}


class _TwoNames(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a
        self.h = nn.Linear(4, 3)

    def forward(self, x):
        return self.h(torch.tanh(self.b(torch.tanh(self.a(x)))))


# ---------------------------------------------------------------- findings (fail on 2d0eb6a)


def test_finding_lazy_module_is_refused_by_tracinfunc_with_the_way_out_or_works():
    """loss_from_module on a model with an uninitialised nn.LazyLinear fails with torch's bare
    "Can't access the shape of an uninitialized parameter" RuntimeError (no function named, no
    fix). Expected: the rows at the given (materialised twin's) parameters, or a tracinfunc error
    naming the lazy layer and the fix (run the model once on an example first)."""
    torch.manual_seed(1)
    lazy = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 3)).eval()
    twin = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).eval()
    params = _params(twin)
    try:
        grads = tif.grads.per_sample_grads(tif.loss_from_module(lazy, F.cross_entropy))(
            params, (X, Y)
        )
    except TracInFuncError as e:
        assert "lazy" in str(e).lower() or "uninitiali" in str(e).lower()
        return
    _assert_rows_equal(grads, _loop_grads(twin, params, X, Y))


def test_finding_a_buffer_registered_inside_forward_is_not_left_as_a_vmap_tensor():
    """A forward that registers a buffer (a cache of its last output) leaves the module holding
    an escaped functorch tensor after per_sample_grads: any later use of it raises torch's
    "tensor may have escaped from inside a function being vmapped". Expected (the fix's promise,
    "each submodule holds its own parameters and buffers again"): the module holds no tensor
    from inside tracinfunc's transforms afterwards. Debatable: plain functional_call leaks too."""

    class Caching(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 3)

        def forward(self, x):
            y = self.a(x)
            self.register_buffer("last", y.detach())
            return y

    model = Caching().eval()
    tif.grads.per_sample_grads(tif.loss_from_module(model, F.cross_entropy))(_params(model), (X, Y))
    for _name, buf in model.named_buffers():
        _ = buf + 0  # raises for an escaped GradTrackingTensor
    model(X)


def test_finding_model_stages_of_a_sequential_repeating_a_layer_gives_the_rows():
    """nn.Sequential(l, Tanh, l, Tanh, head): model_stages(model, ...) (documented: "for a
    Sequential, each child with parameters starts a stage") is refused with StageMismatchError
    advising about reshapes/residuals; the same stages given as names=[...] work. Expected: the
    rows (the repeated child is a child in Sequential.forward)."""
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.Tanh(), lin, nn.Tanh(), nn.Linear(4, 3)).eval()
    params = _params(model, 0.3)
    loss = tif.loss_from_module(model, F.cross_entropy)
    stages = tif.model_stages(model, F.cross_entropy)
    grads = tif.grads.per_sample_grads(loss, options=tif.GradientOptions(stages=stages))(
        params, (X, Y)
    )
    _assert_rows_equal(grads, _loop_grads(model, params, X, Y))


def test_finding_a_checkpoint_tensor_of_another_dtype_is_refused_naming_it():
    """One checkpoint tensor in float64 beside a float32 model: torch's bare "expected m1 and m2
    to have the same dtype" RuntimeError from per_sample_grads (no parameter named). Expected: a
    tracinfunc error naming the parameter and both dtypes, as for shapes."""
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).eval()
    params = _params(model)
    params["0.weight"] = params["0.weight"].double()
    with pytest.raises(TracInFuncError) as err:
        tif.grads.per_sample_grads(tif.loss_from_module(model, F.cross_entropy))(params, (X, Y))
    msg = str(err.value)
    assert "0.weight" in msg and "float64" in msg and "float32" in msg


def test_finding_an_integer_checkpoint_tensor_is_refused_naming_it():
    """An int32 checkpoint tensor: torch's bare "only Tensors of floating point dtype can require
    gradients". Expected: a tracinfunc error naming the parameter and its dtype."""
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).eval()
    params = _params(model)
    params["0.weight"] = params["0.weight"].round().int()
    with pytest.raises(TracInFuncError) as err:
        tif.grads.per_sample_grads(tif.loss_from_module(model, F.cross_entropy))(params, (X, Y))
    assert "0.weight" in str(err.value)


def test_finding_a_plain_shape_bug_is_not_blamed_on_vmap_or_lstm():
    """A forward with a genuine broadcast bug (y += ones(2, 3) on a [1, 3] output; fails without
    vmap too) is reported as "an in-place operation writes per-example values into a tensor
    without the batch dimension that vmap adds ... nn.LSTM, nn.GRU and nn.RNN do this". Expected:
    a LossFunctionError that does not send the user to vmap/LSTM advice for a bug of their own."""

    class Bug(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 3)

        def forward(self, x):
            y = self.a(x)
            y += torch.ones(2, 3)
            return y

    model = Bug().eval()
    with pytest.raises(RuntimeError):
        model(X[:1])  # the bug is there without tracinfunc
    with pytest.raises(LossFunctionError) as err:
        tif.grads.per_sample_grads(tif.loss_from_module(model, F.cross_entropy))(
            _params(model), (X, Y)
        )
    assert "LSTM" not in str(err.value)


def test_finding_a_preallocated_output_filled_in_place_gets_the_in_place_advice():
    """out = torch.zeros(1, 3); out[:] = layer(x): vmap's bare RuntimeError ("inplace arithmetic
    ... is not possible") comes through untranslated. Expected: the LossFunctionError the fix
    gives for in-place writes into a tensor without the batch dimension, with its way out."""

    class Prealloc(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 3)

        def forward(self, x):
            out = torch.zeros(1, 3)
            out[:] = self.a(x)
            return out

    model = Prealloc().eval()
    with pytest.raises(LossFunctionError) as err:
        tif.grads.per_sample_grads(tif.loss_from_module(model, F.cross_entropy))(
            _params(model), (X, Y)
        )
    assert "in-place" in str(err.value) or "in place" in str(err.value)


def test_finding_the_nn_rnn_advice_names_its_own_cell():
    """nn.RNN's error advises "their cells (nn.LSTMCell, nn.GRUCell)"; nn.RNN's cell is
    nn.RNNCell. Expected: the message names nn.RNNCell for nn.RNN."""

    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            self.r = nn.RNN(3, 4, batch_first=True)
            self.h = nn.Linear(4, 2)

        def forward(self, x):
            return self.h(self.r(x)[0][:, -1])

    model = Rec().eval()
    xs = torch.randn(4, 5, 3)
    with pytest.raises(LossFunctionError) as err:
        tif.grads.per_sample_grads(tif.loss_from_module(model, F.cross_entropy))(
            _params(model), (xs, torch.tensor([0, 1, 0, 1]))
        )
    assert "RNNCell" in str(err.value)


def test_finding_checkpoint_load_of_a_mixed_dtype_state_dict_is_cast_or_refused(tmp_path):
    """A state dict with one float64 tensor (float32 model): Checkpoint.load keeps it float64
    (model.load_state_dict would cast it), and build_store then fails with "self and mat2 must
    have the same dtype" wrapped in advice about parameter names and batch dimensions. Expected:
    the tensor cast to the model's dtype as load_state_dict does (then a store), or a refusal at
    load naming the parameter and both dtypes."""
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["0.weight"] = state["0.weight"].double()
    torch.save(state, tmp_path / "ckpt.pt")
    try:
        ckpt = tif.Checkpoint.load(tmp_path / "ckpt.pt", model)
    except TracInFuncError as e:
        assert "0.weight" in str(e) and "float64" in str(e)
        return
    assert ckpt.params["0.weight"].dtype == torch.float32
    store = tif.build_store(
        tif.loss_from_module(model, F.cross_entropy),
        [ckpt],
        (X, Y),
        projection=tif.Projection(dim=8),
        progress=False,
    )
    assert store.read_rows(0, 0, 6).shape == (6, 8)


def _bn_model():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3))
    model.train()
    model(torch.randn(20, 4, generator=torch.Generator().manual_seed(5)) * 3 + 1)
    return model.eval()


@pytest.mark.parametrize("shape", [(5,), (1, 4)])
def test_finding_a_wrong_shaped_checkpoint_buffer_is_refused_naming_it(shape):
    """Checkpoint(params, buffers={..., "1.running_mean": zeros(5)}) on an eval-mode model:
    build_store says TrainModeError "Put the model in eval mode" (it is); with [1, 4] a bare
    "TensorAccessor expected 1 dims" with advice about parameter names. Expected: as for
    parameters, a refusal naming the buffer and both shapes."""
    model = _bn_model()
    params = _params(model)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    buffers["1.running_mean"] = torch.zeros(shape)
    with pytest.raises(TracInFuncError) as err:
        tif.build_store(
            tif.loss_from_module(model, F.cross_entropy),
            [tif.Checkpoint(params, buffers=buffers)],
            (X, Y),
            projection=tif.Projection(dim=8),
            progress=False,
        )
    msg = str(err.value)
    assert not isinstance(err.value, tif.errors.TrainModeError)
    assert "1.running_mean" in msg and "[4]" in msg


def test_finding_a_checkpoint_missing_one_buffer_is_not_mixed_with_the_modules():
    """Checkpoint buffers without "1.running_var" (the others given): build_store runs, silently
    using the module's current running_var beside the checkpoint's running_mean (missing
    parameters are refused by name). Expected: a refusal naming the missing buffer."""
    model = _bn_model()
    buffers = {n: b.clone() for n, b in model.named_buffers() if n != "1.running_var"}
    with pytest.raises(TracInFuncError) as err:
        tif.build_store(
            tif.loss_from_module(model, F.cross_entropy),
            [tif.Checkpoint(_params(model), buffers=buffers)],
            (X, Y),
            projection=tif.Projection(dim=8),
            progress=False,
        )
    assert "1.running_var" in str(err.value)


def test_finding_nested_calls_on_two_modules_in_two_threads_do_not_hang():
    """FIXED (lead: per-module locks that refuse the wait closing a cycle). Thread A's forward of m1 (holding m1's lock) evaluates a loss of m2 while thread B's
    forward of m2 (holding m2's lock) evaluates a loss of m1 (events order them): both hang for
    ever (the per-module locks are taken in opposite orders). Expected: both finish, or a
    tracinfunc error naming the cycle; at least the docs' "Threads and one module" should say
    so. The stuck threads are daemons on test-local modules."""

    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 3)
            self.inner = {}

        def forward(self, x):
            fn = self.inner.pop(threading.current_thread(), None)
            if fn is not None:
                fn()
            return self.a(x)

    m1, m2 = Hooked().eval(), Hooked().eval()
    l1 = tif.loss_from_module(m1, F.cross_entropy)
    l2 = tif.loss_from_module(m2, F.cross_entropy)
    p1, p2 = _params(m1), _params(m2)
    in_a, in_b = threading.Event(), threading.Event()
    results = {}

    def inner_a():
        in_a.set()
        in_b.wait(2)  # a rendezvous when both can be inside (per-module locks), else a bound
        results["a_inner"] = l2(p2, (X[0], Y[0]))

    def inner_b():
        in_b.set()
        in_a.wait(2)
        results["b_inner"] = l1(p1, (X[0], Y[0]))

    def run(key, loss, params):
        try:
            results[key] = loss(params, (X[0], Y[0]))
        except Exception as e:  # recorded for the asserts
            results[key] = e

    thread_a = threading.Thread(target=run, args=("a", l1, p1), daemon=True)
    thread_b = threading.Thread(target=run, args=("b", l2, p2), daemon=True)
    m1.inner[thread_a] = inner_a
    m2.inner[thread_b] = inner_b
    thread_a.start()
    thread_b.start()
    thread_a.join(60)  # a bound on a hang, not a timing assumption: each call takes milliseconds
    thread_b.join(60)
    assert not thread_a.is_alive() and not thread_b.is_alive()
    # both threads finish: the one whose wait would close the cycle gets an error saying so
    # (it may not come to that when a thread was not yet inside its forward)
    errors = [value for value in results.values() if isinstance(value, Exception)]
    assert len(errors) <= 1, errors
    assert all("wait for ever" in str(error) for error in errors), errors
    for key in ("a", "b"):
        assert isinstance(results.get(key), torch.Tensor | LossFunctionError), results


# ---------------------------------------------------------------- held (regression guards)


@pytest.mark.parametrize(
    "kind", ["two_names", "two_parents", "parametrize", "weight_norm", "batchnorm"]
)
def test_held_each_submodule_holds_its_own_tensors_and_rows_are_exact(kind):
    class Inner(nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return torch.tanh(self.lin(x))

    class TwoParents(nn.Module):
        def __init__(self):
            super().__init__()
            lin = nn.Linear(4, 4)
            self.p1, self.p2, self.h = Inner(lin), Inner(lin), nn.Linear(4, 3)

        def forward(self, x):
            return self.h(self.p2(self.p1(x)))

    if kind == "two_names":
        model = _TwoNames()
    elif kind == "two_parents":
        model = TwoParents()
    elif kind == "parametrize":
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
        torch.nn.utils.parametrizations.orthogonal(model[0])
    elif kind == "weight_norm":
        model = nn.Sequential(
            nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 3)
        )
    else:
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3))
        model(torch.randn(10, 4))
    model.eval()
    before = _registered(model)
    values = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = _params(model)
    grads = tif.grads.per_sample_grads(tif.loss_from_module(model, F.cross_entropy))(params, (X, Y))
    assert _same_objects(before, _registered(model))
    assert all(torch.equal(values[k], v) for k, v in model.state_dict().items())
    _assert_rows_equal(grads, _loop_grads(model, params, X, Y))


def test_held_old_style_weight_norm_rows_and_module_output():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.Sequential(
            nn.utils.weight_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 3)
        ).eval()
    out0 = model(X).detach().clone()
    params = _params(model, 0.5)
    grads = tif.grads.per_sample_grads(tif.loss_from_module(model, F.cross_entropy))(params, (X, Y))
    torch.testing.assert_close(model(X).detach(), out0)
    assert set(grads) == {"0.bias", "0.weight_g", "0.weight_v", "2.bias", "2.weight"}


def test_held_an_exception_mid_forward_restores_the_module_and_releases_its_lock():
    """Thread A raises inside the forward while thread B waits for the module; B then gets its
    own exact rows, and the module holds its own tensors (events order the threads)."""
    entered, release = threading.Event(), threading.Event()

    class Gate(_TwoNames):
        victim = None

        def forward(self, x):
            y = super().forward(x)
            if threading.current_thread() is self.victim:
                entered.set()
                release.wait(30)
                raise ValueError("boom in A")
            return y

    model = Gate().eval()
    before = _registered(model)
    loss = tif.loss_from_module(model, F.cross_entropy)
    p_a, p_b = _params(model, 1.0), _params(model, -1.0)
    results = {}

    def run(key, params):
        try:
            results[key] = tif.grads.per_sample_grads(loss)(params, (X, Y))
        except Exception as e:  # recorded for the asserts
            results[key] = e

    thread_a = threading.Thread(target=run, args=("a", p_a), daemon=True)
    model.victim = thread_a
    thread_a.start()
    assert entered.wait(30)
    thread_b = threading.Thread(target=run, args=("b", p_b), daemon=True)
    thread_b.start()
    release.set()
    thread_a.join(30)
    thread_b.join(60)
    assert not thread_a.is_alive() and not thread_b.is_alive()
    assert isinstance(results["a"], LossFunctionError)
    model.victim = None
    assert _same_objects(before, _registered(model))
    _assert_rows_equal(results["b"], _loop_grads(model, p_b, X, Y))


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_embd=16,
        n_layer=1,
        n_head=2,
        vocab_size=30,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval().double()


def test_held_gpt2_tied_head_restored_and_kronecker_ln_f_rows_equal_the_projection():
    model = _gpt2()
    before = _registered(model)
    ids = torch.randint(0, 30, (3, 8), generator=torch.Generator().manual_seed(2))
    params = {n: p.detach().clone() + 0.01 for n, p in model.named_parameters()}
    loss = tif.causal_lm_loss(model)
    proj = tif.Projection(dim=16, kind="kronecker", seed=3)
    for select in (
        tif.last_layers(1),
        ["transformer.h.0.attn.c_attn.bias", "transformer.ln_f.weight"],
    ):
        options = tif.GradientOptions(select=select)
        rows = tif.projected_grads(loss, proj, options=options)(params, {"input_ids": ids})
        grads = tif.grads.per_sample_grads(loss, options=options)(params, {"input_ids": ids})
        layout = tif.projection.canonical_layout({n: params[n] for n in grads})
        expected = torch.func.vmap(
            tif.projection.make_projector(proj, layout, dtype=torch.float64)
        )(grads)
        torch.testing.assert_close(rows, expected, atol=1e-12, rtol=1e-9)
    assert _same_objects(before, _registered(model))
    assert model.lm_head.weight is model.transformer.wte.weight


def test_held_a_transposed_checkpoint_weight_is_refused_naming_both_shapes_in_build_store():
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).eval()
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    params["0.weight"] = params["0.weight"].T.copy()
    with pytest.raises(LossFunctionError) as err:
        tif.build_store(
            tif.loss_from_module(model, F.cross_entropy),
            [tif.Checkpoint(params)],
            (X, Y),
            projection=tif.Projection(dim=8),
            progress=False,
        )
    msg = str(err.value)
    assert "0.weight" in msg and "[4, 5]" in msg and "[5, 4]" in msg


def test_held_an_lstm_cell_loop_gives_rows_equal_to_a_float64_loop():
    class CellLoop(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.LSTMCell(3, 4)
            self.h = nn.Linear(4, 2)

        def forward(self, x):
            h = x.new_zeros(x.shape[0], 4)
            c = x.new_zeros(x.shape[0], 4)
            for t in range(x.shape[1]):
                h, c = self.cell(x[:, t], (h, c))
            return self.h(h)

    model = CellLoop().eval()
    xs = torch.randn(4, 5, 3, generator=torch.Generator().manual_seed(3))
    ys = torch.tensor([0, 1, 1, 0])
    params = _params(model, 0.05)
    grads = tif.grads.per_sample_grads(tif.loss_from_module(model, F.cross_entropy))(
        params, (xs, ys)
    )
    _assert_rows_equal(grads, _loop_grads(model, params, xs, ys))


@pytest.mark.parametrize("kwargs", [{}, {"num_layers": 2}, {"bidirectional": True}])
def test_held_nn_lstm_itself_runs_under_vmap_with_exact_rows(kwargs):
    """Not a failure: the CHANGELOG says nn.LSTM fails under vmap "inside torch"; on torch 2.13
    it runs, and its rows equal a float64 loop (only nn.GRU and nn.RNN fail). Guards the rows."""

    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            self.r = nn.LSTM(3, 4, batch_first=True, **kwargs)
            self.h = nn.Linear(8 if kwargs.get("bidirectional") else 4, 2)

        def forward(self, x):
            return self.h(self.r(x)[0][:, -1])

    model = Rec().eval()
    xs = torch.randn(4, 5, 3, generator=torch.Generator().manual_seed(4))
    ys = torch.tensor([0, 1, 1, 0])
    params = _params(model, 0.05)
    grads = tif.grads.per_sample_grads(tif.loss_from_module(model, F.cross_entropy))(
        params, (xs, ys)
    )
    _assert_rows_equal(grads, _loop_grads(model, params, xs, ys))


def test_held_checkpoint_buffers_are_used_and_the_module_keeps_its_own():
    model = _bn_model()
    before = _registered(model)
    own_mean = model[1].running_mean.clone()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    buffers["1.running_mean"] = torch.arange(4.0)
    buffers["1.running_var"] = torch.arange(4.0) + 1
    params = _params(model)
    proj = tif.Projection(kind="identity")
    store = tif.build_store(
        tif.loss_from_module(model, F.cross_entropy),
        [tif.Checkpoint(params, buffers=buffers)],
        (X, Y),
        projection=proj,
        dtype=torch.float64,
        progress=False,
    )
    project = tif.projection.make_projector(
        proj, tif.projection.canonical_layout(params), dtype=torch.float64
    )
    expected = torch.stack([project(r) for r in _loop_grads(model, params, X, Y, buffers)])
    torch.testing.assert_close(store.read_rows(0, 0, 6), expected, atol=1e-6, rtol=1e-5)
    assert _same_objects(before, _registered(model))
    assert torch.equal(model[1].running_mean, own_mean)
