"""ZarrWriter: fills a zarr v3 store (a directory or an object-storage URL) shard by shard.

It buffers rows into whole shards (writing part of a shard would make zarr read, modify and
rewrite it) and records the committed row count in the group metadata after each shard, so
an interrupted build resumes from its last completed shard; :meth:`ZarrWriter.finish` seals
the store and returns the read-only :class:`~tracinfunc.store.zarr.store.ZarrStore`. The layout is
described in ``store/zarr/store.py``.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from tracinfunc._artifacts import check_writable
from tracinfunc._validate import current_caller, entry_point
from tracinfunc.errors import (
    IncompatibleGradientsError,
    ReadOnlyStoreError,
    StoreExistsError,
)
from tracinfunc.interop import as_tensor
from tracinfunc.store.codes import check_codes, to_stored
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import check_block
from tracinfunc.store.zarr.integrity import seal, sync_files
from tracinfunc.store.zarr.layout import (
    ATTRS_KEY,
    buffer_rows,
    check_rerun,
    check_resumable,
    chunk_files,
    create_layout,
    pending_buffers,
    read_meta,
    writable_arrays,
    writable_scales,
    write_errors,
    write_pending,
)
from tracinfunc.store.zarr.lock import RemoteLock, WriterLock
from tracinfunc.store.zarr.object_integrity import seal_objects
from tracinfunc.store.zarr.store import ZarrStore, read_back_rows
from tracinfunc.store.zarr.urls import exists, is_url, remove, write_location

__all__ = ["BUILD_KEY", "ZarrWriter"]

BUILD_KEY = "tracinfunc_build"
"""Group attribute: how a one-process build cuts its rows into calls (``batch_size``)."""


class ZarrWriter:
    """Writes rows to a zarr v3 store shard by shard, resuming an interrupted build.

    Args:
        path: Directory to create. If it holds an *incomplete* store made with the same
            metadata, writing resumes after its last completed shard (``rows_written``).
        meta: Metadata of the store (``n_train`` and ``complete`` are managed here).
        chunk_rows: Rows per inner chunk (default: ~4 MiB of rows).
        shard_rows: Rows per shard, a multiple of ``chunk_rows`` (default: ~256 MiB).
        compression: ``None`` (default, raw chunks: fastest reads) or ``"zstd"``.
        overwrite: Replace a *finished* store at ``path`` (default: refuse).

    Raises:
        StoreExistsError: a finished store (or something else) is already at ``path``.
        IncompatibleGradientsError: an incomplete store at ``path`` was started differently.
        ForeignArtifactError: ``path`` is, lies inside, or holds an artefact of another
            kind (a store, index, curvature, recording...; see docs/concepts/stores.md).
    """

    @entry_point("ZarrWriter")
    def __init__(self, path: str | os.PathLike[str], meta: StoreMeta, *,
                 chunk_rows: int | None = None, shard_rows: int | None = None,
                 compression: str | None = None, overwrite: bool = False) -> None:
        # A directory or an fsspec URL (s3://bucket/grads.zarr); a symlink: its target.
        self._path = write_location(path)
        check_writable(self._path, "gradient store", overwrite=overwrite)
        self._finished = False
        # Before looking at the path: a flock locally, a conditionally created lock object
        # on object storage. A refusal from here on gives it back (and removes its file).
        self._lock = (RemoteLock(self._path) if is_url(self._path)
                      else WriterLock(self._path))
        try:
            self._open(meta, chunk_rows, shard_rows, compression, overwrite)
        except BaseException:
            self._lock.release()
            raise

    def _open(self, meta: StoreMeta, chunk_rows: int | None, shard_rows: int | None,
              compression: str | None, overwrite: bool) -> None:
        """Resume, rerun, replace or create the store at the locked path."""
        self._rerun: ZarrStore | None = None  # a finished store this call would make again
        if exists(self._path) and not self._resumable(meta, overwrite):
            remove(self._path)
        if self._rerun is not None:  # nothing to write: rows_written == n_train, finish() opens
            self._lock.release()
            return
        if not exists(self._path, "zarr.json"):
            self._group = create_layout(self._path, meta, chunk_rows=chunk_rows,
                                        shard_rows=shard_rows, compression=compression)
        self._meta = read_meta(self._group, self._path)
        self._committed = self._meta.n_train
        self._resumed = self._committed > 0  # rows from an earlier run: record_build adds none
        self._rows = writable_arrays(self._group, "rows", meta.n_ckpt)
        self._norms = writable_arrays(self._group, "norms", meta.n_ckpt)
        self._scales = writable_scales(self._group, meta)
        self._shard_rows = int(self._rows[0].shards[0])
        # Drop anything a killed build wrote past its last committed shard.
        for array in self._rows + self._scales + self._norms:
            array.resize((self._committed, *array.shape[1:]))
        self._pending, self._pending_scales, self._pending_norms = pending_buffers(
            meta, self._shard_rows)
        self._filled = 0

    def _resumable(self, meta: StoreMeta, overwrite: bool) -> bool:
        """True to resume the store at ``path``; False to replace it (after checks)."""
        import zarr
        try:
            self._group = zarr.open_group(self._path, mode="r+")
            existing = self._group.attrs[ATTRS_KEY]
        except Exception as error:
            raise StoreExistsError(
                f"ZarrWriter: {str(self._path)!r} exists and is not a tracinfunc store; "
                "choose another path."
            ) from error
        if "tracinfunc_parts" in self._group.attrs and not existing.get("complete"):
            raise StoreExistsError(
                f"ZarrWriter: {str(self._path)!r} holds a sharded build in progress; resume "
                "its parts with build_store(..., shard=(index, count)) and seal it with "
                "tif.store.commit_store(path), or choose another path."
            )
        if existing.get("complete"):
            if overwrite:
                return False
            # A re-run after a crash between the build and the user's next step: same
            # arguments give the finished store back (its data is checked as it is skipped).
            self._rerun = ZarrStore(self._path)
            check_rerun(self._rerun.meta, meta, self._path)
            return True
        if existing.get("n_train") == 0:  # a build that failed before storing a row: replace
            return False
        check_resumable(StoreMeta.from_dict(existing), meta, self._path)
        return True

    #: Rows before this writer's first (a one-process store starts at row 0).
    first_row = 0

    @property
    def rows_written(self) -> int:
        """Rows stored so far, including those of a resumed build (or a finished one)."""
        if self._rerun is not None:
            return self._rerun.n_train
        return self._committed + self._filled

    def read_back(self, start: int, stop: int) -> Tensor:
        """Stored rows ``[n_ckpt, stop - start, k]`` (a resume checks its data against them)."""
        if self._rerun is not None:
            return torch.stack([self._rerun.read_rows(c, start, stop)
                                for c in range(self._rerun.n_ckpt)])
        return read_back_rows(self._meta, self._rows, self._scales, start, stop)

    def record_build(self, build: dict) -> None:
        """Record how the rows are computed (``build_store`` passes ``{"batch_size": ...,
        "mixed_precision": ...}``, with ``"first_batch"``, the size of the data's first batch,
        when ``batch_size`` is ``None``): the calls decide the rows' float rounding and
        ``mixed_precision`` (``"float16"``, ``"bfloat16"`` or ``None``) their precision, so a
        resumed build is bit-identical only with the same record. Keys that only one of the
        records holds are not compared (a store from before ``mixed_precision`` was recorded
        is accepted); a store started before the record (or a finished one) is never given
        one: it would be a guess.

        Raises:
            IncompatibleGradientsError: the store (incomplete, or finished and called again)
                was built with another record; ``error.build_record`` is the stored one.
        """
        earlier = self._group.attrs.get(BUILD_KEY)
        if earlier is None:
            if self._rerun is None and not self._resumed:
                self._group.attrs[BUILD_KEY] = build
            return
        changed = [key for key in sorted(set(earlier) & set(build)) if earlier[key] != build[key]]
        if not changed:
            return
        when = "built" if self._rerun is not None else "started"
        said = "; ".join(_changed(key, earlier[key], build[key], when) for key in changed)
        what = ("reuse the finished store" if self._rerun is not None
                else "resume the incomplete store")
        fix = ("pass overwrite=True to rebuild it" if self._rerun is not None
               else "remove the store to start over")
        error = IncompatibleGradientsError(
            f"{current_caller()}: cannot {what} at {str(self._path)!r}: {said}. The rows "
            "depend on it (the gradient calls decide their float rounding, mixed_precision "
            f"their precision); call again with the value it was {when} with (or {fix}, or "
            "write to another path)."
        )
        error.build_record = dict(earlier)  # the command line names its flag from it
        error.changed_keys = tuple(changed)
        self._lock.release()  # refused: nothing may be written, no lock file left
        raise error

    @entry_point("ZarrWriter.append")
    def append(self, rows: Tensor, norms: Tensor) -> None:
        """Add ``rows`` ``[n_ckpt, b, k]`` (any float dtype) and their ``norms`` ``[n_ckpt, b]``."""
        if self._finished:
            raise ReadOnlyStoreError("ZarrWriter.append: the store is already finished.")
        if self._rerun is not None:
            raise StoreExistsError(
                f"build_store: the finished store at {str(self._path)!r} holds "
                f"{self._rerun.n_train} rows but the data has more: it is not the data the "
                "store was built from. Pass overwrite=True to rebuild it, or use another path."
            )
        rows = as_tensor(rows)  # any __dlpack__ array
        norms = as_tensor(norms)
        check_block(self._meta, rows, norms)
        buffer_rows(self, *to_stored(rows.detach(), self._meta), norms.detach())

    @entry_point("ZarrWriter.append_codes")
    def append_codes(self, codes: Tensor, scales: Tensor, norms: Tensor) -> None:
        """Add a block of a quantised store as stored (see ``MemoryWriter.append_codes``)."""
        if self._finished or self._rerun is not None:
            raise ReadOnlyStoreError("ZarrWriter.append_codes: the store is already finished.")
        check_codes(self._meta, codes, scales, norms)
        buffer_rows(self, codes, scales, norms)

    def finish(self) -> ZarrStore:
        """Write the last (partial) shard, mark the store complete and reopen it read-only."""
        if self._finished:
            raise ReadOnlyStoreError("ZarrWriter.finish: the store is already finished.")
        if self._rerun is not None:
            self._finished = True
            return self._rerun
        self._flush()
        self._finished = True
        # Sealed (files fsync'ed, manifest and metadata checksum) in the same write that
        # marks it complete: a reader sees an incomplete store or a sealed one, nothing else.
        finished = self._meta.replace(n_train=self._committed, complete=True).to_dict()
        with write_errors(self._path, rows_stored=self._committed):
            if is_url(self._path):  # object storage: a manifest of objects, nothing to fsync
                self._group.attrs[ATTRS_KEY] = seal_objects(self._group.store, self._path,
                                                            finished)
            else:
                self._group.attrs[ATTRS_KEY] = seal(self._path, finished)
                sync_files([self._path / "zarr.json", self._path])
        self._lock.release()
        return ZarrStore(self._path)

    def _flush(self) -> None:
        """Write the buffered rows as whole shards, then record them as committed."""
        n = self._filled
        if n == 0:
            return
        self._lock.check()
        start, stop = self._committed, self._committed + n
        with write_errors(self._path, rows_stored=start):
            written = write_pending(self, start, resize=True)
            # On disk before they are counted: else a power loss leaves counted empty shards.
            # (An object store's PUT is durable when it returns: nothing to fsync there.)
            if not is_url(self._path):
                sync_files([f for a in written for f in chunk_files(a, start, stop)])
            # Only now is the shard counted: a crash before this line redoes it on resume.
            self._group.attrs[ATTRS_KEY] = self._meta.replace(n_train=stop).to_dict()
        self._committed, self._filled = stop, 0


def _changed(key: str, earlier: object, now: object, when: str) -> str:
    """One difference of two build records, in words."""
    if key == "first_batch":
        return (f"the data's first batch held {earlier!r} examples when {when}, {now!r} now "
                "(batch_size=None keeps the data's batches as gradient calls)")
    if key == "mixed_precision":
        return (f"mixed_precision={_dtype(earlier)} when {when}, {_dtype(now)} now (pass "
                f"GradientOptions(mixed_precision={_dtype(earlier)}))")
    return f"{key}={earlier!r} when {when}, {now!r} now"


def _dtype(name: object) -> str:
    """``"float16"`` -> ``torch.float16``; ``None`` stays ``None`` (full precision)."""
    return "None" if name is None else f"torch.{name}"
