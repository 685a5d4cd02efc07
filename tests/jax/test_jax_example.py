"""examples/jax_interop.py end to end in its reduced size: JAX writes, torch scores."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "jax_interop.py"


def test_jax_interop_example_agrees_across_frameworks():
    result = subprocess.run([sys.executable, str(EXAMPLE), "--quick"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    found = re.search(r"max relative score error (\S+), top-10 identical for (\d+) of (\d+)",
                      out)
    assert found, out
    assert float(found.group(1)) <= 1e-5, out
    assert found.group(2) == found.group(3), out
    assert "0.weight" in out and "self-influence (a jax.Array)" in out, out
