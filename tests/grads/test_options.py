"""GradientOptions carries the gradient options whole; errors name the function the user called."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
from tests.conftest import make_checkpoints, make_data, make_mlp
from tracinfunc._validate import calling, check_int, current_caller, entry_point

PROJ = tif.Projection(dim=8, seed=1)


@pytest.fixture(scope="module")
def setup():
    model = make_mlp().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    return loss, make_checkpoints(model), make_data(12)


def test_the_0_1_keywords_are_gone_in_0_2(setup):
    """0.2.0 removed the deprecated bare keywords: they are refused by Python, not forwarded."""
    loss, ckpts, data = setup
    with pytest.raises(TypeError, match="chunk_size"):
        tif.build_store(loss, ckpts, data, projection=PROJ, chunk_size=5)
    with pytest.raises(TypeError, match="select"):
        tif.projected_grads(loss, PROJ, select=["2.weight"])
    with pytest.raises(TypeError, match="chunk_size"):
        tif.per_sample_grads(loss, chunk_size=5)


def test_the_options_spelling_warns_nothing(setup, recwarn):
    loss, _, _ = setup
    tif.per_sample_grads(loss, options=tif.GradientOptions(chunk_size=5))
    tif.projected_grads(loss, PROJ, options=tif.GradientOptions(chunk_size=5))
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_options_are_frozen_and_replaced_like_any_value():
    options = tif.GradientOptions(chunk_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.chunk_size = 8
    assert dataclasses.replace(options, chunk_size=8).chunk_size == 8
    with pytest.raises(TypeError):
        tif.GradientOptions(4)  # keywords only: a positional size says nothing


@pytest.mark.parametrize(("field", "value", "message"), [
    ("chunk_size", 0, "chunk_size must be a positive int or None, got 0"),
    ("chunk_size", True, "chunk_size must be a positive int or None, got True"),
    ("memory_budget", -1, "memory_budget must be a positive number of bytes or None"),
    ("offload", 1, "offload must be True or False, got 1"),
    ("compile_projection", "yes", "compile_projection must be True or False"),
    ("stages", "model", "stages must be a tracinfunc.grads.Stages, got str"),
    ("mixed_precision", "bf16", "mixed_precision must be None"),
])
def test_bad_options_are_refused_when_made(field, value, message):
    with pytest.raises(tif.TracInFuncError, match=f"GradientOptions: {message}"):
        tif.GradientOptions(**{field: value})


def test_options_of_the_wrong_type_are_refused(setup):
    loss, _, _ = setup
    with pytest.raises(tif.errors.InvalidTypeError, match="projected_grads: options must be a "
                                                   "tracinfunc.GradientOptions, got dict"):
        tif.projected_grads(loss, PROJ, options={"chunk_size": 5})


def test_a_bad_keyword_names_the_public_function(setup):
    loss, ckpts, data = setup
    with pytest.raises(tif.errors.InvalidArgumentError,
                       match="^GradientOptions: chunk_size must"):
        tif.GradientOptions(chunk_size=0)
    with pytest.raises(tif.errors.ParameterSelectionError,
                       match="^projected_grads: select entries"):
        tif.projected_grads(loss, PROJ, options=tif.GradientOptions(select=["nope"]))(
            dict(ckpts[0].params), data)


@pytest.fixture(scope="module")
def stores(setup):
    loss, ckpts, data = setup
    return tif.build_store(loss, ckpts, data, projection=PROJ), ckpts


@pytest.mark.parametrize("function", ["score", "top_k", "score_chunks"])
def test_scoring_errors_name_the_function_called(stores, function):
    """top_k and score_chunks used to say "score" for bad test gradients."""
    store, _ = stores
    bad = torch.zeros(3, 2, 5)  # k=5, the store has k=8
    call = {"score": lambda: tif.score(store, bad),
            "top_k": lambda: tif.top_k(store, bad, k=2),
            "score_chunks": lambda: next(tif.score_chunks(store, bad))}[function]
    with pytest.raises(
        tif.errors.IncompatibleGradientsError, match=f"^{function}: test gradients must"
    ):
        call()
    with pytest.raises(tif.errors.InvalidArgumentError, match=f"^{function}: chunk_rows must"):
        {"score": lambda: tif.score(store, store, chunk_rows=0),
         "top_k": lambda: tif.top_k(store, store, k=2, chunk_rows=0),
         "score_chunks": lambda: next(tif.score_chunks(store, store, chunk_rows=0))}[function]()


def test_self_influence_names_itself(stores):
    store, _ = stores
    with pytest.raises(tif.TracInFuncError, match="^self_influence: output must"):
        tif.self_influence(store, output="matlab")


def test_the_outermost_entry_point_speaks_and_generators_keep_their_name():
    @entry_point("inner")
    def inner():
        return current_caller()

    @entry_point("outer")
    def outer():
        return inner()

    @entry_point("gen")
    def gen():
        yield current_caller()
        yield inner()

    assert inner() == "inner" and outer() == "outer"
    items = gen()
    assert next(items) == "gen"
    assert current_caller("nobody") == "nobody"  # not while the caller holds the generator
    assert next(items) == "gen"
    with pytest.raises(tif.errors.InvalidArgumentError, match="^mine: n must be an int in "
                                                       r"\[1, n_train=3\], got 4; fix it\.$"), \
            calling("mine"):
        check_int(4, "n", maximum=3, maximum_label="n_train", fix="fix it")


def test_no_function_takes_the_callers_name_as_a_parameter():
    """One caller mechanism: the context variable set at entry points, never a parameter."""
    import ast
    from pathlib import Path

    offenders = []
    for path in Path(tif.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(argument.arg == "caller" for argument in arguments):
                    offenders.append(f"{path.name}:{node.name}")
    assert offenders == []


def test_a_method_entry_point_names_the_class_of_self():
    class Base:
        @entry_point("{cls}.read")
        def read(self):
            return current_caller()

    class Special(Base):
        pass

    assert Base().read() == "Base.read" and Special().read() == "Special.read"
