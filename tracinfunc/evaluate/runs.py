"""The Zarr group of a retraining run: created so an interrupted run resumes, rows checksummed.

    path/zarr.json   attributes["tracinfunc_retrain"] = {n_train, n_subsets, alpha, seed}
    path/subsets     [m, n_train] bool
    path/outputs     [m, n_test] float64, one chunk per subset
    path/checksums   [m] uint64, BLAKE2b-64 of each row of outputs as written
    path/done        [m] bool, written last (per row, and when the arrays are created)

``done`` is the commit mark: the arrays are created before it (replacing any that a run
killed while creating them left), and row ``j`` is written, then its checksum, then
``done[j]``. A row marked done whose bytes no longer match its checksum (a deleted chunk
reads as NaN, flipped bytes read as other numbers) is not done: ``retrain_subsets`` trains it
again (with a warning) and ``load_retrain`` refuses the run.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from tracinfunc._artifacts import check_writable
from tracinfunc._jsonfile import check_json_file
from tracinfunc._validate import calling
from tracinfunc.errors import InvalidArgumentError

__all__ = ["ATTRS_KEY", "check_run_json", "checked_rows", "open_run", "read_run", "row_checksum",
           "save_row"]

ATTRS_KEY = "tracinfunc_retrain"


def open_run(path: Path, config: dict[str, Any]) -> Any:
    """The run's group at ``path``: a new one, or a previous run's with the same ``config``."""
    import zarr
    with calling("retrain_subsets"):  # an enclosing entry point speaks first
        check_writable(path, "retraining run", overwrite=False)
    if not (path / "zarr.json").exists():
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            # mode="w" would clear the directory: never delete what this harness did not write
            raise InvalidArgumentError(
                f"retrain_subsets: expected path to be a new or empty directory or a previous "
                f"run's Zarr group, got {str(path)!r}, which holds other files; pass another "
                "path."
            )
        group = zarr.open_group(path, mode="w")
        group.attrs[ATTRS_KEY] = config
        return group
    check_run_json(path)
    group = zarr.open_group(path, mode="r+")
    saved = dict(group.attrs.get(ATTRS_KEY, {}))
    if saved != config:
        raise InvalidArgumentError(
            f"retrain_subsets: the results at {path} were made with {saved or 'no run'}, but "
            f"this call asks for {config}; pass the same settings to resume, or another path "
            "to start a new run."
        )
    return group


def check_run_json(path: Path) -> None:
    """Read every ``zarr.json`` of the run at ``path`` (the group's and each array's) with the
    bounded reader before zarr parses one: a crafted file is a CorruptStoreError naming it."""
    check_json_file(path / "zarr.json", what="retraining run metadata")
    if path.is_dir():
        for child in sorted(path.iterdir()):
            check_json_file(child / "zarr.json", what="retraining run array metadata")


def read_run(group: Any, n_subsets: int) -> tuple[np.ndarray | None, np.ndarray]:
    """``(outputs [m, n_test] or None, done [m])`` as saved, damaged rows not done (warned)."""
    if group is None or "done" not in group:
        return None, np.zeros(n_subsets, dtype=bool)
    outputs, done, damaged = checked_rows(group)
    if damaged:
        warnings.warn(
            f"retrain_subsets: the saved outputs of subsets {damaged} in {group.store} do not "
            "match their checksums (deleted or damaged files); they are trained again.",
            UserWarning, stacklevel=3)
        done[damaged] = False
    return outputs, done


def checked_rows(group: Any) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """``(outputs, done, rows marked done whose outputs fail their checksum)``."""
    done = np.asarray(group["done"][:], dtype=bool)
    outputs_array = group["outputs"]
    outputs = np.full(outputs_array.shape, np.nan)
    sums = group["checksums"][:] if "checksums" in group else None
    damaged = []
    for j in np.flatnonzero(done):
        try:  # one row at a time: a chunk zarr cannot decode is that row's damage only
            outputs[j] = outputs_array[j]
        except Exception:
            damaged.append(int(j))
            continue
        # Runs saved before checksums: a missing chunk (NaN) is all that can be told.
        intact = (np.isfinite(outputs[j]).all() if sums is None
                  else row_checksum(outputs[j]) == int(sums[j]))
        if not intact:
            damaged.append(int(j))
    return outputs, done, damaged


def save_row(group: Any, subsets: np.ndarray, outputs: np.ndarray, j: int) -> None:
    """Write row ``j`` of ``outputs``, its checksum, then mark it done."""
    if "done" not in group:  # the first result fixes n_test: create the arrays now
        _create_arrays(group, subsets, outputs.shape)
    group["outputs"][j] = outputs[j]
    group["checksums"][j] = row_checksum(outputs[j])
    group["done"][j] = True  # written last, so a kill before it only redoes j


def _create_arrays(group: Any, subsets: np.ndarray, shape: tuple[int, int]) -> None:
    # overwrite=True: a run killed while creating them left some; "done" (last) is absent,
    # so nothing in them was ever marked done.
    group.create_array("subsets", data=subsets, overwrite=True)
    group.create_array("outputs", shape=shape, dtype="float64", chunks=(1, shape[1]),
                       fill_value=np.nan, overwrite=True)
    group.create_array("checksums", shape=(shape[0],), dtype="uint64", chunks=(1,),
                       fill_value=0, overwrite=True)
    group.create_array("done", shape=(shape[0],), dtype="bool", fill_value=False)


def row_checksum(row: np.ndarray) -> int:
    """BLAKE2b-64 of a row's float64 little-endian bytes, as an int."""
    data = np.ascontiguousarray(row, dtype="<f8").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
