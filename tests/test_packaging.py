"""Installing prints no warning the project causes: an SPDX license, a simple editable layout."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_license_is_an_spdx_string_with_a_setuptools_that_reads_it():
    config = tomllib.loads(PYPROJECT.read_text())
    # A TOML table ({text = ...}) makes setuptools >= 77 print a deprecation wall on install.
    assert config["project"]["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in config["project"].get("classifiers", []))
    [setuptools] = [r for r in config["build-system"]["requires"] if r.startswith("setuptools")]
    minimum = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools.replace(" ", ""))
    assert minimum is not None and int(minimum.group(1)) >= 77  # PEP 639 strings from 77


def test_an_editable_install_prints_no_notice(tmp_path):
    # Issue 24 item 9: `make install` printed setuptools' "Editable installation" notice,
    # which its meta-path-finder strategy emits for any layout it cannot call simple. With the
    # project root as the package root, setuptools writes a plain .pth and says nothing.
    pytest.importorskip("setuptools", minversion="77")  # what [build-system] asks for
    result = subprocess.run(
        [sys.executable, "-W", "default", "-c",
         f"import setuptools.build_meta as b; print(b.build_editable({str(tmp_path)!r}))"],
        cwd=PYPROJECT.parent, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Editable installation" not in result.stdout + result.stderr
    assert "__editable__.tracinfunc" in result.stdout  # the .pth strategy, not a finder
    assert (tmp_path / result.stdout.strip().splitlines()[-1]).is_file()
