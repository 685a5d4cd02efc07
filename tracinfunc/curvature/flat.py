"""Per-example gradients between their three forms: a dict, a flat row, a layer matrix.

Flat rows follow the canonical layout (parameters sorted by name, each flattened as stored), the
order of the ``identity`` projection and of ``tests/reference.py``. A K-FAC layer's matrix is
``[d_out, d_a]``: the weight as ``[d_out, d_in]`` (``Conv1D`` and ``Embedding`` weights are
stored transposed, a ``Conv2d`` weight flattened past its first dimension) and the bias as the
last column.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from tracinfunc.curvature.capture import KfacLayer
from tracinfunc.projection.spec import Layout

__all__ = ["flat_map", "flatten", "layer_matrix", "split_layer", "unflatten"]


def flatten(grads: dict[str, Tensor], layout: Layout) -> Tensor:
    """``{name: [b, *shape]} -> [b, p]`` in layout order."""
    return torch.cat([grads[name].reshape(grads[name].shape[0], -1) for name, _ in layout], 1)


def unflatten(flat: Tensor, layout: Layout) -> dict[str, Tensor]:
    """``[b, p] -> {name: [b, *shape]}``."""
    out, start = {}, 0
    for name, shape in layout:
        size = math.prod(shape)
        out[name] = flat[:, start:start + size].reshape(flat.shape[0], *shape)
        start += size
    return out


def flat_map(fn: Callable[..., dict[str, Tensor]], layout: Layout
             ) -> Callable[[Tensor], Tensor]:
    """``fn`` on named vectors ``{name: [b, *shape]}`` as a map of flat rows ``[b, p]``
    (float64, in layout order): a dict-valued product or preconditioner, given flat rows
    (keyword arguments are passed on: a product's ``batches=``)."""
    def on_rows(rows: Tensor, **options) -> Tensor:
        return flatten(fn(unflatten(rows, layout), **options), layout).double()

    return on_rows


def layer_matrix(grads: dict[str, Tensor], layer: KfacLayer) -> Tensor:
    """``[b, d_out, d_a]`` from the layer's weight (and bias) gradients."""
    weight = grads[layer.weight]
    if layer.rule in ("conv1d", "embedding"):  # stored [d_in, d_out]
        weight = weight.transpose(1, 2)
    elif layer.rule == "conv2d":  # [b, C_out, C_in, kh, kw] -> [b, d_out, C_in kh kw]
        weight = weight.reshape(weight.shape[0], layer.d_out, layer.d_in)
    if layer.bias is None:
        return weight
    return torch.cat([weight, grads[layer.bias][:, :, None]], dim=2)


def split_layer(matrix: Tensor, layer: KfacLayer, shape: tuple[int, ...]) -> dict[str, Tensor]:
    """Inverse of :func:`layer_matrix`: ``{weight: [b, *shape], bias: [b, d_out]}``."""
    weight = matrix[:, :, :layer.d_in]
    if layer.rule in ("conv1d", "embedding"):
        weight = weight.transpose(1, 2)
    out = {layer.weight: weight.reshape(matrix.shape[0], *shape)}
    if layer.bias is not None:
        out[layer.bias] = matrix[:, :, layer.d_in]
    return out
