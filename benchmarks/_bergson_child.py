"""bergson's gradient hooks for llm_throughput.py, in bergson's own environment.

Run by ``llm_throughput.py`` with ``.venv-bergson/bin/python`` (``make bench-setup``); imports
neither tracinfunc nor the benchmark, builds the same GPT-2 (same config, seed and batches),
freezes every weight as bergson does (only the input embeddings require grad, so hooks fire)
and collects per-module projected gradients (``projection_dim=p``, so ``k = p*p`` per
module) through bergson's ``HookCollectorBase``. Prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from bergson.collector.collector import HookCollectorBase
from bergson.gradients import GradientProcessor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llm_throughput


@dataclass(kw_only=True)
class Rows(HookCollectorBase):
    """Keeps the current batch's projected per-module gradients in memory."""

    def setup(self) -> None:
        self.rows = {}

    def teardown(self) -> None:
        pass

    def backward_hook(self, module, g) -> None:
        self.rows[module._name] = self._compute_gradient(module, g)

    def process_batch(self, indices, **kwargs) -> None:
        pass


def build(cfg):
    """The same model as the tracinfunc side builds (one definition, in llm_throughput.py)."""
    return llm_throughput.build(cfg["model"], cfg["quick"], cfg["tokens"])


def batches_of(config, n, batch, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab_size, (batch, tokens), generator=g) for _ in range(n)]


def per_example_losses(model, ids):
    logits = model(input_ids=ids).logits[:, :-1]
    token = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return token.view(ids.shape[0], -1).mean(1)


def floor_step(model, ids):
    model.requires_grad_(True)
    per_example_losses(model, ids).mean().backward()
    model.zero_grad(set_to_none=True)
    freeze(model)


def freeze(model):
    model.requires_grad_(False)
    model.get_input_embeddings().requires_grad_(True)


def cpu(fn):
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    model, config = build(cfg)
    batches = batches_of(config, 3, cfg["batch"], cfg["tokens"], seed=1)
    targets = None
    if cfg["params"] == "matched":
        targets = {name for name, module in model.named_modules()
                   if name.startswith("transformer.h.") and type(module).__name__ == "Conv1D"}
    freeze(model)
    collector = Rows(model=model, processor=GradientProcessor(projection_dim=cfg["p"]),
                     target_modules=targets)

    def rows(ids):
        with collector:
            per_example_losses(model, ids).sum().backward()
        model.zero_grad(set_to_none=True)
        return torch.cat([collector.rows[name] for name in sorted(collector.rows)], dim=1)

    rows(batches[0])  # warm-up
    tool = [cpu(lambda ids=ids: rows(ids)) for ids in batches]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    floor = []
    for r in range(cfg["repeats"]):
        ids = batches[r % len(batches)]
        floor.append(cpu(lambda ids=ids: floor_step(model, ids)))
        tool.append(cpu(lambda ids=ids: rows(ids)))
    floor.append(cpu(lambda: floor_step(model, batches[0])))
    result = {"tool_s": statistics.median(tool), "floor_s": statistics.median(floor),
              "rss_mib": rss, "tokens": cfg["batch"] * cfg["tokens"],
              "k": rows(batches[0]).shape[1]}
    if cfg["agreement"] and targets is not None:
        result.update(agreement(model, config, cfg, rows, targets))
    print("RESULT " + json.dumps(result))


def agreement(model, config, cfg, rows, targets) -> dict:
    """Pearson r and top-10 overlap with exact TracIn over the same weights."""
    n_train, n_test = (16, 4) if cfg["quick"] else (64, 16)
    train = batches_of(config, 1, n_train, cfg["tokens"], seed=2)[0]
    test = batches_of(config, 1, n_test, cfg["tokens"], seed=3)[0]
    weights = [model.get_submodule(name).weight for name in sorted(targets)]

    def exact(ids):
        out = []
        for i in range(ids.shape[0]):
            for w in weights:
                w.requires_grad_(True)
            grads = torch.autograd.grad(per_example_losses(model, ids[i:i + 1]).sum(), weights)
            out.append(torch.cat([g.flatten() for g in grads]))
        freeze(model)
        return torch.stack(out)

    scores = exact(test) @ exact(train).T
    approx = torch.cat([rows(test[i:i + 8]) for i in range(0, n_test, 8)]) @ torch.cat(
        [rows(train[i:i + 8]) for i in range(0, n_train, 8)]).T
    r = torch.corrcoef(torch.stack([scores.flatten(), approx.flatten()]))[0, 1]
    top = min(10, n_train)
    overlap = [len(set(scores[i].topk(top).indices.tolist())
                   & set(approx[i].topk(top).indices.tolist())) / top for i in range(n_test)]
    return {"r": float(r), "top10": statistics.mean(overlap)}


if __name__ == "__main__":
    main()
