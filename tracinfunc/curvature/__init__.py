"""Curvature-aware TracIn over the same store: test gradients preconditioned by ``(H_c + l I)^-1``.

:func:`fit_curvature` fits a damped Gauss-Newton (true Fisher) estimate per checkpoint
(``"dense"``, ``"projected"``, ``"kfac"``, ``"ekfac"``); ``score``, ``top_k`` and
``self_influence`` take it as ``curvature=``, and :func:`preconditioned_test_grads` makes the
test gradients of the full-space kinds. :func:`choose_damping` picks the damping by held-out
loss change (:func:`tracinfunc.evaluate.choose_damping_by_lds` by LDS). See
``docs/curvature.md``.
"""

from tracinfunc.curvature.capture import SUPPORTED, KfacLayer
from tracinfunc.curvature.conditioning import MAX_CONDITION
from tracinfunc.curvature.damping import DEFAULT_SCALES, Damping
from tracinfunc.curvature.fit import MAX_DENSE_PARAMS, fit_curvature
from tracinfunc.curvature.heldout import CANDIDATE_SCALES, DampingChoice, choose_damping
from tracinfunc.curvature.persist import load_curvature, save_curvature
from tracinfunc.curvature.samplers import (
    Sampler,
    causal_lm_sampler,
    classification_sampler,
    default_sampler,
)
from tracinfunc.curvature.test_grads import preconditioned_test_grads
from tracinfunc.curvature.value import CURVATURE_KINDS, Curvature

__all__ = [
    "CANDIDATE_SCALES",
    "CURVATURE_KINDS",
    "DEFAULT_SCALES",
    "MAX_CONDITION",
    "MAX_DENSE_PARAMS",
    "SUPPORTED",
    "Curvature",
    "Damping",
    "DampingChoice",
    "KfacLayer",
    "Sampler",
    "causal_lm_sampler",
    "choose_damping",
    "classification_sampler",
    "default_sampler",
    "fit_curvature",
    "load_curvature",
    "preconditioned_test_grads",
    "save_curvature",
]
