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

Beside each kind's speed, its agreement with exact TracIn: the Pearson correlation of the
projected inner products between 8 test and 8 training sequences with the exact ones
(``kind="identity"``), over three projection seeds (min-max). LoRA adapters start random
(``init_lora_weights=False``), as after training, so both factors have gradients.

    python benchmarks/llm_throughput.py            # CPU, ~1 minute
    python benchmarks/llm_throughput.py --quick    # CPU, a few minutes: 4 x 32 tokens, k=1024
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
    if size == "small":
        config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=2048,
                                         n_positions=128, bos_token_id=0, eos_token_id=0)
    else:  # GPT-2 small's shape, ~124M parameters
        config = transformers.GPT2Config(n_positions=1024)
    torch.manual_seed(0)  # the same weights every run: the agreement column depends on them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    if lora:
        import peft

        with warnings.catch_warnings():  # peft reads transformers' deprecated property
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated",
                                    FutureWarning)
            model = peft.get_peft_model(model, peft.LoraConfig(
                r=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0, fan_in_fan_out=True,
                init_lora_weights=False))
    return model.to(device).eval(), config


def timed(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls after a warm-up (the least disturbed by other load)."""
    fn()  # warm-up: torch.func tracing, plan discovery, projection blocks
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def agreement(loss, params, train, test, kind: str, k: int) -> tuple[float, float]:
    """Min and max over seeds 0-2 of the Pearson correlation with exact inner products."""
    exact_fn = tif.projected_grads(loss, tif.Projection(kind="identity"))
    exact = (exact_fn(params, test) @ exact_fn(params, train).T).flatten()
    values = []
    for seed in range(3):
        fn = tif.projected_grads(loss, tif.Projection(dim=k, kind=kind, seed=seed))
        approx = (fn(params, test) @ fn(params, train).T).flatten()
        values.append(float(torch.corrcoef(torch.stack([exact, approx]))[0, 1]))
    return min(values), max(values)


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
                        help="4 x 32 tokens, k=1024, best of 3; no fallback/loop rows")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.tokens, args.k, args.repeats = 4, 32, 1024, 3
    device = "cuda" if args.gpu else "cpu"
    size = "gpt2" if args.gpu else "small"
    rows = []
    for lora in (False, True):
        model, config = build(size, device, lora)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, config.vocab_size, (args.batch, args.tokens), generator=g)
        batch = {"input_ids": ids.to(device)}
        # Agreement on 8 training and 8 test sequences (64 pairs) whatever the timing batch.
        pairs = torch.randint(1, config.vocab_size, (16, args.tokens), generator=g).to(device)
        train, test = {"input_ids": pairs[:8]}, {"input_ids": pairs[8:]}
        params = dict(tif.Checkpoint.from_module(model).params)
        n_tokens = ids.numel()
        tag = "LoRA-only" if lora else "full model"
        p = sum(v.numel() for v in params.values())
        floor = timed(floor_fn(model, batch), args.repeats)
        rows.append((tag, f"fwd+bwd floor (batched), p={p:,}", floor, floor, n_tokens, ""))
        loss = tif.causal_lm_loss(model)
        for kind in ("kronecker", "sjlt"):
            fn = tif.projected_grads(loss, tif.Projection(dim=args.k, kind=kind))
            seconds = timed(lambda fn=fn, p=params, b=batch: fn(p, b), args.repeats)
            low, high = agreement(loss, params, train, test, kind, args.k)
            rows.append((tag, f"{kind} k={args.k}", seconds, floor, n_tokens,
                         f"{low:.3f}-{high:.3f}"))
        if lora or args.quick:
            continue
        sjlt = tif.Projection(dim=args.k, kind="sjlt")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback's "performance drop" warning
            fused = tif.projected_grads(hf_sdpa_loss(model), sjlt)
            seconds = timed(lambda f=fused, p=params, b=batch: f(p, b), 1)
        rows.append((tag, "sjlt, vmap over HF SDPA (fallback)", seconds, floor, n_tokens, ""))
        projector = tif.projection.make_projector(
            sjlt, tif.projection.canonical_layout(params), device=device
        )
        seconds = timed(loop_fn(loss, params, batch, projector), 1)
        rows.append((tag, "sjlt, loop of batch-of-one grads", seconds, floor, n_tokens, ""))
    print(f"device: {torch.cuda.get_device_name() if args.gpu else 'CPU'}, threads "
          f"{torch.get_num_threads()}, batch {args.batch} x {args.tokens} tokens")
    print(f"{'model':<11} {'method':<40} {'s/batch':>8} {'tokens/s':>9} {'x floor':>8} "
          f"{'Pearson vs exact':>17}")
    for tag, method, seconds, floor, n_tokens, pearson in rows:
        print(f"{tag:<11} {method:<40} {seconds:8.3f} {n_tokens / seconds:9.0f} "
              f"{seconds / floor:8.2f} {pearson:>17}")


if __name__ == "__main__":
    main()
