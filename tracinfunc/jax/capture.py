"""Layer inputs ``x`` and output gradients ``delta`` from a JAX loss, for K-FAC and EK-FAC.

The JAX twin of :mod:`tracinfunc.curvature.capture`. A JAX loss is an opaque function, so
the layers are found where Flax calls them: while the loss runs here, a linen interceptor
(``flax.linen.intercept_methods``) and, for NNX, a wrapper around ``nnx.Linear.__call__`` /
``nnx.Embed.__call__`` record each call whose kernel *is* one of the checkpoint's parameter
leaves (the same array object: ``nnx.merge`` and ``module.apply`` pass leaves through), and
add a zero "tap" to its output; ``jax.grad`` with respect to the taps gives ``delta``.

The contract, documented in docs/jax.md:

* the loss builds its model from the ``params`` it receives (``nnx.merge(graphdef, params,
  state)`` or ``module.apply({"params": params, ...}, x)``) without copying or casting the
  leaves, and calls each layer once per example;
* every parameter is the kernel or bias of a linen ``nn.Dense`` / NNX ``nnx.Linear`` (rule
  ``"linear"``, kernel ``[in, out]`` -> torch ``[out, in]``) or the table of an ``nn.Embed`` /
  ``nnx.Embed`` (rule ``"embedding"``, ``[vocab, features]`` both sides); anything else
  (Conv, LayerNorm, a hand-written ``x @ w``) is refused by name, as torch refuses it;
* the :class:`~tracinfunc.jax.ParamMapping` gives each leaf its torch name, so the factors
  are keyed and shaped exactly as :func:`tracinfunc.fit_curvature` keys them on the twin.

Flax is imported only here (and only when a K-FAC fit runs).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax import tree_util

from tracinfunc._validate import current_caller
from tracinfunc.curvature.capture import KfacLayer
from tracinfunc.errors import IncompatibleGradientsError, InvalidArgumentError, LossFunctionError
from tracinfunc.jax.grads import held_slot, weakly
from tracinfunc.jax.layout import ParamMapping
from tracinfunc.jax.precision import float32_jit, float32_matmuls

__all__ = ["SUPPORTED", "kfac_io"]

SUPPORTED = ("flax.linen Dense", "flax.linen Embed", "nnx.Linear", "nnx.Embed")


@dataclass(frozen=True)
class _Call:
    """One recorded layer call: its rule (or unsupported type name), leaf indices, input."""

    rule: str | None
    kind: str
    kernel: int
    bias: int | None
    x: Any
    out: Any


def _flax() -> tuple[Any, Any]:
    try:
        import flax.linen as linen
        from flax import nnx
    except ImportError as error:  # pragma: no cover - flax is how layers are found
        raise ImportError(
            f"{current_caller()}: kind='kfac'/'ekfac' from JAX finds Flax layers; install "
            "it with: pip install flax") from error
    return linen, nnx


@contextmanager
def _tapped(ids: dict[int, int], taps: list | None) -> Iterator[list[_Call]]:
    """Record calls of Flax layers whose kernel is a leaf in ``ids`` (``id -> leaf index``);
    add ``taps[call]`` to their outputs when given."""
    linen, nnx = _flax()
    calls: list[_Call] = []

    def record(kind: str, rule: str | None, kernel: Any, bias: Any, x: Any, run) -> Any:
        index = ids.get(id(kernel))
        if index is None:
            return run()
        out = run()
        if rule is not None and taps is not None:
            if len(calls) >= len(taps):
                raise LossFunctionError(
                    f"{current_caller()}: a layer was called more often than on the first "
                    "example; K-FAC needs each layer called once per example.")
            out = out + taps[len(calls)]
        calls.append(_Call(rule, kind, index, ids.get(id(bias)), x, out))
        return out

    def intercept(next_fun, args, kwargs, context):
        module, method = context.module, context.method_name
        own = module.variables.get("params", {}) if module.scope is not None else {}
        kernel = own.get("kernel", own.get("embedding")) if hasattr(own, "get") else None
        if kernel is None or id(kernel) not in ids:
            return next_fun(*args, **kwargs)
        rule = {(linen.Dense, "__call__"): "linear",
                (linen.Embed, "__call__"): "embedding"}.get((type(module), method))
        return record(f"{type(module).__name__}.{method}", rule, kernel, own.get("bias"),
                      args[0] if args else None, lambda: next_fun(*args, **kwargs))

    originals = {}

    def wrap(cls: type, method: str, rule: str | None, leaf: str) -> None:
        original = getattr(cls, method)
        originals[(cls, method)] = original

        def wrapped(self, *args, **kwargs):
            kernel = _value(getattr(self, leaf))
            bias = getattr(self, "bias", None)
            supported = rule if type(self) is cls else None
            return record(f"nnx.{type(self).__name__}.{method}", supported, kernel,
                          None if bias is None else _value(bias), args[0] if args else None,
                          lambda: original(self, *args, **kwargs))

        setattr(cls, method, wrapped)

    try:
        wrap(nnx.Linear, "__call__", "linear", "kernel")
        wrap(nnx.Embed, "__call__", "embedding", "embedding")
        wrap(nnx.Embed, "attend", None, "embedding")
        for cls in (nnx.Conv, nnx.ConvTranspose, nnx.LinearGeneral, nnx.Einsum):
            wrap(cls, "__call__", None, "kernel")
        with linen.intercept_methods(intercept):
            yield calls
    finally:
        for (cls, method), original in originals.items():
            setattr(cls, method, original)


def _value(variable: Any) -> Any:
    """The array an NNX Variable holds, the very object (``variable[...]`` would copy)."""
    get = getattr(variable, "get_value", None)
    return get() if get is not None else variable.value


def _leaf_ids(mapping: ParamMapping, params: Any) -> dict[int, int]:
    """``{id(leaf): index in mapping.leaves}`` of the parameter leaves as the loss gets them."""
    return {id(leaf): i for i, leaf in enumerate(mapping._leaves_of(params))}


def _layers(calls: list[_Call], mapping: ParamMapping) -> list[KfacLayer]:
    """The K-FAC layers of the recorded calls, in call order; refuse what is not covered."""
    leaves = mapping.leaves
    layers, covered, unsupported, repeated, shapes = [], set(), [], [], []
    for call in calls:
        weight = leaves[call.kernel].name
        bias = None if call.bias is None else leaves[call.bias].name
        if call.rule is None:
            unsupported.append(f"{weight!r} ({call.kind})")
            covered |= {weight, bias} - {None}
            continue
        if weight in covered:
            repeated.append(weight)
            continue
        torch_shape = leaves[call.kernel].shape
        jax_shape = tuple(call.x.shape[-1:] if call.rule == "linear" else ())
        d_out = int(call.out.shape[-1])
        if call.rule == "linear":
            d_in, expected = int(jax_shape[0]), (d_out, int(jax_shape[0]))
        else:
            d_in = torch_shape[0] if len(torch_shape) == 2 else -1
            expected = (d_in, d_out)
        if tuple(torch_shape) != expected:
            shapes.append(f"{weight!r} is {list(torch_shape)} in torch layout, expected "
                          f"{list(expected)}")
        layers.append(KfacLayer(weight, bias, call.rule, d_out, d_in))
        covered |= {weight, bias} - {None}
    if shapes:
        raise IncompatibleGradientsError(
            f"{current_caller()}: the mapping does not give torch's layout to these layers: "
            f"{'; '.join(shapes)}. Build it with ParamMapping.flax(model) (Dense kernels "
            "[in, out] become torch's [out, in]).")
    rest = [leaf.name for leaf in leaves if leaf.name not in covered]
    if unsupported or repeated or rest:
        problems = []
        if unsupported:
            problems.append(f"applied by unsupported layers: {', '.join(unsupported)}")
        if repeated:
            problems.append(f"applied by several layer calls (tied weights): {repeated}")
        if rest:
            problems.append(f"not the kernel or bias of a Flax layer the loss called: "
                            f"{rest[:6]}")
        raise InvalidArgumentError(
            f"{current_caller()}: kind='kfac'/'ekfac' from JAX covers the kernels and biases "
            f"of {', '.join(SUPPORTED)} layers, each called once per example on the very "
            f"parameter arrays the loss receives, but some parameters are "
            f"{'; '.join(problems)}. Use kind='projected' (any model) or 'dense' (small "
            "models), or fit K-FAC with tracinfunc.fit_curvature on the torch twin.")
    return layers


def kfac_io(loss: Callable, mapping: ParamMapping, args: tuple, example: Any
            ) -> tuple[list[KfacLayer], Callable[..., list[tuple[torch.Tensor, torch.Tensor]]]]:
    """:func:`_kfac_io`, made once per (loss, mapping, argument shapes) and kept as long as
    the loss lives: a second fit with the same loss compiles nothing."""
    signature = (mapping, *(
        (tree_util.tree_structure(tree),
         tuple((jnp.shape(leaf), jnp.result_type(leaf)) for leaf in tree_util.tree_leaves(tree)))
        for tree in (*args, example)))
    held = held_slot(_IO, loss)
    if held is None:  # not weak-referenceable: made anew
        return _kfac_io(loss, mapping, args, example)
    if signature not in held:
        held[signature] = _kfac_io(loss, mapping, args, example)
    return held[signature]


_IO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loss -> {signature: io}


def _kfac_io(loss: Callable, mapping: ParamMapping, args: tuple, example: Any
             ) -> tuple[list[KfacLayer], Callable[..., list[tuple[torch.Tensor, torch.Tensor]]]]:
    """The layers of ``loss`` and ``fn(*args, batch) -> [(x, delta) per layer]`` torch tensors.

    Args:
        loss: ``loss(*args, example) -> scalar`` in JAX.
        mapping: Names the parameter leaves (``args[0]``) in torch.
        args: A checkpoint's ``args`` (``(params,)`` or ``(params, state)``).
        example: One example (no batch dimension): fixes the layers and their shapes.

    Returns:
        The :class:`~tracinfunc.curvature.capture.KfacLayer` list in call order, and the
        function giving per layer ``x [b, T, d_in]`` (token ids ``[b, T]`` for an embedding)
        and ``delta [b, T, d_out]``, as :func:`tracinfunc.curvature.capture.layer_io`.
    """
    found: list[list[_Call]] = []
    loss = weakly(loss)  # the result is cached under the loss: never keep it alive

    def discover(args: tuple, example: Any) -> Any:
        with _tapped(_leaf_ids(mapping, args[0]), None) as calls:
            value = loss(*args, example)
        found.append([_Call(c.rule, c.kind, c.kernel, c.bias,
                            jax.ShapeDtypeStruct(jnp.shape(c.x), jnp.result_type(c.x)),
                            jax.ShapeDtypeStruct(c.out.shape, c.out.dtype)) for c in calls])
        return value

    with float32_matmuls():  # traced as every program traces it (jax/precision.py)
        jax.eval_shape(discover, args, example)
    layers = _layers(found[0], mapping)
    outs = [c.out for c in found[0]]

    def one(args: tuple, example: Any) -> tuple[list, list]:
        ids = _leaf_ids(mapping, args[0])

        def inner(taps: list) -> tuple[Any, list]:
            with _tapped(ids, taps) as calls:
                value = loss(*args, example)
            if [c.kernel for c in calls] != [c.kernel for c in found[0]]:
                raise LossFunctionError(
                    f"{current_caller()}: the layers were called otherwise than on the first "
                    "example; K-FAC needs the same layer calls for every example.")
            return value, [c.x for c in calls]

        taps = [jnp.zeros(o.shape, o.dtype) for o in outs]
        deltas, inputs = jax.grad(inner, has_aux=True)(taps)
        return inputs, deltas

    batched = float32_jit(jax.vmap(one, in_axes=(None, 0)))

    def io(*args_and_batch: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        *args, batch = args_and_batch
        inputs, deltas = batched(tuple(args), batch)
        out = []
        for layer, x, delta in zip(layers, inputs, deltas, strict=True):
            b = delta.shape[0]
            x = _tensor(x).reshape(b, -1) if layer.rule == "embedding" else \
                _tensor(x).reshape(b, -1, layer.d_in)
            out.append((x.long() if layer.rule == "embedding" else x,
                        _tensor(delta).reshape(b, -1, layer.d_out)))
        return out

    return layers, io


def _tensor(array: Any) -> torch.Tensor:
    return torch.from_numpy(jax.device_get(array).copy())
