"""Language models: per-example losses, batches of token data, LoRA/peft adapters, per-token
and span attribution."""

from tracinfunc.lm.adapters import adapter_checkpoint, adapter_state_dict
from tracinfunc.lm.data import completion_batch, completion_collator, generation_batch
from tracinfunc.lm.losses import (
    IGNORE_INDEX,
    causal_lm_loss,
    completion_labels,
    sequence_classification_loss,
)
from tracinfunc.lm.spans import Span, span_scores, top_spans
from tracinfunc.lm.tokens import TokenScores, next_token_terms, token_scores

__all__ = [
    "IGNORE_INDEX",
    "Span",
    "TokenScores",
    "adapter_checkpoint",
    "adapter_state_dict",
    "causal_lm_loss",
    "completion_batch",
    "completion_collator",
    "completion_labels",
    "generation_batch",
    "next_token_terms",
    "sequence_classification_loss",
    "span_scores",
    "token_scores",
    "top_spans",
]
