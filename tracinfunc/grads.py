"""Per-example gradients as pure function transforms: ``vmap(grad(loss))``.

Both transforms return functions, like ``torch.func``: build them once, call them on any
``(params, batch)``. Projection happens *inside* the vmapped function, so with ``chunk_size``
only ``chunk_size`` full per-example gradients exist at any moment, never ``b`` of them.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor
from torch.func import grad, vmap

from tracinfunc.errors import LossFunctionError, TrainModeError
from tracinfunc.projection import Projection, Projector, canonical_layout, make_projector
from tracinfunc.types import Batch, Example, LossFn, Params

__all__ = ["per_sample_grads", "projected_grads"]


def per_sample_grads(
    loss: LossFn, *, chunk_size: int | None = None
) -> Callable[[Params, Batch], dict[str, Tensor]]:
    """Per-example gradients of ``loss`` with respect to ``params``: ``vmap(grad(loss))``.

    Args:
        loss: ``loss(params, example) -> scalar``; ``example`` has no batch dimension.
        chunk_size: Examples differentiated at once inside vmap (``None``: the whole batch).
            Smaller values bound memory; results do not change.

    Returns:
        ``fn(params, batch) -> {name: [b, *shape]}``, the gradient of each example's loss.

    Example:
        >>> psg = per_sample_grads(loss)
        >>> grads = psg(params, (x, y))   # {"fc.weight": [b, out, in], ...}
    """
    _check_chunk_size(chunk_size, caller="per_sample_grads")
    batched = vmap(grad(loss), in_dims=(None, 0), chunk_size=chunk_size)

    def per_sample_grads_fn(params: Params, batch: Batch) -> dict[str, Tensor]:
        return _call_loss_transform(batched, params, batch, caller="per_sample_grads")

    return per_sample_grads_fn


def projected_grads(
    loss: LossFn, projection: Projection, *, chunk_size: int | None = None
) -> Callable[[Params, Batch], Tensor]:
    """Per-example gradients projected to ``k`` dimensions, the projection fused inside vmap.

    The returned function keeps one :class:`~tracinfunc.projection.Projector` per parameter
    layout, device and dtype, so projection blocks are generated once and reused across
    batches and checkpoints.

    Args:
        loss: ``loss(params, example) -> scalar``; ``example`` has no batch dimension.
        projection: The projection spec (kind, dim, seed).
        chunk_size: Examples differentiated at once (``None``: the whole batch). Only this
            many full gradients are alive at once; results do not change.

    Returns:
        ``fn(params, batch) -> [b, k]`` in the dtype and on the device of ``params``.
    """
    if not isinstance(projection, Projection):
        raise TypeError(
            "projected_grads: projection must be a tracinfunc.Projection, got "
            f"{type(projection).__name__}; e.g. Projection(dim=512, seed=0)."
        )
    _check_chunk_size(chunk_size, caller="projected_grads")
    if projection.kind == "kronecker":  # factorised Linear/Conv2d; imported here: it imports us
        from tracinfunc.factorized import factorized_projected_grads

        factorized = factorized_projected_grads(loss, projection, chunk_size=chunk_size)
        return lambda params, batch: _call_loss_transform(factorized, params, batch,
                                                          caller="projected_grads")
    projectors: dict[tuple, Projector] = {}

    def projector_for(params: Params) -> Projector:
        layout = canonical_layout(params)
        first = next(iter(params.values()))
        key = (layout, first.device, first.dtype)
        if key not in projectors:
            projectors[key] = make_projector(
                projection, layout, device=first.device, dtype=first.dtype
            )
        return projectors[key]

    def projected_grads_fn(params: Params, batch: Batch) -> Tensor:
        project = projector_for(params)

        def one_example(params: Params, example: Example) -> Tensor:
            return project(grad(loss)(params, example))

        batched = vmap(one_example, in_dims=(None, 0), chunk_size=chunk_size)
        return _call_loss_transform(batched, params, batch, caller="projected_grads")

    return projected_grads_fn


def _call_loss_transform(fn, params: Params, batch: Batch, *, caller: str):
    """Call a vmapped gradient function, turning torch.func's errors into actionable ones."""
    try:
        return fn(dict(params), batch)
    except RuntimeError as error:
        clearer = explain_loss_error(error, caller=caller)
        if clearer is None:
            raise
        raise clearer from error


def explain_loss_error(error: Exception, *, caller: str) -> Exception | None:
    """A tracinfunc error that explains a known torch failure of the loss, else ``None``."""
    message = str(error).strip()
    batchnorm_hints = ("running_mean", "running_var", "value per channel", "mutate a captured")
    if any(hint in message for hint in batchnorm_hints):
        return TrainModeError(
            f"{caller}: the loss updates state in place, as a BatchNorm layer in train mode "
            f"does ({message}). Put the model in eval mode (model.eval()) before computing "
            "gradients: per-example gradients need fixed statistics."
        )
    if "to return a scalar" in message or "scalar Tensor" in message:
        return LossFunctionError(
            f"{caller}: loss(params, example) must return a scalar for one example, but "
            f"torch.func said: {message}. Reduce the loss (e.g. .sum()) and make sure "
            "`example` has no batch dimension."
        )
    return None


def _check_chunk_size(chunk_size: int | None, *, caller: str) -> None:
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(
            f"{caller}: chunk_size must be a positive int or None, got {chunk_size!r}."
        )

