"""Measuring attribution quality: LDS against retrained models, mislabel detection.

- :func:`lds`: the linear datamodeling score with bootstrap confidence intervals.
- :func:`retrain_subsets`: a resumable retraining harness that produces its ground truth.
- :func:`mislabel_curve`: flipped labels found against data inspected, and its AUC.
- :func:`evaluate_lds_from_files`: LDS of saved scores against a saved run (for the CLI).
- :func:`choose_damping_by_lds`: a curvature's damping chosen by LDS, with the curve.
"""

from tracinfunc.evaluate.damping import choose_damping_by_lds
from tracinfunc.evaluate.files import evaluate_lds_from_files
from tracinfunc.evaluate.harness import RetrainResult, draw_subsets, load_retrain, retrain_subsets
from tracinfunc.evaluate.lds import LDSResult, lds, spearman
from tracinfunc.evaluate.mislabel import MislabelCurve, mislabel_curve

__all__ = [
    "LDSResult",
    "MislabelCurve",
    "RetrainResult",
    "choose_damping_by_lds",
    "draw_subsets",
    "evaluate_lds_from_files",
    "lds",
    "load_retrain",
    "mislabel_curve",
    "retrain_subsets",
    "spearman",
]
