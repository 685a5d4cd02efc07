"""tif.rerank (issue 35): retrieve with a cheap store (or its index), rank the candidates with
a strong scorer; exact against top_k with candidates=, provenance recorded, bad pairs refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.curvature import classification_sampler
from tracinfunc.errors import IncompatibleGradientsError, InvalidArgumentError, InvalidTypeError


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(128, 6, dtype=torch.float64, generator=g), torch.randint(0, 3, (128,))
    ckpts = [tif.Checkpoint.from_module(model, lr=0.1, name="a")]
    train, test = (x[:120], y[:120]), (x[120:], y[120:])
    cheap_p, strong_p = tif.Projection(dim=8, seed=0), tif.Projection(kind="identity")
    common = dict(dtype=torch.float64, progress=False)
    cheap = tif.build_store(loss, ckpts, train, projection=cheap_p, **common)
    cheap_test = tif.build_store(loss, ckpts, test, projection=cheap_p, **common)
    strong = tif.build_store(loss, ckpts, train, projection=strong_p, **common)
    strong_test = tif.build_store(loss, ckpts, test, projection=strong_p, **common)
    curvature = tif.fit_curvature(loss, ckpts, train, kind="projected", projection=strong_p,
                                  sampler=classification_sampler(exact=True))
    return cheap, cheap_test, strong, strong_test, curvature


def test_rerank_is_top_k_over_the_retrieved_candidates(setup):
    cheap, cheap_test, strong, strong_test, curvature = setup
    result = tif.rerank(tif.Retriever(cheap, cheap_test), strong, strong_test, 5,
                        n_candidates=30, curvature=curvature)
    retrieved = tif.top_k(cheap, cheap_test, 30)[1]
    assert torch.equal(result.candidates, retrieved.sort(1).values)
    expected = tif.top_k(strong, strong_test, 5, curvature=curvature, candidates=retrieved)
    values, indices = result  # unpacks as top_k's pair
    assert torch.equal(indices, expected[1])
    torch.testing.assert_close(values, expected[0], rtol=0, atol=0)
    full = tif.score(strong, strong_test, curvature=curvature)
    torch.testing.assert_close(values, full.gather(1, indices), rtol=1e-10, atol=1e-12)
    # every row a candidate: the full curvature top_k
    every = tif.rerank(tif.Retriever(cheap, cheap_test), strong, strong_test, 5,
                       n_candidates=120, curvature=curvature)
    assert torch.equal(every.indices, tif.top_k(strong, strong_test, 5, curvature=curvature)[1])


def test_the_result_records_who_retrieved_ranked_and_m(setup):
    cheap, cheap_test, strong, strong_test, curvature = setup
    query = tif.Contrast(strong_test, strong_test, weight=0.5, name="self")
    result = tif.rerank(tif.Retriever(cheap, cheap_test), strong, query, 3, n_candidates=12,
                        curvature=curvature, output="numpy")
    assert result.n_candidates == 12 and result.candidates.shape == (8, 12)
    assert result.retrieved_by == "top_k on store (rademacher k=8, 1 checkpoint)"
    assert result.reranked_by.startswith("store (identity k=83, 1 checkpoint), curvature "
                                         "projected ")
    assert result.contrast == "minus 0.5 x mean of control 'self' (8 rows)"
    text = repr(result)
    assert "n_candidates=12" in text and "retrieved_by=" in text and "contrast=" in text
    assert type(result.values).__module__ == "numpy"
    with pytest.raises(AttributeError):
        result.n_candidates = 3  # frozen


def test_an_index_retrieves(setup):
    pytest.importorskip("faiss")
    cheap, cheap_test, strong, strong_test, _ = setup
    index = tif.build_index(cheap, nlist=1, progress=False)
    result = tif.rerank(tif.Retriever(cheap, cheap_test, index=index), strong, strong_test, 4,
                        n_candidates=20)
    assert result.retrieved_by.startswith("indexed_top_k (ivf_flat, nlist=1) on store")
    exact = tif.rerank(tif.Retriever(cheap, cheap_test), strong, strong_test, 4,
                       n_candidates=20)
    assert torch.equal(result.indices, exact.indices)  # nlist=1 searches everything
    query = tif.Contrast(cheap_test, cheap_test, weight=0.5, paired=True)  # half the test
    indexed = tif.indexed_top_k(cheap, query, 4, index=index)
    assert torch.equal(indexed[1], tif.top_k(cheap, cheap_test, 4)[1])
    torch.testing.assert_close(indexed[0], 0.5 * tif.top_k(cheap, cheap_test, 4)[0])


def test_bad_pairs_and_sizes_are_refused(setup):
    cheap, cheap_test, strong, strong_test, _ = setup
    retriever = tif.Retriever(cheap, cheap_test)
    with pytest.raises(InvalidTypeError, match="^rerank: retriever must be a tif.Retriever"):
        tif.rerank((cheap, cheap_test), strong, strong_test, n_candidates=20)
    fewer = tif.store.MemoryStore(
        cheap.meta.replace(n_train=100),
        torch.stack([cheap.read_rows(0, 0, 100)]), torch.stack([cheap.read_norms(0, 0, 100)]))
    with pytest.raises(IncompatibleGradientsError, match="holds 100 rows but the ranking"):
        tif.rerank(tif.Retriever(fewer, cheap_test), strong, strong_test, n_candidates=20)
    other = tif.store.MemoryStore(
        cheap.meta.replace(dataset_fingerprint="a"), torch.stack([cheap.read_rows(0, 0, 120)]),
        torch.stack([cheap.read_norms(0, 0, 120)]))
    labelled = tif.store.MemoryStore(
        strong.meta.replace(dataset_fingerprint="b"), torch.stack([strong.read_rows(0, 0, 120)]),
        torch.stack([strong.read_norms(0, 0, 120)]))
    with pytest.raises(IncompatibleGradientsError, match="from dataset 'a' but the ranking"):
        tif.rerank(tif.Retriever(other, cheap_test), labelled, strong_test, n_candidates=20)
    with pytest.raises(InvalidArgumentError, match=r"n_candidates must be an int in \[5, "):
        tif.rerank(retriever, strong, strong_test, 5, n_candidates=4)
    with pytest.raises(InvalidArgumentError, match=r"n_candidates must be an int in \[10, "):
        tif.rerank(retriever, strong, strong_test, n_candidates=121)
    with pytest.raises(InvalidTypeError, match="Retriever: store must be a GradientStore"):
        tif.Retriever("grads.zarr", cheap_test)
