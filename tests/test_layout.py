"""The package layout keeps its promises: imports run one way, with no cycle anywhere.

The import graph here is read from every import statement of a module: at module level,
under ``if TYPE_CHECKING:`` and inside function bodies. An import inside a function hides a
cycle from Python (the module is half-initialised only when the function runs), not from the
design, so inside a function only an optional dependency may be imported.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tracinfunc"

# Import names of the optional extras (pyproject's optional-dependencies): the only modules a
# function body may import, so that ``import tracinfunc`` works without them.
OPTIONAL = {"faiss", "s3fs", "fsspec", "botocore", "obstore", "transformers", "peft",
            "safetensors", "jax", "jaxlib", "flax", "matplotlib", "sklearn"}
# Core dependencies imported inside functions on purpose: zarr (with numcodecs) costs 0.3-0.5
# s and ~6 MiB to import, which ``import tracinfunc`` need not pay until a Zarr store, a saved
# curvature or a retraining run is opened or written.
DEFERRED = {"zarr"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _targets(node: ast.Import | ast.ImportFrom, package: str, modules: dict[str, Path]
             ) -> list[str]:
    """Absolute module names an import statement names (``from pkg import sub`` -> pkg.sub)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, *([base] if base else [])])
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
            for alias in node.names]


def _imports(path: Path, name: str, modules: dict[str, Path]
             ) -> tuple[set[str], list[tuple[int, str]]]:
    """(tracinfunc modules ``name`` imports anywhere, imports made inside function bodies)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.update(t for t in _targets(node, package, modules) if t in modules)
    in_functions = [(node.lineno, target)
                    for function in ast.walk(tree)
                    if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
                    for node in ast.walk(function)
                    if isinstance(node, ast.Import | ast.ImportFrom)
                    for target in _targets(node, package, modules)]
    return found, in_functions


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules)[0] for name, path in modules.items()}


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


def _is_ancestor(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def test_the_package_has_no_import_cycle_even_through_function_bodies():
    # A package's __init__ re-exports its own modules; a module importing a sibling through
    # the package's full path is not a cycle through __init__, so edges from a module to
    # its own ancestor packages are left out (they are refused by the next test instead).
    graph = {name: {t for t in targets if not _is_ancestor(t, name)}
             for name, targets in import_graph().items()}
    assert find_cycle(graph) is None


def test_no_module_imports_its_own_package_facade():
    """Inside the package, import from the defining module, never ``tracinfunc`` itself or an
    enclosing package's ``__init__`` (the road to cycles)."""
    offenders = sorted((name, target) for name, targets in import_graph().items()
                       for target in targets if _is_ancestor(target, name))
    assert offenders == []


def test_function_bodies_import_only_optional_dependencies():
    modules = _modules()
    offenders = sorted(
        (name, line, target)
        for name, path in modules.items()
        for line, target in _imports(path, name, modules)[1]
        if target.split(".")[0] not in OPTIONAL | DEFERRED
    )
    assert offenders == []


def test_import_tracinfunc_leaves_the_deferred_dependencies_unloaded():
    code = ("import sys, tracinfunc; print(sorted(m for m in sys.modules "
            f"if m.split('.')[0] in {sorted(DEFERRED)!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_the_optional_list_matches_the_extras():
    """Every name allowed inside functions belongs to an extra (not a core dependency)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {dep.split(">")[0].split("=")[0].split("[")[0].strip().lower()
            for dep in project["dependencies"]}
    assert not OPTIONAL & core


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_reader_sees_imports_inside_functions(tmp_path):
    source = "def f():\n    from tracinfunc.query.score import score\n    import faiss\n"
    (tmp_path / "m.py").write_text(source)
    modules = {"tracinfunc.query.score": Path("score.py"), "tracinfunc.m": tmp_path / "m.py"}
    found, inside = _imports(tmp_path / "m.py", "tracinfunc.m", modules)
    assert found == {"tracinfunc.query.score"}
    assert inside == [(2, "tracinfunc.query.score"), (3, "faiss")]


def test_the_store_protocols_import_no_implementation():
    imports = import_graph()["tracinfunc.store.protocols"]
    assert {name for name in imports if name.startswith("tracinfunc.store.")} <= {
        "tracinfunc.store.meta"}


def test_the_store_mixin_imports_no_store():
    imports = import_graph()["tracinfunc.store.properties"]
    assert not {name for name in imports if name.startswith("tracinfunc.store.")} - {
        "tracinfunc.store.meta"}


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


def test_the_import_hook_is_gone():
    """Old module paths of the unreleased 0.2 layout are not kept alive by a meta-path hook."""
    import sys

    import tracinfunc  # noqa: F401

    assert not [finder for finder in sys.meta_path
                if type(finder).__module__.startswith("tracinfunc")]


# --- The tree in docs/concepts/layout.md is the package's (issue 30) -------------------------

LAYOUT_DOC = ROOT / "docs" / "concepts" / "layout.md"


def documented_tree() -> dict[str, set[str]]:
    """``{package path: module file names}`` as the layout page's tree block lists them.

    ``""`` is the package root (its ``.py`` entries); ``"store/zarr"`` a nested package. A
    package's modules are the ``*.py`` words on its line and the lines below it, up to the
    next entry.
    """
    block = LAYOUT_DOC.read_text().split("```text\n", 1)[1].split("```", 1)[0]
    tree: dict[str, set[str]] = {"": set()}
    current = ""
    for line in block.splitlines()[1:]:
        if line.startswith("tests/") or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        first = line.split()[0]
        if indent == 2:
            current = first.rstrip("/") if first.endswith("/") else ""
            if first.endswith(".py"):
                tree[""].add(first)
                continue
        elif indent == 4 and first.endswith("/"):
            current = f"{current.split('/')[0]}/{first.rstrip('/')}"
        tree.setdefault(current, set())
        if current:
            tree[current] |= {word for word in line.split()
                              if word.endswith(".py") and "/" not in word}
    return tree


def actual_tree() -> dict[str, set[str]]:
    tree: dict[str, set[str]] = {"": {p.name for p in PACKAGE.glob("*.py")}}
    for init in PACKAGE.rglob("__init__.py"):
        folder = init.parent
        if folder != PACKAGE:
            tree[str(folder.relative_to(PACKAGE))] = {
                p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
    return tree


def test_the_layout_page_lists_every_module_and_nothing_else():
    """A new top-level module, package or module is refused until the page places it."""
    documented, actual = documented_tree(), actual_tree()
    assert sorted(documented) == sorted(actual), "packages differ from the layout page"
    for package in sorted(actual):
        missing = actual[package] - documented[package]
        stale = documented[package] - actual[package]
        assert not missing and not stale, (
            f"tracinfunc/{package}: add {sorted(missing)} to / remove {sorted(stale)} from the "
            "tree in docs/concepts/layout.md")


def test_the_layout_page_counts_the_everyday_names():
    import tracinfunc

    stated = int(LAYOUT_DOC.read_text().split("the everyday public API (", 1)[1].split()[0])
    assert stated == len(tracinfunc.__all__)


def test_dir_of_the_package_holds_the_everyday_names_and_the_rooms_only():
    import tracinfunc

    rooms = {name.removesuffix(".py") for name in documented_tree()[""]} | {
        package for package in documented_tree() if package and "/" not in package}
    public = {name for name in dir(tracinfunc) if not name.startswith("_")}
    assert set(tracinfunc.__all__) <= public | {"__version__"}
    assert public - set(tracinfunc.__all__) <= rooms, sorted(
        public - set(tracinfunc.__all__) - rooms)


def test_each_everyday_name_is_exported_from_one_subpackage():
    """``tif.X`` is re-exported from exactly one room (its defining module's package)."""
    import importlib

    import tracinfunc

    owners: dict[str, list[str]] = {}
    for room in sorted(package for package in actual_tree() if package and "/" not in package):
        module = importlib.import_module(f"tracinfunc.{room}")
        for name in getattr(module, "__all__", ()):
            # The same object (tracinfunc.jax.build_store is another function by design).
            if name in tracinfunc.__all__ and getattr(module, name) is getattr(tracinfunc, name):
                owners.setdefault(name, []).append(room)
    assert {name: rooms for name, rooms in owners.items() if len(rooms) > 1} == {}


def test_no_public_signature_has_more_than_14_parameters():
    import inspect
    import pkgutil

    import tracinfunc

    long = []
    for info in pkgutil.walk_packages(tracinfunc.__path__, "tracinfunc."):
        if info.name.startswith("tracinfunc.jax") or info.name.endswith("testing"):
            try:
                module = importlib.import_module(info.name)
            except ImportError:  # an optional extra that is not installed
                continue
        else:
            module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (inspect.isfunction(value) and not name.startswith("_")
                    and value.__module__ == module.__name__
                    and len(inspect.signature(value).parameters) > 14):
                long.append(f"{info.name}.{name}")
    assert long == []
