"""The saved store and curvature the refinement CLI tests score (``tests/data/tiny_spec.py``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import tracinfunc as tif
from tracinfunc.cli.spec import load_spec

SPEC_PATH = str(Path(__file__).resolve().parents[1] / "data" / "tiny_spec.py")


def saved_for_cli(tmp_path: Path) -> SimpleNamespace:
    """The spec, its projection, a store at ``grads.zarr`` and an EK-FAC curvature at
    ``curvature.zarr`` under ``tmp_path`` (``spec_path``, ``spec``, ``projection``, ``store``,
    ``curvature``)."""
    spec = load_spec(f"{SPEC_PATH}:make")
    projection = tif.Projection(dim=16, seed=2)
    store = tif.build_store(spec.loss, spec.checkpoints, spec.train, projection=projection,
                            store=str(tmp_path / "grads.zarr"), progress=False)
    curvature = tif.fit_curvature(spec.loss, spec.checkpoints, spec.train, kind="ekfac")
    tif.save_curvature(curvature, tmp_path / "curvature.zarr")
    return SimpleNamespace(spec_path=SPEC_PATH, spec=spec, projection=projection, store=store,
                           curvature=curvature)
