"""Language models: per-example losses, batches of token data, LoRA/peft adapters."""

from tracinfunc.lm.adapters import adapter_checkpoint, adapter_state_dict
from tracinfunc.lm.data import completion_batch, completion_collator, generation_batch
from tracinfunc.lm.losses import (
    IGNORE_INDEX,
    causal_lm_loss,
    completion_labels,
    sequence_classification_loss,
)

__all__ = [
    "IGNORE_INDEX",
    "adapter_checkpoint",
    "adapter_state_dict",
    "causal_lm_loss",
    "completion_batch",
    "completion_collator",
    "completion_labels",
    "generation_batch",
    "sequence_classification_loss",
]
