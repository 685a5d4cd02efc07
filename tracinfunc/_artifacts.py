"""The one guard every writer calls first: never write inside, over or above another artefact.

Each kind of artefact the library writes is registered in :data:`KINDS` with how to recognise
its root directory (the files and marks its writer leaves there). :func:`check_writable`
refuses, before anything is created (a lock file included):

* a path *inside* any artefact (``s.zarr/zarr.json``, ``index/meta.json``, a symlink into
  one: paths are resolved first);
* a path that *is* an artefact of another kind (a curvature saved over a gradient store);
* with ``overwrite``, an existing directory that is not an artefact of the writer's kind (the
  parent of a store, a user's folder: replacing it would delete what is inside), and the file
  system root, the home directory and the working directory (or a folder holding it);
* a file writer's target that is a directory.

A new artefact kind joins by adding a :class:`ArtifactKind` to :data:`KINDS`
(``tests/test_artifacts.py`` checks that every writer's artefact is recognised). URLs
(object storage) are not checked here: their writers hold their own conditional locks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracinfunc._jsonfile import read_json
from tracinfunc._validate import current_caller
from tracinfunc.errors import CorruptStoreError, ForeignArtifactError, InvalidArgumentError

__all__ = ["FILE_KINDS", "KINDS", "ArtifactKind", "artifact_kind", "check_removable",
           "check_writable", "enclosing_artifact"]


@dataclass(frozen=True)
class ArtifactKind:
    """How to recognise one kind of artefact's root directory.

    Attributes:
        name: What messages call it ("gradient store").
        recognise: ``recognise(directory) -> bool``; must not raise, and reads little (it runs
            on every folder above a path being written).
        writers: The public writers of this kind, for messages and the registry test.
    """

    name: str
    recognise: Callable[[Path], bool]
    writers: tuple[str, ...]


def _zarr_attributes(directory: Path) -> dict[str, Any]:
    """The attributes of the Zarr v3 group at ``directory`` (``{}`` if none or unreadable)."""
    try:
        attrs = read_json(directory / "zarr.json").get("attributes", {})
    except (OSError, CorruptStoreError, AttributeError):
        return {}
    return attrs if isinstance(attrs, dict) else {}


def _zarr_marked(*marks: str) -> Callable[[Path], bool]:
    return lambda directory: any(mark in _zarr_attributes(directory) for mark in marks)


def _is_index(directory: Path) -> bool:
    try:
        saved = read_json(directory / "meta.json")
        names = {entry.name for entry in directory.iterdir()}
    except (OSError, CorruptStoreError):
        return False
    return (isinstance(saved, dict) and {"format_version", "fingerprint", "kind"} <= set(saved)
            and names <= _INDEX_FILES)


# The files build_index writes (search/files.py names them; this module sits below search/).
_INDEX_FILES = frozenset({"index.faiss", "meta.json", "norms.npy", "sketch.npy"})


def _is_recording(directory: Path) -> bool:
    # The manifest only: a folder of the user's own ``checkpoint-N.pt`` files is not one.
    try:
        manifest = read_json(directory / "manifest.json")
    except (OSError, CorruptStoreError):
        return False
    return isinstance(manifest, dict) and "checkpoints" in manifest


#: Every artefact kind the library writes as a directory, by name.
KINDS: dict[str, ArtifactKind] = {kind.name: kind for kind in (
    # finished, incomplete and sharded (``tracinfunc_parts``) stores share the root mark
    ArtifactKind("gradient store", _zarr_marked("tracinfunc", "tracinfunc_parts"),
                 ("build_store", "save_store", "ZarrWriter", "remove_store", "tracinfunc build")),
    ArtifactKind("store part", _zarr_marked("tracinfunc_part"), ("build_store(shard=...)",)),
    ArtifactKind("search index", _is_index, ("build_index", "SearchIndex.save")),
    ArtifactKind("saved curvature", _zarr_marked("tracinfunc_curvature"), ("save_curvature",)),
    ArtifactKind("recording", _is_recording, ("CheckpointRecorder", "record_checkpoint")),
    ArtifactKind("retraining run", _zarr_marked("tracinfunc_retrain"), ("retrain_subsets",)),
    ArtifactKind("CLI result", _zarr_marked("tracinfunc_results"), ("tracinfunc score",)),
)}

#: Kinds written as one plain file (never a directory); any file may be replaced by them
#: with ``overwrite`` unless it lies inside an artefact.
FILE_KINDS = ("result file", "selection file", "report file")


def artifact_kind(directory: str | os.PathLike[str]) -> str | None:
    """The name of the artefact whose root is ``directory``, or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    return next((kind.name for kind in KINDS.values() if kind.recognise(directory)), None)


def enclosing_artifact(path: str | os.PathLike[str]) -> tuple[str, Path] | None:
    """``(kind, root)`` of the artefact that ``path`` (resolved) is or lies inside, or None."""
    resolved = Path(path).resolve()
    for candidate in (resolved, *resolved.parents):
        kind = artifact_kind(candidate)
        if kind is not None:
            return kind, candidate
    return None


def check_writable(path: str | os.PathLike[str], kind: str, *, overwrite: bool) -> None:
    """Raise unless the writer of ``kind`` may write at ``path`` (call before creating anything).

    Args:
        path: What the writer creates (a directory for the kinds in :data:`KINDS`, a file for
            those in :data:`FILE_KINDS`). A URL is not checked.
        kind: The kind the writer writes: a key of :data:`KINDS` or one of :data:`FILE_KINDS`.
        overwrite: Whether the writer was told it may replace what is at ``path``.

    Raises:
        ForeignArtifactError: ``path`` lies inside an artefact, is one of another kind, or is
            a directory (a parent of artefacts, a user's folder, home, root, the working
            directory) that ``overwrite`` would delete.
    """
    if kind not in KINDS and kind not in FILE_KINDS:
        raise InvalidArgumentError(
            f"check_writable: kind must be one of {sorted(KINDS) + list(FILE_KINDS)}, got "
            f"{kind!r}; register a new artefact kind in tracinfunc._artifacts.KINDS.")
    if "://" in str(path):
        return
    caller = current_caller()  # the public function the user called
    target = Path(path)
    resolved = target.resolve()
    inside = enclosing_artifact(resolved.parent)  # the nearest artefact above the target
    if inside is not None:
        found, parent = inside
        raise ForeignArtifactError(
            f"{caller}: {str(target)!r} is or lies inside the {found} at {str(parent)!r}; "
            f"writing a {kind} there would damage that {found}. Choose a path outside "
            f"{str(parent)!r} (beside it, not in it).")
    if not (resolved.exists() or target.is_symlink()):
        return
    _check_over(target, resolved, kind, overwrite=overwrite)


def check_removable(path: str | os.PathLike[str], kind: str) -> Path:
    """Raise unless the remover of ``kind`` may delete ``path``; return what to delete.

    The guard for deleting, phrased for it: ``path`` (resolved, so a symlink counts as where
    it points) must not lie inside another artefact, nor be the file system root, the home
    directory or the working directory (or hold it). Whether it *is* a ``kind`` is the
    caller's check (it reads the artefact's own metadata).

    Returns:
        The resolved path, the directory to delete.

    Raises:
        ForeignArtifactError: as above; nothing is deleted.
    """
    caller = current_caller()  # the public function the user called
    target = Path(path)
    resolved = target.resolve()
    inside = enclosing_artifact(resolved.parent)  # the nearest artefact above the target
    if inside is not None:
        found, parent = inside
        raise ForeignArtifactError(
            f"{caller}: {str(target)!r} is or lies inside the {found} at {str(parent)!r}, "
            f"not a {kind} of its own; removing it would damage that {found}, so nothing "
            f"was removed. Pass the path of a {kind} (remove the {found} as a whole with "
                "its own remover).")
    if _protected(resolved):
        raise ForeignArtifactError(
            f"{caller}: {str(target)!r} is the file system root, the home directory or the "
            f"working directory (or holds it), never a {kind} to remove; nothing was removed. "
            f"Pass the path of the {kind} itself (a folder below it).")
    found = artifact_kind(resolved)
    held = _children(resolved) if found is None and resolved.is_dir() else []
    if (found is not None and found != kind) or held:
        what = f"is the {found}" if found else f"holds the {held[0][0]} at {str(held[0][1])!r}"
        raise ForeignArtifactError(
            f"{caller}: {str(target)!r} {what}, not a {kind}; nothing was removed. Pass the "
            f"path of a {kind}.")
    return resolved


def _check_over(target: Path, resolved: Path, kind: str, *, overwrite: bool) -> None:
    """Refuse replacing what exists at ``target`` unless it is a ``kind`` (or a plain file
    for a file kind)."""
    caller = current_caller()
    found = artifact_kind(resolved)
    if found is not None and found != kind:
        raise ForeignArtifactError(
            f"{caller}: {str(target)!r} is the {found} at {str(resolved)!r}, not a "
            f"{kind}; writing a {kind} there would destroy it. Choose another path.")
    if kind in KINDS and resolved.exists() and not resolved.is_dir():
        # Refused here, before the writer creates its lock file beside the user's file.
        raise ForeignArtifactError(
            f"{caller}: {str(target)!r} is a file, not a {kind}; a {kind} is a directory "
            "and never replaces a file (overwrite or not). Choose a new path.")
    if overwrite and _protected(resolved):
        raise ForeignArtifactError(
            f"{caller}: {str(target)!r} is the file system root, the home directory or the "
            f"working directory (or holds it); no {kind} is ever written over it. Choose a new "
            "path below it.")
    if found is None and resolved.is_dir():
        if kind in FILE_KINDS:
            raise ForeignArtifactError(
                f"{caller}: {str(target)!r} is a directory; a {kind} is one file and never "
                "replaces a directory. Choose a file path.")
        held = _children(resolved)
        if held:  # the parent of artefacts: writing a kind there would mix with or delete them
            raise ForeignArtifactError(
                f"{caller}: {str(target)!r} is not a {kind} but a directory holding the "
                f"{held[0][0]} at {str(held[0][1])!r}; a {kind} is never written over or "
                "into the folder of another artefact. Choose a new path beside them.")
        if overwrite and any(resolved.iterdir()):
            raise ForeignArtifactError(
                f"{caller}: {str(target)!r} exists and is not a {kind} (a directory holding "
                "files tracinfunc did not write), so overwrite will not delete it; choose "
                "another path.")


def _protected(resolved: Path) -> bool:
    """The root, a home directory (``~``, ``/home/<user>``, ``/Users/<user>``), the working
    directory or a folder holding it: never an overwrite target."""
    cwd = Path.cwd().resolve()
    return (resolved == Path(resolved.anchor) or resolved in (Path.home().resolve(), cwd)
            or resolved in cwd.parents or str(resolved.parent) in ("/home", "/Users"))


def _children(directory: Path) -> list[tuple[str, Path]]:
    """The artefacts directly inside ``directory`` (to name what overwriting it would lose)."""
    try:
        entries = sorted(directory.iterdir())[:1000]
    except OSError:
        return []
    return [(kind, entry) for entry in entries if (kind := artifact_kind(entry)) is not None]
