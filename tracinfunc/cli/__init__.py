"""The ``tracinfunc`` command line: argument parsing and output over the public API.

:class:`Spec` is what a spec file (``--spec file.py:make``) returns: the model, loss,
checkpoints and data the command line builds from.
"""

from __future__ import annotations

from tracinfunc.cli.commands import main
from tracinfunc.cli.spec import Spec

__all__ = ["Spec", "main"]
