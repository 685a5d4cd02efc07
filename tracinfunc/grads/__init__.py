"""Per-example gradients as pure function transforms, and the options that bound their cost.

:func:`per_sample_grads` is ``vmap(grad(loss))``; :func:`projected_grads` fuses a projection
inside the vmap. The memory and speed options compose: :mod:`~tracinfunc.grads.selection`
(``select=``), :mod:`~tracinfunc.grads.precision` (``mixed_precision=``),
:mod:`~tracinfunc.grads.stages` with :mod:`~tracinfunc.grads.staged` and
:mod:`~tracinfunc.grads.offload` (``stages=``, ``offload=``), :mod:`~tracinfunc.grads.chunking`
(``memory_budget=``), and :mod:`~tracinfunc.grads.factorized` (``kind="kronecker"``).
"""

from tracinfunc.grads.chunking import chunk_size_for_budget
from tracinfunc.grads.factorized import factorized_weights
from tracinfunc.grads.options import GradientOptions
from tracinfunc.grads.precision import autocast_supported
from tracinfunc.grads.selection import last_layers, select_params
from tracinfunc.grads.stages import Stage, Stages, model_stages
from tracinfunc.grads.transforms import per_sample_grads, projected_grads

__all__ = [
    "GradientOptions",
    "Stage",
    "Stages",
    "autocast_supported",
    "chunk_size_for_budget",
    "factorized_weights",
    "last_layers",
    "model_stages",
    "per_sample_grads",
    "projected_grads",
    "select_params",
]
