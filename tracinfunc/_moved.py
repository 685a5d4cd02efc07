"""Old module paths keep working: ``import tracinfunc.stages`` gives ``tracinfunc.grads.stages``.

The 0.2 layout moved modules into packages (``grads/``, ``projection/``, ``cli/``). Importing
an old path returns the module at its new path (the same object, so monkeypatching either
name patches both) with a ``DeprecationWarning`` naming the new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "tracinfunc._hashing": "tracinfunc.projection._kernels",
    "tracinfunc.checkpointing": "tracinfunc.grads.staged",
    "tracinfunc.chunking": "tracinfunc.grads.chunking",
    "tracinfunc.factorized": "tracinfunc.grads.factorized",
    "tracinfunc.offload": "tracinfunc.grads.offload",
    "tracinfunc.precision": "tracinfunc.grads.precision",
    "tracinfunc.results": "tracinfunc.cli.results",
    "tracinfunc.selection": "tracinfunc.grads.selection",
    "tracinfunc.spec": "tracinfunc.cli.spec",
    "tracinfunc.stages": "tracinfunc.grads.stages",
    "tracinfunc.store._stream": "tracinfunc.store.stream",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (or from "
                      "tracinfunc).", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._own_spec = module.__spec__  # importlib stamps the old spec on it next
        return module

    def exec_module(self, module):
        # Already executed at its new path; importlib filed it under the old name too, but
        # also stamped the old spec on it: give the module back its own.
        module.__spec__ = self._own_spec


def install() -> None:
    """Add the finder once (idempotent across reloads)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
