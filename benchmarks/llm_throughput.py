"""Tokens/s of projected per-example gradients of a GPT-2-style model, beside the floor.

The floor is one batched forward+backward over the same tokens (what training a step costs);
the table gives each method's tokens/s and its ratio to the floor, measured side by side in
one run, after a warm-up call of each. Methods:

- ``kronecker`` / ``sjlt``: :func:`tracinfunc.projected_grads` with :func:`causal_lm_loss`
  (full model), and the same on a LoRA-only model (peft adapters on ``c_attn``/``c_fc``);
- attention under vmap: the same sjlt run with a hand-written loss that calls HF's SDPA
  attention directly (vmap falls back to a per-example loop for the fused kernel), with
  tracinfunc's loss (math attention inside vmap: the default), and a Python loop of
  batch-of-one ``grad`` calls (no vmap).

    python benchmarks/llm_throughput.py            # CPU, ~1 minute
    python benchmarks/llm_throughput.py --quick    # tiny sizes (tests/ runs it)
    python benchmarks/llm_throughput.py --gpu      # CUDA, a ~100M-parameter model (GPT-2 small)

Targets: kronecker within 3x of the fwd+bwd floor (full model and LoRA-only).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import transformers
from torch.func import functional_call, grad

import tracinfunc as tif


def build(size: str, device: str, lora: bool):
    if size == "tiny":  # --quick: checks the script runs (tests/)
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512,
                                         n_positions=64, bos_token_id=0, eos_token_id=0)
    elif size == "small":
        config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=2048,
                                         n_positions=128, bos_token_id=0, eos_token_id=0)
    else:  # GPT-2 small's shape, ~124M parameters
        config = transformers.GPT2Config(n_positions=1024)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0, fan_in_fan_out=True))
    return model.to(device).eval(), config


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: torch.func tracing, plan discovery, projection blocks
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def floor_fn(model, batch):
    def step():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=batch["input_ids"]).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                          batch["input_ids"][:, 1:].flatten()).backward()
    return step


def hf_sdpa_loss(model):
    """A hand-written loss calling HF's SDPA attention as is (the fused kernel under vmap)."""
    def loss(params, example):
        ids = example["input_ids"][None]
        logits = functional_call(model, params, (), {"input_ids": ids}).logits
        return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    return loss


def loop_fn(loss, params, batch, projector):
    def run():
        rows = []
        for i in range(batch["input_ids"].shape[0]):
            g = grad(loss)(params, {k: v[i] for k, v in batch.items()})
            rows.append(projector(g))
        return torch.stack(rows)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="a 2-layer 64-wide model, 2 x 16 tokens, k=256, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.tokens, args.k, args.repeats = 2, 16, 256, 1
    device = "cuda" if args.gpu else "cpu"
    size = "gpt2" if args.gpu else "tiny" if args.quick else "small"
    rows = []
    for lora in (False, True):
        model, config = build(size, device, lora)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, config.vocab_size, (args.batch, args.tokens), generator=g)
        batch = {"input_ids": ids.to(device)}
        params = dict(tif.Checkpoint.from_module(model).params)
        n_tokens = ids.numel()
        tag = "LoRA-only" if lora else "full model"
        p = sum(v.numel() for v in params.values())
        floor = timed(floor_fn(model, batch), args.repeats)
        rows.append((tag, f"fwd+bwd floor (batched), p={p:,}", floor, floor, n_tokens))
        loss = tif.causal_lm_loss(model)
        for kind in ("kronecker", "sjlt"):
            fn = tif.projected_grads(loss, tif.Projection(dim=args.k, kind=kind))
            seconds = timed(lambda fn=fn, p=params, b=batch: fn(p, b), args.repeats)
            rows.append((tag, f"{kind} k={args.k}", seconds, floor, n_tokens))
        if lora:
            continue
        sjlt = tif.Projection(dim=args.k, kind="sjlt")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback's "performance drop" warning
            fused = tif.projected_grads(hf_sdpa_loss(model), sjlt)
            seconds = timed(lambda f=fused, p=params, b=batch: f(p, b), 1)
        rows.append((tag, "sjlt, vmap over HF SDPA (fallback)", seconds, floor, n_tokens))
        projector = tif.make_projector(sjlt, tif.canonical_layout(params), device=device)
        seconds = timed(loop_fn(loss, params, batch, projector), 1)
        rows.append((tag, "sjlt, loop of batch-of-one grads", seconds, floor, n_tokens))
    print(f"device: {torch.cuda.get_device_name() if args.gpu else 'CPU'}, threads "
          f"{torch.get_num_threads()}, batch {args.batch} x {args.tokens} tokens")
    print(f"{'model':<11} {'method':<40} {'s/batch':>8} {'tokens/s':>9} {'x floor':>8}")
    for tag, method, seconds, floor, n_tokens in rows:
        print(f"{tag:<11} {method:<40} {seconds:8.3f} {n_tokens / seconds:9.0f} "
              f"{seconds / floor:8.2f}")


if __name__ == "__main__":
    main()
