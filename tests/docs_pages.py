"""What one page's prose builds before its examples, as tiny stand-ins (tests/docs_namespaces.py).

A page's blocks each run in a fresh copy of the page's namespace, so a name one block defines
(docs/attribution.md's token store, docs/jax.md's `MLP`) is provided here for the others, built
the way the page says it was built. Everything is generated; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif

# README's and docs/attribution.md's `top_k(store, test, k=100)`: the store holds more documents
N_DOCS = 128
WORDS = ("alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta")


def _token_batch(tokenizer: Any, texts: list[str]) -> dict[str, torch.Tensor]:
    """Right-padded `{"input_ids", "attention_mask"}` [n, T] of a tokenizer's ids."""
    ids = [tokenizer(text)["input_ids"] for text in texts]
    width, lengths = max(map(len, ids)), torch.tensor([len(row) for row in ids])
    padded = [row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids]
    return {"input_ids": torch.tensor(padded),
            "attention_mask": (torch.arange(width) < lengths[:, None]).long()}


def token_store(loss, ckpts, tokenizer) -> dict[str, Any]:
    """docs/attribution.md's first block, done: a token store of `N_DOCS` documents, one
    query's test row, its top 100 candidates and their per-token scores."""
    train = _token_batch(tokenizer, [
        f"{WORDS[i % 8]} {WORDS[(i * 3) % 8]} {WORDS[(i * 5 + 1) % 8]} {i}"
        for i in range(N_DOCS)])
    queries = _token_batch(tokenizer, ["alpha beta gamma 7", "eps zeta eta 3"])
    store = tif.build_store(loss, ckpts, train, projection=tif.Projection(dim=256,
                                                                         kind="kronecker"))
    test = tif.build_store(loss, ckpts, {key: value[:1] for key, value in queries.items()},
                           projection=store.projection)
    _, rows = tif.top_k(store, test, k=100)
    docs = {key: value[rows[0]] for key, value in train.items()}
    scores = tif.token_scores(store, test, loss, ckpts, docs, rows=rows[0])
    return dict(train=train, queries=queries, store=store, test=test, rows=rows, docs=docs,
                scores=scores, checkpoints=ckpts)


def digits() -> dict[str, Any]:
    """The quickstart's digits in small: flat 8x8 images, a linear classifier, its stores."""
    g = torch.Generator().manual_seed(4)
    x_train, y_train = torch.rand(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
    x_test, y_test = torch.rand(4, 64, generator=g), torch.randint(0, 10, (4,), generator=g)
    torch.manual_seed(4)
    model = nn.Linear(64, 10).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.1, name="epoch-1")]
    store = tif.build_store(loss, ckpts, (x_train, y_train), projection=tif.Projection(dim=32))
    test = tif.build_store(loss, ckpts, (x_test, y_test), projection=store.projection)
    return dict(model=model, loss=loss, ckpts=ckpts, store=store, test=test, x_train=x_train,
                y_train=y_train, x_test=x_test, y_test=y_test)


def rerank_stores(workdir: Path) -> dict[str, Any]:
    """docs/rerank.md's stores: one training set (128 rows, over the page's 100 candidates)
    written twice, kronecker k=256 (`grads-k256.zarr`) and exact (`grads-exact.zarr`), with
    test and control gradients for each and a curvature fitted for the exact one."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(128 + 6 + 8, 16, generator=g), torch.randint(0, 3, (142,), generator=g)
    train, test, control = (x[:128], y[:128]), (x[128:134], y[128:134]), (x[134:], y[134:])
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 3)).eval()  # p = 643
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.1, name="epoch-1")]
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=g))
    ckpts.append(tif.Checkpoint.from_module(model, lr=0.05, name="epoch-2"))
    cheap = tif.build_store(loss, ckpts, train, projection=tif.Projection(dim=256,
                            kind="kronecker"), store=str(workdir / "grads-k256.zarr"))
    strong = tif.build_store(loss, ckpts, train, projection=tif.Projection(kind="identity"),
                             store=str(workdir / "grads-exact.zarr"))
    return dict(
        model=model, loss=loss, ckpts=ckpts, store=strong, cheap=cheap, strong=strong,
        cheap_test_grads=tif.build_store(loss, ckpts, test, projection=cheap.projection),
        test_grads=tif.build_store(loss, ckpts, test, projection=strong.projection),
        control_grads=tif.build_store(loss, ckpts, control, projection=strong.projection),
        curvature=tif.fit_curvature(loss, ckpts, train, kind="projected",
                                    projection=strong.projection))


def jax_page(x_train, y_train) -> dict[str, Any]:
    """docs/jax.md's models: the NNX `MLP` (BatchNorm included) and the user's training loop
    of its first block, and the linen model with `batch_stats` of its state section."""
    import flax.linen as linen
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs) -> None:
            self.linear1 = nnx.Linear(x_train.shape[1], 8, rngs=rngs)
            self.norm = nnx.BatchNorm(8, rngs=rngs)
            self.linear2 = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.linear2(jnp.tanh(self.norm(self.linear1(x))))

    def train_one_epoch(model, tx) -> None:
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        model.train()  # BatchNorm updates its running averages

        def batch_loss(m, x, y):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

        for start in range(0, len(x_train), 32):
            batch = x_train[start:start + 32], y_train[start:start + 32]
            optimizer.update(model, nnx.grad(batch_loss)(model, *batch))

    class LinenMLP(linen.Module):
        @linen.compact
        def __call__(self, x, train: bool = True):
            hidden = linen.BatchNorm(use_running_average=not train)(linen.Dense(8)(x))
            return linen.Dense(3)(jnp.tanh(hidden))

    return dict(MLP=MLP, train_one_epoch=train_one_epoch, model=LinenMLP(),
                key=jax.random.PRNGKey(0), optax=optax)
