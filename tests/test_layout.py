"""The package layout keeps its promises: imports run one way, the spec is framework-neutral."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tracinfunc"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _top_level_imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """tracinfunc modules imported when ``name`` is imported: module-level statements only
    (function bodies run later, ``if TYPE_CHECKING:`` never)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # ``from pkg import sub`` imports the submodule when ``sub`` is one.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _top_level_imports(path, name, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_store_protocol_imports_no_implementation():
    imports = import_graph()["tracinfunc.store.base"]
    implementations = {"memory", "pinned", "zarr", "convert", "writer", "paths", "fill"}
    assert not {f"tracinfunc.store.{name}" for name in implementations} & imports


@pytest.mark.parametrize("module", ["tracinfunc.projection.spec", "tracinfunc.store.meta"])
def test_neutral_modules_need_no_framework_beyond_their_own(module):
    """The projection spec imports neither torch nor JAX; it is what JAX and torch share."""
    source = Path(importlib.util.find_spec(module).origin).read_text()
    roots = {alias.name.split(".")[0] for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Import) for alias in node.names}
    roots |= {(node.module or "").split(".")[0] for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.ImportFrom) and not node.level}
    assert "jax" not in roots
    if module.endswith("spec"):
        assert "torch" not in roots


def test_old_module_paths_still_import_with_a_warning():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "import tracinfunc, tracinfunc.grads.stages as new\n"
            "try:\n    import tracinfunc.stages\nexcept DeprecationWarning as w:\n"
            "    print('warned:', w)\n"
            "warnings.simplefilter('ignore')\n"
            "import tracinfunc.stages as old\n"
            "print(old is new, new.__spec__.name)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert "warned: tracinfunc.stages moved to tracinfunc.grads.stages" in result.stdout
    assert "True tracinfunc.grads.stages" in result.stdout
