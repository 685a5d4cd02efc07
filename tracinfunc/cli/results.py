"""Writing score results to .json, .csv, .npy or .zarr, atomically and without clobbering."""

from __future__ import annotations

import csv
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from torch import Tensor

from tracinfunc._artifacts import check_writable
from tracinfunc._validate import current_caller
from tracinfunc.errors import InvalidArgumentError, OutputPathError

__all__ = ["RESULT_SUFFIXES", "check_output_path", "check_result_format",
           "check_writable_directory", "write_results"]

RESULT_SUFFIXES = (".json", ".csv", ".npy", ".zarr")
RESULTS_MARK = "tracinfunc_results"


def check_output_path(path: Path, *, overwrite: bool) -> None:
    """Fail before any work if ``path`` has an unknown suffix, exists, or cannot be written."""
    check_writable(path, "CLI result" if path.suffix == ".zarr" else "result file",
                   overwrite=overwrite)
    if path.suffix not in RESULT_SUFFIXES:
        raise InvalidArgumentError(
            f"{current_caller()}: output {str(path)!r} must end in one of "
            f"{', '.join(RESULT_SUFFIXES)}."
        )
    if path.exists() and not overwrite:
        raise OutputPathError(
            f"{current_caller()}: output {str(path)!r} exists; choose another path or pass "
            "--overwrite."
        )
    if path.is_dir():
        _check_replaceable_directory(path)
    check_writable_directory(path.resolve().parent, what="output directory")


def check_result_format(path: Path, n_arrays: int) -> None:
    """Fail before any work if the output format cannot hold ``n_arrays`` arrays (.npy: one)."""
    if path.suffix == ".npy" and n_arrays != 1:
        raise InvalidArgumentError(
            f"{current_caller()}: a .npy file holds one array but --top-k gives {n_arrays} "
            "(values and indices); use .json, .csv or .zarr for top-k results."
        )


def _check_replaceable_directory(path: Path) -> None:
    """--overwrite replaces a directory only if it is a result this CLI wrote."""
    try:
        attrs = json.loads((path / "zarr.json").read_text()).get("attributes", {})
    except (OSError, ValueError, AttributeError):
        attrs = {}
    if isinstance(attrs, dict) and "tracinfunc" in attrs:
        raise OutputPathError(
            f"{current_caller()}: output {str(path)!r} is a gradient store; results never replace "
            "one (it may be the store being scored). Choose another output path."
        )
    if not (isinstance(attrs, dict) and attrs.get(RESULTS_MARK) is True):
        raise OutputPathError(
            f"{current_caller()}: output {str(path)!r} is a directory but not a result written by "
            "tracinfunc, so --overwrite will not delete it; choose another output path or "
            "remove it yourself."
        )


def check_writable_directory(directory: Path, *, what: str) -> None:
    """Fail unless ``directory`` exists and a file can be created in it."""
    if not directory.is_dir():
        raise OutputPathError(
            f"{current_caller()}: {what} {str(directory)!r} does not exist; create it or choose "
            "another path."
        )
    try:  # os.access says yes to root everywhere; only creating a file tells the truth
        probe, probe_path = tempfile.mkstemp(prefix=".tracinfunc.probe.", dir=directory)
    except OSError as error:
        raise OutputPathError(
            f"{current_caller()}: {what} {str(directory)!r} is not writable ({error.strerror}); "
            "choose a writable location."
        ) from error
    os.close(probe)
    os.unlink(probe_path)


def write_results(path: Path, arrays: dict[str, Tensor], *, columns: str,
                  attributes: dict | None = None) -> None:
    """Write named arrays. ``columns`` says how to flatten to CSV: "matrix", "top_k" or "vector".

    ``attributes`` (how the results were made, e.g. a contrast) go into a ``.json`` file as
    keys beside the arrays and into a ``.zarr`` group's attributes; ``.csv`` and ``.npy``
    hold arrays only.

    Writes to a temporary sibling first and renames, so a failure never leaves half a file
    and an existing file is replaced only by a complete one.
    """
    numpy_arrays = {name: value.detach().cpu().numpy() for name, value in arrays.items()}
    writers: dict[str, Callable[[Path], None]] = {
        ".json": lambda tmp: _write_json(tmp, numpy_arrays, attributes or {}),
        ".csv": lambda tmp: _write_csv(tmp, numpy_arrays, columns),
        ".npy": lambda tmp: _write_npy(tmp, numpy_arrays),
        ".zarr": lambda tmp: _write_zarr(tmp, numpy_arrays, attributes or {}),
    }
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.resolve().parent)) / path.name
    try:
        writers[path.suffix](tmp)
        if path.is_dir():  # os.replace cannot replace a directory: move the old one aside
            os.rename(path, tmp.parent / "replaced")
        os.replace(tmp, path)
    except OSError as error:  # disk full, quota, I/O error: nothing half-written is left
        raise OutputPathError(
            f"writing results to {str(path)!r} failed ({error.strerror or error}); "
            f"{'the previous file is unchanged; ' if path.exists() else ''}free space or "
            "choose another output path and run the command again."
        ) from error
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def _write_json(path: Path, arrays: dict[str, np.ndarray], attributes: dict) -> None:
    path.write_text(json.dumps({**attributes,
                                **{name: value.tolist() for name, value in arrays.items()}}))


def _write_npy(path: Path, arrays: dict[str, np.ndarray]) -> None:
    if len(arrays) != 1:
        raise InvalidArgumentError(
            f"a .npy file holds one array but there are {sorted(arrays)}; use .json, .csv or "
            ".zarr for top-k results."
        )
    with path.open("wb") as file:
        np.save(file, next(iter(arrays.values())))


def _write_zarr(path: Path, arrays: dict[str, np.ndarray], attributes: dict) -> None:
    import zarr
    group = zarr.open_group(str(path), mode="w-")
    group.attrs.update(attributes)
    group.attrs[RESULTS_MARK] = True  # what --overwrite may replace later
    for name, value in arrays.items():
        group.create_array(name, data=value)


def _write_csv(path: Path, arrays: dict[str, np.ndarray], columns: str) -> None:
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        if columns == "top_k":
            writer.writerow(["test_index", "rank", "train_index", "score"])
            values, indices = arrays["values"], arrays["indices"]
            for i in range(values.shape[0]):
                for rank in range(values.shape[1]):
                    writer.writerow([i, rank, int(indices[i, rank]), float(values[i, rank])])
        elif columns == "vector":
            (name, vector), = arrays.items()
            writer.writerow(["train_index", name])
            writer.writerows([j, float(v)] for j, v in enumerate(vector))
        else:
            (matrix,) = arrays.values()
            writer.writerow(["test_index"] + [f"train_{j}" for j in range(matrix.shape[1])])
            writer.writerows([i, *map(float, row)] for i, row in enumerate(matrix))
