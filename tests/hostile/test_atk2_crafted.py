"""atk2 outside pass, surface 2: crafted files (HOSTILE.md class 6).

Failing tests (found by the pass) first; tests marked HELD guard attacks that held."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tracinfunc as tif
import tracinfunc.evaluate as ev
from tracinfunc.errors import CorruptRecordingError, CorruptStoreError, TracInFuncError

from ._atk2 import data, model_ckpts

DEEP = "[" * 200_000 + "]" * 200_000


def _retrain_run(path):
    return ev.retrain_subsets(lambda subset: torch.randn(5), 40, 3, path=str(path))


def test_retraining_run_array_metadata_nested_deep_is_corrupt_not_recursionerror(tmp_path):
    """stores.md: a retraining run's JSON metadata is read through the bounded reader. The
    top-level zarr.json is (CorruptStoreError), but its arrays' metadata (subsets/zarr.json)
    nested 200,000 deep still raises a raw RecursionError from load_retrain."""
    _retrain_run(tmp_path / "rt.zarr")
    (tmp_path / "rt.zarr" / "subsets" / "zarr.json").write_text(DEEP)
    with pytest.raises(CorruptStoreError, match="subsets"):
        ev.load_retrain(str(tmp_path / "rt.zarr"))


def _recording(d):
    m, _loss, _ck = model_ckpts()
    X, Y = data()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    rec = tif.training.CheckpointRecorder(str(d), m, opt)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(m(X), Y).backward()
        opt.step()
        rec.step()
    return m


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("which", ["checkpoint-1.pt", "optimizer-1.pt"])
def test_a_crafted_pickle_in_a_resealed_recording_is_a_corrupt_recording(tmp_path, which):
    """A pickle that runs code, put in a recording with its manifest hash recomputed. It is
    not executed (weights_only held), but the error is torch's raw UnpicklingError ('Weights
    only load failed ... Re-running torch.load with weights_only set to False will likely
    succeed'), which names neither the file nor the recording and suggests the unsafe fix.
    Expected: CorruptRecordingError naming the file."""
    d = tmp_path / "ckpts"
    m = _recording(d)
    marker = tmp_path / "PWNED"
    torch.save({"0.weight": _Evil(marker)}, d / which)
    man = json.loads((d / "manifest.json").read_text())
    b = (d / which).read_bytes()
    man["checkpoints"][0]["files"][which] = {
        "size": len(b), "blake2b": hashlib.blake2b(b, digest_size=32).hexdigest()}
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CorruptRecordingError, match=which):
        if which.startswith("checkpoint"):
            tif.load_recorded_checkpoints(str(d), m)
        else:
            tif.load_recorded_preconditioners(str(d), m, kind="adam")
    assert not marker.exists()


# ---------------------------------------------------------------- HELD (regression guards)


def _index(tmp_path):
    _m, loss, ck = model_ckpts()
    X, Y = data()
    s = tif.build_store(loss, ck, (X, Y), projection=tif.Projection(dim=16, seed=0),
                        store=str(tmp_path / "s.zarr"))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tif.build_index(s, nlist=2)
    return s, tmp_path / "s.zarr.faiss"


def _reseal(d):
    d.pop("checksum", None)
    d["checksum"] = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()
    return d


@pytest.mark.parametrize("craft", ["sketch_big_endian", "norms_object_pickle", "norms_float64"])
def test_held_resealed_index_side_files_of_another_dtype_are_corrupt(tmp_path, craft):
    """HELD: sketch.npy / norms.npy rewritten as >f4, a pickled object array or float64, with
    meta.json's sizes, hashes and own checksum recomputed: CorruptStoreError."""
    _s, idx = _index(tmp_path)
    name = "sketch.npy" if craft.startswith("sketch") else "norms.npy"
    a = np.load(idx / name)
    if craft == "sketch_big_endian":
        np.save(idx / name, a.astype(">f4"))
    elif craft == "norms_object_pickle":
        np.save(idx / name, np.array([object()] * 2, dtype=object), allow_pickle=True)
    else:
        np.save(idx / name, a.astype("f8"))
    meta = json.loads((idx / "meta.json").read_text())
    b = (idx / name).read_bytes()
    meta["files"][name] = [len(b), hashlib.sha256(b).hexdigest()]
    (idx / "meta.json").write_text(json.dumps(_reseal(meta)))
    with pytest.raises(CorruptStoreError):
        tif.load_index(str(idx), tif.GradientStore.open(str(tmp_path / "s.zarr")))


@pytest.mark.parametrize("target", ["index", "curvature", "manifest"])
def test_held_deep_json_is_refused_as_corrupt(tmp_path, target):
    """HELD: meta.json / curvature zarr.json / recording manifest.json nested 200,000 deep."""
    if target == "index":
        s, idx = _index(tmp_path)
        (idx / "meta.json").write_text(DEEP)
        with pytest.raises(CorruptStoreError):
            tif.load_index(str(idx), s)
    elif target == "curvature":
        m, loss, ck = model_ckpts()
        X, Y = data()
        c = tif.fit_curvature(loss, ck, (X, Y), projection=tif.Projection(dim=16, seed=0))
        tif.save_curvature(c, tmp_path / "c.zarr")
        (tmp_path / "c.zarr" / "zarr.json").write_text(DEEP)
        with pytest.raises(CorruptStoreError):
            tif.load_curvature(tmp_path / "c.zarr")
    else:
        m = _recording(tmp_path / "ckpts")
        (tmp_path / "ckpts" / "manifest.json").write_text(DEEP)
        with pytest.raises(TracInFuncError):
            tif.load_recorded_checkpoints(str(tmp_path / "ckpts"), m)
