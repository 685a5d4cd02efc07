"""Stores held in host memory: ordinary (``dense``), quantised codes (``quantized``) and
page-locked for fast copies to a GPU (``pinned``)."""

from tracinfunc.store.memory.dense import MemoryStore, MemoryWriter
from tracinfunc.store.memory.pinned import PinnedStore, PinnedWriter, QuantizedPinnedStore
from tracinfunc.store.memory.quantized import QuantizedMemoryStore

__all__ = [
    "MemoryStore",
    "MemoryWriter",
    "PinnedStore",
    "PinnedWriter",
    "QuantizedMemoryStore",
    "QuantizedPinnedStore",
]
