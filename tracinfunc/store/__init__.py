"""Gradient stores: immutable projected training gradients ``[n_ckpt, n_train, k]``."""

from tracinfunc.store.base import GradientStore
from tracinfunc.store.memory import MemoryStore, MemoryWriter
from tracinfunc.store.meta import CheckpointMeta, StoreMeta, check_compatible

__all__ = [
    "CheckpointMeta",
    "GradientStore",
    "MemoryStore",
    "MemoryWriter",
    "StoreMeta",
    "check_compatible",
]
