"""One query path (issue 30): every query function prepares its test gradients exactly once,
through one function, shares one keyword set, and refuses wrong inputs with one error.

Exactness stays with the reference tests (tests/test_score.py, tests/search/,
tests/curvature/); here the results are compared with ``top_k``/``score`` themselves.
"""

from __future__ import annotations

import inspect
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.curvature import classification_sampler
from tracinfunc.query import prepared

PROJECTION = tif.Projection(dim=10, seed=4)
FIVE = ("score", "top_k", "self_influence", "score_chunks", "indexed_top_k")


@pytest.fixture(scope="module")
def setup():
    pytest.importorskip("faiss")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(60, 5, dtype=torch.float64, generator=g), torch.randint(0, 3, (60,))
    ckpts = [tif.Checkpoint.from_module(model, lr=0.3, name="a")]
    with torch.no_grad():
        model[0].weight.add_(0.5)
    ckpts.append(tif.Checkpoint.from_module(model, lr=0.2, name="b"))
    build = dict(projection=PROJECTION, dtype=torch.float64, progress=False)
    store = tif.build_store(loss, ckpts, (x[:50], y[:50]), **build)
    tests = tif.build_store(loss, ckpts, (x[50:], y[50:]), **build)
    curvature = tif.fit_curvature(loss, ckpts, (x[:50], y[:50]), kind="projected",
                                  projection=PROJECTION,
                                  sampler=classification_sampler(exact=True))
    index = tif.build_index(store, nlist=1, progress=False)
    return store, tests, curvature, index, (loss, ckpts, x, y)


def _rows(store) -> torch.Tensor:
    meta = store.meta
    return torch.stack([store.read_rows(c, 0, meta.n_train) for c in range(meta.n_ckpt)])


@pytest.fixture
def preparations(monkeypatch):
    """Counts calls of the one prepare function, wherever a query module imported it."""
    calls = []
    real = prepared.prepare_query

    def counting(*args, **kwargs):
        calls.append(kwargs.get("curvature"))
        return real(*args, **kwargs)

    patched = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("tracinfunc") and getattr(module, "prepare_query", None) is real:
            monkeypatch.setattr(module, "prepare_query", counting)
            patched += 1
    assert patched >= 4  # prepared itself, chunks, score, top_k, search.rerank
    return calls


def _queries(store, tests, index):
    return {
        "score": lambda **kw: tif.score(store, tests, **kw),
        "top_k": lambda **kw: tif.top_k(store, tests, 4, **kw),
        "score_chunks": lambda **kw: list(tif.score_chunks(store, tests, chunk_rows=7, **kw)),
        "indexed_top_k": lambda **kw: tif.indexed_top_k(store, tests, 4, index=index, **kw),
    }


@pytest.mark.parametrize("name", ["score", "top_k", "score_chunks", "indexed_top_k"])
@pytest.mark.parametrize("with_curvature", [False, True])
def test_every_query_prepares_its_test_gradients_once(setup, preparations, name,
                                                      with_curvature):
    store, tests, curvature, index, _ = setup
    kwargs = {"curvature": curvature} if with_curvature else {}
    _queries(store, tests, index)[name](**kwargs)
    assert len(preparations) == 1
    assert (preparations[0] is curvature) == with_curvature


@pytest.mark.parametrize("with_curvature", [False, True])
def test_blocked_top_k_splits_one_prepared_query(setup, preparations, monkeypatch,
                                                 with_curvature):
    # Above _MAX_QUERY_BLOCK test rows top_k scans once per block: the query is split, not
    # prepared again, and the blocks' results equal one scan's.
    store, tests, curvature, _, _ = setup
    kwargs = {"curvature": curvature} if with_curvature else {}
    whole = tif.top_k(store, tests, 4, **kwargs)
    monkeypatch.setattr(sys.modules["tracinfunc.query.top_k"], "_MAX_QUERY_BLOCK", 3)
    preparations.clear()
    blocked = tif.top_k(store, tests, 4, **kwargs)
    assert len(preparations) == 1
    assert torch.equal(blocked[1], whole[1])
    torch.testing.assert_close(blocked[0], whole[0])


def test_the_five_share_one_keyword_set():
    shared = {"device", "progress", "rows", "curvature"}
    for name in FIVE:
        parameters = inspect.signature(getattr(tif, name)).parameters
        assert shared <= set(parameters), name
        assert len(parameters) <= 14, name
        if name != "score_chunks":  # blocks live one step: a generator of torch tensors
            assert {"output", "like"} <= set(parameters), name
        if name != "indexed_top_k":  # reads candidate rows only, no chunks of rows
            assert "chunk_rows" in parameters, name
    assert inspect.signature(tif.indexed_top_k).parameters["k"].default == 10
    assert "n_candidates" in inspect.signature(tif.indexed_top_k).parameters
    assert "candidates" not in inspect.signature(tif.indexed_top_k).parameters


def test_indexed_top_k_takes_rows_output_and_device_as_top_k_does(setup):
    store, tests, curvature, index, _ = setup
    for kwargs in ({}, {"rows": (5, 31)}, {"rows": (5, 31), "curvature": curvature}):
        exact = tif.top_k(store, tests, 4, device="cpu", **kwargs)
        got = tif.indexed_top_k(store, tests, 4, index=index, nprobe=1, device="cpu",
                                **kwargs)
        assert torch.equal(got[1], exact[1])
        torch.testing.assert_close(got[0], exact[0])
    values, indices = tif.indexed_top_k(store, tests, index=index, output="numpy")
    assert isinstance(values, np.ndarray) and indices.shape == (10, 10)  # k=10 by default
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match=r"k must be an int in \[1, n_train=3\]"):
        tif.indexed_top_k(store, tests, 4, index=index, rows=(0, 3))


def test_self_influence_chunks_and_progress_change_nothing(setup):
    store, _, curvature, _, _ = setup
    # Norms add elementwise (bit-identical); preconditioning is a matmul whose rounding may
    # depend on how many rows share it (float64 here).
    for kwargs, tolerance in (({}, 0), ({"curvature": curvature}, 1e-12)):
        whole = tif.self_influence(store, **kwargs)
        chunked = tif.self_influence(store, chunk_rows=7, progress=False, **kwargs)
        ranged = tif.self_influence(store, rows=(3, 17), chunk_rows=4, **kwargs)
        torch.testing.assert_close(chunked, whole, rtol=tolerance, atol=0)
        torch.testing.assert_close(ranged, whole[3:17], rtol=tolerance, atol=0)


def test_preconditioned_test_grads_take_options_and_default_to_the_curvatures_selection():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    x, y = torch.randn(20, 5, dtype=torch.float64), torch.randint(0, 3, (20,))
    ckpts = [tif.Checkpoint.from_module(model, lr=0.3, name="a")]
    options = tif.GradientOptions(select=["2.*"])
    store = tif.build_store(loss, ckpts, (x, y), projection=PROJECTION, options=options,
                            dtype=torch.float64, progress=False)
    curvature = tif.fit_curvature(loss, ckpts, (x, y), kind="kfac",
                                  options=tif.GradientOptions(select=["2.*"]))
    chosen = tif.preconditioned_test_grads(loss, ckpts, (x[:4], y[:4]), curvature,
                                           projection=PROJECTION, options=options)
    default = tif.preconditioned_test_grads(loss, ckpts, (x[:4], y[:4]), curvature,
                                            projection=PROJECTION)
    assert torch.equal(_rows(chosen), _rows(default))
    assert tif.score(store, default, curvature=curvature).shape == (4, 20)
    with pytest.raises(tif.errors.InvalidTypeError, match="options must be a tracinfunc"):
        tif.preconditioned_test_grads(loss, ckpts, (x[:4], y[:4]), curvature,
                                      projection=PROJECTION, options={"select": ["2.*"]})


def test_curvature_exports_one_name_per_thing():
    import tracinfunc.curvature as curvature
    import tracinfunc.precondition.optimizer as optimizer

    assert "precondition_test_grads" not in dir(curvature)
    assert "curvature_self_influence" not in dir(curvature)
    assert "KINDS" not in curvature.__all__ and "KINDS" not in optimizer.__all__
    assert set(curvature.CURVATURE_KINDS) == {"dense", "projected", "kfac", "ekfac"}
    assert set(optimizer.PRECONDITIONER_KINDS) == {"adam", "trackstar"}


def _calls(store, tests, index):
    """The five, as one-argument callables over (store, test_grads, extra keywords)."""
    return {
        "score": lambda s, t, **kw: tif.score(s, t, **kw),
        "top_k": lambda s, t, **kw: tif.top_k(s, t, 4, **kw),
        "score_chunks": lambda s, t, **kw: list(tif.score_chunks(s, t, **kw)),
        "indexed_top_k": lambda s, t, **kw: tif.indexed_top_k(s, t, 4, index=index, **kw),
        "self_influence": lambda s, t, **kw: tif.self_influence(s, **kw),
    }


@pytest.mark.parametrize("name", FIVE)
@pytest.mark.parametrize("rows", [(5, 3), (-1, 4), (0, 51), (4, 4), (0.0, 3), "0:3"])
def test_bad_rows_give_one_error_everywhere(setup, name, rows):
    store, tests, _, index, _ = setup
    call = _calls(store, tests, index)[name]
    with pytest.raises(tif.errors.RowRangeError,
                       match=rf"^{name}: rows must be \(start, stop\) with 0 <= start < stop"):
        call(store, tests, rows=rows)


@pytest.mark.parametrize("name", FIVE)
def test_an_empty_store_gives_one_error_everywhere(setup, name):
    store, tests, _, index, _ = setup
    empty = tif.store.MemoryStore(store.meta.replace(n_train=0), _rows(store)[:, :0],
                                  _rows(store)[:, :0].norm(dim=-1))
    call = _calls(store, tests, index)[name]
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match=rf"^{name}: the store holds no rows \(n_train=0\)"):
        call(empty, tests)


@pytest.mark.parametrize("name", ["top_k", "indexed_top_k"])
@pytest.mark.parametrize("k", [0, 51, -1, 2.0, True, np.float64(3.0), np.bool_(True),
                               np.array([3]), np.int64(51)])
def test_bad_k_gives_one_error_everywhere(setup, name, k):
    store, tests, _, index, _ = setup
    call = {"top_k": lambda: tif.top_k(store, tests, k),
            "indexed_top_k": lambda: tif.indexed_top_k(store, tests, k, index=index)}[name]
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match=rf"^{name}: k must be an int in \[1, n_train=50\]"):
        call()


@pytest.mark.parametrize("name", ["top_k", "indexed_top_k"])
def test_an_integer_scalar_k_is_a_python_int(setup, name):
    """NumPy, torch and JAX integer scalars are ints: the same result as k=3."""
    jnp = pytest.importorskip("jax.numpy")
    store, tests, _, index, _ = setup
    call = {"top_k": lambda k: tif.top_k(store, tests, k),
            "indexed_top_k": lambda k: tif.indexed_top_k(store, tests, k, index=index)}[name]
    want = call(3)
    for k in (np.int64(3), np.uint8(3), np.array(3), torch.tensor(3), jnp.asarray(3)):
        got = call(k)
        assert got[1].shape == want[1].shape == (want[1].shape[0], 3)
        torch.testing.assert_close(got[1], want[1])
        torch.testing.assert_close(got[0], want[0])


QUERIES = ("score", "top_k", "score_chunks", "indexed_top_k")


@pytest.mark.parametrize("name", QUERIES)
def test_wrong_test_gradients_give_one_error_everywhere(setup, name):
    store, tests, _, index, _ = setup
    call = _calls(store, tests, index)[name]
    rows = _rows(tests)
    cases = [
        (rows.tolist(), tif.errors.InvalidTypeError, "test_grads must be a GradientStore"),
        (rows[0], tif.errors.IncompatibleGradientsError, r"must be \[n_ckpt=2, n_test, k=10\]"),
        (rows[:, :, :4], tif.errors.IncompatibleGradientsError, r"must be \[n_ckpt=2"),
        (rows.long(), tif.errors.InvalidTypeError, "must be floating point"),
    ]
    for bad in (float("nan"), float("inf"), -float("inf")):
        poisoned = rows.clone()
        poisoned[1, 2, 3] = bad
        cases.append((poisoned, tif.errors.NonFiniteGradientError, "contain NaN or inf"))
        cases.append((poisoned.numpy(), tif.errors.NonFiniteGradientError, "contain NaN or inf"))
    other = tif.store.MemoryStore(tests.meta.replace(projection=tif.Projection(dim=10, seed=5)),
                                  rows, rows.norm(dim=-1))
    cases.append((other, tif.errors.IncompatibleGradientsError, "projection"))
    for bad, error, message in cases:
        with pytest.raises(error, match=rf"^{name}: .*{message}"):
            call(store, bad)


def _tensors(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for item in result for t in (item if isinstance(item, tuple) else (item,))
            if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", QUERIES)
@pytest.mark.parametrize("framework", ["numpy", "jax"])
def test_numpy_and_jax_test_gradients_give_the_tensors_result(setup, name, framework):
    store, tests, _, index, _ = setup
    call = _calls(store, tests, index)[name]
    rows = _rows(tests).float()  # JAX holds float32 unless x64 is switched on process-wide
    if framework == "jax":
        jnp = pytest.importorskip("jax.numpy")
        array = jnp.asarray(rows.numpy())
    else:
        array = rows.numpy()
    expected, got = _tensors(call(store, rows)), _tensors(call(store, array))
    assert len(got) == len(expected) > 0
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
