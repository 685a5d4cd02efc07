"""Nothing in tracinfunc unpickles or executes data; store paths never leave the store."""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

import pytest

import tracinfunc as tif
from tests.store.test_tamper import memory_store
from tracinfunc.store.zarr.integrity import digest

PACKAGE = Path(tif.__file__).resolve().parent
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def unsafe_uses(tree: ast.AST) -> list[str]:
    """``import pickle``, ``eval(...)``, ``exec(...)``, ``torch.load`` without weights_only."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            found += [f"import {n}" for n in names if n.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in {"eval", "exec"}:
                found.append(f"{func.id}()")
            if isinstance(func, ast.Attribute) and func.attr == "load" and \
                    isinstance(func.value, ast.Name) and func.value.id == "torch":
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                           and k.value.value is True for k in node.keywords)
                found += [] if safe else ["torch.load without weights_only=True"]
            if isinstance(func, ast.Attribute) and func.attr in {"loads", "load"} and \
                    isinstance(func.value, ast.Name) and func.value.id in UNSAFE_MODULES:
                found.append(f"{func.value.id}.{func.attr}")
    return found


def test_the_checker_finds_what_it_looks_for():
    bad = ast.parse("import pickle\nexec('1')\neval('1')\ntorch.load(p)\n"
                    "torch.load(p, weights_only=False)\nfrom dill import loads\n")
    assert sorted(unsafe_uses(bad)) == ["eval()", "exec()", "import dill", "import pickle",
                                        "torch.load without weights_only=True",
                                        "torch.load without weights_only=True"]
    assert unsafe_uses(ast.parse("torch.load(p, weights_only=True)\njson.loads(s)")) == []


def test_no_module_of_the_package_unpickles_or_executes_data():
    problems = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        uses = unsafe_uses(ast.parse(path.read_text(), filename=str(path)))
        if uses:
            problems[str(path.relative_to(PACKAGE))] = uses
    assert problems == {}


def test_checkpoint_names_never_become_paths(tmp_path):
    source = memory_store()
    meta = source.meta.replace(checkpoints=tuple(
        c.__class__(name, c.lr, c.fingerprint)
        for c, name in zip(source.meta.checkpoints, ["../../escape", "/etc/x", "a/../../b"],
                           strict=True)))
    store = tif.store.MemoryStore(meta, _all_rows(source), _all_norms(source))
    saved = tif.save_store(store, tmp_path / "inside" / "g.zarr", progress=False)
    outside = {p for p in tmp_path.rglob("*") if "inside" not in p.parts}
    assert outside == set()
    assert tif.open_store(saved.path).meta.checkpoints[0].name == "../../escape"


def _all_rows(store):
    import torch

    return torch.stack([store.read_rows(c, 0, store.n_train) for c in range(store.n_ckpt)])


def _all_norms(store):
    import torch

    return torch.stack([store.read_norms(c, 0, store.n_train) for c in range(store.n_ckpt)])


@pytest.mark.parametrize("name", ["../outside.json", "/etc/hostname", "rows/../../x.json"])
def test_a_manifest_naming_files_outside_the_store_is_refused(tmp_path, name):
    """Even with a recomputed checksum (a hostile edit), no file outside is opened."""
    path = tmp_path / "g.zarr"
    tif.save_store(memory_store(), path, progress=False)
    (tmp_path / "outside.json").write_text("{}")
    document = json.loads((path / "zarr.json").read_text())
    meta = document["attributes"]["tracinfunc"]
    files = meta["integrity"]["files"]
    files[name] = [2, hashlib.blake2b(b"{}", digest_size=8).hexdigest()]
    meta["integrity"]["digest"] = digest(meta, files)
    (path / "zarr.json").write_text(json.dumps(document))
    with pytest.raises(tif.errors.CorruptStoreError, match="outside"):
        tif.open_store(path)
