"""A recording's manifest: its run identity, its checkpoints in step order, their files' hashes.

``manifest.json`` is the one root of a recording directory::

    {"format_version": 3, "run_id": "<32 hex>", "frozen": {fingerprint: [names]},
     "checkpoints": [{"name", "step", "lr", "weights", "frozen", "optimizer",
                      "optimizer_param_names", "files": {file: {"size", "blake2b"}}}, ...],
     "pending": [files being written]}

A run owns its directory: it holds ``.recording.lock`` (an ``flock``, dropped by the kernel
when the process dies) while it records, and a new run refuses a directory that already
holds a recording unless told to continue it (``resume=True``) or replace it
(``overwrite=True``, which removes the files the manifest lists and nothing else). Checkpoints
only ever follow the last recorded step, so no recorded file is written over and the
manifest's order is training order. Files are written after the manifest names them as
pending and before it lists them, and the manifest is replaced atomically, so a run killed at
any moment leaves the recorded checkpoints intact and a rerun writes the pending step again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tracinfunc._artifacts import check_writable
from tracinfunc._validate import current_caller
from tracinfunc.errors import (
    CorruptRecordingError,
    InvalidArgumentError,
    InvalidTypeError,
    RecordingExistsError,
    StoreLockedError,
)
from tracinfunc.store.zarr.lock import WriterLock

__all__ = ["MANIFEST", "Recording", "check_options", "read_manifest", "recorded_entries",
           "verified_file", "write_manifest"]

MANIFEST = "manifest.json"
FORMAT_VERSION = 3
_HASH = "blake2b"
_FILE_NAME = re.compile(r"(checkpoint|optimizer)-\d+\.pt")  # what a recorder writes
_FIX = ("pass resume=True to continue that run (from its last step, or from start_step=), "
        "overwrite=True to replace it (its files are removed), or choose another directory")


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of ``directory`` (an empty one if there is none)."""
    path = directory / MANIFEST
    if not path.exists():
        return {"checkpoints": [], "frozen": {}}
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, RecursionError) as error:
        raise CorruptRecordingError(
            f"{current_caller()}: {str(path)!r} is not a recording's manifest ({error}); "
            "record the checkpoints again."
        ) from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("checkpoints"), list):
        raise CorruptRecordingError(
            f"{current_caller()}: {str(path)!r} has no list of checkpoints; it is not a "
            "manifest written by CheckpointRecorder or trainer_callback."
        )
    return manifest


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Replace the manifest atomically: written aside, flushed, then renamed over it."""
    tmp = directory / f".{MANIFEST}.tmp"
    with open(tmp, "w") as file:
        file.write(json.dumps(manifest, indent=1))
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, directory / MANIFEST)


def file_record(path: Path) -> dict[str, Any]:
    """``{"size", "blake2b"}`` of the file's bytes (read in 1 MiB blocks)."""
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return {"size": path.stat().st_size, _HASH: digest.hexdigest()}


def recorded_entries(directory: Path, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's checkpoints after checking they are in training (step) order; warns
    when the recording predates file hashes (format 1 and 2), whose files go unchecked."""
    entries = manifest["checkpoints"]
    steps = [entry.get("step") for entry in entries]
    if any(not isinstance(s, int) for s in steps) or steps != sorted(set(steps)):
        raise CorruptRecordingError(
            f"{current_caller()}: the checkpoints of {str(directory / MANIFEST)!r} are not in "
            f"step order (steps {steps}); the manifest was edited or two runs were mixed; "
            "record the checkpoints again."
        )
    if entries and any("files" not in entry for entry in entries):
        warnings.warn(
            f"{current_caller()}: {str(directory)!r} was recorded by an older version (no file "
            "hashes), so swapped, replaced or edited checkpoint files cannot be detected; "
            "record it again to have them checked.", RuntimeWarning, stacklevel=4)
    return entries


def check_listed_files(directory: Path, manifest: dict[str, Any]) -> set[str]:
    """Every file the manifest lists (recorded and pending), checked to be one a recorder
    writes: a plain ``checkpoint-<step>.pt`` or ``optimizer-<step>.pt`` inside ``directory``.

    Raises:
        CorruptRecordingError: a name that is not (``../x``, an absolute path, another name):
            the manifest was edited, and nothing is read or removed through it.
    """
    pending = manifest.get("pending", [])
    names = list(pending) if isinstance(pending, list) else [pending]
    for entry in manifest["checkpoints"]:
        if not isinstance(entry, dict):
            names.append(entry)
            continue
        names += [n for n in (entry.get("weights"), entry.get("optimizer")) if n is not None]
        names += list(entry.get("files", {}) if isinstance(entry.get("files"), dict) else [0])
    bad = [n for n in names if not isinstance(n, str) or not _FILE_NAME.fullmatch(n)]
    if bad:
        raise CorruptRecordingError(
            f"{current_caller()}: {str(directory / MANIFEST)!r} lists {bad[:3]!r}, which are "
            "not files a recorder writes (checkpoint-<step>.pt or optimizer-<step>.pt in the "
            "directory): the manifest was edited, so nothing is read or removed through it; "
            "restore the manifest, or remove the directory yourself and record anew."
        )
    return {*names}


def verified_file(directory: Path, entry: dict[str, Any], name: str) -> Path:
    """The path of ``entry``'s file ``name`` after checking its size and hash (when recorded)."""
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name):
        raise CorruptRecordingError(
            f"{current_caller()}: {entry.get('name')!r} names the file {name!r}, which is not "
            "one a recorder writes (checkpoint-<step>.pt or optimizer-<step>.pt in the "
            "directory); the manifest was edited; record the checkpoints again."
        )
    path = directory / name
    expected = entry.get("files", {}).get(name) if "files" in entry else None
    if "files" in entry and expected is None:
        raise CorruptRecordingError(
            f"{current_caller()}: {entry['name']!r} names {name!r} but records no hash for it; "
            "the manifest was edited; record the checkpoints again."
        )
    if not path.is_file():
        raise CorruptRecordingError(
            f"{current_caller()}: {str(path)!r}, recorded for {entry['name']!r}, is missing; "
            "restore it or record the checkpoints again."
        )
    if expected is None:
        return path
    if path.stat().st_size != expected["size"]:
        got = path.stat().st_size
        raise CorruptRecordingError(
            f"{current_caller()}: {str(path)!r} has size {got} bytes but {expected['size']} "
            f"were recorded for {entry['name']!r}; it was truncated or replaced; restore it "
            "or record the checkpoints again."
        )
    if file_record(path)[_HASH] != expected[_HASH]:
        raise CorruptRecordingError(
            f"{current_caller()}: {str(path)!r} does not hold the bytes recorded for "
            f"{entry['name']!r} (its {_HASH} hash differs): it was swapped with another file, "
            "replaced or edited; restore it or record the checkpoints again."
        )
    return path


def check_options(*, every: Any, resume: Any, overwrite: Any, start_step: Any = None) -> None:
    """The recorder options both front ends share, checked before touching the directory."""
    caller = current_caller()
    if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                              or every < 1):
        raise InvalidArgumentError(
            f"{caller}: every must be a positive int (optimizer steps between checkpoints), "
            f"got {every!r}; e.g. every=100."
        )
    if not isinstance(resume, bool) or not isinstance(overwrite, bool):
        raise InvalidTypeError(
            f"{caller}: resume and overwrite must be True or False, got {resume!r} and "
            f"{overwrite!r}."
        )
    if resume and overwrite:
        raise InvalidArgumentError(
            f"{caller}: pass resume=True or overwrite=True, not both: resume continues the "
            "recording in the directory, overwrite replaces it."
        )
    if start_step is not None and (isinstance(start_step, bool)
                                   or not isinstance(start_step, int) or start_step < 0):
        raise InvalidArgumentError(
            f"{caller}: start_step must be a non-negative int (the optimizer steps done "
            f"before this run), got {start_step!r}."
        )


class Recording:
    """A recording directory opened for writing by one run (the lock held until :meth:`close`).

    Raises:
        RecordingExistsError: the directory holds a recording and neither ``resume`` nor
            ``overwrite`` was given.
        StoreLockedError: another recorder is writing to the directory now.
    """

    def __init__(self, directory: Path, *, resume: bool, overwrite: bool) -> None:
        self.directory = directory
        # Never inside a store, an index or any other artefact, nor over one (the one guard
        # every writer calls), before anything is created.
        check_writable(directory, "recording", overwrite=overwrite)
        if directory.exists() and not directory.is_dir():
            raise RecordingExistsError(
                f"{current_caller()}: {str(directory)!r} is a file, not a directory; a recording "
                "is a directory of checkpoints: pass a directory path (new or a recording's)."
            )
        directory.mkdir(parents=True, exist_ok=True)
        self.model_checked = False  # a resumed run's model is compared once (contents.py)
        try:
            self._lock = WriterLock(directory / "recording")  # .recording.lock inside it
        except StoreLockedError:
            raise StoreLockedError(
                f"{current_caller()}: another recorder is recording into {str(directory)!r} "
                "right now; let it finish, or record into another directory."
            ) from None
        try:
            self.manifest = self._open(resume=resume, overwrite=overwrite)
        except BaseException:
            self.close()
            raise

    def _open(self, *, resume: bool, overwrite: bool) -> dict[str, Any]:
        manifest = read_manifest(self.directory)
        used = bool(manifest["checkpoints"])
        if used and not (resume or overwrite):
            raise RecordingExistsError(
                f"{current_caller()}: {str(self.directory)!r} already holds a recording "
                f"(run {manifest.get('run_id', 'of an older version')}, steps "
                f"{[e.get('step') for e in manifest['checkpoints']]}); a new run would mix "
                f"with it: {_FIX}."
            )
        if overwrite and (self.directory / MANIFEST).exists():
            self._remove(manifest)
            manifest = {"checkpoints": []}
        if used and resume:
            manifest.setdefault("run_id", uuid.uuid4().hex)
            return {**manifest, "format_version": FORMAT_VERSION}
        # Nothing recorded: a new run, which may rewrite the files an interrupted first
        # checkpoint left pending.
        return {"format_version": FORMAT_VERSION, "run_id": uuid.uuid4().hex, "frozen": {},
                "checkpoints": [], "pending": list(manifest.get("pending", []))}

    def _remove(self, manifest: dict[str, Any]) -> None:
        """Delete the files the manifest lists (recorded and pending), then the manifest: all
        of it checked first, so an edited manifest removes nothing."""
        for name in check_listed_files(self.directory, manifest):
            path = self.directory / name
            if path.parent == self.directory and not path.is_symlink():
                path.unlink(missing_ok=True)
        (self.directory / MANIFEST).unlink()

    @property
    def last_entry(self) -> dict[str, Any] | None:
        """The last recorded checkpoint's entry (``None`` before the first)."""
        return self.manifest["checkpoints"][-1] if self.manifest["checkpoints"] else None

    def check_step(self, step: int) -> None:
        """Refuse a step at or before the last recorded one (it would write over or before it)."""
        self._check_lock()
        last = self.last_entry
        if last is not None and step <= last["step"]:
            raise RecordingExistsError(
                f"{current_caller()}: {str(self.directory)!r} already holds checkpoints up to "
                f"step {last['step']} ({last['weights']}); recording step {step} would write "
                "over or before them, and a recorded checkpoint is never overwritten: count "
                f"from step {last['step']} or later (resume=True continues from it, or "
                "start_step=; for a Trainer, resume it from its latest checkpoint), or record "
                "into another directory."
            )

    def add(self, entry: dict[str, Any], files: dict[str, Callable[[Path], None]],
            frozen_names: list[str]) -> dict[str, Any]:
        """Write ``files`` (name -> writer of a path) and list ``entry`` with their hashes."""
        self.check_step(entry["step"])
        pending = set(self.manifest.get("pending", ()))
        for name in files:
            if (self.directory / name).exists() and name not in pending:
                raise RecordingExistsError(
                    f"{current_caller()}: {str(self.directory / name)!r} exists but is not part "
                    "of this recording; it is never overwritten: move it away or record into "
                    "another directory."
                )
        write_manifest(self.directory, {**self.manifest, "pending": sorted(pending | {*files})})
        for name, write in files.items():
            tmp = self.directory / f".{name}.tmp"
            write(tmp)
            os.replace(tmp, self.directory / name)
        entry = {**entry, "files": {name: file_record(self.directory / name) for name in files}}
        frozen = dict(self.manifest.get("frozen", {}))
        if entry["frozen"] is not None:
            frozen[entry["frozen"]] = frozen_names
        manifest = {**self.manifest, "frozen": frozen,
                    "checkpoints": [*self.manifest["checkpoints"], entry], "pending": []}
        write_manifest(self.directory, manifest)
        self.manifest = manifest
        return entry

    def _check_lock(self) -> None:
        try:
            self._lock.check()
        except StoreLockedError:
            raise StoreLockedError(
                f"{current_caller()}: a later recorder in this process took over "
                f"{str(self.directory)!r} (or this one was closed); record with the later one."
            ) from None

    def close(self) -> None:
        """Give the directory up (idempotent)."""
        with contextlib.suppress(AttributeError):
            self._lock.release()
