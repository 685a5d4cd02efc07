"""Which training snippets made a small language model continue a prompt this way?

A GPT-2-style model built from a ``transformers`` config (no download), with a character
tokenizer, is trained briefly on docstrings of standard-library modules (text that ships with
Python), saving a checkpoint with its learning rate every few steps. Then:

1. ``build_store`` projects per-example gradients of every training snippet at every
   checkpoint (``kind="kronecker"``: the embedding, every Conv1D and the tied head are
   factorised, never materialised per example);
2. for each prompt, the model's greedy continuation becomes a test example whose loss counts
   only the continuation (``tif.generation_batch``: completion-only labels, as LESS does);
3. ``top_k`` finds the training snippets with the highest TracIn scores; ``tif.TopExamples``
   prints them as text and saves them (JSON, and an HTML page).

With ``--lora``, the LESS workflow end to end: the trained model is fine-tuned further with
LoRA adapters (peft) by a HF ``Trainer`` whose ``tif.trainer_callback`` records the adapter
checkpoints (each weighted by the mean lr of its steps, the frozen base never re-saved) with
Adam's state; the store holds LESS's Adam update directions (``preconditioners=``); cosine
scores against the prompts (one validation task each) are aggregated as LESS does and
``tif.select_training_data`` keeps the top 10% of the training snippets, written as JSON.

Run:  python examples/language_model.py            (a few minutes on a laptop CPU)
      python examples/language_model.py --lora     (LoRA fine-tuning, adapter influence)
      python examples/language_model.py --quick    (tiny; used by the test suite)
"""

from __future__ import annotations

import argparse
import html
import importlib
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers

import tracinfunc as tif

MODULES = ["json", "collections", "functools", "itertools", "pathlib", "string", "textwrap",
           "heapq", "bisect", "random", "statistics", "fractions", "decimal", "shutil", "csv"]
PROMPTS = ["Return a ", "The default ", "If the "]


def snippets(length: int, limit: int) -> list[str]:
    """Docstring lines of standard-library objects, cut to ``length`` characters."""
    out: list[str] = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            doc = getattr(getattr(module, attr, None), "__doc__", None)
            if not isinstance(doc, str):
                continue
            for line in doc.splitlines():
                line = " ".join(line.split())
                if len(line) >= 24 and line.isascii():
                    out.append(line[:length])
    unique = list(dict.fromkeys(out))
    g = torch.Generator().manual_seed(0)
    return [unique[i] for i in torch.randperm(len(unique), generator=g)[:limit].tolist()]


class Chars:
    """A character tokenizer: id 0 pads, printable ASCII from 1 (called as a HF tokenizer is)."""

    pad_token_id, eos_token_id = 0, None

    def __init__(self) -> None:
        self.chars = [chr(c) for c in range(32, 127)]
        self.index = {c: i + 1 for i, c in enumerate(self.chars)}

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [self.index.get(c, 1) for c in text]}

    def encode(self, texts: list[str], length: int) -> dict[str, torch.Tensor]:
        ids = torch.zeros(len(texts), length, dtype=torch.long)
        for row, text in enumerate(texts):
            codes = [self.index.get(c, 1) for c in text[:length]]
            ids[row, :len(codes)] = torch.tensor(codes)
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.chars[i - 1] for i in ids if i > 0)


def make_model(length: int, width: int) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(n_layer=2, n_embd=width, n_head=4, vocab_size=96,
                                     n_positions=length, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    model.loss_type = "ForCausalLM"  # transformers cannot tell from the class name GPT2LMHeadModel
    return model


def train(model, data, *, steps: int, every: int, lr: float, name: str):
    """AdamW on the causal LM loss; a Checkpoint (trainable params, lr) every ``every`` steps."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    checkpoints = []
    g = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        model.train()
        rows = torch.randint(0, len(data["input_ids"]), (16,), generator=g)
        labels = data["input_ids"][rows].masked_fill(data["attention_mask"][rows] == 0, -100)
        out = model(input_ids=data["input_ids"][rows], attention_mask=data["attention_mask"][rows],
                    labels=labels)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        if step % every == 0:
            checkpoints.append(tif.Checkpoint.from_module(model, lr=lr, name=f"{name}-{step}"))
    return model.eval(), checkpoints


def train_lora(model, data, *, steps: int, every: int, lr: float, directory: str):
    """LoRA fine-tuning with a HF Trainer (linear lr decay, AdamW); ``tif.trainer_callback``
    records the adapters and Adam's state every ``every`` steps and at the end."""
    import peft

    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated",
                                FutureWarning)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"], lora_dropout=0.0,
            fan_in_fan_out=True))
    labels = tif.completion_labels(data, 0)  # the whole snippet is scored, padding is not
    rows = [{"input_ids": i, "attention_mask": m, "labels": y}
            for i, m, y in zip(data["input_ids"], data["attention_mask"], labels, strict=True)]
    args = transformers.TrainingArguments(
        output_dir=directory, max_steps=steps, per_device_train_batch_size=16, learning_rate=lr,
        lr_scheduler_type="linear", save_strategy="no", report_to=[], use_cpu=True,
        logging_strategy="no", disable_tqdm=True, seed=1)
    transformers.Trainer(model=model, args=args, train_dataset=rows,
                         callbacks=[tif.trainer_callback(directory, every=every)]).train()
    return model.eval()


def less_selection(model, loss, texts, data, test, directory: str, *, dim: int, out: Path):
    """LESS: Adam-preconditioned training rows, cosine scores, per-task aggregation, top 10%."""
    checkpoints = tif.load_recorded_checkpoints(directory, model)
    adam = tif.load_recorded_preconditioners(directory, model, kind="adam")
    projection = tif.Projection(dim=dim, seed=0, kind="sjlt")
    store = tif.build_store(loss, checkpoints, data, projection=projection, batch_size=64,
                            preconditioners=adam)
    val_grads = tif.build_store(loss, checkpoints, test, projection=projection)
    scores = tif.score(store, val_grads, normalize=True)  # [n_val, n_train]
    chosen = tif.select_training_data(scores, fraction=0.1, tasks=PROMPTS)
    print(f"\nLESS: {len(checkpoints)} adapter checkpoints, lrs "
          f"{[f'{c.lr:.2g}' for c in checkpoints]}; kept {len(chosen.indices)} of "
          f"{chosen.n_train} snippets, best first:")
    print(chosen.examples(texts))
    chosen.examples(texts).save(out, overwrite=True)
    print(f"saved {out}")
    return chosen


def write_page(path: Path, results: list[tuple[str, str, list[tuple[float, str]]]]) -> None:
    parts = ["<html><head><meta charset='utf-8'><title>Influential snippets</title></head>",
             "<body style='font-family: monospace'>"]
    for prompt, completion, top in results:
        parts.append(f"<h3>{html.escape(prompt)}<b style='color:#b00'>"
                     f"{html.escape(completion)}</b></h3><ol>")
        parts += [f"<li>{value:+.3g}: {html.escape(text)}</li>" for value, text in top]
        parts.append("</ol>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([*parts, "</body></html>"]))


def main(argv: list[str] | None = None) -> list[tuple[str, str, list[tuple[float, str]]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for tests)")
    parser.add_argument("--lora", action="store_true", help="LoRA fine-tuning, adapter influence")
    parser.add_argument("--dim", type=int, default=4096, help="projected dimension k")
    parser.add_argument("--out", type=Path, default=Path("examples/output/language_model.html"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    length = 48
    n_train, steps, every, width = (48, 6, 3, 32) if args.quick else (600, 300, 100, 64)
    texts = snippets(length, n_train)
    chars = Chars()
    data = chars.encode(texts, length)
    model, checkpoints = train(make_model(length + 16, width), data, steps=steps, every=every,
                               lr=3e-3, name="step")
    recording = tempfile.TemporaryDirectory(prefix="lora-checkpoints-")
    if args.lora:
        model = train_lora(model, data, steps=steps // 2, every=every, lr=1e-3,
                           directory=recording.name)
        checkpoints = tif.load_recorded_checkpoints(recording.name, model)
    print(f"trained on {len(texts)} docstring snippets; {len(checkpoints)} checkpoints "
          f"of {sum(v.numel() for v in checkpoints[0].params.values()):,} parameters")

    loss = tif.causal_lm_loss(model)
    projection = tif.Projection(dim=args.dim, seed=0, kind="kronecker")
    store = tif.build_store(loss, checkpoints, data, projection=projection, batch_size=64)
    # The model's own greedy continuations (never the pad id), scored as completions.
    test, completions = tif.generation_batch(model, chars, PROMPTS,
                                             max_new_tokens=8 if args.quick else 16,
                                             bad_words_ids=[[0]])
    test_grads = tif.build_store(loss, checkpoints, test, projection=projection)
    values, indices = tif.top_k(store, test_grads, 3 if args.quick else 5)
    top = tif.TopExamples(values, indices, texts,
                          queries=[f"{p}[{c}]" for p, c in zip(PROMPTS, completions, strict=True)])
    print(top)
    results = [(prompt, completion, [(value, item) for value, _, item in top[i]])
               for i, (prompt, completion) in enumerate(zip(PROMPTS, completions, strict=True))]
    write_page(args.out, results)
    top.save(args.out.with_suffix(".json"), overwrite=True)
    if args.lora:
        less_selection(model, loss, texts, data, test, recording.name, dim=args.dim,
                       out=args.out.with_suffix(".selected.json"))
    recording.cleanup()
    print(f"\nsaved {args.out} ({time.perf_counter() - started:.0f} s)")
    return results


if __name__ == "__main__":
    main()
