
"""Every benchmark's ``--quick`` mode runs to the end, so no benchmark rots unnoticed.

Each script in ``benchmarks/`` (helpers starting with ``_`` aside) runs as a user would run
it, in a subprocess with this checkout on ``PYTHONPATH``, in a scratch directory. A script
whose optional dependency is missing is skipped, saying which; the figures are not checked
(they depend on the machine), only that the run finishes and prints its table. The quality
benchmark's table and JSON are also checked, as its numbers are deterministic.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import child_env

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
# What each script needs beyond the core and dev installs (modules of this interpreter).
NEEDS = {"search.py": ["faiss"], "index_binding.py": ["faiss"], "scale_out.py": ["boto3", "moto"],
         "llm_throughput.py": ["transformers", "peft"], "vs_captum.py": ["captum"],
         "quality.py": ["sklearn", "matplotlib"],
         "quality_lm.py": ["transformers", "matplotlib"],
         "refine_cost.py": ["transformers", "sklearn"],
         "curvature_fit.py": ["sklearn", "transformers"],
         "rerank.py": ["sklearn", "transformers"],
         "token_attribution.py": ["transformers"], "report.py": ["sklearn"]}
# Arguments beyond --quick ({tmp}: the scratch directory).
EXTRA = {"quality.py": ["--model", "logreg", "--out", "{tmp}"], "search.py": ["--dir", "{tmp}"],
         "curvature.py": ["--model", "logreg", "--out", "{tmp}"],
         "quality_lm.py": ["--out", "{tmp}"], "rerank.py": ["--out", "{tmp}"]}
# Text a script prints when it ran to the end (beyond some output at all).
PRINTS = {"quality.py": "| exact-all | identity | p | all | dot |",
          "search.py": "nlist // 16",
          "curvature.py": "| dense-exact |", "gpu.py": "verdict: PASS",
          "curvature_fit.py": "| lm (",
          "quality_lm.py": "| tracin-all | tracin | all |",
          "refine_cost.py": "| mlp | 3 | 100, 5, 5 | direct |",
          "rerank.py": "| LM projected curvature, retrieve with curvature |",
          "token_attribution.py": "| canary document top-1 proponent |",
          "report.py": "| page top-10 rows == tif.top_k's | True |"}
# Scripts whose quick run is a test elsewhere, in process, with checks on what it returns.
IN_PROCESS = {"llm_throughput.py": "tests/grads/test_factorized_batched.py"}


def _skip_reason(script: str) -> str | None:
    if script == "run_all.py":
        return "run_all.py only runs the other scripts, each of which runs here"
    if script in IN_PROCESS:
        return f"{script} --quick runs in process in {IN_PROCESS[script]}"
    if script == "gpu.py" and torch.cuda.is_available():
        return "with CUDA gpu.py measures (minutes); run it by hand"
    missing = [m for m in NEEDS.get(script, []) if importlib.util.find_spec(m) is None]
    if missing:
        return f"{script} needs {', '.join(missing)}, not installed (pip install -e '.[bench]')"
    if script == "vs_dattri.py":
        python = os.environ.get("DATTRI_PYTHON", str(ROOT / ".venv-dattri" / "bin" / "python"))
        if not Path(python).exists():
            return f"vs_dattri.py needs dattri's own venv at {python} (make bench-setup)"
    return None


def run_quick(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    extra = [arg.format(tmp=tmp_path) for arg in EXTRA.get(script, [])]
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", *extra], cwd=tmp_path,
        capture_output=True, text=True, timeout=600,
        env=child_env(),
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_quick_mode_runs_to_the_end(script, tmp_path):
    if (reason := _skip_reason(script)) is not None:
        pytest.skip(reason)
    done = run_quick(script, tmp_path)
    assert done.returncode == 0, f"{script} --quick failed:\n{done.stderr[-3000:]}"
    assert done.stdout.strip() and PRINTS.get(script, "") in done.stdout, done.stdout[-2000:]
    if script == "quality.py":
        check_quality_results(done.stdout, tmp_path)
    if script == "curvature.py":
        check_curvature_results(done.stdout, tmp_path)
    if script == "quality_lm.py":
        check_quality_lm_results(done.stdout, tmp_path)
    if script == "search.py" and importlib.util.find_spec("transformers") is not None:
        assert "LM cosine          ivf_pq" in done.stdout  # the real gradient store ran
    if script == "gpu.py":  # no CUDA here: the CPU checks, and the GPU parts said skipped
        assert "skipped (needs CUDA)" in done.stdout and "FAIL" not in done.stdout


def check_curvature_results(stdout: str, out: Path) -> None:
    """benchmarks/curvature.py --quick: every kind beside TracIn, in its JSON and picture."""
    (saved,) = json.loads((out / "curvature.json").read_text())
    kinds = {row["kind"] for row in saved["rows"]}
    assert kinds - {"kronfluence-ekfac"} == {"tracin", "dense", "kfac", "ekfac", "projected"}
    configs = {row["config"] for row in saved["rows"]}  # the last checkpoint beside all
    assert {"tracin-exact-last", "dense-exact-last", "ekfac-exact-last"} <= configs
    assert all(-1 <= row["lds"] <= 1 for row in saved["rows"])
    # choose_damping's held-out pick, one per curvature, among the swept multiples
    assert {c["kind"] for c in saved["choices"]} == kinds - {"tracin", "kronfluence-ekfac"}
    assert all(c["heldout"] in {row["scale"] for row in saved["rows"]} for c in saved["choices"])
    assert (out / "curvature.png").exists()


def check_quality_lm_results(stdout: str, out: Path) -> None:
    """benchmarks/quality_lm.py --quick: TracIn and every curvature kind, all and last
    checkpoints, finite LDS, each peer run or said why not, the picture written."""
    saved = json.loads((out / "quality_lm.json").read_text())
    rows = saved["rows"]
    for checkpoints in ("all", "last"):
        kinds = {row["kind"] for row in rows if row["checkpoints"] == checkpoints}
        assert {"tracin", "dense", "kfac", "ekfac", "projected"} <= kinds, kinds
        # one default-damping row per kind, and the sweep around it
        for kind in ("dense", "kfac", "ekfac", "projected"):
            mine = [r for r in rows if r["kind"] == kind and r["checkpoints"] == checkpoints]
            assert sum(r["default"] for r in mine) == 1 and len(mine) >= 2
    assert all(math.isfinite(row["lds"]) and -1 <= row["lds"] <= 1 for row in rows)
    peers = {peer["name"]: peer for peer in saved["peers"]}
    assert set(peers) == {"kronfluence", "bergson"}
    for name, peer in peers.items():
        assert peer["status"] in ("ran", "unavailable", "not run"), peer  # never "failed"
        ran = [r for r in rows if r["kind"] == f"{name}-ekfac"]
        assert bool(ran) == (peer["status"] == "ran")
        assert f"peer {name}" in stdout
    from tracinfunc.curvature import DEFAULT_SCALES

    scale = DEFAULT_SCALES["ekfac"]
    assert f"| ekfac-all | ekfac | all | p | {scale:g}x mean eig (default) |" in stdout
    assert (out / "quality_lm.png").stat().st_size > 0


def check_quality_results(stdout: str, out: Path) -> None:
    """benchmarks/quality.py --quick: its table and JSON say what the docs report."""
    (result,) = json.loads((out / "quality.json").read_text())
    names = {row["name"] for row in result["rows"]}
    for kind in ("identity", "rademacher", "sjlt", "kronecker"):
        assert any(row["kind"] == kind for row in result["rows"])
    assert {"exact-last", "exact-all-cos", "kronecker-64-last-cos"} <= names
    for row in result["rows"]:
        assert -1 <= row["low"] <= row["lds"] <= row["high"] <= 1
        # exact float32 rows are the reference of their own (checkpoints, normalize) group
        assert (row["score_error"] == 0) == (row["kind"] == "identity" and not row["storage"])
    # storage rows beside their float32 rows, in the JSON and a second table
    storage = {row["name"]: row for row in result["rows"] if row["storage"]}
    assert {"exact-int8-all", "rademacher-64-sign-all", "exact-bfloat16-all"} <= set(storage)
    assert "| exact-int8-all | int8 |" in stdout
    int8, sign = storage["exact-int8-all"], storage["exact-sign-all"]
    assert int8["vs_float32"]["score_error"] < 0.02 < sign["vs_float32"]["score_error"]
    assert int8["flip_auc"] == int8["vs_float32"]["flip_auc"]  # from the exact stored norms
    k = (int8["vs_float32"]["row_bytes"] - 4) // 4  # float32: 4 bytes a value, plus the norm
    assert int8["row_bytes"] == k + 4 + 4  # int8: a byte a value, the scale and the norm
    assert (out / "quality.png").stat().st_size > 0
    assert len(list(out.glob("retrain-logreg-*.zarr"))) == 2  # kept, so a rerun resumes
