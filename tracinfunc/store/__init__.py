"""Gradient stores: immutable projected training gradients ``[n_ckpt, n_train, k]``.

``protocols`` is the interface (:class:`GradientStore`, :class:`StoreWriter` and the optional
abilities) and the checks every store shares; ``meta`` what a store was made from; ``codes``
the int8 and sign codes of quantised stores. The implementations live one folder a backend:
``memory/`` (dense, quantised, pinned) and ``zarr/`` (local disk and object storage).
Operations over any store: ``convert`` (copies between kinds), ``writer`` (the writer for a
``store=`` argument), ``rowrange`` (a row range as a store) and ``stream`` (feeding ``score``).
"""

from tracinfunc.store.convert import save_store, to_memory, to_pinned
from tracinfunc.store.memory import (
    MemoryStore,
    MemoryWriter,
    PinnedStore,
    PinnedWriter,
    QuantizedMemoryStore,
    QuantizedPinnedStore,
)
from tracinfunc.store.meta import CheckpointMeta, StoreMeta, check_compatible
from tracinfunc.store.protocols import (
    GradientStore,
    StoreWriter,
    SupportsChunkAlignment,
    SupportsQuantizedRows,
    SupportsRowViews,
)
from tracinfunc.store.writer import make_writer
from tracinfunc.store.zarr import (
    PartWriter,
    StorePart,
    ZarrStore,
    ZarrWriter,
    commit_store,
    open_store,
    read_store_meta,
    remove_store,
    verify_store,
)

__all__ = [
    "CheckpointMeta",
    "GradientStore",
    "MemoryStore",
    "MemoryWriter",
    "PartWriter",
    "PinnedStore",
    "PinnedWriter",
    "QuantizedMemoryStore",
    "QuantizedPinnedStore",
    "StoreMeta",
    "StorePart",
    "StoreWriter",
    "SupportsChunkAlignment",
    "SupportsQuantizedRows",
    "SupportsRowViews",
    "ZarrStore",
    "ZarrWriter",
    "check_compatible",
    "commit_store",
    "make_writer",
    "open_store",
    "read_store_meta",
    "remove_store",
    "save_store",
    "to_memory",
    "to_pinned",
    "verify_store",
]
