"""Index directories on disk: where one may go, saving beside and swapping in, checked reads.

An index directory holds these files and nothing else::

    grads.zarr.faiss/
      index.faiss     faiss.write_index output
      norms.npy       the indexed rows' norms [n_ckpt, n_train] float32 (from format 3)
      sketch.npy      the indexed rows' sketch [n_train, 8] float32 (from format 4)
      meta.json       the SearchIndex description, the store's fingerprints, the size and
                      SHA-256 of each other file, and a SHA-256 of all of that ("checksum")

A save writes a new directory beside the target and swaps it in with two renames, so a
failure (a full disk) leaves the previous index as it was. ``overwrite`` replaces only a
directory that holds an index; stores, and paths inside a store or an index, are never
written to.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tracinfunc._artifacts import artifact_kind, check_writable
from tracinfunc._jsonfile import read_json
from tracinfunc._validate import calling, current_caller
from tracinfunc.errors import (
    CorruptStoreError,
    InvalidArgumentError,
    StoreExistsError,
    StoreNotFoundError,
    StoreWriteError,
)
from tracinfunc.store.zarr.integrity import sync_files

__all__ = ["INDEX_FILE", "META_FILE", "NORMS_FILE", "SKETCH_FILE", "check_index_target",
           "checked_sketch", "read_index_files",
           "save_index_files"]

INDEX_FILE, META_FILE, NORMS_FILE, SKETCH_FILE = ("index.faiss", "meta.json", "norms.npy",
                                                  "sketch.npy")
_ARRAYS = (NORMS_FILE, SKETCH_FILE)  # in the order they were introduced (formats 3, 4)
_CHECKSUM = "checksum"
_HASH_BLOCK = 16 * 2**20


def check_index_target(target: Path, store_path: object, *, overwrite: bool) -> None:
    """Raise unless an index may be saved at ``target`` (before any work is done).

    Args:
        target: The index directory to write.
        store_path: The indexed store's ``path`` (a local directory, a URL, or ``None``).
        overwrite: Whether an index already at ``target`` may be replaced.
    """
    caller = current_caller("build_index")
    with calling(caller):
        check_writable(target, "search index", overwrite=overwrite)
    if isinstance(store_path, Path) and _overlaps(target, store_path):
        kind, where = "store", store_path
        raise InvalidArgumentError(
            f"{caller}: path={str(target)!r} is or lies inside the {kind} at {str(where)!r}; "
            f"writing there would damage that {kind}. Save the index beside it, e.g. "
            f"path={str(where) + '.faiss'!r}."
        )
    if not target.exists():
        return
    if not overwrite:
        raise StoreExistsError(
            f"{caller}: an index already exists at {str(target)!r}; pass overwrite=True "
            "to replace it, or load it with tif.load_index(path, store)."
        )
    if artifact_kind(target) != "search index":
        raise StoreExistsError(
            f"{caller}: {str(target)!r} exists and is not a search index (expected a directory "
            f"holding only {INDEX_FILE} and {META_FILE}), so overwrite=True will not delete "
            "it; choose another path."
        )


def _overlaps(target: Path, store_path: Path) -> bool:
    target, store_path = target.resolve(), store_path.resolve()
    return target == store_path or store_path in target.parents or target in store_path.parents


def save_index_files(target: Path, description: dict[str, Any], write_index,
                     arrays: dict[str, np.ndarray]) -> None:
    """Write ``index.faiss`` (``write_index(file_path)``), the float32 ``arrays`` (file name
    -> array: ``norms.npy`` ``[n_ckpt, n_train]``, ``sketch.npy`` ``[n_train, s]``) and
    ``meta.json`` beside ``target``, then swap them in: the previous index at ``target`` is
    let go only once all are on disk.

    Raises:
        StoreWriteError: writing failed (disk full, I/O error); ``target`` is unchanged.
    """
    caller = current_caller("build_index")
    existed = target.exists()
    scratch = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        fresh = scratch / target.name
        fresh.mkdir()
        write_index(str(fresh / INDEX_FILE))
        for name, array in arrays.items():
            np.save(fresh / name, np.ascontiguousarray(array, dtype=np.float32),
                    allow_pickle=False)
        files = {name: list(_file_digest(fresh / name)) for name in (INDEX_FILE, *arrays)}
        body = {**description, "files": files}
        (fresh / META_FILE).write_text(json.dumps({**body, _CHECKSUM: _checksum(body)},
                                                  indent=1))
        sync_files([*(fresh / name for name in files), fresh / META_FILE, fresh])
        _swap(fresh, target, scratch / "replaced")
        sync_files([target.parent])
    except (OSError, RuntimeError) as error:  # faiss reports write errors as RuntimeError
        raise StoreWriteError(
            f"{caller}: saving the index to {str(target)!r} failed "
            f"({getattr(error, 'strerror', None) or error}); "
            f"{'the previous index there is unchanged; ' if existed else ''}free space or "
            "choose another path and build it again."
        ) from error
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _swap(fresh: Path, target: Path, aside: Path) -> None:
    if not target.exists():
        os.rename(fresh, target)
        return
    os.rename(target, aside)
    try:
        os.rename(fresh, target)
    except OSError:
        os.rename(aside, target)  # put the previous index back before reporting
        raise


def read_index_files(path: Path, read_index
                     ) -> tuple[dict[str, Any], Any, dict[str, np.ndarray]]:
    """``(meta.json, the FAISS index, {file name: array})`` of the index at ``path``, every
    file checked against the checksums in ``meta.json``.

    Args:
        path: The index directory.
        read_index: ``faiss.read_index``.

    Returns:
        The arrays saved: ``norms.npy`` from format 3, ``sketch.npy`` from format 4 (none
        before format 3: bound by its exact fingerprint instead). Their shapes are the
        caller's to check.

    Raises:
        StoreNotFoundError: no index at ``path``.
        CorruptStoreError: a file was edited, damaged, swapped or is missing, or the index
            was saved without checksums (before format 2).
    """
    caller, shown = current_caller("load_index"), repr(str(path))
    if not (path / META_FILE).is_file() or not (path / INDEX_FILE).is_file():
        raise StoreNotFoundError(
            f"{caller}: no index at {shown} (expected {META_FILE} and {INDEX_FILE}); build "
            "one with tif.build_index(store, path=...)."
        )
    saved = _checked_meta(path)
    for name in saved["files"]:
        if not (path / name).is_file() or (list(_file_digest(path / name))
                                            != list(saved["files"][name])):
            raise CorruptStoreError(
                f"{caller}: {name} in {shown} is not the file saved with its {META_FILE} "
                "(missing, or its size or SHA-256 differs: damaged, or another index's file "
                "put there); rebuild it with tif.build_index(store, overwrite=True)."
            )
    arrays = {name: _load_array(path / name) for name in _ARRAYS if name in saved["files"]}
    return saved, _read_faiss(path / INDEX_FILE, saved, read_index), arrays


def _faiss_message(error: Exception) -> str:
    """The part of a FAISS error that says what failed (not the C++ signature before it)."""
    text = " ".join(str(error).split())
    return text[text.find("Error: ") + 7:][:160] if "Error: " in text else text[-160:]


# The four bytes FAISS writes first for each kind build_index makes (faiss/impl/index_write.cpp)
_FOURCC = {"ivf_flat": b"IwFl", "ivf_pq": b"IwPQ"}


def _read_faiss(file: Path, saved: dict[str, Any], read_index) -> Any:
    """``read_index(file)`` once its header names the kind recorded in ``meta.json``; FAISS's
    own errors (a truncated or crafted file that still matches a resealed checksum) become
    CorruptStoreError naming the file."""
    caller, shown = current_caller("load_index"), repr(str(file))
    fix = "rebuild the index with tif.build_index(store, overwrite=True)."
    with file.open("rb") as handle:
        header = handle.read(4)
    expected = _FOURCC.get(saved.get("kind"))
    if expected is None or header != expected:
        raise CorruptStoreError(
            f"{caller}: {shown} starts with {header!r}, but its meta.json says it is a "
            f"{saved.get('kind')!r} index (a FAISS file starting with {expected!r}); it is "
            f"another kind of file or was damaged; {fix}")
    try:
        index = read_index(str(file))
    except Exception as error:  # FAISS raises RuntimeError for every malformed file
        raise CorruptStoreError(
            f"{caller}: FAISS cannot read {shown} ({_faiss_message(error)}); "
            f"the file is truncated or malformed; {fix}") from None
    expected_shape = (int(saved.get("n_train", -1)), int(saved.get("nlist", -1)))
    got = (int(getattr(index, "ntotal", -1)), int(getattr(index, "nlist", -1)))
    if got != expected_shape or getattr(index, "metric_type", None) != 0:  # 0: inner product
        raise CorruptStoreError(
            f"{caller}: {shown} holds {got[0]} rows in {got[1]} lists (metric "
            f"{getattr(index, 'metric_type', None)}), but its meta.json describes "
            f"{expected_shape[0]} rows in {expected_shape[1]} lists searched by inner product "
            f"(metric 0); another index's file was put there; {fix}")
    return index


def _load_array(path: Path) -> np.ndarray:
    """A saved float32 array; anything else (a crafted file whose checksums were redone)
    is corrupt, never a raw NumPy error."""
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        array = error
    if not isinstance(array, np.ndarray) or array.dtype != np.float32 or array.ndim != 2:
        raise CorruptStoreError(
            f"{current_caller()}: {path.name} in {str(path.parent)!r} is not a 2-D float32 "
            f"array as build_index writes ({array if isinstance(array, Exception) else ''}"
            f"{'' if isinstance(array, Exception) else f'{array.dtype} {list(array.shape)}'}"
            "); rebuild the index with tif.build_index(store, overwrite=True)."
        )
    return array


def _checked_meta(path: Path) -> dict[str, Any]:
    shown = repr(str(path / META_FILE))
    try:
        saved = read_json(path / META_FILE, what="index metadata")
    except CorruptStoreError:
        raise
    except OSError as error:
        raise CorruptStoreError(
            f"{current_caller()}: {shown} is not readable JSON ({error}); rebuild the index with "
            "tif.build_index(store, overwrite=True)."
        ) from error
    if not isinstance(saved, dict) or _CHECKSUM not in saved or "files" not in saved:
        raise CorruptStoreError(
            f"{current_caller()}: {shown} has no checksums (an index saved by tracinfunc before "
            "index format 2, or an edited file), so a damaged or swapped index could not be told "
            "apart; rebuild it with tif.build_index(store, overwrite=True)."
        )
    body = {key: value for key, value in saved.items() if key != _CHECKSUM}
    files = body.get("files")
    version = body.get("format_version", 0)
    version = version if isinstance(version, int) else 0
    needed = {INDEX_FILE, *(name for since, name in enumerate(_ARRAYS, 3) if version >= since)}
    if (saved[_CHECKSUM] != _checksum(body) or not isinstance(files, dict)
            or not needed <= set(files) or not set(files) <= {INDEX_FILE, *_ARRAYS}):
        raise CorruptStoreError(
            f"{current_caller()}: {shown} does not match its checksum: it was edited or damaged "
            "after the index was saved; rebuild it with tif.build_index(store, overwrite=True)."
        )
    return saved


def _checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _file_digest(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(_HASH_BLOCK):
            digest.update(block)
    return path.stat().st_size, digest.hexdigest()


def checked_sketch(saved: dict[str, Any], sketch: np.ndarray | None,
                  path: Path) -> tuple[np.ndarray | None, int | None]:
    """The sketch ``[n_train, 8]`` and its seed (absent before format 4: ``(None, None)``),
    refused unless as build_index writes them (checksums can be redone by whoever crafts a
    file).

    Raises:
        CorruptStoreError: another shape, non-finite values, or no int seed in ``meta.json``.
    """
    if sketch is None:
        return None, None
    about, n_train = saved.get("sketch"), saved.get("n_train")
    seed = about.get("seed") if isinstance(about, dict) else None
    if (not isinstance(seed, int) or isinstance(seed, bool) or about.get("size") != 8
            or sketch.shape != (n_train, 8) or not np.isfinite(sketch).all()):
        raise CorruptStoreError(
            f"{current_caller()}: {SKETCH_FILE} in {str(path)!r} must be a finite [{n_train}, 8] "
            f"float32 array with an int seed in meta.json, got {list(sketch.shape)} and "
            f"{about!r:.80}; rebuild the index with tif.build_index(store, overwrite=True)."
        )
    return sketch, seed
