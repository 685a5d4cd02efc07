"""Each example runs end to end in its reduced size."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tracinfunc as tif

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_quickstart_finds_flipped_labels_and_saves_its_picture(tmp_path):
    picture = tmp_path / "quickstart.png"
    out = _run("quickstart.py", "--quick", "--out", str(picture))
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    found = re.search(r"hold (\d+) of (\d+) flipped labels", out)
    assert found, out
    hits, flipped = map(int, found.groups())
    # Random inspection of 10% finds ~10% of flips; self-influence must do far better.
    assert hits / flipped > 0.5, out
    assert len(re.findall(r"test digit \d+ \(label \d\): proponents #", out)) == 5


def test_mislabel_detection_beats_random(tmp_path):
    out = tmp_path / "curve.png"
    text = _run("mislabel_detection.py", "--quick", "--out", str(out))
    rows = {line[:24].strip(): [float(v.rstrip("%")) for v in line[24:].split()]
            for line in text.splitlines() if line.startswith(("TracIn", "final", "random"))}
    # Columns: 5%, 10%, 20%, 30% inspected. Random finds about as many as it inspects.
    assert rows["TracIn self-influence"][1] > 3 * rows["random"][1]
    assert out.stat().st_size > 0


def test_knowledge_graph_reports_per_triple_time():
    text = _run("knowledge_graph.py", "--quick")
    per_triple = re.search(r"([\d.]+) ms per test triple", text)
    assert per_triple, text
    one = re.search(r"one test triple alone: ([\d.]+) ms", text)
    assert one and float(one.group(1)) > 0, text
    assert text.count("proponents:") == 3 and text.count("training row") == 9


def test_store_reuse_reopens_the_store_in_a_second_process(tmp_path):
    text = _run("store_reuse.py", "--quick", "--workdir", str(tmp_path))
    assert "[build process] wrote ZarrStore" in text
    assert "[experiment process] reopened ZarrStore" in text
    share = re.search(r"(\d+)% of their top-5 proponents carry the wrongly predicted label", text)
    found = re.search(r"hold (\d+) of (\d+) flipped labels", text)
    assert share and found, text
    assert int(share.group(1)) > 50  # proponents of a mistake mostly carry the mistaken label
    assert int(found.group(1)) / int(found.group(2)) > 0.5
    store = tif.open_store(str(tmp_path / "grads.zarr"))
    assert store.meta.complete and store.meta.n_train == 1500
