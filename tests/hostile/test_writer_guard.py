"""Every writer, API and CLI, pointed at every artefact kind the library writes (issue 31,
findings 5 and 6; HOSTILE.md class 1): at its root, a file inside it, a symlink into it and its
parent. Each is refused with ForeignArtifactError and nothing on disk changes; overwriting an
artefact with its own kind still works.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

import tracinfunc as tif
from tests.cli.test_cli import cli_here
from tests.search.test_search import _store
from tracinfunc import _artifacts
from tracinfunc.cli.results import write_results
from tracinfunc.errors import ForeignArtifactError
from tracinfunc.store.zarr.parts import PartWriter

faiss = pytest.importorskip("faiss")

LRS = (0.5, 0.2)
N = 40

# kind -> (directory name, a file inside it)
ARTEFACTS = {
    "gradient store": ("s.zarr", "zarr.json"),
    "sharded layout": ("sharded.zarr", "zarr.json"),
    "store part": ("sharded.zarr/parts/0", "zarr.json"),
    "search index": ("s.zarr.faiss", "meta.json"),
    "saved curvature": ("c.zarr", "zarr.json"),
    "recording": ("ckpts", "manifest.json"),
    "retraining run": ("run.zarr", "zarr.json"),
    "CLI result": ("r.zarr", "zarr.json"),
}
KIND_OF = {"sharded layout": "gradient store"}  # one registry kind covers both
POSITIONS = ("root", "inside", "rows/zarr.json", "symlink", "parent")


def _curvature():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2)).double().eval()
    loss = tif.loss_from_module(model, torch.nn.functional.cross_entropy)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
    ckpts = [tif.Checkpoint.from_module(model, lr=0.3, name="a")]
    return tif.fit_curvature(loss, ckpts, (x, y), kind="projected",
                             projection=tif.Projection(dim=4, seed=0))


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """One folder holding one artefact of every kind, and a folder of symlinks into them."""
    root = tmp_path_factory.mktemp("arts")
    memory = _store(n=N, seed=0, lrs=LRS)
    store = tif.save_store(memory, root / "s.zarr", chunk_rows=8)
    tif.build_index(store, nlist=1)
    curvature = _curvature()
    tif.save_curvature(curvature, root / "c.zarr")
    part = PartWriter(root / "sharded.zarr", memory.meta.replace(n_train=0, complete=False),
                      (0, 2))
    part._lock.release()
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tif.training.CheckpointRecorder(root / "ckpts", model, optimizer) as recorder:
        recorder.save()
    tif.evaluate.retrain_subsets(lambda idx: torch.zeros(2), 6, 2, path=root / "run.zarr")
    write_results(root / "r.zarr", {"values": torch.zeros(3)}, columns="vector")
    links = tmp_path_factory.mktemp("links")
    for kind, (name, inner) in ARTEFACTS.items():
        os.symlink(root / name / inner, links / f"{kind.replace(' ', '_')}.json")
    return root, links, store, memory, curvature


def _tree(*roots: Path) -> str:
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*")):
            digest.update(str(path.relative_to(root)).encode())
            if path.is_symlink():
                digest.update(os.readlink(path).encode())
            elif path.is_file():
                digest.update(path.read_bytes())
    return digest.hexdigest()


def _target(arts, kind: str, position: str) -> Path:
    root, links = arts[:2]
    name, inner = ARTEFACTS[kind]
    return {"root": root / name, "inside": root / name / inner,
            "rows/zarr.json": root / name / "rows" / "zarr.json",
            "symlink": links / f"{kind.replace(' ', '_')}.json", "parent": root}[position]


def _cli(args, cwd):
    result = cli_here(*args, cwd=cwd)
    if result.returncode != 0 and "ForeignArtifactError" not in result.stderr:
        # the CLI prints one line: assert it is the guard's
        assert "is or lies inside" in result.stderr or " is the " in result.stderr \
            or "is not a" in result.stderr or "is a directory" in result.stderr, result.stderr
        raise ForeignArtifactError(result.stderr)
    return result


def _build_store(target, arts):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    loss = tif.loss_from_module(model, torch.nn.functional.cross_entropy)
    data = (torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1]))
    return tif.build_store(loss, [tif.Checkpoint.from_module(model, lr=0.1)], data,
                           projection=tif.Projection(dim=4, seed=0), store=str(target),
                           progress=False)


WRITERS = {
    "build_store": ("gradient store", _build_store),
    # name: (kind it writes, call(target, arts))
    "save_store": ("gradient store", lambda t, a: tif.save_store(a[3], t, overwrite=True)),
    "ZarrWriter": ("gradient store",
                   lambda t, a: tif.store.ZarrWriter(t, a[3].meta.replace(n_train=0,
                                                                           complete=False),
                                                     overwrite=True)),
    "remove_store": ("gradient store", lambda t, a: tif.remove_store(t)),
    "build_index": ("search index",
                    lambda t, a: tif.build_index(a[2], path=t, overwrite=True, nlist=1)),
    "save_curvature": ("saved curvature",
                       lambda t, a: tif.save_curvature(a[4], t,
                                                       overwrite=True)),
    "TopExamples.save": ("selection file",
                         lambda t, a: tif.TopExamples(torch.ones(1, 2), torch.tensor([[0, 1]]),
                                                      ["a", "b"]).save(t, overwrite=True)),
    "retrain_subsets": ("retraining run",
                        lambda t, a: tif.evaluate.retrain_subsets(lambda i: torch.zeros(2), 6,
                                                                  2, path=t)),
    "cli self-influence": ("result file",
                           lambda t, a: _cli(["self-influence", str(a[0] / "s.zarr"),
                                              "--output", str(t), "--overwrite"], a[0])),
    "cli build": ("gradient store",
                  lambda t, a: _cli(["build", "--spec", "nowhere.py:spec", "--out", str(t),
                                     "--overwrite"], a[0])),
}


def _cases():
    for writer, (writes, _) in WRITERS.items():
        for kind in ARTEFACTS:
            for position in POSITIONS:
                own = KIND_OF.get(kind, kind) == writes or (writes, kind) == ("result file",
                                                                             "CLI result")
                if position in ("root", "symlink") and own:
                    continue  # replacing its own kind: tested below
                if position == "rows/zarr.json" and "zarr" not in ARTEFACTS[kind][0]:
                    continue
                if position == "parent" and kind != "gradient store":
                    continue  # one parent folder holds them all
                yield writer, kind, position


@pytest.mark.parametrize(("writer", "kind", "position"), list(_cases()))
def test_every_writer_refuses_every_foreign_artefact(arts, writer, kind, position):
    target = _target(arts, kind, position)
    if position == "rows/zarr.json" and not target.exists():
        target = target.parent.parent / ARTEFACTS[kind][1]
    before = _tree(arts[0], arts[1])
    with pytest.raises(ForeignArtifactError):
        WRITERS[writer][1](target, arts)
    assert _tree(arts[0], arts[1]) == before


def test_messages_name_the_function_the_kind_the_path_and_the_fix(arts):
    target = arts[0] / "s.zarr" / "zarr.json"
    with pytest.raises(ForeignArtifactError, match=r"TopExamples.save: .*zarr.json' is or lies "
                       r"inside the gradient store at .*s.zarr'.*Choose a path outside"):
        WRITERS["TopExamples.save"][1](target, arts)
    curvature = arts[0] / "c.zarr" / "zarr.json"
    result = cli_here("self-influence", "s.zarr", "--output", str(curvature), "--overwrite",
                      cwd=arts[0])
    assert result.returncode == 1 and "inside the saved curvature" in result.stderr


def test_the_home_root_and_working_directories_are_never_overwrite_targets(arts, tmp_path,
                                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    for where in (tmp_path, Path("/")):
        with pytest.raises(ForeignArtifactError, match="root, the home directory or the work"):
            tif.save_store(arts[3], where, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_overwriting_an_artefact_with_its_own_kind_still_works(tmp_path, arts):
    memory = arts[3]
    first = tif.save_store(memory, tmp_path / "g.zarr").read_rows(0, 0, N)
    again = tif.save_store(_store(n=N, seed=5, lrs=LRS), tmp_path / "g.zarr", overwrite=True)
    assert not torch.equal(again.read_rows(0, 0, N), first)
    tif.build_index(again, nlist=1)
    assert tif.build_index(again, nlist=1, overwrite=True).nlist == 1
    top = tif.TopExamples(torch.ones(1, 2), torch.tensor([[0, 1]]), ["a", "b"])
    top.save(tmp_path / "top.json")
    top.save(tmp_path / "top.json", overwrite=True)
    result = cli_here("self-influence", str(tmp_path / "g.zarr"), "--output", "si.zarr",
                      cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    result = cli_here("self-influence", str(tmp_path / "g.zarr"), "--output", "si.zarr",
                      "--overwrite", cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_every_writers_artefact_is_in_the_registry(arts):
    """A new artefact kind joins the guard: each one a writer made is recognised."""
    root = arts[0]
    for kind, (name, _) in ARTEFACTS.items():
        assert _artifacts.artifact_kind(root / name) == KIND_OF.get(kind, kind), kind
    assert set(KIND_OF.get(k, k) for k in ARTEFACTS) == set(_artifacts.KINDS)
    assert {writes for writes, _ in WRITERS.values()} <= set(_artifacts.KINDS) | set(
        _artifacts.FILE_KINDS) | {"retraining run"}


@pytest.mark.parametrize("inside", ["s.zarr", "s.zarr/rows", "s.zarr.faiss", "c.zarr"])
def test_a_recorder_never_records_inside_another_artefact(arts, inside):
    root = arts[0]
    before = _tree(root)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tif.errors.ForeignArtifactError, match="CheckpointRecorder: .* inside"):
        tif.training.CheckpointRecorder(root / inside / "ckpts", model, optimizer)
    assert _tree(root) == before
