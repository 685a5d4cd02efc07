"""Every Python example in README.md and docs/ runs as written, on tiny models.

A block runs in a fresh namespace holding the names the docs assume (`model`, `loss`,
`ckpts`, `loader`, `store`, ...; see tests/docs_namespaces.py): a small MLP on generated data,
a 12-layer (tiny) HF BERT for BERT examples, a GPT-2 from a config with peft and a HF
`Trainer` for the language-model examples, a Flax MLP for the JAX ones. A block that cannot
run here (a GPU, S3, the user's own module, hours) carries, on the line before its fence,
`<!-- fragment: the reason -->`; it is reported as skipped with that reason. Any other block
that fails, fails the suite.

Run one page or one block: `pytest tests/test_docs_examples.py -k jax.md`,
`-k "README.md:37"` (ids are page:line of the opening fence).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

import tracinfunc as tif
from tests import docs_namespaces

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FRAGMENT = re.compile(r"<!--\s*fragment:\s*(.*?)\s*-->")
LM_WORDS = ("causal_lm_loss", "peft", "tokenizer", "lora", "completion_", "adapter_checkpoint",
            "token_scores")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    fragment: str | None  # the reason it does not run, from its marker

    @property
    def kind(self) -> str:
        """Which namespace the block runs in."""
        if self.page == "docs/jax.md" or "tracinfunc.jax" in self.code or "tj." in self.code:
            return "flax"
        if "encoder.layer" in self.code:
            return "bert"
        if self.page == "docs/language-models.md" or any(w in self.code for w in LM_WORDS):
            return "lm"
        return "mlp"


def python_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The ```python blocks of a Markdown page, with their fragment markers."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip().startswith("```python"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = FRAGMENT.fullmatch(before.strip())
            blocks.append(Block(str(path.relative_to(root)), i + 1, "\n".join(lines[i + 1:end]),
                                marker.group(1) if marker else None))
            i = end
        i += 1
    return blocks


BLOCKS = [block for page in PAGES for block in python_blocks(page)]


@pytest.fixture(autouse=True)
def _quiet_torch_threads():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def namespaces(tmp_path_factory):
    """One namespace per (page, kind), built on first use; its files live in a template
    folder copied into each block's own working directory."""
    built: dict[tuple[str, str], tuple[dict, Path]] = {}

    def get(block: Block) -> tuple[dict, Path]:
        key = (block.page, block.kind)
        if key not in built:
            folder = tmp_path_factory.mktemp("docs-namespace")
            with pytest.MonkeyPatch.context() as patch:
                patch.chdir(folder)
                built[key] = docs_namespaces.KINDS[block.kind](folder, block.page), folder
        return built[key]

    return get


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.page}:{b.line}" for b in BLOCKS])
def test_documented_example_runs(block, namespaces, tmp_path, monkeypatch):
    if block.fragment is not None:
        pytest.skip(f"fragment: {block.fragment}")
    if block.kind == "flax" and importlib.util.find_spec("flax") is None:
        pytest.skip("flax is not installed (pip install 'tracinfunc[jax]' flax)")
    namespace, files = namespaces(block)
    shutil.copytree(files, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    exec(compile(block.code, f"{block.page}:{block.line}", "exec"), dict(namespace))


def test_every_fragment_marker_gives_a_reason_and_precedes_a_block():
    for page in PAGES:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            marker = FRAGMENT.fullmatch(line.strip())
            if marker is None:
                continue
            where = f"{page.relative_to(ROOT)}:{number}"
            assert marker.group(1), f"{where}: a fragment marker needs a reason"
            after = next((text for text in lines[number:] if text.strip()), "")
            assert after.strip().startswith("```python"), f"{where}: marks no python block"


def test_the_harness_finds_the_blocks_and_would_fail_a_broken_one(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- fragment: needs a GPU -->\n```python\ncuda()\n```\n\n"
                    "```python\nx = undefined_name\n```\n")
    fragment, runnable = python_blocks(page, tmp_path)
    assert fragment.fragment == "needs a GPU" and runnable.fragment is None
    with pytest.raises(NameError):
        exec(compile(runnable.code, "page.md", "exec"), {})
    assert len(BLOCKS) > 30  # README and docs: every page's blocks were found



def test_less_walkthrough_trains_records_and_selects(tmp_path, monkeypatch):
    # docs/language-models.md, LESS end to end: a GPT-2 from a config with peft LoRA, trained
    # by the HF Trainer for a few steps, recorded, then an Adam-preconditioned store.
    block = next(b for b in BLOCKS if "Trainer(model=peft_model" in b.code)
    assert block.fragment is None
    monkeypatch.chdir(tmp_path)
    namespace = docs_namespaces.KINDS["lm"](tmp_path, block.page)
    exec(compile(block.code, f"{block.page}:{block.line}", "exec"), namespace)
    assert len(namespace["ckpts"]) >= 1 and namespace["store"].meta.preconditioner == "adam"
    assert namespace["store"].shape[1] == len(namespace["pairs"])
    assert len(namespace["chosen"].indices) == 1  # 5% of 16 training pairs, at least one
    # Without the walkthrough's eval(), the Trainer's train mode is refused with the fix.
    trained = block.code.replace("peft_model.eval()", "pass").replace('"ckpts"', '"ckpts2"')
    fresh = docs_namespaces.KINDS["lm"](tmp_path / "again", block.page)
    with pytest.raises(tif.errors.TrainModeError, match=r"dropout p=0\.1.*model\.eval\(\)"):
        exec(compile(trained, f"{block.page}:{block.line}", "exec"), fresh)
