"""Tiny language models built from configs (never downloaded) and brute-force references."""

from __future__ import annotations

import warnings

import numpy as np
import torch
import transformers
from torch.func import functional_call

from tests import numpy_projection as ref
from tracinfunc.projection import kronecker_factors

VOCAB = 97


def tiny_gpt2(seed: int = 0, *, dtype=torch.float64, attn: str = "sdpa"):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation=attn)
    return model.to(dtype).eval()


def tiny_bert(seed: int = 0, *, dtype=torch.float64, attn: str = "sdpa"):
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=32, num_labels=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.BertForSequenceClassification._from_config(
            config, attn_implementation=attn)
    return model.to(dtype).eval()


def token_batch(n: int = 4, length: int = 10, seed: int = 0):
    """``{"input_ids", "attention_mask"}`` with right padding of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, length), generator=g)
    lengths = torch.tensor([length - (i % 3) * 2 for i in range(n)])
    mask = (torch.arange(length) < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask}


def params_of(model):
    return {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}


def next_token_reference(outputs, row):
    """Mean of -log p(label[t+1] | <= t) over scored targets, by a Python loop over tokens."""
    logits, ids = outputs.logits[0], row["input_ids"][0]
    labels = row.get("labels", row["input_ids"])[0]
    mask = row.get("attention_mask", torch.ones_like(row["input_ids"]))[0]
    terms = [-torch.log_softmax(logits[t], -1)[labels[t + 1]] for t in range(len(ids) - 1)
             if labels[t + 1] != -100 and mask[t + 1] != 0]
    return torch.stack(terms).sum() / max(len(terms), 1)


def class_reference(outputs, row):
    return -torch.log_softmax(outputs.logits[0], -1)[row["labels"][0]]


def own_loss(outputs, row):
    return outputs.loss


def hf_loop_grads(model, params, batch, reference=next_token_reference, *, labels_in=False):
    """``{name: [n, *shape]}``: autograd per example on a batch of one with the 2-D mask."""
    names = sorted(params)
    n = batch["input_ids"].shape[0]
    out = {name: [] for name in names}
    for i in range(n):
        leaves = {k: params[k].detach().clone().requires_grad_(True) for k in names}
        row = {k: v[i:i + 1] for k, v in batch.items()}
        kwargs = row if labels_in else {k: v for k, v in row.items() if k != "labels"}
        value = reference(functional_call(model, leaves, (), kwargs), row)
        for name, g in zip(names, torch.autograd.grad(value, [leaves[k] for k in names]),
                           strict=True):
            out[name].append(g)
    return {name: torch.stack(out[name]) for name in names}


def explicit_kronecker(grads, spec):
    """``[n, k]``: materialised gradients times ``P_out (x) P_in`` (vectors: NumPy blocks)."""
    n = next(iter(grads.values())).shape[0]
    out = torch.zeros(n, spec.dim, dtype=torch.float64)
    for name, g in grads.items():
        shape = g.shape[1:]
        if len(shape) >= 2:
            p_out, p_in = kronecker_factors(spec, name, shape, dtype=torch.float64)
            matrix = torch.kron(p_out, p_in)  # [d_out * d_in, k_out * k_in]
        else:
            matrix = torch.from_numpy(ref.rademacher_block(
                spec.seed, spec.dim, name, shape, 0, int(np.prod(shape)), kind="kronecker"))
        out += g.reshape(n, -1).double() @ matrix.double()
    return out / np.sqrt(spec.dim)
