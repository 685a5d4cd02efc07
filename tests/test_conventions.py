"""The public API follows the house conventions (issue: JAX interoperability, item 1).

loss(params, example) transforms with has_aux, options keyword-only after the data, no
module-level mutable state, params keyed by name in a canonical order.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import torch

import tracinfunc as tif
import tracinfunc.jax as tj

# Positional parameters with defaults that are part of the data, not options.
_POSITIONAL_DEFAULTS = {"top_k": {"k"}, "indexed_top_k": {"k"}, "rerank": {"k"}}


def _public_functions():
    for module, names in ((tif, tif.__all__), (tj, tj.__all__)):
        for name in names:
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                yield f"{module.__name__}.{name}", obj


def test_options_after_the_data_are_keyword_only():
    offenders = []
    for qualname, fn in _public_functions():
        allowed = _POSITIONAL_DEFAULTS.get(fn.__name__, set())
        for p in inspect.signature(fn).parameters.values():
            positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            if positional and p.default is not p.empty and p.name not in allowed:
                offenders.append(f"{qualname}({p.name}=...)")
    assert offenders == []


def test_gradient_transforms_take_has_aux():
    for fn in (tif.per_sample_grads, tif.projected_grads, tj.per_sample_grads,
               tj.projected_grads):
        param = inspect.signature(fn).parameters["has_aux"]
        assert param.kind is param.KEYWORD_ONLY and param.default is False


def test_no_module_level_mutable_state():
    """Mutable containers at module level are only UPPERCASE constants or __all__."""
    offenders = []
    for info in pkgutil.walk_packages(tif.__path__, "tracinfunc."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            constant = name.startswith("__") or name.lstrip("_") == name.lstrip("_").upper()
            if isinstance(value, dict | list | set) and not constant:
                offenders.append(f"{info.name}.{name}")
    assert offenders == []


def test_projection_is_keyed_by_name_not_insertion_order():
    g = torch.Generator().manual_seed(0)
    params = {"b.weight": torch.randn(3, 4, generator=g), "a.bias": torch.randn(3, generator=g)}
    flipped = dict(reversed(list(params.items())))
    projection = tif.Projection(dim=8, seed=1)

    def loss(p, x):
        return (p["b.weight"] @ x + p["a.bias"]).square().sum()

    x = torch.randn(5, 4, generator=g)
    rows = tif.projected_grads(loss, projection)(params, x)
    assert torch.equal(rows, tif.projected_grads(loss, projection)(flipped, x))
    assert tif.projection.canonical_layout(params) == tif.projection.canonical_layout(flipped)
    assert tif.checkpoint.params_fingerprint(params) == tif.checkpoint.params_fingerprint(flipped)


def test_every_raised_error_is_a_tracinfunc_error():
    # errors.py promises `except tif.TracInFuncError` catches whatever the library raises;
    # ImportError (a missing optional dependency, with its install command) is the exception,
    # and so is AttributeError from a __getattr__, which Python's attribute protocol requires.
    import ast
    import builtins
    from pathlib import Path

    root = Path(tif.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        tree = ast.parse(path.read_text())
        protocol = {id(raise_) for function in ast.walk(tree)
                    if isinstance(function, ast.FunctionDef) and function.name == "__getattr__"
                    for raise_ in ast.walk(function) if isinstance(raise_, ast.Raise)
                    and isinstance(raise_.exc, ast.Call) and isinstance(raise_.exc.func, ast.Name)
                    and raise_.exc.func.id == "AttributeError"}
        for node in ast.walk(tree):
            if id(node) in protocol:
                continue
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and isinstance(node.exc.func, ast.Name)):
                continue  # re-raises and raises of computed errors
            name = node.exc.func.id
            raised = getattr(module, name, getattr(builtins, name, None))
            if isinstance(raised, type) and not (issubclass(raised, tif.TracInFuncError)
                                                 or raised is ImportError):
                offenders.append(f"{path.relative_to(root.parent)}:{node.lineno} {name}")
    assert not offenders, offenders


def test_no_test_module_sets_torch_threads_when_imported():
    """A test module calling ``torch.set_num_threads`` at import sets it for the whole session
    (every module is imported at collection), and on MKL's AMD path a GEMM sums differently
    with 1 and 2 threads: a CLI subprocess then disagreed with the in-process API. Set it in
    a fixture (``one_thread`` in conftest.py) or inside the test."""
    import ast
    from pathlib import Path

    offenders = []
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            call = node.value if isinstance(node, ast.Expr) else None
            if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("set_num_threads"):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []
