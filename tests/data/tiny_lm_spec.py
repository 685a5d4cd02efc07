"""A tiny causal-LM spec for the command-line tests: GPT-2 from a config, random tokens."""

import warnings

import torch
import transformers

import tracinfunc as tif


def make():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel._from_config(config).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (14, 8), generator=g)
    return tif.cli.Spec(
        loss=tif.causal_lm_loss(model),
        train={"input_ids": ids[:12]},
        test={"test": {"input_ids": ids[12:]}},
        checkpoints=[tif.Checkpoint.from_module(model, lr=0.1)],
        model=model,
    )
