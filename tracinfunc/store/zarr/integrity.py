"""Integrity of a finished Zarr store: a sealed manifest of its files and a metadata checksum.

zarr checks each chunk's crc32c but nothing binds a chunk to its position, an empty shard
file reads as fill values (zeros), and the group metadata (learning rates, projection seed,
checkpoint order) has no checksum at all. When a writer finishes it therefore *seals* the
store: every file below the root gets an entry ``relative path -> [size, BLAKE2b of its last
TAIL_BYTES]`` and a SHA-256 over the metadata and that manifest is stored beside them::

    zarr.json  attributes.tracinfunc = {...StoreMeta..., "integrity": {
                   "algorithm": "sha256", "digest": "...", "files": {"rows/0/c/0/0": [size, hash]}}}

Opening a store checks the digest (any edit of the metadata or the manifest) and the full
hash of every array's ``zarr.json`` (codecs, endianness, shape). Before the first read of a
shard file its size (truncation, deletion, empty files) and the hash of its tail (its index
and the checksum of its last chunk) are checked, which binds shards to their positions: two
swapped shards or checkpoint directories fail there.
The tail and the manifest are cheap (one small read per shard), so reads stay at disk speed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import stat
import threading
from pathlib import Path
from typing import Any

from tracinfunc._validate import current_caller
from tracinfunc.errors import CorruptStoreError

__all__ = ["INTEGRITY_KEY", "TAIL_BYTES", "FileGuard", "check_digest", "file_identity",
           "open_regular", "seal", "sync_files"]

INTEGRITY_KEY = "integrity"
TAIL_BYTES = 64 * 2**10  # covers a shard index of 1024 chunks plus its last chunk's checksum
_ROOT_JSON = "zarr.json"


def _tail_hash(path: Path, size: int, fd: int | None = None) -> str:
    # Not crc32c: a chunk ends with its own crc32c, and the crc32c of data followed by its
    # crc32c is the same constant for every chunk, so it could not tell two shards apart.
    if fd is not None:  # the file already open (the one about to be read)
        start = max(0, size - TAIL_BYTES)
        return hashlib.blake2b(os.pread(fd, size - start, start), digest_size=8).hexdigest()
    with path.open("rb") as file:
        file.seek(max(0, size - TAIL_BYTES))
        return hashlib.blake2b(file.read(), digest_size=8).hexdigest()


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    """What tells a file apart from its replacement or its edited self: device, inode, size,
    modification and status-change times (``st`` from ``os.stat``/``os.fstat``)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def open_regular(path: Path | str) -> int:
    """``path`` opened read-only, refused unless it is a regular file.

    Opened without blocking (``O_NONBLOCK``, cleared once the file is found regular): a
    named pipe in place of a store file would otherwise block ``open`` until a writer comes.

    Raises:
        FileNotFoundError: nothing is there (callers name the missing file).
        CorruptStoreError: a directory, pipe, socket or device is there.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptStoreError(_not_regular(path, mode))
        fcntl.fcntl(fd, fcntl.F_SETFL, os.O_RDONLY)  # blocking reads, as any regular file
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_regular(path: Path | str, mode: int) -> str:
    kind = next((name for test, name in ((stat.S_ISDIR, "a directory"),
                                         (stat.S_ISFIFO, "a named pipe"),
                                         (stat.S_ISSOCK, "a socket"),
                                         (stat.S_ISCHR, "a character device"),
                                         (stat.S_ISBLK, "a block device")) if test(mode)),
                "not a regular file")
    return (f"{current_caller()}: {str(path)!r} is {kind}, not a regular file as the store "
            "was written with; the store is damaged. Rebuild it or restore it from a copy.")


def manifest(root: Path) -> dict[str, list]:
    """``relative path -> [size, BLAKE2b-64 of the tail]`` of every file below ``root``.

    Raises:
        CorruptStoreError: a file is empty. Every file a writer makes (array metadata, shard
            files) holds bytes; an empty one is a lost write, which zarr would read as zeros.
    """
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        name = path.relative_to(root).as_posix()
        if name != _ROOT_JSON:
            size = path.stat().st_size
            if size == 0:
                raise CorruptStoreError(
                    f"{current_caller()}: {name} in {str(root)!r} is empty: its write was lost "
                    "(a crash, a full disk or an edit), and zarr would read it as zeros. The "
                    "store is not sealed; rebuild it (or resume the build)."
                )
            files[name] = [size, _tail_hash(path, size)]
    return files


def digest(meta: dict[str, Any], files: dict[str, list]) -> str:
    """SHA-256 of the metadata (without its integrity block) and the manifest."""
    body = {key: value for key, value in meta.items() if key != INTEGRITY_KEY}
    text = json.dumps({"meta": body, "files": files}, sort_keys=True, allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def sync_files(paths: list[Path]) -> None:
    """fsync each file and directory: a power loss must not leave empty or partial files."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def seal(root: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with an integrity block for the files now under ``root`` (all fsync'ed first)."""
    sync_files([p for p in root.rglob("*")] + [root])
    files = manifest(root)
    block = {"algorithm": "sha256", "digest": digest(meta, files), "files": files}
    return {**meta, INTEGRITY_KEY: block}


def check_digest(meta: dict[str, Any], path: Path) -> None:
    """Raise unless the finished store's metadata matches the checksum it was sealed with."""
    where = f"{str(path).rstrip('/')}/{_ROOT_JSON}" if isinstance(path, str) else str(
        path / _ROOT_JSON)
    where = repr(where)
    block = meta.get(INTEGRITY_KEY)
    if not isinstance(block, dict) or not isinstance(block.get("files"), dict):
        raise CorruptStoreError(
            f"{current_caller()}: {where} has no metadata checksum ('{INTEGRITY_KEY}' block), "
            "which every finished store of this format has; the metadata was edited or damaged. "
            "Rebuild the store or restore it from a copy."
        )
    if block.get("digest") != digest(meta, block["files"]):
        raise CorruptStoreError(
            f"{current_caller()}: the metadata in {where} does not match its checksum: it was "
            "edited or damaged after the store was written (learning rates, projection, checkpoint "
            "order, sizes or the file list changed), so scores from it cannot be trusted. "
            "Rebuild the store or restore it from a copy."
        )


class FileGuard:
    """Checks the files of one store against its manifest: all at open, each tail once.

    Args:
        root: The store directory.
        files: The sealed manifest, or ``None`` for a store written before manifests
            (format 1): then files are only required to exist and be non-empty.
    """

    def __init__(self, root: Path, files: dict[str, list] | None) -> None:
        for name in files or {}:
            _check_inside(root, name)
        self._root, self._files = root, files
        # name -> identity (device, inode, size, mtime, ctime) of the file last checked there;
        # ``None`` for array metadata (checked in full at open)
        self._checked: dict[str, tuple[int, ...] | None] = {}
        self._lock = threading.Lock()

    @property
    def files(self) -> dict[str, list] | None:
        """The sealed manifest: relative name -> ``[size, tail hash]`` (None before format 2)."""
        return self._files

    def check_metadata_files(self) -> None:
        """Every sealed array and group ``zarr.json`` present and unedited (read in full).

        Shard files are checked on their first read instead: opening stays cheap, and the
        undamaged part of a damaged store stays readable (to salvage it).
        """
        for name, (size, tail_hash) in (self._files or {}).items():
            if not name.endswith(".json"):
                continue
            self._check_sealed(
                self._root / name,
                name,
                size,
                tail_hash,
                differs="differs from the file the store was sealed with (array "
                "metadata edited: codecs, byte order or shape, or files moved)",
            )
            self._checked[name] = None

    def _check_sealed(self, path: Path, name: str, size: int, tail_hash, *, differs: str,
                      fd: int | None = None) -> None:
        """Raise unless ``path`` has its sealed size and tail; ``differs`` says what changed."""
        self._check_size(path, name, size, fd)
        if _tail_hash(path, size, fd) != tail_hash:
            raise CorruptStoreError(
                f"{current_caller()}: {str(path)!r} {differs}; rebuild the store or "
                "restore it from a copy."
            )

    def check(self, path: Path, fd: int | None = None) -> None:
        """Before reading ``path`` (or ``fd``, that file opened): present, right size, tail as
        sealed. Checked again whenever the file's identity (device, inode, size, mtime,
        ctime) differs from the one last checked: a file renamed, hard-linked or copied over
        it after a first read is held to the same check as at a fresh open."""
        name = path.relative_to(self._root).as_posix()
        try:
            identity = file_identity(os.fstat(fd) if fd is not None else path.stat())
        except FileNotFoundError:
            identity = None  # reported as missing below
        if name in self._checked and self._checked[name] in (None, identity):
            return
        if self._files is None:
            self._check_size(path, name, None, fd)
        else:
            if name not in self._files:
                raise CorruptStoreError(
                    f"{current_caller()}: {str(path)!r} is not part of the store as "
                    "sealed (files moved or added); rebuild the store."
                )
            self._check_sealed(
                path, name, *self._files[name],
                differs="is not the file sealed at this position (shard files or checkpoint "
                        "directories swapped, or its index damaged)", fd=fd)
        with self._lock:
            self._checked[name] = identity  # taken before the check: a later change shows

    def _check_size(self, path: Path, name: str, size: int | None, fd: int | None = None
                    ) -> None:
        try:
            st = os.fstat(fd) if fd is not None else path.stat()
        except FileNotFoundError:
            raise CorruptStoreError(
                f"{current_caller()}: {str(path)!r} is missing; the store is damaged. Rebuild it "
                "or restore it from a copy."
            ) from None
        if not stat.S_ISREG(st.st_mode):  # before reading it: a named pipe would block
            raise CorruptStoreError(_not_regular(path, st.st_mode))
        actual = st.st_size
        # Empty is never right, even where a store was sealed with an empty file (before
        # sealing refused them): zarr would read it as zeros.
        if actual == 0 or (size is not None and actual != size):
            expected = "a non-empty file" if size is None else f"{size} bytes"
            found = ("it grew: bytes appended, or another file copied over it"
                     if size is not None and actual > size
                     else "truncated, e.g. by a power loss")
            raise CorruptStoreError(
                f"{current_caller()}: {str(path)!r} has {actual} bytes, expected {expected} "
                f"({found}); the store is damaged. Rebuild it or restore it from a copy."
            )


_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _check_inside(root: Path, name: object) -> None:
    """Manifest names are relative paths of plain parts: never absolute, never ``..``."""
    parts = name.split("/") if isinstance(name, str) else [".."]
    if not all(_NAME.fullmatch(part) and part not in (".", "..") for part in parts):
        raise CorruptStoreError(
            f"{current_caller()}: "
            f"the metadata of {str(root)!r} lists the file {name!r}, which is not a "
            "plain path inside the store (it would point outside); the metadata was edited. "
            "Rebuild the store or restore it from a copy."
        )
