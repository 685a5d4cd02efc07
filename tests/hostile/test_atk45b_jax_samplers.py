"""atk45b: JAX sized builds, DataLoader samplers and the peak memory of in-memory builds.

Black-box attacks written from docs/jax.md, docs/concepts/memory.md ("In-memory builds of
known size") and docs/concepts/stores.md (shuffling DataLoaders are refused).
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.conftest import child_env
from tests.jax_helpers import paired_mlp, to_jax_batch
from tracinfunc.errors import InvalidArgumentError, LossFunctionError

ROOT = pathlib.Path(__file__).resolve().parents[2]
P = tif.Projection(dim=16, seed=0)


@pytest.fixture(scope="module")
def pair():
    return paired_mlp(n_train=40)


def _rows(store):
    rows = torch.stack([store.read_rows(c, 0, store.n_train) for c in range(store.n_ckpt)])
    norms = torch.stack([store.read_norms(c, 0, store.n_train) for c in range(store.n_ckpt)])
    return rows, norms


def _jbuild(pair, data, **kw):
    _, _, jloss, jck, mapping, _, _ = pair
    return tj.build_store(jloss, jck, data, projection=P, mapping=mapping, **kw)


# --------------------------------------------------------------------------------------------
# 1. tracinfunc.jax.build_store with data of known size


def _mixed_lists(x, y):
    xj, yj = to_jax_batch((x, y))
    xn, yn = x.numpy(), y.numpy()
    return {
        "mixed frameworks": [(xj[:10], yj[:10]), (xn[10:13], yn[10:13]), (x[13:30], y[13:30]),
                             (xj[30:], yj[30:])],
        "mixed leaves": [(xj[:10], y[:10]), (x[10:25], yn[10:25]), (xn[25:], yj[25:])],
        "empty batch inside": [(x[:10], y[:10]), (x[10:10], y[10:10]), (x[10:], y[10:])],
        "batches of one": [(x[i:i + 1], y[i:i + 1]) for i in range(40)],
        "small then big": [(x[:3], y[:3]), (x[3:4], y[3:4]), (x[4:], y[4:])],
        "float64 numpy + int32": [(x[:20], y[:20].int()), (x[20:].double().numpy(), y[20:].numpy())],
    }


@pytest.mark.parametrize("case", ["mixed frameworks", "mixed leaves", "empty batch inside",
                                  "batches of one", "small then big", "float64 numpy + int32"])
def test_jax_list_of_batches_equals_the_same_batches_as_a_generator(pair, case):
    x, y = pair[5]
    batches = _mixed_lists(x, y)[case]
    gen = _jbuild(pair, iter(list(batches)))
    lst = _jbuild(pair, batches)
    assert lst.n_train == gen.n_train == 40
    (rg, ng), (rl, nl) = _rows(gen), _rows(lst)
    assert torch.equal(rg, rl) and torch.equal(ng, nl)


def test_jax_one_batch_equals_a_generator_of_it(pair):
    x, y = pair[5]
    for batch in [(x, y), to_jax_batch((x, y)), (x.numpy(), y.numpy())]:
        a, b = _rows(_jbuild(pair, batch)), _rows(_jbuild(pair, iter([batch])))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_jax_size_hint_is_not_trusted(pair):
    """A list whose iteration yields more / fewer batches than it holds."""
    x, y = pair[5]
    ref_rows, ref_norms = _rows(_jbuild(pair, iter([(x[:20], y[:20]), (x[20:], y[20:])])))

    class More(list):
        def __iter__(self):
            yield from super().__iter__()
            yield (x[20:], y[20:])

    class Less(list):
        def __iter__(self):
            yield next(super().__iter__())

    more = _jbuild(pair, More([(x[:20], y[:20])]))
    assert more.n_train == 40 and torch.equal(_rows(more)[0], ref_rows)
    less = _jbuild(pair, Less([(x[:20], y[:20]), (x[20:], y[20:])]))
    assert less.n_train == 20 and torch.equal(_rows(less)[0], ref_rows[:, :20])
    assert torch.equal(_rows(less)[1], ref_norms[:, :20])


def test_jax_list_mutated_by_the_loss_during_the_build(pair):
    """The loss (traced during the first batch) pops the last batch of the list."""
    from tests.jax_helpers import flax_mlp_loss

    _, _, _, jck, mapping, (x, y), _ = pair
    data = [(x[:20], y[:20]), (x[20:], y[20:])]

    def popping_loss(params, example):
        if len(data) == 2:
            data.pop()
        return flax_mlp_loss(params, example)

    store = tj.build_store(popping_loss, jck, data, projection=P, mapping=mapping)
    ref = _rows(_jbuild(pair, iter([(x[:20], y[:20])])))
    assert store.n_train == 20
    assert torch.equal(_rows(store)[0], ref[0])


def test_jax_progress_total_is_the_number_of_examples(pair):
    x, y = pair[5]
    for data in [(x, y), [(x[:25], y[:25]), (x[25:], y[25:])]]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            _jbuild(pair, data, progress=True)
        assert "40/40" in err.getvalue(), err.getvalue()


def test_jax_leading_size_mismatch_in_a_later_batch_names_the_batch(pair):
    """torch and JAX both say only 'got shapes [[10, 6], [9]]': which of many batches?"""
    x, y = pair[5]
    data = [(x[:10], y[:10]), (x[10:20], y[10:20]), (x[20:30], y[20:29]), (x[30:], y[30:])]
    with pytest.raises(InvalidArgumentError) as info:
        _jbuild(pair, data)
    msg = str(info.value)
    assert "[10, 6]" in msg and "[9]" in msg
    assert "batch 2" in msg, msg


def test_jax_zero_d_leaf_is_refused_naming_the_batch(pair):
    x, y = pair[5]
    with pytest.raises(InvalidArgumentError) as info:
        _jbuild(pair, [(x[:10], y[:10]), (x[10:20], y[10])])
    assert "batch 1" in str(info.value), str(info.value)


def test_jax_loss_failing_on_a_later_batch_is_a_loss_function_error_naming_it(pair):
    """docs/jax.md: build_store raises LossFunctionError 'as tif.build_store', which names
    'batch 1 of data (rows 20-29)'. The JAX frontend lets jax's TypeError escape bare."""
    x, y = pair[5]
    data = [(x[:20], y[:20]), (x[20:30, :5], y[20:30])]
    with pytest.raises(LossFunctionError) as info:
        _jbuild(pair, data)
    assert "batch 1" in str(info.value) and "20" in str(info.value)


def test_jax_empty_data_is_refused(pair):
    x, y = pair[5]
    for data in [[], [(x[:0], y[:0])]]:
        with pytest.raises(tif.errors.EmptyDataError):
            _jbuild(pair, data)


# --------------------------------------------------------------------------------------------
# 2. DataLoaders whose order is not the dataset's


def _ds(pair):
    x, y = pair[5]
    return TensorDataset(x, y)


def _ref_torch(pair):
    loss, ckpts, *_ = pair
    x, y = pair[5]
    return _rows(tif.build_store(loss, ckpts, iter([(x[i:i + 8], y[i:i + 8])
                                                    for i in range(0, 40, 8)]), projection=P))[0]


SHUFFLING = {
    "shuffle=True": (lambda ds: DataLoader(ds, batch_size=8, shuffle=True), "RandomSampler"),
    "RandomSampler": (lambda ds: DataLoader(ds, batch_size=8, sampler=RandomSampler(ds)),
                      "RandomSampler"),
    "SubsetRandomSampler": (lambda ds: DataLoader(ds, batch_size=8,
                                                  sampler=SubsetRandomSampler(range(40))),
                            "SubsetRandomSampler"),
    "WeightedRandomSampler": (lambda ds: DataLoader(
        ds, batch_size=8, sampler=WeightedRandomSampler(torch.ones(40), 40)),
        "WeightedRandomSampler"),
    "DistributedSampler shuffle": (lambda ds: DataLoader(ds, batch_size=8, sampler=DistributedSampler(
        ds, num_replicas=1, rank=0, shuffle=True)), "DistributedSampler"),
    "DistributedSampler over 2 replicas": (lambda ds: DataLoader(ds, batch_size=8, sampler=DistributedSampler(
        ds, num_replicas=2, rank=0, shuffle=False)), "DistributedSampler"),
    "BatchSampler(RandomSampler)": (lambda ds: DataLoader(
        ds, batch_sampler=BatchSampler(RandomSampler(ds), 8, False)), "RandomSampler"),
    "BatchSampler(SubsetRandomSampler)": (lambda ds: DataLoader(
        ds, batch_sampler=BatchSampler(SubsetRandomSampler(range(40)), 8, False)),
        "SubsetRandomSampler"),
}


@pytest.mark.parametrize("case", list(SHUFFLING))
def test_torch_build_refuses_shuffling_loaders_naming_the_sampler(pair, case):
    loss, ckpts, *_ = pair
    make, name = SHUFFLING[case]
    with pytest.raises(InvalidArgumentError) as info:
        tif.build_store(loss, ckpts, make(_ds(pair)), projection=P)
    msg = str(info.value)
    assert name in msg and "shuffle=False" in msg, msg


@pytest.mark.parametrize("case", ["shuffle=True", "WeightedRandomSampler", "BatchSampler(RandomSampler)"])
def test_jax_build_refuses_shuffling_loaders_as_the_torch_build_does(pair, case):
    """docs/jax.md: tj.build_store is 'the JAX twin of tif.build_store: same metadata, same
    checks'. It takes a shuffled DataLoader and stores rows in a random order."""
    make, name = SHUFFLING[case]
    with pytest.raises(InvalidArgumentError) as info:
        _jbuild(pair, make(_ds(pair)))
    assert name in str(info.value)


@pytest.mark.parametrize("sampler", ["SequentialSampler", "range list", "BatchSampler(Sequential)",
                                     "plain", "DistributedSampler, one replica, no shuffle"])
def test_torch_build_accepts_ordered_loaders_in_dataset_order(pair, sampler):
    loss, ckpts, *_ = pair
    ds = _ds(pair)
    dl = {
        "SequentialSampler": lambda: DataLoader(ds, batch_size=8, sampler=SequentialSampler(ds)),
        "range list": lambda: DataLoader(ds, batch_size=8, sampler=list(range(40))),
        "BatchSampler(Sequential)": lambda: DataLoader(
            ds, batch_sampler=BatchSampler(SequentialSampler(ds), 8, False)),
        "plain": lambda: DataLoader(ds, batch_size=8),
        "DistributedSampler, one replica, no shuffle": lambda: DataLoader(
            ds, batch_size=8, sampler=DistributedSampler(ds, num_replicas=1, rank=0,
                                                         shuffle=False)),
    }[sampler]()
    store = tif.build_store(loss, ckpts, dl, projection=P)
    assert store.n_train == 40 and torch.equal(_rows(store)[0], _ref_torch(pair))


def test_a_permuted_index_list_sampler_gives_rows_in_its_order_as_documented(pair):
    """Found: sampler=list(reversed(range(40))) stored rows reversed without a word. Kept (an
    index list is the caller's explicit, reproducible order) and documented in stores.md:
    row i is the i-th example the loader yields."""
    loss, ckpts, *_ = pair
    ds = _ds(pair)
    dl = DataLoader(ds, batch_size=8, sampler=list(reversed(range(40))))
    store = tif.build_store(loss, ckpts, dl, projection=P)
    # [n_ckpt, n, k]: rows reversed (other calls than the reference's: float rounding)
    torch.testing.assert_close(_rows(store)[0], _ref_torch(pair).flip(1), rtol=1e-5, atol=1e-6)
    text = (ROOT / "docs" / "concepts" / "stores.md").read_text()
    assert "an index list (`sampler=[3, 1, 2]`)" in text
    assert "row `i` is then the `i`-th example the\n  loader yields" in text


def test_docs_say_custom_samplers_are_not_detected():
    """A Sampler subclass yielding a permutation cannot be detected (it is accepted and rows
    come out permuted); stores.md lists only what is refused, not what is not detected."""

    class Perm(Sampler):
        def __len__(self):
            return 40

        def __iter__(self):
            return iter(torch.randperm(40, generator=torch.Generator().manual_seed(0)).tolist())

    assert isinstance(Perm(), Sampler)
    text = (ROOT / "docs" / "concepts" / "stores.md").read_text()
    start = text.index("A shuffling `DataLoader` is refused")
    bullet = text[start:start + 800].split("\n- ")[0]
    assert "not detected" in bullet or "custom" in bullet.lower(), bullet


# --------------------------------------------------------------------------------------------
# 3. Peak memory of an in-memory build of known size: "its peak memory is the store's size"

_MEM_SCRIPT = textwrap.dedent("""
    import gc, sys
    import numpy as np, torch, torch.nn as nn, torch.nn.functional as F
    import tracinfunc as tif
    frontend, N = sys.argv[1], int(sys.argv[2])
    def hwm():
        for line in open('/proc/self/status'):
            if line.startswith('VmHWM'):
                return int(line.split()[1]) * 1024
    P = tif.Projection(dim=1024, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 32), dtype=np.float32)
    y = rng.integers(0, 10, N)
    if frontend == 'torch':
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10)).eval()
        loss = tif.loss_from_module(model, F.cross_entropy)
        p = {k: v.detach().clone() for k, v in model.named_parameters()}
        ck = [tif.Checkpoint(p, lr=0.1, name='a'),
              tif.Checkpoint({k: v + 0.01 for k, v in p.items()}, lr=0.1, name='b')]
        opt = tif.GradientOptions(chunk_size=500)
        data = lambda n: (torch.from_numpy(x[:n]), torch.from_numpy(y[:n]))
        build = lambda d: tif.build_store(loss, ck, d, projection=P, options=opt)
    else:
        import jax, jax.numpy as jnp
        import tracinfunc.jax as tj
        p = {'0': {'weight': jnp.asarray(rng.standard_normal((64, 32), dtype=np.float32) * .1),
                   'bias': jnp.zeros(64)},
             '2': {'weight': jnp.asarray(rng.standard_normal((10, 64), dtype=np.float32) * .1),
                   'bias': jnp.zeros(10)}}
        ck = [tj.Checkpoint(p, lr=0.1, name='a'),
              tj.Checkpoint(jax.tree_util.tree_map(lambda a: a + 0.01, p), lr=0.1, name='b')]
        mapping = tj.ParamMapping.identity(p)
        def loss(params, ex):
            xx, yy = ex
            h = jnp.tanh(params['0']['weight'] @ xx + params['0']['bias'])
            return -jax.nn.log_softmax(params['2']['weight'] @ h + params['2']['bias'])[yy]
        yj = y.astype(np.int32)
        data = lambda n: (jnp.asarray(x[:n]), jnp.asarray(yj[:n]))
        build = lambda d: tj.build_store(loss, ck, d, projection=P, mapping=mapping, chunk_size=500)
    w = build(data(1000)); del w; gc.collect()
    d = data(N)
    h0 = hwm()
    s = build(d)
    h1 = hwm()
    assert s.n_train == N
    print((h1 - h0) / (2 * N * 1024 * 4))
""")


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_one_batch_in_memory_build_peaks_near_the_store_size(frontend, tmp_path):
    """memory.md: an in-memory float store built from one batch 'writes every row straight
    into the store's final tensor ... its peak memory is the store's size' (the JAX frontend
    'does the same for one batch'). A list of 500-example batches peaks at ~1.0-1.1x; one
    batch of the same examples peaks at ~2.0x (JAX) / ~2.7x (torch)."""
    script = tmp_path / "mem.py"
    script.write_text(_MEM_SCRIPT)
    env = child_env()
    out = subprocess.run([sys.executable, str(script), frontend, "8000"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    ratio = float(out.stdout.strip().splitlines()[-1])
    # Found: 2.66x (torch) / 2.03x (JAX) where memory.md promised the store's size. torch's
    # build now fills the call's rows a checkpoint at a time and keeps a call that is the
    # whole store without a copy (2.0-2.3x); memory.md now says what one batch costs.
    assert ratio < 2.5, f"{frontend}: peak growth {ratio:.2f}x the store's size for one batch"
    text = (ROOT / "docs" / "concepts" / "memory.md").read_text()
    assert "peaks at about\ntwice the store" in text
