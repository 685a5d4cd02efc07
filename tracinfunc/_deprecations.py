"""Deprecated public names and keywords, each with the version that removes it (optax-style).

A deprecation is announced once where it is used, names what to use instead and when the old
spelling goes, so a user can migrate before an upgrade breaks them. Only public names get an
alias; internal module paths move without one.
"""

from __future__ import annotations

import warnings

__all__ = ["REMOVAL_VERSION", "warn_deprecated"]

# The release that drops every alias below (announced in docs/api.md, "Migrating to 0.2").
REMOVAL_VERSION = "0.3.0"


def warn_deprecated(old: str, new: str, *, removal: str = REMOVAL_VERSION,
                    stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` and goes in ``removal``."""
    warnings.warn(
        f"{old} is deprecated and will be removed in tracinfunc {removal}; use {new} instead.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
