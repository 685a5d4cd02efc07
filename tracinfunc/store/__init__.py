"""Gradient stores: immutable projected training gradients ``[n_ckpt, n_train, k]``."""

from tracinfunc.store.base import GradientStore
from tracinfunc.store.convert import save_store, to_memory, to_pinned
from tracinfunc.store.memory import MemoryStore, MemoryWriter
from tracinfunc.store.meta import CheckpointMeta, StoreMeta, check_compatible
from tracinfunc.store.pinned import PinnedStore, PinnedWriter
from tracinfunc.store.writer import StoreWriter, make_writer
from tracinfunc.store.zarr import ZarrStore, ZarrWriter

__all__ = [
    "CheckpointMeta",
    "GradientStore",
    "MemoryStore",
    "MemoryWriter",
    "PinnedStore",
    "PinnedWriter",
    "StoreMeta",
    "StoreWriter",
    "ZarrStore",
    "ZarrWriter",
    "check_compatible",
    "make_writer",
    "save_store",
    "to_memory",
    "to_pinned",
]
