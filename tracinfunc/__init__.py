"""tracinfunc: exact, fast TracIn training-data attribution built on torch.func.

TracIn scores a training example's influence on a test prediction as
``sum over checkpoints c of lr_c * <grad L(test; w_c), grad L(train_i; w_c)>``.

The names here are the everyday ones, in the order the tutorial meets them; everything else
lives in its subpackage: :mod:`tracinfunc.errors`, :mod:`tracinfunc.store` (store kinds,
writers, metadata, sharded parts), :mod:`tracinfunc.grads` (stages, budgets, precision),
:mod:`tracinfunc.projection`, :mod:`tracinfunc.search`, :mod:`tracinfunc.evaluate`,
:mod:`tracinfunc.distributed`, :mod:`tracinfunc.cli` and :mod:`tracinfunc.jax`.
"""

from tracinfunc import (  # the subpackages, reachable as tif.errors, tif.store, ...
    batches as batches,
)
from tracinfunc import (
    checkpoint as checkpoint,
)
from tracinfunc import (
    cli as cli,
)
from tracinfunc import (
    distributed as distributed,
)
from tracinfunc import (
    errors as errors,
)
from tracinfunc import (
    grads as grads,
)
from tracinfunc import (
    loss as loss,
)
from tracinfunc import (
    precondition as precondition,
)
from tracinfunc import (
    projection as projection,
)
from tracinfunc import (
    search as search,
)
from tracinfunc import (
    store as store,
)
from tracinfunc import (
    training as training,
)
from tracinfunc._deprecations import warn_deprecated
from tracinfunc._version import __version__
from tracinfunc.adapters import adapter_checkpoint
from tracinfunc.build.torch import build_store
from tracinfunc.checkpoint import Checkpoint
from tracinfunc.curvature import (
    Curvature,
    fit_curvature,
    load_curvature,
    preconditioned_test_grads,
    save_curvature,
)
from tracinfunc.data_selection import select_training_data
from tracinfunc.errors import TracInFuncError
from tracinfunc.grads import (
    GradientOptions,
    last_layers,
    model_stages,
    per_sample_grads,
    projected_grads,
    select_params,
)
from tracinfunc.lm import causal_lm_loss, completion_labels, sequence_classification_loss
from tracinfunc.lm_data import completion_batch, completion_collator, generation_batch
from tracinfunc.loss import loss_from_model, loss_from_module
from tracinfunc.precondition import Preconditioner
from tracinfunc.projection import Projection
from tracinfunc.score import score, score_chunks, self_influence, top_k
from tracinfunc.search import SearchIndex, build_index, indexed_top_k, load_index
from tracinfunc.store import (
    GradientStore,
    open_store,
    remove_store,
    save_store,
    to_memory,
    to_pinned,
    verify_store,
)
from tracinfunc.top_examples import TopExamples
from tracinfunc.training import (
    load_recorded_checkpoints,
    load_recorded_preconditioners,
    trainer_callback,
)

__all__ = [
    "Checkpoint",
    "Curvature",
    "GradientOptions",
    "GradientStore",
    "Preconditioner",
    "Projection",
    "SearchIndex",
    "TopExamples",
    "TracInFuncError",
    "__version__",
    "adapter_checkpoint",
    "build_index",
    "build_store",
    "causal_lm_loss",
    "completion_batch",
    "completion_collator",
    "completion_labels",
    "fit_curvature",
    "generation_batch",
    "indexed_top_k",
    "last_layers",
    "load_curvature",
    "load_index",
    "load_recorded_checkpoints",
    "load_recorded_preconditioners",
    "loss_from_model",
    "loss_from_module",
    "model_stages",
    "open_store",
    "per_sample_grads",
    "preconditioned_test_grads",
    "projected_grads",
    "remove_store",
    "save_curvature",
    "save_store",
    "score",
    "score_chunks",
    "select_params",
    "select_training_data",
    "self_influence",
    "sequence_classification_loss",
    "to_memory",
    "to_pinned",
    "top_k",
    "trainer_callback",
    "verify_store",
]

# Names that moved from the top level to their subpackage in 0.2: still importable from
# here, with a DeprecationWarning naming the new place, until the removal version.
_MOVED = {
    **{name: "errors" for name in errors.__all__ if name != "TracInFuncError"},
    **{name: "store" for name in (
        "CheckpointMeta", "MemoryStore", "MemoryWriter", "PartWriter", "PinnedStore",
        "PinnedWriter", "QuantizedMemoryStore", "QuantizedPinnedStore", "StoreMeta",
        "StorePart", "StoreWriter", "SupportsChunkAlignment", "SupportsQuantizedRows",
        "SupportsRowViews", "ZarrStore", "ZarrWriter", "commit_store", "read_store_meta")},
    **{name: "grads" for name in (
        "Stage", "Stages", "autocast_supported", "chunk_size_for_budget",
        "factorized_weights")},
    **{name: "projection" for name in ("canonical_layout", "make_projector")},
    **{name: "distributed" for name in ("gather_top_k", "merge_top_k")},
    **{name: "precondition" for name in (
        "AdamState", "optimizer_param_names", "trainer_param_names")},
    **{name: "checkpoint" for name in ("loss_at", "params_fingerprint")},
    "CheckpointRecorder": "training",
    "ModuleLoss": "loss",
    "Spec": "cli",
    "iter_batches": "batches",
    "store_fingerprint": "search",
}


def __getattr__(name: str) -> object:
    if name in _MOVED:
        where = _MOVED[name]
        warn_deprecated(f"tracinfunc.{name}", f"tracinfunc.{where}.{name}")
        return getattr(globals()[where], name)
    raise AttributeError(f"module 'tracinfunc' has no attribute {name!r}")
