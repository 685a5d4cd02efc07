"""A Curvature on disk: its own sealed, checksummed Zarr group.

Layout (Zarr v3)::

    curvature.zarr/zarr.json     attributes.tracinfunc_curvature = {...metadata..., "tensors":
                                 {"0/3": [name, shape, dtype, blake2b]}, "integrity": {...}}
    curvature.zarr/<ckpt>/<i>    one float64 array per estimate tensor

The metadata (kind, checkpoints, layout, projection, damping, layers) and a BLAKE2b hash of every
tensor's bytes are sealed with the store's integrity block (:mod:`tracinfunc.store.zarr.integrity`:
a SHA-256 over the metadata and a manifest of the files), so an edited damping, checkpoint list
or tensor is refused on load, as is a truncated or swapped file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from os import PathLike
from pathlib import Path

import numpy as np
import torch

from tracinfunc._artifacts import check_writable
from tracinfunc._jsonfile import check_json_file
from tracinfunc._validate import current_caller, entry_point
from tracinfunc.curvature.binding import check_curvature
from tracinfunc.curvature.capture import KfacLayer
from tracinfunc.curvature.value import Curvature
from tracinfunc.errors import (
    CorruptStoreError,
    InvalidArgumentError,
    StoreExistsError,
    StoreNotFoundError,
)
from tracinfunc.projection.spec import Projection
from tracinfunc.store.meta import CheckpointMeta
from tracinfunc.store.zarr.integrity import FileGuard, check_digest, seal
from tracinfunc.store.zarr.lock import WriterLock

__all__ = ["ATTRIBUTE", "load_curvature", "save_curvature"]

ATTRIBUTE = "tracinfunc_curvature"
# 1: the first format; 2: adds per-layer "blocks" (block-diagonal "projected"). A curvature
# without blocks is still written as format 1, so every version reads it; a format newer than
# this reader's is refused with the fix (readers before format 2 fail on its missing "matrix").
FORMAT = 2


@entry_point("save_curvature")
def save_curvature(curvature: Curvature, path: str | PathLike, *,
                   overwrite: bool = False) -> Path:
    """Write ``curvature`` as a sealed Zarr group at ``path``.

    The group is written beside ``path`` and renamed into place once sealed, under the path's
    one-writer lock (``.<name>.lock``, as ``save_store``), so a reader never sees half a
    curvature and a failed save leaves the old one as it was.

    Raises:
        StoreExistsError: ``path`` exists and ``overwrite`` is false.
        StoreLockedError: another process is saving to ``path`` right now.
        ForeignArtifactError: ``path`` is, lies inside, or holds an artefact of another
            kind (a store, index, curvature, recording...; see docs/concepts/stores.md).
        InvalidArgumentError: a refined curvature (its refinement holds training batches,
            which are not saved).
    """
    curvature = check_curvature(curvature)
    if curvature.refinement is not None:
        raise InvalidArgumentError(
            "save_curvature: the curvature is refined (with_refinement), and its refinement "
            "holds training batches that a saved curvature does not keep; save "
            "curvature.without_refinement() and call with_refinement(data) after loading.")
    root = Path(path)
    check_writable(root, "saved curvature", overwrite=overwrite)
    _refuse_existing(root, overwrite)
    root.parent.mkdir(parents=True, exist_ok=True)
    lock = WriterLock(root)  # one writer per path, as save_store: the others are told so
    scratch = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.resolve().parent))
    try:
        # Again under the lock: another writer may have finished there meanwhile.
        check_writable(root, "saved curvature", overwrite=overwrite)
        _refuse_existing(root, overwrite)
        fresh = scratch / root.name
        _write(curvature, fresh)
        if root.exists():
            os.rename(root, scratch / "replaced")  # only now is the old curvature let go
        os.rename(fresh, root)  # readers never see a half-written curvature
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        lock.release()
    return root


def _refuse_existing(root: Path, overwrite: bool) -> None:
    if root.exists() and not overwrite:
        raise StoreExistsError(
            f"save_curvature: {str(root)!r} exists; pass overwrite=True or another path."
        )


def _write(curvature: Curvature, root: Path) -> None:
    """Write and seal ``curvature`` as a new Zarr group at ``root``."""
    import zarr
    group = zarr.open_group(str(root), mode="w-")
    tensors = {}
    for c, estimate in enumerate(curvature.estimates):
        for i, name in enumerate(sorted(estimate)):
            value = estimate[name].detach().cpu().contiguous().double().numpy()
            key = f"{c}/{i}"
            group.create_array(key, data=value, chunks=value.shape or None)
            tensors[key] = [name, list(value.shape), "float64", _hash(value)]
    meta = {**curvature.metadata(), "format": FORMAT if curvature.blocks else 1,
            "digest": curvature.digest, "tensors": tensors}
    group.attrs[ATTRIBUTE] = seal(root, meta)


@entry_point("load_curvature")
def load_curvature(path: str | PathLike) -> Curvature:
    """Read a curvature written by :func:`save_curvature`, checking every byte first.

    Raises:
        StoreNotFoundError: nothing at ``path``.
        CorruptStoreError: the metadata, a file or a tensor differs from what was sealed.
    """
    import zarr
    root = Path(path)
    if not (root / "zarr.json").is_file():
        raise StoreNotFoundError(
            f"load_curvature: no saved curvature at {str(root)!r}; save one with "
            "tif.save_curvature(curvature, path)."
        )
    check_json_file(root / "zarr.json", what="curvature metadata")
    group = zarr.open_group(str(root), mode="r")
    meta = group.attrs.get(ATTRIBUTE)
    if not isinstance(meta, dict):
        raise CorruptStoreError(
            f"load_curvature: {str(root)!r} is a Zarr group without a curvature's metadata "
            f"('{ATTRIBUTE}'); pass the path given to save_curvature."
        )
    if not isinstance(meta.get("format"), int) or meta["format"] > FORMAT:
        raise CorruptStoreError(
            f"load_curvature: {str(root)!r} holds a curvature in format "
            f"{meta.get('format')!r}, but this version of tracinfunc reads formats 1 to "
            f"{FORMAT}; upgrade tracinfunc, or fit the curvature again with this version."
        )
    check_digest(meta, root)
    guard = FileGuard(root, meta["integrity"]["files"])
    guard.check_metadata_files()
    for name in meta["integrity"]["files"]:
        guard.check(root / name)
    estimates: list[dict] = [{} for _ in meta["checkpoints"]]
    for key, (name, shape, _, digest) in meta["tensors"].items():
        value = np.asarray(group[key][...])
        if list(value.shape) != shape or _hash(value) != digest:
            raise CorruptStoreError(
                f"load_curvature: the array {key!r} ({name}) in {str(root)!r} differs from "
                "the one sealed (edited or damaged); fit the curvature again or restore a copy."
            )
        estimates[int(key.split("/")[0])][name] = torch.from_numpy(value.copy())
    curvature = _curvature(meta, estimates)
    if curvature.digest != meta["digest"]:
        raise CorruptStoreError(
            f"{current_caller()}: the curvature read from {str(root)!r} does not match its "
            "digest; fit it again or restore a copy."
        )
    return curvature


def _curvature(meta: dict, estimates: list[dict]) -> Curvature:
    projection = meta["projection"]
    return Curvature(
        kind=meta["kind"],
        checkpoints=tuple(CheckpointMeta(c["name"], c["lr"], c["fingerprint"])
                          for c in meta["checkpoints"]),
        layout=tuple((name, tuple(shape)) for name, shape in meta["layout"]),
        projection=None if projection is None else Projection.from_dict(projection),
        damping=tuple(float(d) for d in meta["damping"]),
        estimates=tuple(estimates),
        layers=tuple(KfacLayer(*layer) for layer in meta["layers"]),
        info=meta["info"],
        blocks=tuple(meta.get("blocks", ())),
    )


def _hash(value: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(value).tobytes(), digest_size=16).hexdigest()
