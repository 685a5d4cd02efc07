"""The Zarr backend, one folder: stores on local disk or object storage (``s3://``).

``store`` reads a finished store and ``writer`` fills one; ``layout`` creates and checks the
on-disk layout; ``raw_layout``, ``local_reads``, ``remote_reads`` and ``object_reads`` read
row ranges without zarr's decoding; ``integrity`` seals a finished store; ``lock`` keeps one
writer per path; ``urls`` handles fsspec URLs; ``parts`` builds one store from many
processes; ``paths`` opens, verifies and removes stores by path.
"""

from tracinfunc.store.zarr.parts import PartWriter, StorePart, commit_store
from tracinfunc.store.zarr.paths import open_store, read_store_meta, remove_store, verify_store
from tracinfunc.store.zarr.store import ZarrStore
from tracinfunc.store.zarr.writer import ZarrWriter

__all__ = [
    "PartWriter",
    "StorePart",
    "ZarrStore",
    "ZarrWriter",
    "commit_store",
    "open_store",
    "read_store_meta",
    "remove_store",
    "verify_store",
]
