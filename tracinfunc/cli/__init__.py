"""The ``tracinfunc`` command line: argument parsing and output over the public API."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (``python -m tracinfunc`` and the ``tracinfunc`` script)."""
    # Imported on call: ``tracinfunc`` re-exports ``cli.spec.Spec``, and the command line
    # itself imports all of ``tracinfunc``.
    from tracinfunc.cli.commands import main as run

    return run(argv)
