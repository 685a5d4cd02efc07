"""Sharded builds: many processes fill one Zarr store, part by part, then one commit seals it.

A sharded store is created with its final size (``n_train`` rows) up front, so no writer ever
resizes an array (resizing rewrites ``zarr.json``, which concurrent writers would race on).
The rows are split into ``count`` parts **aligned to the Zarr shards**: two writers never
touch one shard file (zarr writes a shard whole, so concurrent writers to one shard lose
rows). Each part keeps its own progress in its own group, ``parts/<index>/zarr.json``, so
parts resume independently after a crash; the root metadata stays ``complete=False`` until
:func:`commit_store` finds every part complete and the parts agree (same build options,
the same data as far as their input fingerprints chain, ``build/inputs.py``)::

    grads.zarr/
      zarr.json            attributes: "tracinfunc" (StoreMeta, n_train = the final size)
                                       "tracinfunc_parts" ({"count": n})
      parts/<i>/zarr.json  attributes: "tracinfunc_part" ({start, stop, rows_written, complete,
                                        build, inputs}: see ``build/inputs.py``)
      rows/<c>/ norms/<c>/ as in a one-process store: the committed store is bit-identical
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor

from tracinfunc._artifacts import check_writable
from tracinfunc._validate import current_caller, entry_point
from tracinfunc.errors import (
    IncompatibleGradientsError,
    IncompleteStoreError,
    InvalidArgumentError,
    ReadOnlyStoreError,
    StoreNotFoundError,
)
from tracinfunc.interop import as_tensor
from tracinfunc.store.codes import to_stored
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import check_block
from tracinfunc.store.zarr.integrity import seal, sync_files
from tracinfunc.store.zarr.layout import (
    ATTRS_KEY,
    buffer_rows,
    chunk_files,
    pending_buffers,
    read_meta,
    writable_arrays,
    writable_scales,
    write_pending,
)
from tracinfunc.store.zarr.lock import RemoteLock, WriterLock
from tracinfunc.store.zarr.object_integrity import seal_objects
from tracinfunc.store.zarr.part_layout import PARTS_KEY, open_or_create
from tracinfunc.store.zarr.store import ZarrStore, read_back_rows
from tracinfunc.store.zarr.urls import is_url, location, write_location

if TYPE_CHECKING:
    import zarr

__all__ = ["PARTS_KEY", "PartWriter", "StorePart", "check_shard", "commit_store",
           "part_rows", "read_parts"]

PART_KEY = "tracinfunc_part"


@dataclasses.dataclass(frozen=True)
class StorePart:
    """One part of a sharded build: rows ``[start, stop)`` of the store at ``path``.

    ``build_store(..., shard=(index, count))`` returns it (the store itself opens only after
    :func:`commit_store`).
    """

    path: Path | str
    index: int
    count: int
    start: int
    stop: int
    complete: bool


def check_shard(shard: object) -> tuple[int, int]:
    """``shard`` as ``(index, count)`` with ``0 <= index < count``, or a clear error."""
    ok = (isinstance(shard, tuple | list) and len(shard) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in shard)
          and 0 <= shard[0] < shard[1])
    if not ok:
        raise InvalidArgumentError(
            f"{current_caller()}: shard must be (index, count) with 0 <= index < count, got "
            f"{shard!r}; e.g. shard=(3, 8) for the fourth of eight parts (SLURM_ARRAY_TASK_ID, "
            "SLURM_ARRAY_TASK_COUNT)."
        )
    return int(shard[0]), int(shard[1])


def part_rows(n_train: int, shard_rows: int, index: int, count: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of part ``index`` of ``count``: whole Zarr shards, split evenly.

    Parts get ``floor``/``ceil`` of ``n_shards / count`` shards; with more parts than shards
    the extra parts are empty (``start == stop``).
    """
    n_shards = -(-n_train // shard_rows)
    first, last = index * n_shards // count, (index + 1) * n_shards // count
    return min(n_train, first * shard_rows), min(n_train, last * shard_rows)


class PartWriter:
    """Writes one part of a sharded Zarr store (the writer interface of ``store.writer``).

    ``rows_written`` counts rows of the *whole store* before the next row this part needs
    (``start`` plus the rows of the part already written), so the shared build loop skips the
    data before the part, and resumes a part after a crash, the same way.

    Args:
        path: The store directory, created by whichever part comes first.
        meta: Metadata with ``n_train`` the final number of rows.
        shard: ``(index, count)``.
        chunk_rows: As for :class:`~tracinfunc.store.ZarrWriter`; every part must pass the same.
        shard_rows: As for :class:`~tracinfunc.store.ZarrWriter`; every part must pass the same.
        compression: As for :class:`~tracinfunc.store.ZarrWriter`; every part must pass the same.

    Raises:
        StoreExistsError: a finished store, or a store split into another count, is there.
        IncompatibleGradientsError: the store there was started with other arguments.
    """

    @entry_point("PartWriter")
    def __init__(self, path: str | os.PathLike[str], meta: StoreMeta, shard: tuple[int, int],
                 *, chunk_rows: int | None = None, shard_rows: int | None = None,
                 compression: str | None = None) -> None:
        self._path = write_location(path)  # a symlink to a store: the store it points to
        check_writable(self._path, "gradient store", overwrite=False)
        self.index, self.count = check_shard(shard)
        # One writer per part, as per store: a requeued task beside a still-running copy of
        # the same part is refused (other parts write beside it freely).
        lock_path = f"{self._path}.part{self.index}"
        self._lock = RemoteLock(lock_path) if is_url(self._path) else WriterLock(Path(lock_path))
        try:  # a refusal gives the lock back (and removes its file)
            self._open(meta, chunk_rows, shard_rows, compression)
        except BaseException:
            self._lock.release()
            raise

    def _open(self, meta: StoreMeta, chunk_rows: int | None, shard_rows: int | None,
              compression: str | None) -> None:
        """Create or join the sharded store at the locked path and find this part's rows."""
        self._group = open_or_create(self._path, meta, self.count, chunk_rows=chunk_rows,
                                      shard_rows=shard_rows, compression=compression)
        self._meta = read_meta(self._group, self._path)
        self._rows = writable_arrays(self._group, "rows", meta.n_ckpt)
        self._norms = writable_arrays(self._group, "norms", meta.n_ckpt)
        self._scales = writable_scales(self._group, meta)
        self._shard_rows = int(self._rows[0].shards[0])
        self.start, self.stop = part_rows(meta.n_train, self._shard_rows, self.index, self.count)
        self._part = self._group.require_group(f"parts/{self.index}")
        state = self._part.attrs.get(PART_KEY) or {}
        self._committed = int(state.get("rows_written", self.start))
        # How it was built and what it saw (``build/inputs.py``), kept across resumes.
        self._notes = {key: state[key] for key in ("build", "inputs") if key in state}
        self._pending, self._pending_scales, self._pending_norms = pending_buffers(
            meta, self._shard_rows)
        self._filled = 0
        self._finished = False
        self._complete = bool(state.get("complete", False))  # as found (a rerun keeps it)
        self._record(complete=self._complete)

    @property
    def first_row(self) -> int:
        """The part's first row (rows before it are other parts')."""
        return self.start

    def read_back(self, start: int, stop: int) -> Tensor:
        """Stored rows ``[n_ckpt, stop - start, k]`` of this part (a resume checks its data
        against them)."""
        return read_back_rows(self._meta, self._rows, self._scales, start, stop)

    @property
    def rows_written(self) -> int:
        """Store rows before the next row this part needs (``start`` + rows written)."""
        return self._committed + self._filled

    @entry_point("PartWriter.append")
    def append(self, rows: Tensor, norms: Tensor) -> None:
        """Add ``rows`` ``[n_ckpt, b, k]`` and ``norms`` ``[n_ckpt, b]``, inside the part."""
        if self._finished:
            raise ReadOnlyStoreError("PartWriter.append: the part is already finished.")
        rows = as_tensor(rows).detach()
        norms = as_tensor(norms).detach()
        check_block(self._meta, rows, norms)
        if self.rows_written + rows.shape[1] > self.stop:
            raise InvalidArgumentError(
                f"PartWriter.append: part {self.index} holds rows [{self.start}, {self.stop}) "
                f"but {self.rows_written + rows.shape[1]} rows would be written; append only "
                "the part's rows (build_store does)."
            )
        buffer_rows(self, *to_stored(rows, self._meta), norms)

    def finish(self) -> StorePart:
        """Write the last shard and mark the part complete (the store needs a commit)."""
        if self._finished:
            raise ReadOnlyStoreError("PartWriter.finish: the part is already finished.")
        self._flush()
        if self._committed != self.stop:
            raise IncompleteStoreError(
                f"PartWriter.finish: part {self.index} of {self.count} needs rows "
                f"[{self.start}, {self.stop}) but only rows up to {self._committed} were "
                "written; pass the same data as the other parts (all n_train examples)."
            )
        self._finished = True
        self._record(complete=True)
        self._lock.release()
        return StorePart(self._path, self.index, self.count, self.start, self.stop, True)

    def _flush(self) -> None:
        """Write the buffered rows (whole shards), then record them in the part's group."""
        n = self._filled
        if n == 0:
            return
        self._lock.check()
        written = write_pending(self, self._committed, resize=False)  # full-size arrays
        # On disk before they are counted, as ZarrWriter does: else a power loss leaves
        # counted empty shards. (An object store's PUT is durable when it returns.)
        if not is_url(self._path):
            sync_files([f for a in written
                        for f in chunk_files(a, self._committed, self._committed + n)])
        # Only now: a crash before redoes the shard.
        self._committed, self._filled = self._committed + n, 0
        self._complete = False
        self._record(complete=False)

    def record_build(self, build: dict) -> None:
        """Record how this part is built (options not in the store's metadata); commit
        requires every part's record to be equal.

        Raises:
            IncompatibleGradientsError: this part was started with another record (a resume
                with other options).
        """
        earlier = self._notes.get("build")
        if earlier is not None and "batch_size" not in earlier:  # a part from before that key:
            build = {k: v for k, v in build.items() if k != "batch_size"}  # unknown, not guessed
        if earlier is not None and earlier != build:
            error = IncompatibleGradientsError(
                f"{current_caller()}: part {self.index} of {str(self._path)!r} was started "
                f"{_difference(earlier, build, who='now')}; resume it with the options of the "
                "interrupted run (or remove its progress, parts/<index>, to start it over)."
            )
            error.build_record = dict(earlier)  # the command line names its flag from it
            self._lock.release()  # refused: nothing may be written, no lock file left
            raise error
        self._notes["build"] = build
        self._record(complete=self._complete)

    def record_inputs(self, *, before: str, through: str) -> None:
        """Record fingerprints of the examples before the part's rows and through them
        (``build/inputs.py``); commit chains each part's ``before`` to the previous part's
        ``through``.

        Raises:
            IncompatibleGradientsError: the part recorded other fingerprints when it was
                written (a finished part run again over other data).
        """
        inputs = {"before": before, "through": through}
        earlier = self._notes.get("inputs")
        if earlier is not None and earlier != inputs:
            raise IncompatibleGradientsError(
                f"{current_caller()}: part {self.index} of {str(self._path)!r} was written "
                "from other data: the examples it iterated now (through its last row "
                f"{self.stop}) are not those it recorded. Run it with the data of the other "
                "parts (or remove its progress, parts/<index>, to build it again)."
            )
        self._notes["inputs"] = inputs

    def _record(self, *, complete: bool) -> None:
        self._part.attrs[PART_KEY] = {"start": self.start, "stop": self.stop,
                                      "rows_written": self._committed, "complete": complete,
                                      **self._notes}


@entry_point("read_parts")
def read_parts(path: str | os.PathLike[str]) -> list[dict | None]:
    """The state of every part of the sharded store at ``path`` (``None``: never started)."""
    group = _group(path)
    count = int(group.attrs[PARTS_KEY]["count"])
    states: list[dict | None] = []
    for index in range(count):
        try:
            states.append(dict(group[f"parts/{index}"].attrs.get(PART_KEY) or {}) or None)
        except KeyError:
            states.append(None)
    return states


@entry_point("commit_store")
def commit_store(path: str | os.PathLike[str]) -> ZarrStore:
    """Seal a sharded store whose parts are all complete, and open it read-only.

    Run once after every part finished: ``tracinfunc commit grads.zarr`` after a SLURM array;
    under torchrun rank 0 does it after a barrier. Committing a committed store just opens it.

    Raises:
        IncompleteStoreError: a part is missing or unfinished (names them; rerun those parts).
        StoreNotFoundError: ``path`` holds no sharded store.
    """
    group = _group(path)
    meta = read_meta(group, location(path))
    if not meta.complete:
        states = read_parts(path)
        missing = [i for i, s in enumerate(states) if not (s and s.get("complete"))]
        if missing:
            raise IncompleteStoreError(
                f"commit_store: parts {missing[:20]} of {len(states)} of {str(path)!r} are not "
                f"complete; rerun them (e.g. 'tracinfunc build --shard {missing[0]}/"
                f"{len(states)} ...', same arguments) and commit again."
            )
        check_parts_agree(path, states)
        finished = meta.replace(complete=True).to_dict()
        where = location(path)
        # Sealed like a one-process build (files fsync'ed, manifest, metadata checksum), so
        # tampering is caught the same way (on object storage: a manifest of its objects).
        group.attrs[ATTRS_KEY] = (seal_objects(group.store, where, finished) if is_url(where)
                                  else seal(where, finished))
    return ZarrStore(path)


def check_parts_agree(path: object, states: list[dict]) -> None:
    """Raise unless the parts were built alike and from the same data, as far as their
    markers record it (``build/inputs.py`` says what is and is not covered).

    Raises:
        IncompatibleGradientsError: names the part(s), the difference and the fix.
    """
    count = len(states)
    built = [(i, s["build"]) for i, s in enumerate(states) if s.get("build") is not None]
    for i, build in built[1:]:
        j, first = built[0]
        if build != first:
            raise IncompatibleGradientsError(
                f"commit_store: part {i} of {count} of {str(path)!r} was built "
                f"{_difference(build, first)} (part {j}); its rows cannot be sealed with "
                f"the others'. Remove {_progress(path, i)} (its progress) and run part {i} "
                "again with the options of the other parts, then commit again."
            )
    chained = [(i, s) for i, s in enumerate(states) if s.get("inputs") and s["stop"] > s["start"]]
    for (i, earlier), (j, later) in itertools.pairwise(chained):
        if later["start"] == earlier["stop"] and (
                later["inputs"]["before"] != earlier["inputs"]["through"]):
            raise IncompatibleGradientsError(
                f"commit_store: parts {i} and {j} of {count} of {str(path)!r} saw different data: "
                f"the examples before row {later['start']} that part {j} iterated are not "
                f"those part {i} (and the parts before it) wrote. One of them was built from "
                "other data, or in another order; remove that part's progress "
                f"({_progress(path, i)} or {_progress(path, j)}) and run it again over the "
                "same data as the others, then commit again."
            )


def _difference(build: dict, other: dict, *, who: str = "the other parts") -> str:
    """``"with mixed_precision 'bfloat16' but ... with None"`` for the first differing key."""
    for key in sorted(set(build) | set(other)):
        if build.get(key) != other.get(key):
            what = "store metadata (digest)" if key == "metadata" else key
            return f"with {what} {build.get(key)!r} but {who} with {other.get(key)!r}"
    return "alike"


def _progress(path: object, index: int) -> str:
    return repr(f"{str(path).rstrip('/')}/parts/{index}")


def _group(path: str | os.PathLike[str]) -> zarr.Group:
    import zarr
    try:
        group = zarr.open_group(location(path), mode="r+")
        group.attrs[PARTS_KEY]["count"]
    except Exception as error:
        raise StoreNotFoundError(
            f"{current_caller()}: no sharded store at {str(path)!r}; it is made by "
            "build_store(..., shard=(index, count), store=path) or 'tracinfunc build --shard i/n'."
        ) from error
    return group
