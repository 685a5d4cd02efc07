"""Gradient stores: immutable projected training gradients ``[n_ckpt, n_train, k]``.

``base`` is the protocol and its optional abilities; ``memory``, ``pinned``, ``quantized``
and ``zarr`` are the implementations (``quant``: the int8 and sign codes of quantised
stores); ``writer`` picks one for ``store=``; ``fill`` is the build loop every frontend
shares; ``convert`` copies between stores; ``paths`` opens, verifies and removes stores by
path; ``stream`` feeds scoring.
"""

from tracinfunc.store.base import (
    GradientStore,
    SupportsChunkAlignment,
    SupportsQuantizedRows,
    SupportsRowViews,
)
from tracinfunc.store.convert import save_store, to_memory, to_pinned
from tracinfunc.store.memory import MemoryStore, MemoryWriter
from tracinfunc.store.meta import CheckpointMeta, StoreMeta, check_compatible
from tracinfunc.store.paths import open_store, read_store_meta, remove_store, verify_store
from tracinfunc.store.pinned import PinnedStore, PinnedWriter, QuantizedPinnedStore
from tracinfunc.store.quantized import QuantizedMemoryStore
from tracinfunc.store.writer import StoreWriter, make_writer
from tracinfunc.store.zarr import ZarrStore
from tracinfunc.store.zarr_writer import ZarrWriter

__all__ = [
    "CheckpointMeta",
    "GradientStore",
    "MemoryStore",
    "MemoryWriter",
    "PinnedStore",
    "PinnedWriter",
    "QuantizedMemoryStore",
    "QuantizedPinnedStore",
    "StoreMeta",
    "StoreWriter",
    "SupportsChunkAlignment",
    "SupportsQuantizedRows",
    "SupportsRowViews",
    "ZarrStore",
    "ZarrWriter",
    "check_compatible",
    "make_writer",
    "open_store",
    "read_store_meta",
    "remove_store",
    "save_store",
    "to_memory",
    "to_pinned",
    "verify_store",
]
