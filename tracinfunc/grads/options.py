"""GradientOptions: the memory and speed options of every gradient transform, in one value.

``per_sample_grads``, ``projected_grads`` and ``build_store`` take the same options, one way:
one frozen value, built with keywords and validated once, so a configuration can be named,
reused and passed whole (``build_store(..., options=opts)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tracinfunc._validate import check_bool, check_int, current_caller, entry_point
from tracinfunc.errors import InvalidArgumentError, InvalidTypeError
from tracinfunc.grads.chunking import check_memory_budget, chunk_size_for_budget
from tracinfunc.grads.precision import check_mixed_precision
from tracinfunc.grads.selection import Selection, check_select, selected_names
from tracinfunc.grads.staged import largest_stage_size, stage_selection
from tracinfunc.grads.stages import Stages
from tracinfunc.types import Params

__all__ = ["GradientOptions", "gradient_options"]


@dataclass(frozen=True, kw_only=True)
class GradientOptions:
    """How per-example gradients are computed; none changes the result beyond float rounding
    (mixed precision aside, an approximation).

    Attributes:
        chunk_size: Examples differentiated at once inside vmap (``None``: the whole batch).
        select: Differentiate only these parameters (names, module names, glob patterns or
            :func:`~tracinfunc.last_layers`); the others are constants.
        mixed_precision: ``torch.bfloat16`` or ``torch.float16``: the forward under autocast.
            Slow on CPUs (measured 9-15x the float32 forward+backward); meant for GPUs.
        stages: The model as :class:`~tracinfunc.grads.Stages`: differentiate stage by stage
            (functional checkpointing).
        offload: With ``stages``, keep stage-boundary activations in CPU memory.
        memory_budget: Bytes for per-example gradients; chooses ``chunk_size``.
        compile_projection: Generate dense projection blocks with ``torch.compile``
            (projected gradients only).

    Example:
        >>> opts = GradientOptions(select=last_layers(2), memory_budget=2**30)
        >>> store = build_store(loss, ckpts, loader, projection=proj, options=opts)
    """

    chunk_size: int | None = None
    select: Selection | None = None
    mixed_precision: torch.dtype | None = None
    stages: Stages | None = None
    offload: bool = False
    memory_budget: int | None = None
    compile_projection: bool = False

    @entry_point("GradientOptions")  # or the public function that made them, if any
    def __post_init__(self) -> None:
        caller = current_caller()
        # Integer scalars of any framework are kept as the Python ints check_int returns.
        object.__setattr__(self, "chunk_size",
                           check_int(self.chunk_size, "chunk_size", optional=True))
        check_memory_budget(self.memory_budget, self.chunk_size)
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", int(self.memory_budget))
        if self.stages is not None and not isinstance(self.stages, Stages):
            raise InvalidTypeError(
                f"{caller}: stages must be a tracinfunc.grads.Stages, got "
                f"{type(self.stages).__name__}; build one with model_stages(model, criterion)."
            )
        check_bool(self.offload, "offload")
        if self.offload and self.stages is None:
            raise InvalidArgumentError(
                f"{caller}: offload=True moves stage-boundary activations to CPU and needs "
                "stages=; pass stages=model_stages(model, criterion)."
            )
        check_bool(self.compile_projection, "compile_projection")
        # Normalised values: a frozen dataclass stores them with object.__setattr__.
        object.__setattr__(self, "select", check_select(self.select))
        object.__setattr__(self, "mixed_precision",
                           check_mixed_precision(self.mixed_precision))

    def plain(self) -> bool:
        """No option beyond ``chunk_size``: the transform is plain ``vmap(grad(loss))``."""
        return (self.select is None and self.mixed_precision is None and self.stages is None
                and self.memory_budget is None)

    def resolve(self, params: Params) -> tuple[tuple[str, ...], list | None, int | None]:
        """``(selected names, per-stage names or None, chunk size)`` for these params."""
        names = selected_names(params, self.select)
        per_stage = None if self.stages is None else stage_selection(
            self.stages, names)
        chunk = self.chunk_size
        if self.memory_budget is not None:
            n_params = (largest_stage_size(per_stage, params) if per_stage is not None
                        else sum(params[name].numel() for name in names))
            itemsize = next(iter(params.values())).element_size()
            chunk = chunk_size_for_budget(self.memory_budget, n_params, itemsize=itemsize)
        return names, per_stage, chunk


def gradient_options(options: GradientOptions | None) -> GradientOptions:
    """The options a public function was called with (``None``: the defaults).

    Raises:
        InvalidTypeError: ``options`` is not a GradientOptions.
    """
    if options is None:
        return GradientOptions()
    if not isinstance(options, GradientOptions):
        raise InvalidTypeError(
            f"{current_caller()}: options must be a tracinfunc.GradientOptions, got "
            f"{type(options).__name__}; e.g. options=GradientOptions(chunk_size=64)."
        )
    return options
