"""Hostile pass atk46: ``tracinfunc.jax`` runs the user's loss under IEEE float32 matmuls.

Surface: every entry point of ``tracinfunc.jax`` that traces a user's loss
(``per_sample_grads``, ``projected_grads``, ``build_store``, ``fit_curvature``,
``preconditioned_test_grads``, ``classification_sampler`` logits) compiles under
``jax.default_matmul_precision("float32")`` and restores the caller's own setting; a precision
the loss sets itself is kept. Also the suite's CPU pinning (``tests/conftest.py``:
``cpu_only``, ``child_env``), which must be a no-op on CPU machines.

On the CPU every precision gives the same numbers, so the precision is observed with spies:
inside a loss ``jax.config.jax_default_matmul_precision`` reads the setting it is traced under,
and ``jax.make_jaxpr`` of a returned function shows each ``dot_general``'s ``precision``
(``float32`` -> ``HIGHEST``, ``bfloat16`` -> ``DEFAULT``, ``tensorfloat32`` -> ``HIGH``).

Attacked: restoring after exceptions and ``KeyboardInterrupt`` in the loss, a global
``jax.config.update`` by the caller, thread-local contexts in two threads, calls inside an
outer ``jax.jit`` / ``jax.vmap`` / ``jax.grad``, how often the loss is traced across calls
under other outer precisions, losses that set a precision themselves (context or
``precision=``), bfloat16 parameters, ``has_aux``, ``chunk_size``, generators, Flax linen and
NNX models, bit-for-bit equality with ``jax.jit(jax.vmap(jax.grad(loss)))`` by hand, errors
naming the batch and rows.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tracinfunc as tif
import tracinfunc.jax as tj
from tests.conftest import REPO, child_env, cpu_only
from tests.jax_helpers import flax_mlp_loss, flax_template

PREC = "jax_default_matmul_precision"
_ENV_AT_IMPORT = dict(os.environ)


def current():
    return getattr(jax.config, PREC)


def dot_precisions(fn, *args) -> set[str]:
    """The ``precision`` of every dot_general in ``fn``'s jaxpr (nested programs included)."""
    text = str(jax.make_jaxpr(fn)(*args))
    return set(re.findall(r"precision=\(?(?:Precision\.)?(\w+)", text))


def make_params(seed=0, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 2)
    return {"params": {
        "layers_0": {"kernel": (jax.random.normal(k[0], (6, 8)) * 0.4).astype(dtype),
                     "bias": jnp.full((8,), 0.05, dtype)},
        "layers_2": {"kernel": (jax.random.normal(k[1], (8, 3)) * 0.4).astype(dtype),
                     "bias": jnp.full((3,), -0.02, dtype)},
    }}


def make_batch(n=10, seed=5, dtype=jnp.float32):
    x = jax.random.normal(jax.random.key(seed), (n, 6)).astype(dtype)
    y = jnp.arange(n, dtype=jnp.int32) % 3
    return x, y


MAPPING = tj.ParamMapping.flax(flax_template())
PROJ = tif.Projection(dim=8, seed=0)


def ckpts(n=2):
    return [tj.Checkpoint(make_params(seed=c), lr=0.1 * (c + 1), name=f"c{c}") for c in range(n)]


class Spy:
    """A loss (and a logits function) recording the precision each trace sees."""

    def __init__(self):
        self.seen: list = []
        self.logits_seen: list = []

        def loss(params, example):
            self.seen.append(current())
            return flax_mlp_loss(params, example)

        def logits(params, x):
            self.logits_seen.append(current())
            p = params["params"]
            h = jnp.tanh(x @ p["layers_0"]["kernel"] + p["layers_0"]["bias"])
            return h @ p["layers_2"]["kernel"] + p["layers_2"]["bias"]

        self.loss = loss
        self.logits = logits


@pytest.fixture(autouse=True)
def _untouched_global():
    """Every test leaves the process-wide setting as it found it."""
    before = current()
    yield
    assert current() == before
    jax.config.update(PREC, before)


ENTRY_POINTS = ["per_sample_grads", "projected_grads", "build_store", "fit_projected",
                "fit_dense", "preconditioned_test_grads"]


def run_entry(name, spy, data=None):
    data = make_batch() if data is None else data
    cks = ckpts()
    if name == "per_sample_grads":
        return tj.per_sample_grads(spy.loss)(cks[0].params, data)
    if name == "projected_grads":
        return tj.projected_grads(spy.loss, PROJ, mapping=MAPPING)(cks[0].params, data)
    if name == "build_store":
        return tj.build_store(spy.loss, cks, data, projection=PROJ, mapping=MAPPING)
    if name == "fit_projected":
        return tj.fit_curvature(spy.loss, cks, data, kind="projected", projection=PROJ,
                                mapping=MAPPING, sampler=tj.classification_sampler(spy.logits))
    if name == "fit_dense":
        return tj.fit_curvature(spy.loss, cks, data, kind="dense", mapping=MAPPING,
                                sampler=tj.classification_sampler(spy.logits))
    if name == "preconditioned_test_grads":
        curv = tj.fit_curvature(spy.loss, cks, data, kind="projected", projection=PROJ,
                                mapping=MAPPING, sampler=tj.classification_sampler(spy.logits))
        spy.seen.clear()
        return tj.preconditioned_test_grads(lambda p, e: spy.loss(p, e), cks, data, curv,
                                            projection=PROJ, mapping=MAPPING)
    raise AssertionError(name)


# --- the loss sees float32; the caller's setting comes back -------------------------------


@pytest.mark.parametrize("outer", [None, "bfloat16", "tensorfloat32"])
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_loss_traced_under_float32_and_outer_context_restored(name, outer):
    spy = Spy()
    if outer is None:
        run_entry(name, spy)
        after = current()
    else:
        with jax.default_matmul_precision(outer):
            run_entry(name, spy)
            after = current()
    assert after == outer
    assert spy.seen and set(spy.seen) == {"float32"}
    assert set(spy.logits_seen) <= {"float32"}
    if name.startswith("fit"):
        assert spy.logits_seen == ["float32"]


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_global_config_update_by_caller_untouched(name):
    spy = Spy()
    jax.config.update(PREC, "bfloat16")
    try:
        run_entry(name, spy)
        assert current() == "bfloat16"
        assert set(spy.seen) == {"float32"}
    finally:
        jax.config.update(PREC, None)


@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("name", ["per_sample_grads", "projected_grads", "build_store",
                                  "fit_dense"])
def test_setting_restored_after_loss_raises(name, exc):
    spy = Spy()

    def boom(params, example):
        spy.seen.append(current())
        raise exc("boom")

    spy.loss = boom
    with jax.default_matmul_precision("bfloat16"):
        with pytest.raises(BaseException) as info:
            run_entry(name, spy)
        assert current() == "bfloat16"
    assert current() is None
    assert spy.seen == ["float32"]
    if exc is not ValueError:  # never wrapped into a library error
        assert info.type is exc


def test_runtime_refusal_restores_setting_and_names_example():
    """NaN inputs are refused after the program ran (naming the example): setting restored."""
    spy = Spy()
    x, y = make_batch()
    x = x.at[3, 2].set(jnp.nan)
    with jax.default_matmul_precision("tensorfloat32"):
        with pytest.raises(Exception, match="3"):
            tj.fit_curvature(spy.loss, ckpts(), (x, y), kind="dense", mapping=MAPPING,
                             sampler=tj.classification_sampler(spy.logits))
        assert current() == "tensorfloat32"


def test_error_on_later_batch_names_batch_and_rows_and_restores():
    def loss(params, example):
        if example[0].shape[-1] != 6:
            raise ValueError("wrong width")
        return flax_mlp_loss(params, example)

    x, y = make_batch(4)
    with jax.default_matmul_precision("bfloat16"):
        with pytest.raises(tif.errors.LossFunctionError, match=r"batch 1.*rows 4-7"):
            tj.build_store(loss, ckpts(), [(x, y), (jnp.ones((4, 5)), y)], projection=PROJ,
                           mapping=MAPPING)
        assert current() == "bfloat16"


# --- threads --------------------------------------------------------------------------------


def test_two_threads_with_different_outer_settings():
    barrier = threading.Barrier(2, timeout=60)
    results = {}

    def work(outer, name):
        spy = Spy()
        barrier.wait()
        with jax.default_matmul_precision(outer):
            run_entry(name, spy)
            results[outer] = (set(spy.seen), current())

    threads = [threading.Thread(target=work, args=("bfloat16", "build_store")),
               threading.Thread(target=work, args=("tensorfloat32", "fit_dense"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {"bfloat16": ({"float32"}, "bfloat16"),
                       "tensorfloat32": ({"float32"}, "tensorfloat32")}


def test_two_threads_same_loss_object_at_once():
    """One loss function object built from two threads at once under different outer
    settings (its programs are cached per loss): both see float32, both keep their own."""
    spy = Spy()
    barrier = threading.Barrier(2, timeout=60)
    results, errors = {}, []

    def work(outer):
        try:
            barrier.wait()
            with jax.default_matmul_precision(outer):
                store = tj.build_store(spy.loss, ckpts(), make_batch(), projection=PROJ,
                                       mapping=MAPPING)
                results[outer] = (current(), tif.self_influence(store, output="numpy"))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(o,)) for o in ("bfloat16", "tensorfloat32")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert results["bfloat16"][0] == "bfloat16"
    assert results["tensorfloat32"][0] == "tensorfloat32"
    np.testing.assert_array_equal(results["bfloat16"][1], results["tensorfloat32"][1])
    assert spy.seen and set(spy.seen) == {"float32"}


def test_other_thread_never_sees_float32_while_a_build_traces():
    """A build in a worker thread blocked inside the loss: the main thread's setting stays
    its own (a process-wide ``config.update`` would leak ``float32`` here)."""
    inside, release = threading.Event(), threading.Event()
    errors = []

    def loss(params, example):
        inside.set()
        release.wait(60)
        return flax_mlp_loss(params, example)

    def work():
        try:
            with jax.default_matmul_precision("bfloat16"):
                tj.build_store(loss, ckpts(1), make_batch(), projection=PROJ, mapping=MAPPING)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            inside.set()

    t = threading.Thread(target=work)
    t.start()
    assert inside.wait(60)
    seen_main = current()
    release.set()
    t.join(120)
    assert not errors
    assert seen_main is None


# --- inside outer transformations ----------------------------------------------------------


def test_inside_outer_jit_inner_float32_outer_setting_kept_in_trace():
    spy = Spy()
    f = tj.per_sample_grads(spy.loss)
    x, y = make_batch(4)
    after_inner = []

    def outer(params, a):
        g = f(params, (x, y))
        after_inner.append(current())
        return jax.tree.leaves(g)[0].sum() + (a @ a.T).sum()

    params = make_params()
    with jax.default_matmul_precision("bfloat16"):
        precs = dot_precisions(jax.jit(outer), params, x)
    assert after_inner == ["bfloat16"]
    assert spy.seen == ["float32"]
    # the user's own a @ a.T (outer trace) stays DEFAULT (bfloat16); ours are HIGHEST
    assert precs == {"HIGHEST", "DEFAULT"}


def test_projected_grads_jaxpr_has_only_highest():
    f = tj.projected_grads(flax_mlp_loss, PROJ, mapping=MAPPING)
    for outer in (None, "bfloat16", "tensorfloat32"):
        with jax.default_matmul_precision(outer):
            assert dot_precisions(f, make_params(), make_batch(4)) == {"HIGHEST"}


def test_under_outer_vmap_and_grad():
    spy = Spy()
    f = tj.per_sample_grads(spy.loss)
    params, batch = make_params(), make_batch(4)
    stacked = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), params)
    with jax.default_matmul_precision("bfloat16"):
        v = jax.vmap(lambda p: f(p, batch))(stacked)
        g = jax.grad(lambda p: sum(jnp.sum(leaf ** 2) for leaf in jax.tree.leaves(f(p, batch))))(
            params)
        precs = dot_precisions(
            jax.grad(lambda p: sum(jnp.sum(leaf ** 2) for leaf in jax.tree.leaves(f(p, batch)))),
            params)
        assert current() == "bfloat16"
    assert set(spy.seen) == {"float32"}
    assert precs == {"HIGHEST"}
    want = jax.vmap(jax.grad(flax_mlp_loss), in_axes=(None, 0))(params, batch)
    # vmapped over parameters the matmuls are batched: equal to float32 rounding, not bitwise
    np.testing.assert_allclose(jax.tree.leaves(v)[0][0], jax.tree.leaves(want)[0], rtol=1e-5,
                               atol=1e-7)
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(g))


def test_build_store_inside_jit_is_refused_as_such_not_blamed_on_loss():
    """FINDING, fixed (``_refuse_traced`` in tracinfunc/jax/build.py). ``tj.build_store`` called inside ``jax.jit`` with traced data. Expected: a
    refusal from build_store saying it cannot run inside a JAX transformation (its data are
    tracers). Observed: a bare ``AttributeError: The 'sharding' attribute is not available on
    traced array with shape float32[8]`` from the library's internals (and, in a process where
    an earlier build's loss had raised, ``LossFunctionError: loss(params, example) failed on batch 0 ... with
    AttributeError: ... sharding`` — the user's correct loss blamed). The caller's precision
    is restored either way (checked here too)."""
    x, y = make_batch(4)

    def outer(xx):
        return tj.build_store(flax_mlp_loss, ckpts(1), (xx, y), projection=PROJ,
                              mapping=MAPPING)

    with jax.default_matmul_precision("bfloat16"):
        with pytest.raises(Exception) as info:
            jax.jit(outer)(x)
        assert current() == "bfloat16"
    assert not isinstance(info.value, AttributeError), repr(info.value)
    assert "loss(params, example) failed" not in str(info.value)
    assert "build_store" in str(info.value)
    assert "build_store was called inside jax.jit" in str(info.value)
    assert "outside the transformation" in str(info.value)


def test_fits_and_traced_checkpoints_inside_jit_are_refused_by_name():
    """The fix's reach: ``fit_curvature`` and ``preconditioned_test_grads`` read batches the
    same way, and a checkpoint whose parameters are traced is refused before any batch."""
    x, y = make_batch(4)
    checkpoints = ckpts(1)
    params = checkpoints[0].params

    def fit(xx):
        return tj.fit_curvature(flax_mlp_loss, checkpoints, (xx, y), kind="dense", mapping=MAPPING,
                                sampler=tj.classification_sampler(lambda p, v: v[:3]))

    with pytest.raises(tif.errors.InvalidArgumentError, match=r"fit_curvature was called inside jax.jit"):
        jax.jit(fit)(x)

    def traced_checkpoint(p):
        return tj.build_store(flax_mlp_loss, [tj.Checkpoint(p)], (x, y), projection=PROJ,
                              mapping=MAPPING)

    with pytest.raises(tif.errors.InvalidArgumentError,
                       match=r"build_store was called inside jax.jit"):
        jax.jit(traced_checkpoint)(params)

    def under_vmap(xx):  # vmap stages nothing for concrete arrays: the batch is the tracer
        return tj.build_store(flax_mlp_loss, checkpoints, (xx, y), projection=PROJ,
                              mapping=MAPPING)

    with pytest.raises(tif.errors.InvalidArgumentError, match=r"\(data holds traced values\)"):
        jax.vmap(under_vmap)(x[None])


# --- traced once across outer precisions -----------------------------------------------------


OUTERS = [None, "bfloat16", "tensorfloat32", "highest", "float32", "default"]


@pytest.mark.parametrize("name", ["per_sample_grads", "projected_grads", "build_store",
                                  "fit_dense"])
def test_no_retrace_for_other_outer_precisions(name):
    spy = Spy()
    loss = spy.loss
    cks = ckpts()
    data = make_batch()
    if name == "per_sample_grads":
        f = tj.per_sample_grads(loss)

        def call():
            return f(cks[0].params, data)
    elif name == "projected_grads":
        f = tj.projected_grads(loss, PROJ, mapping=MAPPING)

        def call():
            return f(cks[0].params, data)
    elif name == "build_store":
        def call():
            return tj.build_store(loss, cks, data, projection=PROJ, mapping=MAPPING)
    else:
        sampler = tj.classification_sampler(spy.logits)

        def call():
            return tj.fit_curvature(loss, cks, data, kind="dense", mapping=MAPPING,
                                    sampler=sampler)
    call()
    first, first_logits = len(spy.seen), len(spy.logits_seen)
    for outer in OUTERS:
        with jax.default_matmul_precision(outer):
            call()
    jax.config.update(PREC, "bfloat16")
    try:
        call()
    finally:
        jax.config.update(PREC, None)
    assert len(spy.seen) == first and len(spy.logits_seen) == first_logits
    assert set(spy.seen) == {"float32"}


def test_first_call_under_bfloat16_does_not_poison_cache():
    """The first trace happens under an outer bfloat16: the cached program is still HIGHEST."""
    loss = Spy().loss
    f = tj.per_sample_grads(loss)
    with jax.default_matmul_precision("bfloat16"):
        f(make_params(), make_batch(4))
    assert dot_precisions(f, make_params(), make_batch(4)) == {"HIGHEST"}
    g = tj.per_sample_grads(loss)  # a second frontend for the same loss object
    assert dot_precisions(g, make_params(), make_batch(4)) == {"HIGHEST"}


# --- precision set by the loss itself is kept ------------------------------------------------


@pytest.mark.parametrize("inner,want", [("bfloat16", "DEFAULT"), ("tensorfloat32", "HIGH")])
def test_loss_context_kept(inner, want):
    seen = []

    def loss(params, example):
        with jax.default_matmul_precision(inner):
            seen.append(current())
            return flax_mlp_loss(params, example)

    f = tj.per_sample_grads(loss)
    assert dot_precisions(f, make_params(), make_batch(4)) == {want}
    fp = tj.projected_grads(loss, PROJ, mapping=MAPPING)
    # the loss's own dots keep its setting; the projection's are HIGHEST
    assert dot_precisions(fp, make_params(), make_batch(4)) == {want, "HIGHEST"}
    tj.build_store(loss, ckpts(1), make_batch(), projection=PROJ, mapping=MAPPING)
    assert set(seen) == {inner}


def test_explicit_precision_argument_kept():
    def loss(variables, example):
        x, y = example
        p = variables["params"]
        h = jnp.tanh(jnp.dot(x, p["layers_0"]["kernel"], precision=jax.lax.Precision.DEFAULT)
                     + p["layers_0"]["bias"])
        logits = h @ p["layers_2"]["kernel"] + p["layers_2"]["bias"]
        return -jax.nn.log_softmax(logits)[y]

    precs = dot_precisions(tj.per_sample_grads(loss), make_params(), make_batch(4))
    assert precs == {"DEFAULT", "HIGHEST"}


# --- the numbers are unchanged ------------------------------------------------------------


def by_hand(loss, params, batch, has_aux=False):
    return jax.jit(jax.vmap(jax.grad(loss, has_aux=has_aux), in_axes=(None, 0)))(params, batch)


def assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(la, lb, strict=True):
        assert u.dtype == v.dtype and u.shape == v.shape
        np.testing.assert_array_equal(np.asarray(u, np.float64), np.asarray(v, np.float64))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("outer", [None, "bfloat16"])
def test_bit_for_bit_with_vmap_grad_by_hand(dtype, outer):
    params, batch = make_params(dtype=dtype), make_batch(dtype=dtype)
    with jax.default_matmul_precision(outer):
        got = tj.per_sample_grads(flax_mlp_loss)(params, batch)
    assert_trees_equal(got, by_hand(flax_mlp_loss, params, batch))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_parameters_build_store(dtype):
    spy = Spy()
    cks = [tj.Checkpoint(make_params(c, dtype=dtype), lr=0.1, name=f"c{c}") for c in range(2)]
    with jax.default_matmul_precision("bfloat16"):
        store = tj.build_store(spy.loss, cks, make_batch(dtype=dtype), projection=PROJ,
                               mapping=tj.ParamMapping.flax(flax_template(dtype=dtype)))
        assert current() == "bfloat16"
    assert set(spy.seen) == {"float32"}
    assert np.isfinite(tif.self_influence(store, output="numpy")).all()


def test_has_aux_and_chunk_size_bit_for_bit_and_float32():
    """With ``chunk_size=3`` the rows equal ``vmap(grad)`` by hand over the same chunks bit
    for bit (the aux loss values of a chunk of 3 differ from a batch of 10 by an ulp in plain
    JAX too, so the reference is chunked the same way, its last chunk padded to 3)."""
    seen = []

    def loss(params, example):
        seen.append(current())
        value = flax_mlp_loss(params, example)
        return value, {"v": value}

    params, batch = make_params(), make_batch(10)
    with jax.default_matmul_precision("bfloat16"):
        got, aux = tj.per_sample_grads(loss, has_aux=True, chunk_size=3)(params, batch)
        full, full_aux = tj.per_sample_grads(loss, has_aux=True)(params, batch)
        assert current() == "bfloat16"
    ours = list(seen)
    padded = jax.tree.map(lambda a: jnp.concatenate([a, a[:2]]), batch)  # 12 = 4 chunks of 3
    parts = [by_hand(loss, params, jax.tree.map(lambda a, i=i: a[i:i + 3], padded), has_aux=True)
             for i in range(0, 12, 3)]
    want = jax.tree.map(lambda *a: jnp.concatenate(a)[:10], *[p[0] for p in parts])
    want_aux = jax.tree.map(lambda *a: jnp.concatenate(a)[:10], *[p[1] for p in parts])
    assert_trees_equal(got, want)
    assert_trees_equal(aux, want_aux)
    assert_trees_equal((full, full_aux), by_hand(loss, params, batch, has_aux=True))
    assert ours and set(ours) == {"float32"}


def test_projected_grads_chunked_equal_unchunked_and_store_rows():
    params, batch = make_params(), make_batch(10)
    with jax.default_matmul_precision("bfloat16"):
        a = tj.projected_grads(flax_mlp_loss, PROJ, mapping=MAPPING, chunk_size=4)(params, batch)
    b = tj.projected_grads(flax_mlp_loss, PROJ, mapping=MAPPING)(params, batch)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_jitted_loss_retraced_under_float32():
    seen = []

    @jax.jit
    def loss(params, example):
        seen.append(current())
        return flax_mlp_loss(params, example)

    params, batch = make_params(), make_batch(4)
    loss(params, (batch[0][0], batch[1][0]))  # the user's own call, default precision
    assert seen == [None]
    tj.per_sample_grads(loss)(params, batch)
    assert seen[1:] and set(seen[1:]) == {"float32"}


# --- data generators: the setting between batches --------------------------------------------


def test_generator_data_and_list_of_batches():
    spy = Spy()
    seen_gen = []

    def gen():
        for i in range(3):
            seen_gen.append(current())
            yield make_batch(4, seed=i)

    with jax.default_matmul_precision("bfloat16"):
        store = tj.build_store(spy.loss, ckpts(), gen(), projection=PROJ, mapping=MAPPING)
        assert current() == "bfloat16"
        ref = tj.build_store(spy.loss, ckpts(), [make_batch(4, seed=i) for i in range(3)],
                             projection=PROJ, mapping=MAPPING)
    assert set(spy.seen) == {"float32"}
    assert seen_gen == ["bfloat16"] * 3  # the user's data code runs under the user's setting
    a = tif.self_influence(store, output="numpy")
    b = tif.self_influence(ref, output="numpy")
    np.testing.assert_array_equal(a, b)


def test_generator_that_raises_restores_setting():
    def gen():
        yield make_batch(4)
        raise RuntimeError("data broke")

    with jax.default_matmul_precision("bfloat16"):
        with pytest.raises(RuntimeError, match="data broke"):
            tj.build_store(flax_mlp_loss, ckpts(), gen(), projection=PROJ, mapping=MAPPING)
        assert current() == "bfloat16"


def test_nested_library_call_inside_loss_keeps_float32_for_rest_of_loss():
    """A loss that itself calls ``tj.per_sample_grads``: after the inner call returns, the
    rest of the outer loss is still traced under float32 (the inner call restores the
    library's setting, not the caller's)."""
    seen = []

    def outer_loss(params, example):
        g = tj.per_sample_grads(flax_mlp_loss)(params, jax.tree.map(lambda a: a[None], example))
        seen.append(current())
        return flax_mlp_loss(params, example) + 0 * jax.tree.leaves(g)[0].sum()

    with jax.default_matmul_precision("bfloat16"):
        tj.per_sample_grads(outer_loss)(make_params(), make_batch(4))
        assert current() == "bfloat16"
    assert seen == ["float32"]


def test_logits_raising_restores_setting():
    seen = []

    def bad_logits(params, x):
        seen.append(current())
        raise ValueError("nope")

    with jax.default_matmul_precision("bfloat16"):
        with pytest.raises(ValueError, match="nope"):
            tj.fit_curvature(flax_mlp_loss, ckpts(), make_batch(), kind="dense", mapping=MAPPING,
                             sampler=tj.classification_sampler(bad_logits))
        assert current() == "bfloat16"
    assert seen == ["float32"]


def test_exact_sampler_and_eval_shape():
    spy = Spy()
    with jax.default_matmul_precision("bfloat16"):
        tj.fit_curvature(spy.loss, ckpts(), make_batch(), kind="dense", mapping=MAPPING,
                         sampler=tj.classification_sampler(spy.logits, exact=True))
    assert set(spy.seen) == {"float32"} and set(spy.logits_seen) == {"float32"}
    spy = Spy()
    out = jax.eval_shape(tj.per_sample_grads(spy.loss), make_params(), make_batch(4))
    assert sorted(leaf.shape for leaf in jax.tree.leaves(out)) == [
        (4, 3), (4, 6, 8), (4, 8), (4, 8, 3)]
    assert spy.seen == ["float32"]


@pytest.mark.parametrize("kind", ["object", "method", "partial"])
def test_callable_objects_methods_partials(kind):
    seen = []

    class Loss:
        def __call__(self, params, example):
            seen.append(current())
            return flax_mlp_loss(params, example)

        def method(self, params, example):
            return self(params, example)

    def plain(scale, params, example):
        seen.append(current())
        return scale * flax_mlp_loss(params, example)

    loss = {"object": Loss(), "method": Loss().method,
            "partial": functools.partial(plain, 1.0)}[kind]
    for outer in ("bfloat16", None):
        with jax.default_matmul_precision(outer):
            tj.build_store(loss, ckpts(), make_batch(), projection=PROJ, mapping=MAPPING)
            assert current() == outer
    assert seen and set(seen) == {"float32"}


def test_torch_dataloader_data():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    x, y = make_batch(10)
    ds = TensorDataset(torch.from_numpy(np.array(x)), torch.from_numpy(np.array(y)).long())
    spy = Spy()
    with jax.default_matmul_precision("bfloat16"):
        s = tj.build_store(spy.loss, ckpts(), DataLoader(ds, batch_size=4), projection=PROJ,
                           mapping=MAPPING)
        assert current() == "bfloat16"
    assert set(spy.seen) == {"float32"}
    ref = tj.build_store(flax_mlp_loss, ckpts(), (x, y), projection=PROJ, mapping=MAPPING)
    np.testing.assert_allclose(tif.self_influence(s, output="numpy"),
                               tif.self_influence(ref, output="numpy"), rtol=1e-6)


# --- Flax linen and NNX ---------------------------------------------------------------------


def test_flax_linen_kfac_and_projected():
    nn = pytest.importorskip("flax.linen")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jnp.tanh(nn.Dense(8)(x))
            return nn.Dense(3, precision=jax.lax.Precision.HIGH)(x)

    model = MLP()
    x, y = make_batch(10)
    variables = model.init(jax.random.key(0), x[:1])
    seen, seen_logits = [], []

    def logits(params, xx):
        seen_logits.append(current())
        return model.apply({"params": params}, xx[None])[0]

    def loss(params, example):
        seen.append(current())
        xx, yy = example
        return -jax.nn.log_softmax(model.apply({"params": params}, xx[None])[0])[yy]

    mapping = tj.ParamMapping.flax(variables)
    cks = [tj.Checkpoint.flax(variables, lr=0.1, name="a")]
    with jax.default_matmul_precision("bfloat16"):
        curv = tj.fit_curvature(loss, cks, (x, y), kind="kfac", mapping=mapping,
                                sampler=tj.classification_sampler(logits))
        tests = tj.preconditioned_test_grads(loss, cks, (x, y), curv, projection=PROJ,
                                             mapping=mapping)
        assert current() == "bfloat16"
    assert seen and set(seen) == {"float32"}
    assert seen_logits and set(seen_logits) == {"float32"}
    assert tests is not None
    # the layer's own precision=HIGH is kept, the other dense is HIGHEST
    precs = dot_precisions(tj.per_sample_grads(loss), variables["params"], (x[:4], y[:4]))
    assert precs == {"HIGH", "HIGHEST"}


def test_flax_nnx_build_store():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(6, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.l2 = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.bn(self.l1(x))))

    model = MLP(nnx.Rngs(0))
    graphdef = nnx.split(model, nnx.Param, ...)[0]
    seen = []

    def loss(params, state, example):
        seen.append(current())
        xx, yy = example
        m = nnx.merge(graphdef, params, state)
        m.eval()
        return -jax.nn.log_softmax(m(xx[None])[0])[yy]

    mapping = tj.ParamMapping.flax(model)
    cks = [tj.Checkpoint.flax(model, lr=0.1, name="a")]
    with jax.default_matmul_precision("tensorfloat32"):
        store = tj.build_store(loss, cks, make_batch(), projection=PROJ, mapping=mapping)
        assert current() == "tensorfloat32"
    assert seen and set(seen) == {"float32"}
    assert len(store) == 10


# --- conftest CPU pinning is a no-op on a CPU machine ----------------------------------------


def test_cpu_only_noop_without_accelerators(monkeypatch):
    import torch

    env = dict(os.environ)
    avail = torch.cuda.is_available
    with cpu_only(monkeypatch, torch_cuda=False, jax_accelerated=False):
        assert dict(os.environ) == env
        assert torch.cuda.is_available is avail
    assert dict(os.environ) == env


def test_this_machine_is_cpu_and_fixture_changed_nothing():
    """Inside a test (the autouse pin active) on this CPU machine: the environment is the one
    seen when this module was imported, and torch's ``is_available`` is torch's own."""
    import torch

    assert jax.default_backend() == "cpu"
    assert not torch.cuda.is_available()
    assert torch.cuda.is_available.__module__.startswith("torch.cuda")
    for key in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES"):
        assert os.environ.get(key) == _ENV_AT_IMPORT.get(key)


@pytest.mark.parametrize("caller", [None, "", "/a/b", "/a/b" + os.pathsep + "/c"])
def test_child_env_pythonpath(monkeypatch, caller):
    if caller is None:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    else:
        monkeypatch.setenv("PYTHONPATH", caller)
    env = child_env(FOO="1")
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts[0] == str(REPO)
    assert "" not in parts  # an empty entry would put the child's cwd on sys.path
    assert parts[1:] == ([p for p in caller.split(os.pathsep) if p] if caller else [])
    assert env["FOO"] == "1"
    assert {k: v for k, v in env.items() if k not in ("PYTHONPATH", "FOO")} == {
        k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_child_env_runs_checkout_and_keeps_callers_paths(tmp_path, monkeypatch):
    (tmp_path / "atk46_probe_mod.py").write_text("X = 46\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c",
         "import atk46_probe_mod, tracinfunc, pathlib; print(atk46_probe_mod.X);"
         "print(pathlib.Path(tracinfunc.__file__).resolve())"],
        env=child_env(), capture_output=True, text=True, check=True, cwd=tmp_path)
    lines = out.stdout.split()
    assert lines[0] == "46"
    assert lines[1].startswith(str(REPO))


def test_cpu_pin_does_not_initialise_jax_backends(tmp_path):
    """FINDING, fixed (tests/conftest.py reads JAX's GPU plugins from package metadata). On a CPU machine the autouse ``_cpu_unless_marked_cuda``
    fixture should be a no-op. It calls ``jax.default_backend()`` before every test whenever
    JAX is imported, which initialises JAX's backends before the test body runs. Expected: a
    test that configures JAX in its body (``jax.config.update("jax_num_cpu_devices", 3)``,
    ``XLA_FLAGS`` host device counts, ``jax_platforms``) behaves as without the fixture
    (passes). Observed: with the fixture it fails with ``RuntimeError: jax_num_cpu_devices
    config should be updated before backends are initialized`` (the same file passes without
    ``tests.conftest``). Run alone or first in a session (``pytest -k``), such a test changed
    behaviour on CPU machines."""
    (tmp_path / "test_probe.py").write_text(
        "import jax\n\n\ndef test_a():\n"
        "    jax.config.update('jax_num_cpu_devices', 3)\n"
        "    assert jax.device_count() == 3\n")

    def run(*plugin):
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin,
             "test_probe.py"], cwd=tmp_path, env=child_env(), capture_output=True, text=True,
            timeout=120)

    assert run().returncode == 0  # control: without the suite's conftest it passes
    with_pin = run("-p", "tests.conftest")
    assert with_pin.returncode == 0, with_pin.stdout[-600:]


def test_flax_nnx_ekfac_and_nan_refusal():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(6, 8, rngs=rngs)
            self.l2 = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    model = MLP(nnx.Rngs(1))
    graphdef = nnx.split(model, nnx.Param, ...)[0]
    seen, seen_logits = [], []

    def logits(params, x):
        seen_logits.append(current())
        return nnx.merge(graphdef, params)(x[None])[0]

    def loss(params, example):
        seen.append(current())
        xx, yy = example
        return -jax.nn.log_softmax(nnx.merge(graphdef, params)(xx[None])[0])[yy]

    mapping = tj.ParamMapping.flax(model)
    cks = [tj.Checkpoint.flax(model, lr=0.1, name="a")]
    x, y = make_batch()
    with jax.default_matmul_precision("bfloat16"):
        curv = tj.fit_curvature(loss, cks, (x, y), kind="ekfac", mapping=mapping,
                                sampler=tj.classification_sampler(logits))
        tj.preconditioned_test_grads(loss, cks, (x, y), curv, projection=PROJ, mapping=mapping)
        assert current() == "bfloat16"
        with pytest.raises(Exception, match="4"):
            tj.fit_curvature(loss, cks, (x.at[4, 0].set(jnp.inf), y), kind="kfac",
                             mapping=mapping, sampler=tj.classification_sampler(logits))
        assert current() == "bfloat16"
    assert seen and set(seen) == {"float32"}
    assert seen_logits and set(seen_logits) == {"float32"}
