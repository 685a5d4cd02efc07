"""The factorised kind='kronecker' path against explicit Kronecker matrices and the generic path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap

import tracinfunc as tif
from tests.conftest import make_checkpoints, make_convnet, make_data, make_mlp
from tests.lm_helpers import explicit_kronecker as explicit_kronecker_of
from tests.reference import loop_grads
from tracinfunc.grads.layer_rules import layer_rule

SPEC = tif.Projection(dim=12, seed=5, kind="kronecker")


def params_of(model):
    return {k: v.detach() for k, v in model.named_parameters()}


def conv_batch(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g))


def explicit_kronecker(loss, params, batch, spec):
    """``[n, k]``: autograd-loop gradients times ``P_out (x) P_in`` (vectors: NumPy blocks)."""
    return explicit_kronecker_of(loop_grads(loss, params, batch), spec)


class Tokens(nn.Module):
    """Linear layers on [T, d] inputs, one of them called twice, one without bias."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.mid = nn.Linear(6, 6, bias=False)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):  # x [1, T, 4]
        h = torch.tanh(self.inp(x))
        h = self.norm(torch.tanh(self.mid(torch.tanh(self.mid(h)))))
        return self.head(h.mean(dim=1))


@pytest.mark.parametrize("setup", ["mlp", "convnet", "tokens"])
def test_factorised_equals_explicit_kronecker_projection(setup):
    torch.manual_seed(0)
    if setup == "mlp":
        model, batch = make_mlp().eval(), make_data(7)
    elif setup == "convnet":
        model, batch = make_convnet().eval(), conv_batch()
    else:
        model = Tokens().double().eval()
        g = torch.Generator().manual_seed(0)
        batch = (torch.randn(5, 3, 4, generator=g, dtype=torch.float64),
                 torch.randint(0, 3, (5,), generator=g))
    params, loss = params_of(model), tif.loss_from_module(model, F.cross_entropy)
    n_weights = sum(1 for _, v in params.items() if v.ndim >= 2)
    assert len(factorizable_layers(model, params)) == n_weights  # every weight factorised
    got = tif.projected_grads(loss, SPEC)(params, batch)
    assert got.shape == (batch[0].shape[0], 12) and got.dtype == torch.float64
    torch.testing.assert_close(got, explicit_kronecker(loss, params, batch, SPEC),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 2, None])
def test_factorised_equals_generic_projector_in_float32(chunk_size):
    model = make_convnet(dtype=torch.float32).eval()
    params, loss = params_of(model), tif.loss_from_module(model, F.cross_entropy)
    x, y = conv_batch()
    batch = (x.float(), y)
    spec = tif.Projection(dim=64, seed=1, kind="kronecker")
    got = tif.projected_grads(loss, spec, options=tif.GradientOptions(chunk_size=chunk_size))(
        params, batch
    )
    project = tif.projection.make_projector(spec, tif.projection.canonical_layout(params))
    expected = vmap(project)(tif.per_sample_grads(loss)(params, batch))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(
        got,
        tif.projected_grads(loss, spec, options=tif.GradientOptions(chunk_size=chunk_size))(
            params, batch
        ),
    )


def test_build_store_with_kronecker_scores_like_the_generic_projection():
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = make_checkpoints(model)
    train, test = make_data(11, seed=1), make_data(4, seed=3)
    batches = [(train[0][:6], train[1][:6]), (train[0][6:], train[1][6:])]
    store = tif.build_store(loss, ckpts, batches, projection=SPEC, dtype=torch.float64)
    test_store = tif.build_store(loss, ckpts, test, projection=store.projection,
                                 dtype=torch.float64)
    expected = sum(
        c.lr * explicit_kronecker(loss, dict(c.params), test, SPEC)
        @ explicit_kronecker(loss, dict(c.params), train, SPEC).T for c in ckpts)
    torch.testing.assert_close(tif.score(store, test_store), expected, rtol=1e-9, atol=1e-12)


class TiedHead(nn.Module):
    """The output layer's weight is also read directly (like a tied embedding)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return self.out(h) + h @ self.out.weight.T * 0.5


def test_weights_used_outside_their_layer_fall_back_with_a_warning():
    torch.manual_seed(0)
    model = TiedHead().double().eval()
    params, loss = params_of(model), tif.loss_from_module(model, F.cross_entropy)
    batch = make_data(5)
    with pytest.warns(UserWarning, match=r"gradients of \['out.weight'\] are not their layers'"):
        got = tif.projected_grads(loss, SPEC)(params, batch)
    torch.testing.assert_close(got, explicit_kronecker(loss, params, batch, SPEC),
                               rtol=1e-10, atol=1e-12)


def test_only_plain_linear_and_conv2d_layers_are_factorised():
    model = nn.ModuleDict({
        "attn": nn.MultiheadAttention(4, 2),  # out_proj is a Linear subclass used via F.*
        "grouped": nn.Conv2d(2, 2, 3, groups=2),
        "same": nn.Conv2d(2, 2, 3, padding="same"),
        "conv": nn.Conv2d(2, 2, 3, padding=1),
        "fc": nn.Linear(3, 3),
        "frozen": nn.Linear(3, 3),
    })
    params = {k: v for k, v in model.named_parameters() if not k.startswith("frozen")}
    assert factorizable_layers(model, params) == ["conv.weight", "fc.weight"]


def test_a_plain_loss_calling_the_module_is_factorised():
    torch.manual_seed(0)
    model = make_mlp().double().eval()
    params, batch = params_of(model), make_data(5)

    def plain(params, example):  # a hand-written loss: functional_call, no ModuleLoss
        inputs, target = example
        logits = torch.func.functional_call(model, params, (inputs[None],))
        return F.cross_entropy(logits, target[None])

    weights = [n for n in params if n.endswith("weight")]
    assert tif.grads.factorized_weights(plain, params, (batch[0][0], batch[1][0])) == sorted(
        weights
    )
    got = tif.projected_grads(plain, SPEC)(params, batch)
    torch.testing.assert_close(got, explicit_kronecker(plain, params, batch, SPEC),
                               rtol=1e-10, atol=1e-12)


def test_a_loss_calling_no_module_falls_back_with_a_warning():
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 4, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}
    inputs = torch.randn(5, 4, dtype=torch.float64)
    target = torch.randint(0, 3, (5,))
    batch = (inputs, target)

    def functional(params, example):  # F.linear on params: no module, nothing to hook
        x, y = example
        return F.cross_entropy(F.linear(x, params["w"], params["b"])[None], y[None])

    with pytest.warns(UserWarning, match="factorised no layer"):
        got = tif.projected_grads(functional, SPEC)(params, batch)
    torch.testing.assert_close(got, explicit_kronecker(functional, params, batch, SPEC),
                               rtol=1e-10, atol=1e-12)
    with pytest.warns(UserWarning, match="factorised no layer"):  # select= takes it too
        again = tif.projected_grads(functional, SPEC, options=tif.GradientOptions(select=["w"]))(
            params, batch
        )
    only_w = explicit_kronecker(lambda p, ex: functional({**params, **p}, ex),
                                {"w": params["w"]}, batch, SPEC)
    torch.testing.assert_close(again, only_w, rtol=1e-10, atol=1e-12)


def test_loss_from_module_returns_a_module_loss():
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    assert isinstance(loss, tif.loss.ModuleLoss) and loss.module is model
    assert loss.criterion is F.cross_entropy and dict(loss.buffers) == {}
    with pytest.raises(TypeError):
        loss.buffers["x"] = torch.zeros(1)  # read-only


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_factorised_on_cuda_equals_cpu():
    model = make_convnet().eval()
    params, loss = params_of(model), tif.loss_from_module(model, F.cross_entropy)
    batch = conv_batch()
    on_cpu = tif.projected_grads(loss, SPEC)(params, batch)
    cuda_params = {k: v.cuda() for k, v in params.items()}
    cuda_loss = tif.loss_from_module(model.cuda(), F.cross_entropy)
    on_gpu = tif.projected_grads(cuda_loss, SPEC)(cuda_params, tuple(t.cuda() for t in batch))
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-10, atol=1e-12)


def test_kronecker_with_memory_options_takes_the_generic_path_to_the_same_rows(tmp_path):
    """Options the factorised path does not take (stages, select, ...) fall back to
    materialising the gradient and projecting it with the same Kronecker blocks."""
    model = make_mlp().eval()
    params, loss = params_of(model), tif.loss_from_module(model, F.cross_entropy)
    batch = make_data(9, seed=2)
    factorised = tif.projected_grads(loss, SPEC)(params, batch)
    stages = tif.model_stages(model, F.cross_entropy)
    staged = tif.projected_grads(
        loss, SPEC, options=tif.GradientOptions(stages=stages, chunk_size=4)
    )(params, batch)
    torch.testing.assert_close(staged, factorised, rtol=1e-10, atol=1e-12)
    everything = tif.projected_grads(loss, SPEC, options=tif.GradientOptions(select=["*"]))(
        params, batch
    )
    torch.testing.assert_close(everything, factorised, rtol=1e-10, atol=1e-12)
    store = tif.build_store(loss, make_checkpoints(model)[:1], batch, projection=SPEC,
                            dtype=torch.float64, store=str(tmp_path / "k.zarr"))
    reopened = tif.open_store(str(tmp_path / "k.zarr"))
    assert reopened.projection == SPEC and torch.equal(reopened.read_rows(0, 0, 9),
                                                       store.read_rows(0, 0, 9))


def factorizable_layers(module: nn.Module, params: dict) -> list[str]:
    """(A test helper.) Names of the weights in ``params`` applied by a factorisable layer
    of ``module``.

    A static look at the module tree (:func:`factorized_weights` runs the loss and is the
    authority): exactly ``nn.Linear``, HF ``Conv1D``, ``nn.Conv2d`` (``groups=1``, numeric
    zero padding) and ``nn.Embedding`` (no ``max_norm``), whose weight is in ``params``.
    """
    names = {id(value): name for name, value in module.named_parameters()}
    found = set()
    for _, sub in module.named_modules(remove_duplicate=False):
        name = names.get(id(getattr(sub, "weight", None)))
        if name in params and layer_rule(sub) is not None:
            found.add(name)
    return sorted(found)

