"""One writer per store path: an exclusive ``flock`` on a lock file beside the store.

Two builds into one path would interleave their rows (and a resume would merge them), so a
writer holds ``.<name>.lock`` next to the store from the moment it opens the path until it
finishes. The kernel drops the lock when the process dies (SIGKILL included), so a killed
build never leaves a stale lock: the next call resumes. Within one process, a writer whose
build raised is never told so (the exception passes it by); a later writer of the same path
in the same process takes its lock over and the old writer refuses to write from then on.

``flock`` is honoured by local file systems (and NFSv4 via POSIX locks on Linux). Object
stores have no locks; there :class:`RemoteLock` creates a lock object with a conditional write
(``If-None-Match: *``, which S3 and its compatible services grant to exactly one writer).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import glob
import json
import os
import socket
import time
import weakref
from pathlib import Path

from tracinfunc._validate import current_caller
from tracinfunc.errors import StoreLockedError, StoreWriteError
from tracinfunc.store.zarr.urls import filesystem

__all__ = ["RemoteLock", "WriterLock", "live_writers"]

# Locks this process holds, by lock file: how a later writer in the same process takes over
# from one whose build raised (process-wide by nature, like the kernel's own lock table).
# Weak: a writer that is dropped unfinished frees its path (``__del__``).
_HELD: weakref.WeakValueDictionary[str, WriterLock | RemoteLock] = (
    weakref.WeakValueDictionary())


class WriterLock:
    """The exclusive right to write the store at ``path``.

    Args:
        path: The store directory (need not exist yet).

    Raises:
        StoreLockedError: another process is writing to ``path``.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._file = path.parent / f".{path.name}.lock"
        self._key = str(self._file.resolve())
        self._superseded = False
        previous = _HELD.pop(self._key, None)
        if previous is not None:  # an earlier writer in this process that never finished
            previous._superseded = True
            self._fd = previous._fd
        else:
            self._fd = _acquire(self._file, path)
        _HELD[self._key] = self

    def check(self) -> None:
        """Raise if a later writer of the same path (in this process) has taken over."""
        if self._superseded or self._fd < 0:
            raise StoreLockedError(
                f"{current_caller()}: this writer of {str(self._path)!r} was superseded by a later "
                "writer of the same path (or already released it); use the later one."
            )

    def release(self) -> None:
        """Give the path up (idempotent); the lock file is removed while still locked."""
        if self._superseded or self._fd < 0:
            return
        _HELD.pop(self._key, None)
        try:
            self._file.unlink(missing_ok=True)
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1

    def __del__(self) -> None:  # a writer dropped without finishing: free the path
        if getattr(self, "_fd", -1) >= 0 and not self._superseded:
            self.release()


def _acquire(lock_file: Path, path: Path) -> int:
    """Open and flock ``lock_file``; retry when a releasing writer unlinked it meanwhile."""
    for _ in range(100):
        try:
            lock_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise StoreWriteError(
                error.errno,
                f"{current_caller()}: cannot write to {str(path.parent)!r} ({error.strerror}); "
                f"the store {path.name!r} needs a writable directory: choose another path.",
            ) from error
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreLockedError(
                f"{current_caller()}: another build (process {holder}) is writing to {str(path)!r} "
                "right now; wait for it to finish (then call again: a finished store is "
                "returned, an interrupted one resumed) or write to another path."
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock_file).st_ino
        except FileNotFoundError:
            same = False
        if same:  # the file we locked is still the lock file: it is ours
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            return fd
        os.close(fd)
    raise StoreLockedError(f"{current_caller()}: could not lock {str(lock_file)!r}; try again.")


def live_writers(path: Path | str) -> list[int]:
    """Processes on this host that hold a writer lock of the local store at ``path`` (its own
    or a part's, ``.<name>.part<i>.lock``), read from the lock files without locking them (a
    probe would make a build starting at that moment fail). A lock file a killed build left
    names a dead process and is not counted, nor is this process (its writers' builds ran
    to an end or raised: this process is not writing while it asks); object storage: ``[]``."""
    if not isinstance(path, Path):
        return []
    found = []
    for lock_file in (path.parent / f".{path.name}.lock",
                      *path.parent.glob(f".{glob.escape(path.name)}.part*.lock")):
        try:
            pid = int(lock_file.read_text().strip() or "0")
        except (OSError, ValueError):
            continue
        if pid > 0 and pid != os.getpid() and _alive(pid):
            found.append(pid)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class RemoteLock:
    """The exclusive right to write the store at an object-storage URL.

    A lock object ``.<name>.lock`` beside the store, created with a conditional write
    (``If-None-Match: *``), which the service grants to exactly one writer. Unlike ``flock``
    it survives a killed process: the error then says which object to delete. Within one
    process a later writer takes over, as with :class:`WriterLock`.

    Raises:
        StoreLockedError: another writer holds the lock object.
    """

    def __init__(self, url: str) -> None:
        self._fs, root = filesystem(url)
        parent, _, name = root.rstrip("/").rpartition("/")
        self._path, self._key = url, f"{parent}/.{name}.lock"
        self._superseded, self._released = False, False
        previous = _HELD.pop(self._key, None)
        if previous is not None:  # an earlier writer in this process that never finished
            previous._superseded = True
        else:
            holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.time()}).encode()
            try:
                self._fs.pipe_file(self._key, holder, IfNoneMatch="*")
            except FileExistsError:
                raise StoreLockedError(
                    f"{current_caller()}: another build ({_read_holder(self._fs, self._key)}) is "
                    "writing "
                    f"to {url!r}; wait for it to finish (then call again), or, if no build is "
                    f"running (one was killed), delete the lock object "
                    f"{_scheme(url)}{self._key} and call again."
                ) from None
        _HELD[self._key] = self

    def check(self) -> None:
        """Raise if a later writer of the same URL (in this process) has taken over."""
        if self._superseded or self._released:
            raise StoreLockedError(
                f"{current_caller()}: this writer of {self._path!r} was superseded by a later "
                "writer of the same store (or already released it); use the later one."
            )

    def release(self) -> None:
        """Delete the lock object (idempotent)."""
        if self._claim_release():
            self._fs.rm_file(self._key)

    def _claim_release(self) -> bool:
        """Mark the lock released; ``False`` if it already was, or was superseded."""
        if getattr(self, "_released", True) or self._superseded:
            return False
        self._released = True
        _HELD.pop(self._key, None)
        return True

    def __del__(self) -> None:  # a writer dropped without finishing: free the store
        if not self._claim_release():
            return
        # The garbage collector may run this on any thread, fsspec's own event-loop thread
        # included, where a blocking call would wait on itself forever (seen: a test suite
        # hung in fs.rm_file from __del__). So an async filesystem only gets the deletion
        # scheduled on its loop, never waited for. At interpreter exit the loop may be gone:
        # the lock object then stays, and the next writer's error names it.
        with contextlib.suppress(Exception):
            if getattr(self._fs, "async_impl", False) and self._fs.loop is not None:
                asyncio.run_coroutine_threadsafe(self._fs._rm_file(self._key), self._fs.loop)
            else:
                self._fs.rm_file(self._key)


def _read_holder(fs, key: str) -> str:
    try:
        holder = json.loads(fs.cat_file(key))
        return f"process {holder['pid']} on {holder['host']}"
    except Exception:  # a holder we cannot read is still a holder
        return "unknown process"


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] + "://"
