"""examples/language_model.py runs end to end in its --quick size (in process)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "language_model.py"


def _example():
    spec = importlib.util.spec_from_file_location("language_model_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_language_model_example_prints_and_saves_influential_snippets(tmp_path):
    module = _example()
    page = tmp_path / "page.html"
    # --lora trains the base model, then adapters: both paths of the example run.
    results = module.main(["--quick", "--lora", "--dim", "64", "--out", str(page)])
    assert [prompt for prompt, _, _ in results] == module.PROMPTS
    texts = set(module.snippets(48, 48))
    for _, _, top in results:
        assert len(top) == 3 and all(text in texts for _, text in top)
        values = [value for value, _ in top]
        assert values == sorted(values, reverse=True)
    assert page.read_text().count("<ol>") == len(module.PROMPTS)
    # The LESS step: the top 10% of the 48 snippets, chosen from recorded adapter checkpoints.
    chosen = json.loads(page.with_suffix(".selected.json").read_text())
    assert len(chosen) == 4 and all(r["text"] in texts for r in chosen)
    assert [r["score"] for r in chosen] == sorted((r["score"] for r in chosen), reverse=True)
    shown = json.loads(page.with_suffix(".json").read_text())
    assert len(shown) == 3 * len(module.PROMPTS)
