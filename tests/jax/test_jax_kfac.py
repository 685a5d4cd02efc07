"""K-FAC and EK-FAC fitted from a JAX loss equal the torch fit on the torch twin (issue 32,
item 3): layer inputs and output gradients captured where the loss calls its Flax layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.conftest import make_checkpoints, make_data
from tests.jax_helpers import to_jax_batch
from tracinfunc.curvature import classification_sampler

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

PROJECTION = tif.Projection(dim=24, seed=5)


def torch_twin():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 3)).eval()
    return tif.loss_from_module(model, F.cross_entropy), make_checkpoints(model)


def linen_twin(ckpts):
    """linen nn.Sequential: names layers_0/layers_2 map to torch's 0/2 by themselves."""
    model = nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(3)])
    mapping = tj.ParamMapping.flax(model.init(jax.random.key(0), jnp.zeros(6)))
    jax_ckpts = [tj.Checkpoint(mapping.from_torch(c.params), lr=c.lr, name=c.name)
                 for c in ckpts]

    def logits(params, x):
        return model.apply(params, x)

    def loss(params, example):
        x, y = example
        return -jax.nn.log_softmax(model.apply(params, x))[y]

    return loss, logits, jax_ckpts, mapping


def nnx_twin(ckpts):
    """nnx.Sequential: paths layers.<i> renamed to torch's <i>."""
    model = nnx.Sequential(nnx.Linear(6, 8, rngs=nnx.Rngs(0)), jnp.tanh,
                           nnx.Linear(8, 3, rngs=nnx.Rngs(1)))
    graphdef, _ = nnx.split(model, nnx.Param)
    mapping = tj.ParamMapping.flax(model, rename=lambda name: name.removeprefix("layers."))
    jax_ckpts = [tj.Checkpoint(mapping.from_torch(c.params), lr=c.lr, name=c.name)
                 for c in ckpts]

    def logits(params, x):
        return nnx.merge(graphdef, params)(x)

    def loss(params, example):
        x, y = example
        return -jax.nn.log_softmax(logits(params, x))[y]

    return loss, logits, jax_ckpts, mapping


@pytest.fixture(scope="module")
def twin():
    loss, ckpts = torch_twin()
    train = make_data(30, dtype=torch.float32, seed=1)
    test = make_data(5, dtype=torch.float32, seed=3)
    return loss, ckpts, train, test


@pytest.mark.parametrize(("frontend", "kind", "exact"), [
    (linen_twin, "kfac", True), (linen_twin, "ekfac", False),
    (nnx_twin, "kfac", False), (nnx_twin, "ekfac", True)],
    ids=["linen-kfac-exact", "linen-ekfac-sampled", "nnx-kfac-sampled", "nnx-ekfac-exact"])
def test_jax_kfac_equals_the_torch_fit_on_the_twin(twin, frontend, kind, exact):
    loss, ckpts, train, test = twin
    jax_loss, logits, jax_ckpts, mapping = frontend(ckpts)
    expected = tif.fit_curvature(loss, ckpts, [tuple(a[:17] for a in train),
                                              tuple(a[17:] for a in train)], kind=kind,
                                 sampler=classification_sampler(exact=exact, samples=2))
    jax_train = to_jax_batch(train)
    got = tj.fit_curvature(jax_loss, jax_ckpts, [tuple(a[:17] for a in jax_train),
                                                 tuple(a[17:] for a in jax_train)],
                           kind=kind, mapping=mapping,
                           sampler=tj.classification_sampler(logits, exact=exact, samples=2))
    assert got.kind == kind and got.layout == expected.layout
    assert got.layers == expected.layers
    assert [c.fingerprint for c in got.checkpoints] == [c.fingerprint
                                                          for c in expected.checkpoints]
    for c in range(len(ckpts)):
        assert got.estimates[c].keys() == expected.estimates[c].keys()
        for key, value in expected.estimates[c].items():
            if key.endswith((":QA", ":QS")):  # eigenvectors: up to sign, compare projectors
                value, mine = value @ value.T, got.estimates[c][key] @ got.estimates[c][key].T
            else:
                mine = got.estimates[c][key]
            np.testing.assert_allclose(mine.numpy(), value.numpy(), rtol=1e-5,
                                       atol=1e-6 * float(value.abs().max()), err_msg=key)
        assert got.damping[c] == pytest.approx(expected.damping[c], rel=1e-5)
    # JAX test gradients preconditioned by the JAX fit score as torch's with the torch fit.
    store = tif.build_store(loss, ckpts, train, projection=PROJECTION, progress=False)
    torch_test = tif.preconditioned_test_grads(loss, ckpts, test, expected,
                                               projection=PROJECTION)
    jax_test = tj.preconditioned_test_grads(jax_loss, jax_ckpts, to_jax_batch(test), got,
                                            projection=PROJECTION, mapping=mapping)
    want = tif.score(store, torch_test, curvature=expected).double()
    have = tif.score(store, jax_test, curvature=got).double()
    assert float((have - want).abs().max() / want.abs().max()) <= 5e-7


class Tagger(torch.nn.Module):
    """Embedding -> flatten -> linear, in torch; ``NnxTagger`` is its NNX twin."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = torch.nn.Embedding(10, 4)
        self.out = torch.nn.Linear(12, 3)

    def forward(self, ids):
        return self.out(self.emb(ids).flatten(1))


class NnxTagger(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(10, 4, rngs=rngs)
        self.out = nnx.Linear(12, 3, rngs=rngs)

    def __call__(self, ids):
        return self.out(self.emb(ids).reshape(-1))


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_jax_kfac_of_an_embedding_equals_torch(kind):
    model = Tagger().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = make_checkpoints(model)
    g = torch.Generator().manual_seed(4)
    data = (torch.randint(0, 10, (20, 3), generator=g), torch.randint(0, 3, (20,), generator=g))
    nnx_model = NnxTagger(nnx.Rngs(0))
    graphdef, _ = nnx.split(nnx_model, nnx.Param)
    mapping = tj.ParamMapping.flax(nnx_model)
    jax_ckpts = [tj.Checkpoint(mapping.from_torch(c.params), lr=c.lr, name=c.name)
                 for c in ckpts]

    def logits(params, ids):
        return nnx.merge(graphdef, params)(ids)

    def jax_loss(params, example):
        return -jax.nn.log_softmax(logits(params, example[0]))[example[1]]

    expected = tif.fit_curvature(loss, ckpts, data, kind=kind, seed=3,
                                 sampler=classification_sampler())
    got = tj.fit_curvature(jax_loss, jax_ckpts, to_jax_batch(data), kind=kind, seed=3,
                           mapping=mapping, sampler=tj.classification_sampler(logits))
    assert got.layers == expected.layers
    for c in range(len(ckpts)):
        for key, value in expected.estimates[c].items():
            mine = got.estimates[c][key]
            if key.endswith((":QA", ":QS")):
                value, mine = value @ value.T, mine @ mine.T
            np.testing.assert_allclose(mine.numpy(), value.numpy(), rtol=1e-5,
                                       atol=1e-6 * float(value.abs().max()), err_msg=key)


# ---- adversarial: what K-FAC from JAX must refuse, with the fix ----

def _nnx_fit(model, data, **kwargs):
    graphdef, _ = nnx.split(model, nnx.Param)
    ckpt = tj.Checkpoint.flax(model)

    def loss(params, example):
        return -jax.nn.log_softmax(nnx.merge(graphdef, params)(example[0]))[example[1]]

    def logits(params, x):
        return nnx.merge(graphdef, params)(x)

    kwargs.setdefault("mapping", tj.ParamMapping.flax(model))
    return tj.fit_curvature(loss, [ckpt], data, kind="kfac",
                            sampler=tj.classification_sampler(logits), **kwargs)


def _data(n=6, d=6):
    x = jax.random.normal(jax.random.key(0), (n, d))
    return x, jnp.arange(n) % 3


class WithNorm(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(6, 6, rngs=rngs)
        self.norm = nnx.LayerNorm(6, rngs=rngs)
        self.head = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.norm(self.fc(x)))


def test_a_layer_kfac_does_not_cover_is_refused_by_name():
    with pytest.raises(tif.errors.InvalidArgumentError, match=r"norm\.weight.*kind='projected'"):
        _nnx_fit(WithNorm(nnx.Rngs(0)), _data())


def test_an_unsupported_flax_layer_and_a_tied_layer_are_named():
    class Convy(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 2, (3,), rngs=rngs)
            self.head = nnx.Linear(12, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(self.conv(x[:, None]).reshape(-1))

    with pytest.raises(tif.errors.InvalidArgumentError, match=r"'conv\.weight' \(nnx\.Conv"):
        _nnx_fit(Convy(nnx.Rngs(0)), _data())

    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(6, 6, rngs=rngs)
            self.head = nnx.Linear(6, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(self.fc(self.fc(x)))

    with pytest.raises(tif.errors.InvalidArgumentError, match=r"tied weights.*fc\.weight"):
        _nnx_fit(Tied(nnx.Rngs(0)), _data())


def test_a_loss_without_flax_layers_is_refused():
    _, ckpts = torch_twin()
    from tests.jax_helpers import flax_mlp_loss, flax_template
    mapping = tj.ParamMapping.flax(flax_template())
    jax_ckpts = [tj.Checkpoint(mapping.from_torch(c.params)) for c in ckpts]
    with pytest.raises(tif.errors.InvalidArgumentError, match="not the kernel or bias"):
        tj.fit_curvature(flax_mlp_loss, jax_ckpts, _data(), kind="kfac", mapping=mapping,
                         sampler=tj.classification_sampler(
                             lambda v, x: jnp.zeros(3) + x.sum()))


def test_a_mapping_without_torch_layout_or_of_another_model_is_refused():
    model = WithNorm(nnx.Rngs(0))
    with pytest.raises(tif.errors.IncompatibleGradientsError, match=r"torch layout.*\[out, in\]"):
        # identity keeps the kernel [in, out]: the factors would not line up with torch's
        _nnx_fit(nnx.Sequential(nnx.Linear(6, 4, rngs=nnx.Rngs(0)),
                                nnx.Linear(4, 3, rngs=nnx.Rngs(0))), _data(),
                 mapping=tj.ParamMapping.identity(nnx.Sequential(
                     nnx.Linear(6, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 3, rngs=nnx.Rngs(0)))))
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="structure differs"):
        _nnx_fit(nnx.Sequential(nnx.Linear(6, 3, rngs=nnx.Rngs(0))), _data(),
                 mapping=tj.ParamMapping.flax(model))


def test_empty_data_is_refused():
    with pytest.raises(tif.errors.EmptyDataError, match="no examples"):
        _nnx_fit(nnx.Sequential(nnx.Linear(6, 3, rngs=nnx.Rngs(0))), [])


@pytest.mark.parametrize("kind", ["kfac", "ekfac", "projected", "dense"])
def test_a_nan_input_is_named_by_its_index(kind):
    model = nnx.Sequential(nnx.Linear(6, 3, rngs=nnx.Rngs(0)))
    x, y = _data(n=8)
    batches = [(x[:5], y[:5]), (x[5:].at[1, 2].set(jnp.nan), y[5:])]
    graphdef, _ = nnx.split(model, nnx.Param)

    def loss(params, example):
        return -jax.nn.log_softmax(nnx.merge(graphdef, params)(example[0]))[example[1]]

    with pytest.raises(tif.errors.NonFiniteGradientError, match=r"example\(s\) 6 .*checkpoint"):
        tj.fit_curvature(loss, [tj.Checkpoint.flax(model)], batches, kind=kind,
                         projection=PROJECTION, mapping=tj.ParamMapping.flax(model),
                         sampler=tj.classification_sampler(
                             lambda p, x: nnx.merge(graphdef, p)(x)))


def test_ekfac_from_a_generator_is_refused_not_a_key_error():
    model = nnx.Sequential(nnx.Linear(6, 3, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(model, nnx.Param)

    def loss(params, example):
        return -jax.nn.log_softmax(nnx.merge(graphdef, params)(example[0]))[example[1]]

    x, y = _data(n=8)
    with pytest.raises(tif.errors.InvalidArgumentError, match="generator"):
        tj.fit_curvature(loss, [tj.Checkpoint.flax(model)], ((x[i:i + 4], y[i:i + 4])
                                                             for i in (0, 4)),
                         kind="ekfac", mapping=tj.ParamMapping.flax(model),
                         sampler=tj.classification_sampler(
                             lambda p, x: nnx.merge(graphdef, p)(x)))


@pytest.mark.parametrize("kind", ["kfac", "ekfac", "dense"])
def test_jax_rank_damping_reads_the_mean_over_the_rank(twin, kind):
    """``Damping(over="rank")`` multiplies the mean eigenvalue over the estimate's rank, as
    the torch fit does; the JAX fit used the mean over the dimension (a smaller lambda)."""
    loss, ckpts, train, _ = twin
    jax_loss, logits, jax_ckpts, mapping = linen_twin(ckpts)
    damping = tif.curvature.Damping(over="rank")
    expected = tif.fit_curvature(loss, ckpts, train, kind=kind, damping=damping,
                                 sampler=classification_sampler(exact=True))
    got = tj.fit_curvature(jax_loss, jax_ckpts, to_jax_batch(train), kind=kind,
                           mapping=mapping, damping=damping,
                           sampler=tj.classification_sampler(logits, exact=True))
    ranked = [damping.value(mean, kind) for mean in got.mean_eigenvalues("rank")]
    assert got.ranks() == expected.ranks()
    assert got.ranks()[0] < got.dim  # rank-deficient: the two means differ
    assert got.damping == pytest.approx(ranked, rel=1e-12)
    assert got.damping == pytest.approx(expected.damping, rel=1e-5)
    assert got.info["damping"] == expected.info["damping"]
