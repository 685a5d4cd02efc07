"""Layer inputs ``x`` and output gradients ``delta`` per example, for K-FAC.

A layer ``y = x W^T + b`` has the per-example gradient ``G = delta^T [x, 1]`` (summed over
tokens), so K-FAC's factors ``E[x x^T]`` and ``E[delta delta^T]`` and the factored
preconditioning ``S^-1 G A^-1`` need ``x`` and ``delta`` only. They are captured as
:mod:`tracinfunc.grads.factorized` does for the Kronecker projection (with its own small
copy, so the two evolve apart): a global forward hook records the calls of layers whose weight
is one of the parameters, and ``grad`` of the loss with respect to zero "taps" added to their
outputs gives ``delta``. Weights and biases stay constants; nothing else may be selected.

Supported layers (exact types), each called once per example: ``nn.Linear``, Hugging Face
``Conv1D`` (GPT-2), ``nn.Conv2d`` (KFC, Grosse & Martens 2016: ``x`` is the unfolded input
patches ``[L, C_in kh kw]`` of ``F.unfold`` and ``delta`` the output gradient at each of the
``L`` output positions, so the layer is a Linear applied at ``L`` positions; ``groups=1`` and
zero padding) and ``nn.Embedding`` (``x`` is the token id: a one-hot input, so ``E[x x^T]`` is
diagonal, the token frequencies; no ``max_norm``, ``scale_grad_by_freq`` or ``sparse``, and
positions holding ``padding_idx`` carry no gradient). Anything else holding a selected
parameter is refused by name.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad, vmap
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from tracinfunc._hooks import register_thread_forward_hook
from tracinfunc._validate import current_caller
from tracinfunc.errors import InvalidArgumentError, LossFunctionError
from tracinfunc.types import Batch, Example, LossFn, Params

__all__ = ["SUPPORTED", "KfacLayer", "check_inputs_unchanged", "find_layers", "layer_io"]

SUPPORTED = ("nn.Linear", "transformers Conv1D", "nn.Conv2d", "nn.Embedding")


@dataclass(frozen=True)
class KfacLayer:
    """One layer K-FAC covers.

    Attributes:
        weight: The weight's parameter name.
        bias: The bias's parameter name, or ``None`` (no bias, or not selected).
        rule: ``"linear"`` (weight ``[d_out, d_in]``), ``"conv1d"`` (weight ``[d_in, d_out]``),
            ``"conv2d"`` (weight ``[d_out, C_in, kh, kw]``, ``d_in = C_in kh kw``) or
            ``"embedding"`` (weight ``[d_in, d_out]``: ``d_in`` tokens, ``A`` diagonal).
        d_out: Output features (channels, embedding size).
        d_in: Input features (without the bias column; patch size; vocabulary size).
    """

    weight: str
    bias: str | None
    rule: str
    d_out: int
    d_in: int

    @property
    def d_a(self) -> int:
        """Size of the input factor ``A``: ``d_in`` plus one column for the bias."""
        return self.d_in + (self.bias is not None)

    def to_list(self) -> list:
        return [self.weight, self.bias, self.rule, self.d_out, self.d_in]


def _rule(module: nn.Module) -> str | None:
    kind = type(module)
    if kind is nn.Linear:
        return "linear"
    if kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers"):
        return "conv1d"
    if kind is nn.Conv2d and module.groups == 1 and module.padding_mode == "zeros" \
            and (not isinstance(module.padding, str) or module.padding == "valid"):
        return "conv2d"
    if kind is nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq \
            and not module.sparse:
        return "embedding"
    return None


def _refusal(module: nn.Module) -> str:
    """Why a module is not covered (its type, and the option when the type is supported)."""
    name = type(module).__name__
    if type(module) is nn.Conv2d:
        return (f"{name} with groups={module.groups}, padding={module.padding!r}, "
                f"padding_mode={module.padding_mode!r}: K-FAC covers groups=1 with zero "
                "padding")
    if type(module) is nn.Embedding:
        return (f"{name} with max_norm/scale_grad_by_freq/sparse: K-FAC covers plain "
                "lookups")
    return name


def _sizes(rule: str, shape: torch.Size) -> tuple[int, int]:
    """``(d_out, d_in)`` of a weight of ``shape`` under ``rule``."""
    if rule in ("linear", "conv2d"):
        return int(shape[0]), int(math.prod(shape[1:]))
    return int(shape[1]), int(shape[0])  # conv1d, embedding: [d_in, d_out]


def _reader(module: nn.Module, layer: KfacLayer) -> Callable[[Tensor, Tensor], tuple]:
    """``(input, output gradient) -> (x [T, d_in] (ids [T] for embeddings), delta [T, d_out])``
    for one example's call of ``module``."""
    if layer.rule == "conv2d":
        padding = 0 if module.padding == "valid" else module.padding

        def patches(x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
            x = x.reshape(-1, *x.shape[-3:])  # [n, C_in, H, W]
            unfolded = F.unfold(x, module.kernel_size, dilation=module.dilation,
                                padding=padding, stride=module.stride)  # [n, d_in, L]
            delta = delta.reshape(-1, layer.d_out, delta.shape[-2] * delta.shape[-1])
            return (unfolded.transpose(1, 2).reshape(-1, layer.d_in),
                    delta.transpose(1, 2).reshape(-1, layer.d_out))

        return patches
    if layer.rule == "embedding":
        pad = module.padding_idx

        def tokens(ids: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
            ids, delta = ids.reshape(-1), delta.reshape(-1, layer.d_out)
            if pad is not None:  # no gradient flows to the padding row
                delta = delta * (ids != pad).to(delta.dtype)[:, None]
            return ids, delta

        return tokens
    return lambda x, delta: (x.reshape(-1, layer.d_in), delta.reshape(-1, layer.d_out))


@contextmanager
def _hooked(ids: dict[int, int], taps: list[Tensor] | None) -> Iterator[list]:
    """Record ``(layer index, module, input, output, id of the bias)`` of calls of layers in
    ``ids`` (the bias as called: ``functional_call`` restores the module's own afterwards);
    add ``taps[call]`` to the outputs when given."""
    seen: list = []

    def hook(module, inputs, output):
        index = ids.get(id(getattr(module, "weight", None)))
        if index is None:
            return None
        call = len(seen)
        seen.append((index, module, inputs[0], output, id(getattr(module, "bias", None)),
                     inputs[0]._version))
        if taps is None:
            return None
        if call >= len(taps):
            raise LossFunctionError(
                f"{current_caller()}: a layer was called more often than on the first "
                "example; K-FAC needs each layer called once per example."
            )
        return output + taps[call]

    handle = register_thread_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def find_layers(loss: LossFn, params: Params, example: Example) -> list[KfacLayer]:
    """The layers applying ``params``, in call order; refuse what K-FAC cannot cover.

    Raises:
        InvalidArgumentError: a parameter is not the weight or bias of a supported layer, a
            layer is called more than once (a tied weight), or a layer's weight or bias is
            read outside its call (``h @ layer.weight``, a penalty, a tied output head).
    """
    ids = {id(value): i for i, value in enumerate(params.values())}
    names = list(params)
    # Grad mode on (nothing needs a gradient, so no graph is kept): a read of a weight under
    # the model's own torch.no_grad() carries no gradient and is not counted as a use.
    with torch.enable_grad(), _hooked(ids, None) as seen, _ParameterUses(params) as uses:
        loss(params, example)
    bias_names = {id(value): name for name, value in params.items()}
    layers, covered, unsupported, repeated = [], set(), [], []
    calls = Counter(name for index, _, _, _, bias_id, _ in seen
                    for name in (names[index], bias_names.get(bias_id)) if name is not None)
    outside = sorted(name for name, count in uses.items() if 0 < calls[name] < count)
    for index, module, _, _, bias_id, _ in seen:
        weight, rule = names[index], _rule(module)
        if rule is None:
            bias = bias_names.get(bias_id)  # name the bias too: both are refused
            unsupported.append(f"{weight!r} ({_refusal(module)})"
                               + (f", {bias!r} (its bias)" if bias else ""))
            covered |= {weight, bias_names.get(bias_id)} - {None}
            continue
        if weight in covered:
            repeated.append(weight)
            continue
        bias = bias_names.get(bias_id)
        d_out, d_in = _sizes(rule, params[weight].shape)
        layers.append(KfacLayer(weight, bias, rule, d_out, d_in))
        covered |= {weight, bias} - {None}
    repeated += [name for name in outside if name not in repeated]
    rest = [name for name in names if name not in covered]
    if unsupported or repeated or rest:
        problems = []
        if unsupported:
            problems.append(f"applied by unsupported layers: {', '.join(unsupported)}")
        if repeated:
            problems.append("applied by several layer calls, or read outside their layer's "
                            f"call (tied weights, a weight in a matmul or penalty): {repeated}")
        if rest:
            problems.append(f"not the weight or bias of a layer: {rest[:6]}")
        coverable = sorted({name for layer in layers for name in (layer.weight, layer.bias)
                            if name is not None} - set(repeated))
        shown = coverable if len(coverable) <= 30 else [*coverable[:30], "..."]
        select = (f"build the store AND fit the curvature with options=GradientOptions("
                  f"select={shown}) ({len(coverable)} parameters); to keep a store of these "
                  "parameters, " if coverable else  # never advise select=[] (refused)
                  "none of the selected parameters is covered, so select supported layers; "
                  "to keep a store of these parameters, ")
        raise InvalidArgumentError(
            f"{current_caller()}: kind='kfac'/'ekfac' covers the weights and biases of "
            f"{', '.join(SUPPORTED)} layers called once per example, but some selected "
            f"parameters are {'; '.join(problems)}. A K-FAC curvature can only score a store "
            f"of exactly the parameters it covers: {select}fit "
            "kind='projected' with projection=store.projection (any model), or 'dense' "
            "(small models)."
        )
    return layers


class _ParameterUses(TorchFunctionMode):
    """Counts, per parameter name, the torch functions that take the parameter itself and
    return a tensor (a layer's own call is one; ``h @ layer.weight``, ``weight ** 2`` or a
    tied head's ``F.linear(h, embedding.weight)`` are more). Metadata (``.shape``,
    ``.dtype``, ``.size()``) returns no tensor, and a use under ``torch.no_grad()`` or through
    ``.detach()``/``.data`` carries no gradient: neither is counted. K-FAC describes a weight
    only as its layer applies it: any other use changes the weight's gradient."""

    def __init__(self, params: Params) -> None:
        super().__init__()
        self.names = {id(value): name for name, value in params.items()}
        self.uses: Counter = Counter()

    def __enter__(self) -> Counter:
        super().__enter__()
        return self.uses

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if not torch.is_grad_enabled() or any(func == plain for plain in _NO_GRADIENT):
            return result
        if isinstance(result, Tensor) or (isinstance(result, tuple | list) and any(
                isinstance(item, Tensor) for item in result)):
            for value in tree_leaves((args, kwargs)):  # torch.cat([w, ...]) too
                name = self.names.get(id(value))
                if name is not None:
                    self.uses[name] += 1
        return result


_NO_GRADIENT = (Tensor.detach, Tensor.data.__get__)  # a parameter's values, no gradient


def layer_io(loss: LossFn, params: Params, layers: list[KfacLayer], example: Example
             ) -> Callable[[Batch], list[tuple[Tensor, Tensor]]]:
    """``fn(batch) -> [(x [b, T, d_in], delta [b, T, d_out]) per layer]`` at ``params``
    (for an embedding ``x`` is the token ids ``[b, T]``; for a Conv2d ``T`` is the output
    positions and ``x`` the input patches).

    ``example`` (no batch dimension) fixes the layers' output shapes; every example of a
    batch must call the layers alike (sequences padded to one length).
    """
    ids = {id(params[layer.weight]): i for i, layer in enumerate(layers)}
    with torch.no_grad(), _hooked(ids, None) as seen:
        loss(params, example)
    shapes = [(output.shape, output.dtype) for _, _, _, output, *_ in seen]
    readers = [_reader(module, layers[index]) for index, module, *_ in seen]
    order = [index for index, *_ in seen]
    if order != list(range(len(layers))):
        raise InvalidArgumentError(
            f"{current_caller()}: the layers were called in another order than when they were "
            "found; K-FAC needs the same layer calls for every example."
        )
    device = next(iter(params.values())).device

    def one(example: Example) -> list[tuple[Tensor, Tensor]]:
        taps = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in shapes]

        def inner(taps: list[Tensor]):
            with _hooked(ids, taps) as calls:
                value = loss(params, example)
            check_inputs_unchanged(x._version != version for _, _, x, _, _, version in calls)
            return value, [x for _, _, x, *_ in calls]

        deltas, inputs = grad(inner, has_aux=True)(taps)
        return [read(x, delta) for read, x, delta in zip(readers, inputs, deltas, strict=True)]

    def batched(batch: Batch) -> list[tuple[Tensor, Tensor]]:
        return vmap(one)(batch)

    return batched


def check_inputs_unchanged(changed: Iterable[bool],
                           error: type[LossFunctionError] = LossFunctionError) -> None:
    """Refuse (``error``) a forward that wrote into a layer's input after the layer read it:
    ``A`` would be formed from the written values (the weights are constants, so no backward
    notices)."""
    if any(changed):
        raise error(
            f"{current_caller()}: the model wrote into a layer's input in place after the "
            "layer read it (e.g. out = layer(h); h.add_(1)), so K-FAC would see the written "
            "values, not the ones the layer read; write out of place (h = h + 1).")


def first_example(batch: Batch) -> Example:
    """Example 0 of a batch (no batch dimension)."""
    return tree_map(lambda leaf: leaf[0], batch)
