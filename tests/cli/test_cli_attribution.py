"""``tracinfunc tokens`` and ``tracinfunc report`` end to end, in process."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import tracinfunc as tif
from tests.cli.test_cli import cli_here
from tracinfunc.cli.spec import load_spec

DATA = Path(__file__).resolve().parents[1] / "data"
LM_SPEC, SPEC = f"{DATA / 'tiny_lm_spec.py'}:make", f"{DATA / 'tiny_spec.py'}:make"


def test_tokens_writes_per_token_scores_that_sum_to_top_k(tmp_path):
    spec = load_spec(LM_SPEC)
    spec_store = tif.Projection(dim=16, kind="kronecker", seed=2)
    store = tif.build_store(spec.loss, spec.checkpoints, spec.train, projection=spec_store,
                            store=str(tmp_path / "g.zarr"), progress=False)
    done = cli_here("tokens", str(tmp_path / "g.zarr"), "--spec", LM_SPEC, "--top-k", "3",
                    "--span", "2", "--output", "t.json", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = json.loads((tmp_path / "t.json").read_text())
    test = tif.build_store(spec.loss, spec.checkpoints, spec.test["test"],
                           projection=spec_store, progress=False)
    values, rows = tif.top_k(store, test, k=3)
    assert len(records) == 2
    for query, record in enumerate(records):
        assert [d["row"] for d in record["documents"]] == rows[query].tolist()
        sums = torch.tensor([sum(d["token_scores"]) for d in record["documents"]],
                            dtype=torch.float64)
        torch.testing.assert_close(sums, values[query].double(), rtol=1e-4, atol=1e-6)
        assert record["top_spans"] and all(s["stop"] - s["start"] == 2
                                           for s in record["top_spans"])
    again = cli_here("tokens", str(tmp_path / "g.zarr"), "--spec", LM_SPEC, "--output",
                     "t.json", cwd=tmp_path)
    assert again.returncode == 1 and "exists" in again.stderr


def test_report_writes_one_page_and_refuses_a_path_inside_the_store(tmp_path):
    spec = load_spec(SPEC)
    tif.build_store(spec.loss, spec.checkpoints, spec.train,
                    projection=tif.Projection(dim=8, seed=0), store=str(tmp_path / "g.zarr"),
                    progress=False)
    done = cli_here("report", "g.zarr", "--spec", SPEC, "--image-shape", "1x5", "--top-k", "4",
                    "--output", "r.html", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "r.html").read_text()
    assert page.count('<tr class="pro"') == 6 * 4 and "data:image/png;base64," in page
    inside = cli_here("report", "g.zarr", "--spec", SPEC, "--output", "g.zarr/r.html",
                      cwd=tmp_path)
    assert inside.returncode == 1 and "inside" in inside.stderr
    bad = cli_here("report", "g.zarr", "--spec", SPEC, "--image-shape", "8", "--output",
                   "x.html", cwd=tmp_path)
    assert bad.returncode == 2
