"""Per-example gradients as pure function transforms: ``vmap(grad(loss))``.

Both transforms return functions, like ``torch.func``: build them once, call them on any
``(params, batch)``. Projection happens *inside* the vmapped function, so with ``chunk_size``
only ``chunk_size`` full per-example gradients exist at any moment, never ``b`` of them.

The memory and speed options compose freely and never change what is computed beyond float
rounding (mixed precision aside, which is an approximation):

- ``select``: differentiate only some parameters (:mod:`tracinfunc.grads.selection`);
- ``mixed_precision``: forward under autocast (:mod:`tracinfunc.grads.precision`);
- ``stages`` / ``offload``: functional checkpointing, activation offloading and a batched,
  autograd-free frozen prefix (:mod:`tracinfunc.grads.staged`);
- ``memory_budget``: ``chunk_size`` chosen from a byte budget (:mod:`tracinfunc.grads.chunking`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from torch.func import vmap
from torch.utils._pytree import tree_leaves

from tracinfunc._attention import vmap_attention
from tracinfunc._devices import in_full_float32
from tracinfunc._validate import check_bool, current_caller, entry_point
from tracinfunc.batches import has_no_examples
from tracinfunc.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    LossFunctionError,
    TracInFuncError,
    TrainModeError,
)
from tracinfunc.grads.factorized import factorized_projected_grads
from tracinfunc.grads.options import GradientOptions, gradient_options
from tracinfunc.grads.precision import (
    loss_scaled_grad,
    loss_scaled_rows,
    with_mixed_precision,
)
from tracinfunc.grads.staged import staged_grads
from tracinfunc.grads.stages import Stages, check_stages
from tracinfunc.loss import holding, in_place_mismatch, modules_reached
from tracinfunc.precondition.optimizer import Preconditioner
from tracinfunc.projection import Projection, Projector, canonical_layout, make_projector
from tracinfunc.projection.spec import check_projection
from tracinfunc.types import Batch, Example, LossFn, Params

__all__ = ["per_sample_grads", "projected_grads"]


@entry_point("per_sample_grads")
def per_sample_grads(
    loss: LossFn,
    *,
    has_aux: bool = False,
    options: GradientOptions | None = None,
) -> Callable[[Params, Batch], dict[str, Tensor]]:
    """Per-example gradients of ``loss`` with respect to ``params``: ``vmap(grad(loss))``.

    Args:
        loss: ``loss(params, example) -> scalar``; ``example`` has no batch dimension. With
            ``has_aux``, ``loss(params, example) -> (scalar, aux)``.
        has_aux: As in ``torch.func.grad``: the loss also returns auxiliary data (a pytree of
            tensors), returned batched beside the gradients. Not with ``stages``.
        options: How gradients are computed, one :class:`~tracinfunc.GradientOptions`:
            ``chunk_size`` (examples differentiated at once; results do not change),
            ``select`` (only these parameters), ``mixed_precision`` (the forward under
            autocast; gradients stay in the parameters' dtype), ``stages`` with ``offload``
            (stage by stage, recomputing each stage's forward; checked against ``loss`` on
            the first call) and ``memory_budget`` (chooses ``chunk_size``; the output, ``b``
            full gradients, is not bounded by it: use :func:`projected_grads` for that).

    Returns:
        ``fn(params, batch) -> {name: [b, *shape]}`` for the selected parameters; with
        ``has_aux``, ``(grads, aux)`` with every aux leaf ``[b, ...]``.

    Example:
        >>> psg = per_sample_grads(loss)
        >>> grads = psg(params, (x, y))   # {"fc.weight": [b, out, in], ...}
    """
    options = _stages_at_buffers(loss, gradient_options(options))
    _check_has_aux(has_aux, options)
    check_staged = _StagesCheck(loss, options.stages)

    @entry_point("per_sample_grads")
    def per_sample_grads_fn(params: Params, batch: Batch) -> dict[str, Tensor]:
        names, per_stage, chunk = options.resolve(params)
        if per_stage is None:
            return _plain_per_sample(loss, params, batch, names, chunk, options, has_aux)
        check_staged(params, batch)

        def run(examples: Batch, scaling: str) -> dict[str, Tensor]:
            results = staged_grads(
                options.stages, params, examples, per_stage=per_stage,
                transform=lambda index, grads: grads, chunk_size=chunk,
                mixed_precision=options.mixed_precision, offload=options.offload,
                scaling=scaling)
            merged = {name: g for _, grads in results for name, g in grads.items()}
            return {name: merged[name] for name in names}

        return loss_scaled_rows(run, batch, mixed_precision=options.mixed_precision,
                                has_aux=False)

    return per_sample_grads_fn


@entry_point("projected_grads")
def projected_grads(
    loss: LossFn,
    projection: Projection,
    *,
    has_aux: bool = False,
    options: GradientOptions | None = None,
    precondition: Preconditioner | None = None,
) -> Callable[[Params, Batch], Tensor]:
    """Per-example gradients projected to ``k`` dimensions, the projection fused inside vmap.

    The returned function keeps one :class:`~tracinfunc.projection.Projector` per parameter
    layout, device and dtype, so projection blocks are generated once and reused across
    batches and checkpoints.

    Args:
        loss: ``loss(params, example) -> scalar``; ``example`` has no batch dimension.
        projection: The projection spec (kind, dim, seed).
        has_aux: As in :func:`per_sample_grads`: the loss returns ``(scalar, aux)`` and the
            function returns ``(rows, aux)``.
        options: How gradients are computed, one :class:`~tracinfunc.GradientOptions`, as
            for :func:`per_sample_grads`: only ``chunk_size`` full gradients are alive at
            once; the projection covers only the ``select``-ed parameters; with ``stages``
            each stage's gradients are projected as soon as they exist and then freed (the
            projection is linear, so the sum over stages equals projecting the whole
            gradient); ``memory_budget`` counts the gradients and their temporaries;
            ``compile_projection`` generates dense blocks with ``torch.compile`` (same
            numbers, ~9x faster generation after a one-off compile).
        precondition: A :class:`~tracinfunc.Preconditioner` (optimizer-aware TracIn)
            applied to each example's gradient before the projection, for training
            gradients only. Exact (per-element) ones use the generic path (also for
            ``kind="kronecker"``: a per-element map does not factorise); a factored one
            (``precondition.as_factored()``) keeps ``kind="kronecker"`` factorised. Not
            with ``stages``.

    Returns:
        ``fn(params, batch) -> [b, k]`` in the dtype and on the device of ``params``.

    Example:
        >>> opts = GradientOptions(stages=model_stages(model, ce),
        ...                        mixed_precision=torch.bfloat16, memory_budget=2**30)
        >>> fn = projected_grads(loss, Projection(dim=512), options=opts)
    """
    check_projection(projection)
    options = _stages_at_buffers(loss, gradient_options(options))
    _check_has_aux(has_aux, options)
    _check_precondition(precondition, options)
    if (projection.kind == "kronecker" and replace(options, select=None).plain()
            and not has_aux and (precondition is None or precondition.factored)):
        # Factorised path for any loss (layer weights never materialised; a loss that calls
        # no layer falls back inside it to the same projection). With a memory option the
        # generic path below computes the same Kronecker projection, from the materialised
        # gradient.
        factorized = factorized_projected_grads(loss, projection, chunk_size=options.chunk_size,
                                                select=options.select, precondition=precondition)
        return entry_point("projected_grads")(in_full_float32(
            lambda params, batch: _call_loss_transform(factorized, params, batch, loss=loss)))
    projector_for = _projector_cache(projection, compile=options.compile_projection)
    check_staged = _StagesCheck(loss, options.stages)

    @entry_point("projected_grads")
    @in_full_float32  # projections in IEEE float32 even where the process turned TF32 on
    def projected_grads_fn(params: Params, batch: Batch) -> Tensor:
        names, per_stage, chunk = options.resolve(params)
        if per_stage is None:
            project = projector_for({name: params[name] for name in names})
            if precondition is not None:
                project = _preconditioned(project, precondition, params, names)
            return _plain_projected(loss, project, params, batch, names, chunk, options,
                                    has_aux)
        check_staged(params, batch)
        return _staged_projected(projection, projector_for, params, batch, names, per_stage,
                                 chunk, options)

    return projected_grads_fn


def _check_has_aux(has_aux: Any, options: GradientOptions) -> None:
    check_bool(has_aux, "has_aux")
    if has_aux and options.stages is not None:
        raise InvalidArgumentError(
            f"{current_caller()}: has_aux=True cannot be combined with stages=: a staged "
            "backward runs the model stage by stage and never calls the loss as a whole, so "
            "there is no aux to return. Drop one of them."
        )


def _check_precondition(precondition: Preconditioner | None, options: GradientOptions) -> None:
    if precondition is not None and not isinstance(precondition, Preconditioner):
        raise InvalidTypeError(
            f"{current_caller()}: precondition must be a tracinfunc.Preconditioner or None, got "
            f"{type(precondition).__name__}; e.g. Preconditioner.from_optimizer(opt, model)."
        )
    if precondition is not None and options.stages is not None:
        raise InvalidArgumentError(
            f"{current_caller()}: precondition= cannot be combined with stages= (the staged path "
            "projects stage by stage); drop stages= or use select= to bound memory instead."
        )


def _preconditioned(project: Projector, precondition: Preconditioner, params: Params,
                    names: tuple[str, ...]) -> Callable[[Params], Tensor]:
    """``project`` after the elementwise preconditioner (inside vmap: one example's grads)."""
    shapes = {name: tuple(value.shape) for name, value in params.items()}
    precondition.check(shapes, names)
    return lambda grads: project(precondition.apply(grads))


def _stages_at_buffers(loss: LossFn, options: GradientOptions) -> GradientOptions:
    """``options`` with stages that read ``loss``'s buffers (a checkpoint's BatchNorm
    statistics, given by ``loss_at``) where ``model_stages`` made them from the same model."""
    stages = options.stages
    if stages is None or stages.at_buffers_of is None:
        return options
    return replace(options, stages=stages.at_buffers_of(loss))


class _StagesCheck:
    """Checks once, on the first call, that the stages reproduce the model and its loss."""

    def __init__(self, loss: LossFn, stages: Stages | None) -> None:
        self._loss, self._stages, self._done = loss, stages, stages is None

    def __call__(self, params: Params, batch: Batch) -> None:
        if not self._done:
            check_stages(self._stages, self._loss, params, batch)
            self._done = True


def _split(params: Params, names: tuple[str, ...]) -> tuple[dict, dict]:
    chosen = set(names)
    return ({name: params[name] for name in names},
            {name: value for name, value in params.items() if name not in chosen})


def _selected_loss(loss: LossFn, params: Params, options: GradientOptions):
    """``loss(selected, frozen, example)``, under autocast if asked."""

    def selected_loss(selected: Params, frozen: Params, example: Example) -> Tensor:
        return loss({**frozen, **selected}, example)

    device = next(iter(params.values())).device
    return with_mixed_precision(selected_loss, options.mixed_precision, device)


def _chunk_for(batch: Batch, chunk: int | None) -> int | None:
    """``chunk``, or ``None`` for a batch of 0 examples (torch's chunked vmap cannot split
    an empty batch: a bare ``AssertionError``; unchunked, it returns empty results)."""
    return None if has_no_examples(batch) else chunk


def _plain_per_sample(loss, params, batch, names, chunk, options, has_aux
                      ) -> dict[str, Tensor]:
    selected, frozen = _split(params, names)
    fn = _selected_loss(loss, params, options)

    def run(examples: Batch, scaling: str) -> Any:
        grad_fn = loss_scaled_grad(fn, has_aux=has_aux, mixed_precision=options.mixed_precision,
                                   scaling=scaling)
        batched = vmap(grad_fn, in_dims=(None, None, 0), chunk_size=_chunk_for(examples, chunk))
        with vmap_attention():
            return _call_loss_transform(batched, selected, frozen, examples, loss=loss)

    return loss_scaled_rows(run, batch, mixed_precision=options.mixed_precision,
                            has_aux=has_aux)


def _plain_projected(loss, project, params, batch, names, chunk, options, has_aux) -> Tensor:
    selected, frozen = _split(params, names)
    fn = _selected_loss(loss, params, options)

    def run(examples: Batch, scaling: str) -> Any:
        grad_fn = loss_scaled_grad(fn, has_aux=has_aux, mixed_precision=options.mixed_precision,
                                   scaling=scaling)

        def one_example(selected: Params, frozen: Params, example: Example) -> Any:
            if has_aux:
                grads, aux = grad_fn(selected, frozen, example)
                return project(grads), aux
            return project(grad_fn(selected, frozen, example))

        batched = vmap(one_example, in_dims=(None, None, 0),
                       chunk_size=_chunk_for(examples, chunk))
        with vmap_attention():
            return _call_loss_transform(batched, selected, frozen, examples, loss=loss)

    return loss_scaled_rows(run, batch, mixed_precision=options.mixed_precision,
                            has_aux=has_aux)


def _staged_projected(projection, projector_for, params, batch, names, per_stage, chunk,
                      options) -> Tensor:
    if projection.kind == "identity":
        # Identity keeps every entry in sorted-name order, across stages: place, then concat.
        def transform(index: int, grads: dict[str, Tensor]) -> dict[str, Tensor]:
            return {name: g.reshape(-1) for name, g in grads.items()}
    else:
        projectors = {i: projector_for({n: params[n] for n in stage_names})
                      for i, stage_names in enumerate(per_stage) if stage_names}

        def transform(index: int, grads: dict[str, Tensor]) -> Tensor:
            return projectors[index](grads)  # this stage's share of P @ g, [k]

    def run(examples: Batch, scaling: str) -> Tensor:
        results = staged_grads(
            options.stages, params, examples, per_stage=per_stage, transform=transform,
            chunk_size=chunk, mixed_precision=options.mixed_precision,
            offload=options.offload, scaling=scaling)
        if projection.kind == "identity":
            flat = {name: g for _, part in results for name, g in part.items()}
            return torch.cat([flat[name] for name in sorted(names)], dim=1)
        total = results[0][1]
        for _, part in results[1:]:
            total = total + part
        return total

    return loss_scaled_rows(run, batch, mixed_precision=options.mixed_precision,
                            has_aux=False)


def _projector_cache(projection: Projection, *, compile: bool
                     ) -> Callable[[Params], Projector]:
    projectors: dict[tuple, Projector] = {}

    def projector_for(params: Params) -> Projector:
        layout = canonical_layout(params)
        first = next(iter(params.values()))
        key = (layout, first.device, first.dtype)
        if key not in projectors:
            projectors[key] = make_projector(
                projection, layout, device=first.device, dtype=first.dtype, compile=compile
            )
        return projectors[key]

    return projector_for


def _call_loss_transform(fn, *args: Any, loss: LossFn):
    """Call a vmapped gradient function of ``loss``, turning torch.func's errors into
    actionable ones, while holding the modules ``loss`` names (a hand-written
    ``functional_call`` loss swaps tensors into its module: two threads at once on one module
    would read each other's weights)."""
    with holding(modules_reached(loss)):
        return _call_checked(fn, *args)


def _call_checked(fn, *args: Any):
    batch = args[-1]
    flat = [leaf for leaf in tree_leaves(batch) if isinstance(leaf, Tensor)]
    if any(leaf.ndim == 0 for leaf in flat):
        raise InvalidArgumentError(
            f"{current_caller()}: every tensor of a batch needs a leading batch dimension, got "
            f"shapes {[list(leaf.shape) for leaf in flat]}; pass x[None] for a single example."
        )
    try:
        return fn(*args)
    except TracInFuncError:
        raise  # already says what is wrong and how to fix it
    except RuntimeError as error:
        params = args[0] if args and isinstance(args[0], Mapping) else None
        clearer = explain_loss_error(error, params)
        if clearer is None:
            raise
        raise clearer from error
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as error:
        clearer = explain_loss_error(error)
        if clearer is not None:
            raise clearer from error
        # The user's loss failed on this batch (other batches may have passed): say so.
        raise LossFunctionError(
            f"{current_caller()}: loss(params, example) failed with {type(error).__name__}: "
            f"{error}. Check that every batch has the structure the loss expects (the same as the "
            "first batch's) and that the loss takes one example without a batch dimension."
        ) from error


# torch's batched backward of a norm given a 16-bit input and float32 weights (a loss's own
# autocast), which its plain backward accepts.
_AUTOCAST_NORM = re.compile(r"expected scalar type (BFloat16|Half) but found Float|"
                            r"expected scalar type Float but found (BFloat16|Half)")


def explain_loss_error(error: Exception, params: Params | None = None) -> Exception | None:
    """A tracinfunc error that explains a known torch failure of the loss, else ``None``
    (``params``: the parameters differentiated, to name the culprits where known)."""
    message = str(error).strip()
    if isinstance(error, KeyError) and "already exists" in message and _raised_in(error, _in_swap):
        return LossFunctionError(
            f"{current_caller()}: the model's forward changed a module attribute that "
            f"functional_call had swapped in for the call (torch said: {message}), so torch "
            "could not put the module's own tensor back; a forward that calls "
            "torch.nn.utils.parametrize.register_parametrization does this. Register "
            "parametrizations once, before the model is given to tracinfunc (loss_from_module, "
            "Checkpoint.from_module), not inside forward."
        )
    if "floating point dtype can require gradients" in message:
        integer = sorted(name for name, value in (params or {}).items()
                         if isinstance(value, Tensor) and not value.is_floating_point())
        return LossFunctionError(
            f"{current_caller()}: the parameters differentiated must be floating-point tensors"
            + (f"; {integer[:5]} are {params[integer[0]].dtype}" if integer else "")
            + f" (torch said: {message}). Pass the checkpoint's tensors as float (a "
            "checkpoint saved or built with an integer dtype?)."
        )
    if "same device" in message:  # names running_mean too when a buffer is left behind
        return LossFunctionError(
            f"{current_caller()}: the loss mixes devices ({message}). Put the model, its buffers, "
            "the parameters and the batch on one device (build_store(..., device=...) moves the "
            "parameters, buffers and batches it is given)."
        )
    batchnorm_hints = ("running_mean", "running_var", "value per channel", "mutate a captured")
    if any(hint in message for hint in batchnorm_hints):
        return TrainModeError(
            f"{current_caller()}: the loss updates state in place, as a BatchNorm layer in train "
            f"mode does, or a loss writing into its batch (x.mul_(2)) ({message}). Put the "
            "model in eval mode (model.eval()) before computing gradients: per-example "
            "gradients need fixed statistics; compute on a copy of the batch (x.clone()) or "
            "out of place (x * 2)."
        )
    vmap_hints = (".item()", "data-dependent control flow", "randomness")
    if "vmap" in message and any(hint in message for hint in vmap_hints):
        return LossFunctionError(
            f"{current_caller()}: the loss cannot run under torch.func.vmap, which computes "
            f"the per-example gradients (torch.func said: {message}). Write the loss (and its "
            "criterion) with tensor operations only: no .item() or Python `if` on tensor "
            "values (use torch.where), and no random operations (model.eval() turns dropout "
            "off)."
        )
    if in_place_mismatch(message):
        return LossFunctionError(
            f"{current_caller()}: an in-place operation in the loss got a value that does not "
            f"fit the tensor it writes into (torch said: {message}). If the loss runs on one "
            "example outside tracinfunc, the usual cause is torch.func.vmap, which computes the "
            "per-example gradients: a tensor made inside the loss with a fixed shape "
            "(torch.zeros(1, 3)) has no batch dimension, so per-example values cannot be "
            "written into it in place. Create it from the inputs (x.new_zeros(...), "
            "torch.zeros_like) or compute it out of place. If the loss fails on one example "
            "too, the shapes in the loss are wrong."
        )
    if _AUTOCAST_NORM.search(message) and _raised_in(error, _in_backward):
        return LossFunctionError(
            f"{current_caller()}: a 16-bit and a float32 tensor met in the backward of the "
            f"loss under torch.func.vmap (torch said: {message}). The usual cause is a "
            "torch.autocast inside the loss around a normalisation layer whose weights stay "
            "float32 (LayerNorm, BatchNorm, InstanceNorm): torch's batched backward of the "
            "norm does not take the mixed dtypes (a torch limitation; a plain backward does). "
            "Pass mixed_precision=torch.bfloat16 (or float16) to tracinfunc instead of "
            "autocasting inside the loss (it runs norms in float32), or cast the norm's input "
            "yourself: F.layer_norm(h.float(), ...)."
        )
    if "to return a scalar" in message or "scalar Tensor" in message:
        return LossFunctionError(
            f"{current_caller()}: loss(params, example) must return a scalar for one example, but "
            f"torch.func said: {message}. Reduce the loss (e.g. .sum()) and make sure "
            "`example` has no batch dimension."
        )
    return None


def _raised_in(error: BaseException, where: Callable[[Any], bool]) -> bool:
    """Whether a frame of ``error``'s traceback has a code object for which ``where`` holds:
    torch's swapping of tensors in and out of a module (``functional_call``'s
    ``_named_member_accessor``: a forward turning a name into a parametrization), or
    autograd's backward (``_engine_run_backward``: a forward's own dtype mismatch, say an
    int8 batch through a float matmul, has other causes and fixes)."""
    trace = error.__traceback__
    while trace is not None:
        if where(trace.tb_frame.f_code):
            return True
        trace = trace.tb_next
    return False


def _in_backward(code: Any) -> bool:
    return code.co_name == "_engine_run_backward"


def _in_swap(code: Any) -> bool:
    return code.co_filename.endswith("_named_member_accessor.py")
