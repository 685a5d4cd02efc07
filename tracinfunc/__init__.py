"""tracinfunc: exact, fast TracIn training-data attribution built on torch.func.

TracIn scores a training example's influence on a test prediction as
``sum over checkpoints c of lr_c * <grad L(test; w_c), grad L(train_i; w_c)>``.
"""

from tracinfunc import _moved
from tracinfunc._version import __version__
from tracinfunc.adapters import adapter_checkpoint
from tracinfunc.batches import iter_batches
from tracinfunc.build import build_store
from tracinfunc.checkpoint import Checkpoint, loss_at, params_fingerprint
from tracinfunc.cli.spec import Spec
from tracinfunc.curvature import (
    Curvature,
    fit_curvature,
    load_curvature,
    preconditioned_test_grads,
    save_curvature,
)
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
    StoreLockedError,
    StoreNotFoundError,
    StoreWriteError,
    TracInFuncError,
    TrainModeError,
    UnsupportedPrecisionError,
)
from tracinfunc.grads import GradientOptions, per_sample_grads, projected_grads
from tracinfunc.grads.chunking import chunk_size_for_budget
from tracinfunc.grads.factorized import factorized_weights
from tracinfunc.grads.precision import autocast_supported
from tracinfunc.grads.selection import last_layers, select_params
from tracinfunc.grads.stages import Stage, Stages, model_stages
from tracinfunc.lm import causal_lm_loss, completion_labels, sequence_classification_loss
from tracinfunc.loss import ModuleLoss, loss_from_model, loss_from_module
from tracinfunc.precondition import (
    AdamState,
    Preconditioner,
    optimizer_param_names,
    trainer_param_names,
)
from tracinfunc.projection import Projection, canonical_layout, make_projector
from tracinfunc.score import score, score_chunks, self_influence, top_k
from tracinfunc.search import SearchIndex, build_index, load_index, store_fingerprint
from tracinfunc.store import (
    CheckpointMeta,
    GradientStore,
    MemoryStore,
    MemoryWriter,
    PinnedStore,
    PinnedWriter,
    QuantizedMemoryStore,
    QuantizedPinnedStore,
    StoreMeta,
    StoreWriter,
    SupportsChunkAlignment,
    SupportsQuantizedRows,
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
from tracinfunc.training import (
    CheckpointRecorder,
    load_recorded_checkpoints,
    load_recorded_preconditioners,
    trainer_callback,
)

__all__ = [
    "AdamState",
    "Checkpoint",
    "CheckpointMeta",
    "CheckpointRecorder",
    "CorruptStoreError",
    "Curvature",
    "EmptyDataError",
    "GradientOptions",
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
    "Preconditioner",
    "Projection",
    "QuantizedMemoryStore",
    "QuantizedPinnedStore",
    "ReadOnlyStoreError",
    "RowRangeError",
    "SearchIndex",
    "Spec",
    "Stage",
    "StageMismatchError",
    "Stages",
    "StoreExistsError",
    "StoreLockedError",
    "StoreMeta",
    "StoreNotFoundError",
    "StorePart",
    "StoreWriteError",
    "StoreWriter",
    "SupportsChunkAlignment",
    "SupportsQuantizedRows",
    "SupportsRowViews",
    "TracInFuncError",
    "TrainModeError",
    "UnsupportedPrecisionError",
    "ZarrStore",
    "ZarrWriter",
    "__version__",
    "adapter_checkpoint",
    "autocast_supported",
    "build_index",
    "build_store",
    "canonical_layout",
    "causal_lm_loss",
    "chunk_size_for_budget",
    "commit_store",
    "completion_labels",
    "factorized_weights",
    "fit_curvature",
    "gather_top_k",
    "iter_batches",
    "last_layers",
    "load_curvature",
    "load_index",
    "load_recorded_checkpoints",
    "load_recorded_preconditioners",
    "loss_at",
    "loss_from_model",
    "loss_from_module",
    "make_projector",
    "merge_top_k",
    "model_stages",
    "open_store",
    "optimizer_param_names",
    "params_fingerprint",
    "per_sample_grads",
    "preconditioned_test_grads",
    "projected_grads",
    "read_store_meta",
    "remove_store",
    "save_curvature",
    "save_store",
    "score",
    "score_chunks",
    "select_params",
    "self_influence",
    "sequence_classification_loss",
    "store_fingerprint",
    "to_memory",
    "to_pinned",
    "top_k",
    "trainer_callback",
    "trainer_param_names",
    "verify_store",
]

_moved.install()  # old module paths (tracinfunc.stages, ...) still import, with a warning
