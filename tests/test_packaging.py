"""Installing prints no warning the project causes: the license is an SPDX string."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_license_is_an_spdx_string_with_a_setuptools_that_reads_it():
    config = tomllib.loads(PYPROJECT.read_text())
    # A TOML table ({text = ...}) makes setuptools >= 77 print a deprecation wall on install.
    assert config["project"]["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in config["project"].get("classifiers", []))
    [setuptools] = [r for r in config["build-system"]["requires"] if r.startswith("setuptools")]
    minimum = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools.replace(" ", ""))
    assert minimum is not None and int(minimum.group(1)) >= 77  # PEP 639 strings from 77
