"""Per-example gradients as pure function transforms, and the options that bound their cost.

:func:`per_sample_grads` is ``vmap(grad(loss))``; :func:`projected_grads` fuses a projection
inside the vmap. The memory and speed options compose: :mod:`~tracinfunc.grads.selection`
(``select=``), :mod:`~tracinfunc.grads.precision` (``mixed_precision=``),
:mod:`~tracinfunc.grads.stages` with :mod:`~tracinfunc.grads.staged` and
:mod:`~tracinfunc.grads.offload` (``stages=``, ``offload=``), :mod:`~tracinfunc.grads.chunking`
(``memory_budget=``), and :mod:`~tracinfunc.grads.factorized` (``kind="kronecker"``).
"""

from tracinfunc.grads.options import GradientOptions
from tracinfunc.grads.transforms import per_sample_grads, projected_grads

__all__ = ["GradientOptions", "per_sample_grads", "projected_grads"]
