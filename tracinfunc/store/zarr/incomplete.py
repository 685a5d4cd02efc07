"""Why a store cannot be opened yet: being written, awaiting its commit, or interrupted.

An unfinished store reached by ``open_store`` is in one of four states, each with its own
remedy; :func:`incomplete_error` names the right one instead of advising deletion:

* a live build (this host) holds its writer lock: wait for it;
* a sharded build whose parts all finished: seal it with ``commit_store``;
* a sharded build with unfinished parts: rerun those parts, then commit;
* an interrupted one-process build: resume it (or delete it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tracinfunc._validate import current_caller
from tracinfunc.errors import IncompleteStoreError
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.zarr.lock import live_writers
from tracinfunc.store.zarr.urls import Location

if TYPE_CHECKING:
    import zarr

__all__ = ["incomplete_error"]

PARTS_KEY = "tracinfunc_parts"  # as store/zarr/part_layout.py writes it
PART_KEY = "tracinfunc_part"


def incomplete_error(path: Location, group: zarr.Group, meta: StoreMeta) -> IncompleteStoreError:
    """The error for opening the unfinished store at ``path`` (group and metadata read)."""
    where = str(path)
    head = f"{current_caller()}: the store at {where!r} is not finished"
    writers = live_writers(path)
    if writers:
        return IncompleteStoreError(
            f"{head}: a build (process {', '.join(map(str, writers))}) is being written to it "
            "right now. Wait for that build to finish, then open it again.")
    parts = group.attrs.get(PARTS_KEY)
    if isinstance(parts, dict) and isinstance(parts.get("count"), int):
        unfinished = _unfinished_parts(group, parts["count"])
        if not unfinished:
            return IncompleteStoreError(
                f"{head}: all {parts['count']} parts of its sharded build are complete but not "
                f"committed yet. Seal it with tif.store.commit_store({where!r}) (or "
                f"'tracinfunc commit {where}'), then open it.")
        return IncompleteStoreError(
            f"{head}: parts {unfinished[:20]} of the {parts['count']} of its sharded build are "
            "not complete. Run them (build_store(..., shard=(index, count)), same arguments), "
            f"then seal it with tif.store.commit_store({where!r}).")
    return IncompleteStoreError(
        f"{head} ({meta.n_train} rows written): the build that wrote it was interrupted. "
        "Resume it by calling build_store again with the same arguments and store=path, or "
        "delete it.")


def _unfinished_parts(group: zarr.Group, count: int) -> list[int]:
    unfinished = []
    for index in range(count):
        try:
            state = group[f"parts/{index}"].attrs.get(PART_KEY)
        except (KeyError, ValueError, TypeError):
            state = None
        if not (isinstance(state, dict) and state.get("complete")):
            unfinished.append(index)
    return unfinished
