"""Each example runs end to end in its reduced size."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_quickstart_finds_flipped_labels():
    out = _run("quickstart.py", "--quick")
    found = re.search(r"hold (\d+) of (\d+) flipped labels", out)
    assert found, out
    hits, flipped = map(int, found.groups())
    # Random inspection of 10% finds ~10% of flips; self-influence must do far better.
    assert hits / flipped > 0.5, out
    assert len(re.findall(r"test digit \d+ \(label \d\): proponents #", out)) == 5
