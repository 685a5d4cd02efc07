"""tracinfunc: exact, fast TracIn training-data attribution built on torch.func.

TracIn scores a training example's influence on a test prediction as
``sum over checkpoints c of lr_c * <grad L(test; w_c), grad L(train_i; w_c)>``.
"""

from tracinfunc import _moved
from tracinfunc._version import __version__
from tracinfunc.build import build_store, iter_batches
from tracinfunc.checkpoint import Checkpoint, params_fingerprint
from tracinfunc.cli.spec import Spec
from tracinfunc.distributed import gather_top_k, merge_top_k
from tracinfunc.errors import (
    CorruptStoreError,
    EmptyDataError,
    IncompatibleGradientsError,
    IncompleteStoreError,
    InvalidArgumentError,
    InvalidProjectionError,
    InvalidTypeError,
    LossFunctionError,
    MemoryBudgetError,
    MissingDependencyError,
    MissingParametersError,
    NonFiniteGradientError,
    OutputPathError,
    ParameterSelectionError,
    ReadOnlyStoreError,
    RowRangeError,
    StageMismatchError,
    StoreExistsError,
    StoreNotFoundError,
    TracInFuncError,
    TrainModeError,
    UnsupportedPrecisionError,
)
from tracinfunc.grads import per_sample_grads, projected_grads
from tracinfunc.grads.chunking import chunk_size_for_budget
from tracinfunc.grads.precision import autocast_supported
from tracinfunc.grads.selection import last_layers, select_params
from tracinfunc.grads.stages import Stage, Stages, model_stages
from tracinfunc.loss import ModuleLoss, loss_from_module
from tracinfunc.projection import Projection, canonical_layout, make_projector
from tracinfunc.score import score, score_chunks, self_influence, top_k
from tracinfunc.store import (
    CheckpointMeta,
    GradientStore,
    MemoryStore,
    MemoryWriter,
    PinnedStore,
    PinnedWriter,
    StoreMeta,
    StoreWriter,
    SupportsChunkAlignment,
    SupportsRowViews,
    ZarrStore,
    ZarrWriter,
    open_store,
    read_store_meta,
    remove_store,
    save_store,
    to_memory,
    to_pinned,
    verify_store,
)
from tracinfunc.store.parts import PartWriter, StorePart, commit_store

__all__ = [
    "Checkpoint",
    "CheckpointMeta",
    "CorruptStoreError",
    "EmptyDataError",
    "GradientStore",
    "IncompatibleGradientsError",
    "IncompleteStoreError",
    "InvalidArgumentError",
    "InvalidProjectionError",
    "InvalidTypeError",
    "LossFunctionError",
    "MemoryBudgetError",
    "MemoryStore",
    "MemoryWriter",
    "MissingDependencyError",
    "MissingParametersError",
    "ModuleLoss",
    "NonFiniteGradientError",
    "OutputPathError",
    "ParameterSelectionError",
    "PartWriter",
    "PinnedStore",
    "PinnedWriter",
    "Projection",
    "ReadOnlyStoreError",
    "RowRangeError",
    "Spec",
    "Stage",
    "StageMismatchError",
    "Stages",
    "StoreExistsError",
    "StoreMeta",
    "StoreNotFoundError",
    "StorePart",
    "StoreWriter",
    "SupportsChunkAlignment",
    "SupportsRowViews",
    "TracInFuncError",
    "TrainModeError",
    "UnsupportedPrecisionError",
    "ZarrStore",
    "ZarrWriter",
    "__version__",
    "autocast_supported",
    "build_store",
    "canonical_layout",
    "chunk_size_for_budget",
    "commit_store",
    "gather_top_k",
    "iter_batches",
    "last_layers",
    "loss_from_module",
    "make_projector",
    "merge_top_k",
    "model_stages",
    "open_store",
    "params_fingerprint",
    "per_sample_grads",
    "projected_grads",
    "read_store_meta",
    "remove_store",
    "save_store",
    "score",
    "score_chunks",
    "select_params",
    "self_influence",
    "to_memory",
    "to_pinned",
    "top_k",
    "verify_store",
]

_moved.install()  # old module paths (tracinfunc.stages, ...) still import, with a warning
