"""Tiny stand-ins for the names the documented examples use (`model`, `loss`, `ckpts`, ...).

Each kind builds a fresh namespace (a new model, so a block that trains or switches modes never
changes the next block's) in the block's own working directory, with the files the examples
open (`epoch-5.pt`, `run/`, `grads.zarr`). Everything is generated; nothing is downloaded.
What one page's earlier blocks build (a token store, rerank's two stores, jax.md's `MLP`) is
added from tests/docs_pages.py.
"""

from __future__ import annotations

import collections
import importlib
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tracinfunc as tif
from tests import docs_pages

N_TRAIN, N_TEST, D_IN, N_CLASSES = 64, 6, 6, 3
PROJ = tif.Projection(dim=16, seed=0)


def _mlp(seed: int = 0) -> nn.Module:
    """An nn.Sequential whose children are named as the docs name stages."""
    torch.manual_seed(seed)
    return nn.Sequential(collections.OrderedDict(
        stem=nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh()),
        body=nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
        head=nn.Linear(8, N_CLASSES))).eval()


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D_IN, generator=g), torch.randint(0, N_CLASSES, (n,), generator=g)


def _adam_after_a_step(model: nn.Module, x, y) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def mlp(workdir: Path, page: str) -> dict[str, Any]:
    """A classifier on generated data: the names of README's ten lines and the concept pages."""
    model = _mlp()
    x_train, y_train = _data(N_TRAIN, 1)
    x_test, y_test = _data(N_TEST, 2)
    for epoch in (5, 10, 15):
        torch.save(_mlp(epoch).state_dict(), workdir / f"epoch-{epoch}.pt")
    torch.save(model.state_dict(), workdir / "e3.pt")
    loss = tif.loss_from_module(model, F.cross_entropy)
    checkpoints = [tif.Checkpoint.from_module(_mlp(e), lr=0.1, name=f"epoch-{e}")
                   for e in (5, 10, 15)]
    ckpts = checkpoints if page == "docs/curvature.md" else checkpoints[:2]
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=16)
    store = tif.build_store(loss, ckpts, loader, projection=PROJ)
    test = tif.build_store(loss, ckpts, (x_test, y_test), projection=PROJ)
    optimizer = _adam_after_a_step(model, x_train, y_train)
    names = tif.precondition.optimizer_param_names(optimizer, model)
    torch.save(optimizer.state_dict(), workdir / "opt-300.pt")
    (workdir / "out/checkpoint-300").mkdir(parents=True)
    torch.save(optimizer.state_dict(), workdir / "out/checkpoint-300/optimizer.pt")
    pre = tif.Preconditioner.from_optimizer(optimizer, model, kind="adam")
    if page == "docs/search.md":
        big = _data(2048, 3)
        tif.build_store(loss, ckpts, big, projection=PROJ, store=str(workdir / "grads.zarr"))
    params = dict(ckpts[0].params)
    namespace = dict(
        torch=torch, F=F, nn=nn, tif=tif, DataLoader=DataLoader, model=model, loss=loss,
        ckpts=ckpts, checkpoints=checkpoints, train_set=TensorDataset(x_train, y_train),
        train_loader=loader, loader=loader, train_data=(x_train, y_train),
        test_data=(x_test, y_test), validation_data=(x_test, y_test), x=x_train, y=y_train,
        x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test, n_train=N_TRAIN,
        proj=PROJ, params=params, batch=(x_train[:4], y_train[:4]), store=store, store32=store,
        test=test, tests=test, test_store=test, test_grads=test,
        test_rows=torch.stack([test.read_rows(c, 0, 1) for c in range(len(ckpts))]),
        w=params["head.weight"], b=params["head.bias"], optimizer=optimizer, names=names,
        pre_1=pre, pre_2=pre, pre_3=pre,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=10),
        loss_fn=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]),
        flipped=torch.tensor([1, 5, 9]), ev=importlib.import_module("tracinfunc.evaluate"),
        stages=tif.model_stages(model, F.cross_entropy),
        curvature=(tif.fit_curvature(loss, ckpts, (x_train, y_train), projection=PROJ)
                   if page == "docs/curvature.md" else None),
        train_fn=lambda indices: torch.randn(N_TEST, generator=torch.Generator().manual_seed(
            int(indices.sum()))),
        train_from_scratch=_train_from_scratch, correct_class_margin=_margin,
    )
    if page == "docs/attribution.md":  # its report block opens on the quickstart's digits
        namespace.update(docs_pages.digits())
    if page == "docs/rerank.md":
        namespace.update(docs_pages.rerank_stores(workdir))
    return namespace


def _train_from_scratch(x, y, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Linear(D_IN, N_CLASSES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(5):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def _margin(model: nn.Module, x, y) -> torch.Tensor:
    with torch.no_grad():
        logits = model(x)
    right = logits.gather(1, y[:, None])[:, 0]
    other = logits.scatter(1, y[:, None], float("-inf")).max(1).values
    return right - other


class Chars:
    """A character tokenizer, called as a HF tokenizer is: id 0 pads, 1 ends a text."""

    pad_token_id, eos_token_id = 0, 1

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [2 + (ord(c) % 90) for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + int(i) - 2) for i in ids if int(i) > 1)


def _gpt2(seed: int = 0) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=96,
                                     n_positions=64, bos_token_id=1, eos_token_id=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    model.loss_type = "ForCausalLM"
    return model.eval()


def bert(workdir: Path, page: str, *, layers: int = 12) -> dict[str, Any]:
    """An HF BertForSequenceClassification with 12 (tiny) layers: README's selection example."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=96, hidden_size=8, num_hidden_layers=layers,
                                     num_attention_heads=2, intermediate_size=16,
                                     max_position_embeddings=32, num_labels=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.BertForSequenceClassification._from_config(
            config, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(2, 96, (8, 10), generator=g),
             "attention_mask": torch.ones(8, 10, dtype=torch.long),
             "labels": torch.randint(0, 3, (8,), generator=g)}
    loss = tif.sequence_classification_loss(model)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.1, name="last")]
    return dict(torch=torch, tif=tif, model=model, bert=model, loss=loss, ckpts=ckpts,
                loader=[batch], proj=PROJ, params=dict(ckpts[0].params), batch=batch)


def language_model(workdir: Path, page: str) -> dict[str, Any]:
    """A GPT-2 from a config, a char tokenizer, prompt/completion pairs, a recorded run."""
    import peft
    import transformers

    model, tokenizer = _gpt2(), Chars()
    words = ["alpha", "beta", "gamma", "delta", "eps"]
    pairs = [{"prompt": f"q{i} {words[i % 5]}?", "completion": f" {words[(i * 3) % 5]}"}
             for i in range(16)]
    collate = tif.completion_collator(tokenizer)
    batch = collate(pairs[:4])
    loss = tif.causal_lm_loss(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    ckpts = [tif.Checkpoint.from_module(model, lr=1e-3, name="step-1")]
    if page == "README.md":  # `tif.trainer_callback("run/")`'s recording, by the plain recorder
        recorder = tif.training.CheckpointRecorder(workdir / "run", model, optimizer)
        model(**batch).loss.backward()
        optimizer.step()
        recorder.step()
    base = _gpt2(1)
    if page == "docs/language-models.md":  # a saved adapter, as the Trainer saves one
        adapter = peft.get_peft_model(_gpt2(2), peft.LoraConfig(  # as the page's config
            r=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True))
        adapter.save_pretrained(workdir / "run/checkpoint-500")
    peft_model = peft.get_peft_model(_gpt2(3), peft.LoraConfig(
        r=2, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True))
    args = transformers.TrainingArguments(
        output_dir=str(workdir / "trainer"), max_steps=3, per_device_train_batch_size=8,
        learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True,
        logging_strategy="no", disable_tqdm=True, remove_unused_columns=False, seed=0)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    namespace = dict(
        torch=torch, tif=tif, peft=peft, transformers=transformers, DataLoader=DataLoader,
        Trainer=transformers.Trainer, model=model, base=base, bert=_tiny_bert(),
        tokenizer=tokenizer,
        pairs=pairs, batch=batch, example={k: v[0] for k, v in batch.items()}, ids=ids,
        mask=mask, prompt_length=4, loss=loss, params=dict(ckpts[0].params), ckpts=ckpts,
        optimizer=optimizer, train_batches=[collate(pairs[:8]), collate(pairs[8:])],
        val_batch=collate(pairs[:3]), val_tasks=["a", "a", "b"],
        train_texts=[p["prompt"] + p["completion"] for p in pairs],
        val_prompts=["q0 alpha?", "q1 beta?", "q2 gamma?"], val_answers=[" a", " b", " c"],
        peft_model=peft_model, args=args, checkpoints=ckpts,
    )
    if page in ("README.md", "docs/attribution.md"):  # a token store to explain
        namespace.update(docs_pages.token_store(loss, ckpts, tokenizer))
    return namespace


def _tiny_bert() -> nn.Module:
    return bert(Path("."), "", layers=1)["model"]


def flax(workdir: Path, page: str) -> dict[str, Any]:
    """A Flax MLP, its variables at two epochs, a JAX loss, and the torch side of the mapping."""
    import flax.linen as fnn
    import jax
    import jax.numpy as jnp
    import optax

    import tracinfunc.jax as tj

    class MLP(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            hidden = fnn.Dense(8)(x)  # Dense_0, as the torch twin's first layer
            return fnn.Dense(N_CLASSES)(jnp.tanh(hidden))

    net = MLP()
    x_train, y_train = (jnp.asarray(t.numpy()) for t in _data(N_TRAIN, 1))
    x_test, y_test = (jnp.asarray(t.numpy()) for t in _data(N_TEST, 2))
    snapshots = [(e, net.init(jax.random.PRNGKey(e), x_train[:1])) for e in (5, 10)]
    variables = snapshots[0][1]

    def loss(v, example):
        x, y = example
        return optax.softmax_cross_entropy_with_integer_labels(net.apply(v, x[None]), y[None])[0]

    mapping = tj.ParamMapping.flax(variables)
    ckpts = [tj.Checkpoint(v, lr=0.1, name=f"epoch-{e}") for e, v in snapshots]
    store = tj.build_store(loss, ckpts, (x_train, y_train), projection=PROJ, mapping=mapping)
    test = tj.build_store(loss, ckpts, (x_test, y_test), projection=PROJ, mapping=mapping)
    # README's block builds its store with Projection(dim=512): a torch-side test store to match
    torch_test = tj.build_store(loss, ckpts, (x_test, y_test), mapping=mapping,
                                projection=tif.Projection(dim=512))
    rows = jnp.asarray(torch.stack([test.read_rows(c, 0, N_TEST) for c in range(2)]).numpy())
    torch_loss = tif.loss_from_module(_TorchMLP(), F.cross_entropy)
    namespace = dict(torch_loss=torch_loss, jax=jax, jnp=jnp, tif=tif, tj=tj, torch=torch,
                variables=variables, logits=lambda v, x: net.apply(v, x),
                snapshots=snapshots, loss=loss, jax_loss=loss, x=x_train, y=y_train,
                x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test, mapping=mapping,
                ckpts=ckpts, jax_ckpts=ckpts, store=store, jax_store=store, test=test,
                torch_test_store=torch_test, test_rows=rows,
                train_data=(torch.as_tensor(np.asarray(x_train)),
                            torch.as_tensor(np.asarray(y_train)).long()),
                test_data=(x_test, y_test))
    if page == "docs/jax.md":
        namespace.update(docs_pages.jax_page(x_train, y_train))
    return namespace


class _TorchMLP(nn.Module):
    """The Flax MLP's torch twin, under the names ParamMapping.flax gives (Dense_0.weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.Dense_0, self.Dense_1 = nn.Linear(D_IN, 8), nn.Linear(8, N_CLASSES)

    def forward(self, x):
        return self.Dense_1(torch.tanh(self.Dense_0(x)))


KINDS = {"mlp": mlp, "bert": bert, "lm": language_model, "flax": flax}
