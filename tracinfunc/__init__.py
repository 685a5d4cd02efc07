"""tracinfunc: exact, fast TracIn training-data attribution built on torch.func.

TracIn scores a training example's influence on a test prediction as
``sum over checkpoints c of lr_c * <grad L(test; w_c), grad L(train_i; w_c)>``.
"""

from tracinfunc._version import __version__
from tracinfunc.build import build_store, iter_batches
from tracinfunc.checkpoint import Checkpoint, params_fingerprint
from tracinfunc.errors import (
    EmptyDataError,
    IncompatibleGradientsError,
    InvalidProjectionError,
    LossFunctionError,
    NonFiniteGradientError,
    ReadOnlyStoreError,
    TracInFuncError,
    TrainModeError,
)
from tracinfunc.grads import per_sample_grads, projected_grads
from tracinfunc.loss import ModuleLoss, loss_from_module
from tracinfunc.projection import Projection, canonical_layout, make_projector
from tracinfunc.score import score, score_chunks, self_influence, top_k
from tracinfunc.store import CheckpointMeta, GradientStore, MemoryStore, MemoryWriter, StoreMeta

__all__ = [
    "Checkpoint",
    "CheckpointMeta",
    "EmptyDataError",
    "GradientStore",
    "IncompatibleGradientsError",
    "InvalidProjectionError",
    "LossFunctionError",
    "MemoryStore",
    "MemoryWriter",
    "ModuleLoss",
    "NonFiniteGradientError",
    "Projection",
    "ReadOnlyStoreError",
    "StoreMeta",
    "TracInFuncError",
    "TrainModeError",
    "__version__",
    "build_store",
    "canonical_layout",
    "iter_batches",
    "loss_from_module",
    "make_projector",
    "params_fingerprint",
    "per_sample_grads",
    "projected_grads",
    "score",
    "score_chunks",
    "self_influence",
    "top_k",
]
