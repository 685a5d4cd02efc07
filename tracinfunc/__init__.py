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
    report as report,
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
from tracinfunc._version import __version__
from tracinfunc.build.torch import build_store
from tracinfunc.checkpoint import Checkpoint
from tracinfunc.curvature import (
    Curvature,
    fit_curvature,
    load_curvature,
    preconditioned_test_grads,
    save_curvature,
)
from tracinfunc.errors import TracInFuncError
from tracinfunc.grads import (
    GradientOptions,
    last_layers,
    model_stages,
    per_sample_grads,
    projected_grads,
    select_params,
)
from tracinfunc.lm.adapters import adapter_checkpoint
from tracinfunc.lm.data import completion_batch, completion_collator, generation_batch
from tracinfunc.lm.losses import causal_lm_loss, completion_labels, sequence_classification_loss
from tracinfunc.lm.outputs import output_token_grads
from tracinfunc.lm.spans import span_scores, top_spans
from tracinfunc.lm.tokens import TokenScores, token_scores
from tracinfunc.loss import loss_from_model, loss_from_module
from tracinfunc.precondition.optimizer import Preconditioner
from tracinfunc.projection import Projection
from tracinfunc.query.chunks import score_chunks
from tracinfunc.query.contrast import Contrast
from tracinfunc.query.score import score
from tracinfunc.query.self_influence import self_influence
from tracinfunc.query.top_k import top_k
from tracinfunc.report import write_report
from tracinfunc.search import (
    Retriever,
    SearchIndex,
    build_index,
    indexed_top_k,
    load_index,
    rerank,
)
from tracinfunc.select.less import select_training_data
from tracinfunc.select.top_examples import TopExamples
from tracinfunc.store import (
    GradientStore,
    open_store,
    remove_store,
    save_store,
    to_memory,
    to_pinned,
    verify_store,
)
from tracinfunc.training.hf import trainer_callback
from tracinfunc.training.recorder import load_recorded_checkpoints, load_recorded_preconditioners

__all__ = [
    "Checkpoint",
    "Contrast",
    "Curvature",
    "GradientOptions",
    "GradientStore",
    "Preconditioner",
    "Projection",
    "Retriever",
    "SearchIndex",
    "TokenScores",
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
    "output_token_grads",
    "per_sample_grads",
    "preconditioned_test_grads",
    "projected_grads",
    "remove_store",
    "rerank",
    "save_curvature",
    "save_store",
    "score",
    "score_chunks",
    "select_params",
    "select_training_data",
    "self_influence",
    "sequence_classification_loss",
    "span_scores",
    "to_memory",
    "to_pinned",
    "token_scores",
    "top_k",
    "top_spans",
    "trainer_callback",
    "verify_store",
    "write_report",
]
