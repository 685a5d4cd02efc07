"""Retrieve, then rerank: a cheap store (or its index) finds ``M`` candidates per test
example, a stronger scorer orders them, in one call that records which did what.

``tif.rerank(tif.Retriever(cheap_store, cheap_test_grads), store, test_grads, 10,
n_candidates=100, curvature=curvature)`` is ``top_k(store, test_grads, 10, curvature=...,
candidates=top_k(cheap_store, cheap_test_grads, 100))`` with its provenance kept: a
:class:`Reranked` holds the values and indices (it unpacks as ``values, indices``), the
candidates, ``M`` and a line each on how they were retrieved and reranked.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from tracinfunc._validate import check_int, current_caller, entry_point
from tracinfunc.curvature.value import Curvature
from tracinfunc.errors import IncompatibleGradientsError, InvalidTypeError
from tracinfunc.interop import Array
from tracinfunc.progress import ProgressArg
from tracinfunc.query.contrast import Contrast
from tracinfunc.query.top_k import top_k
from tracinfunc.search.index import SearchIndex
from tracinfunc.search.rerank import indexed_top_k
from tracinfunc.store.protocols import GradientStore

__all__ = ["Reranked", "Retriever", "rerank"]


@dataclass(frozen=True, repr=False)
class Retriever:
    """The cheap side: where candidates come from.

    Attributes:
        store: A store of the same training rows, in the same order, as the ranking store
            (e.g. a small kronecker projection of the same data).
        test_grads: The test examples' gradients for ``store`` (or a :class:`Contrast`).
        index: A :class:`SearchIndex` of ``store``: retrieve with
            :func:`~tracinfunc.indexed_top_k` instead of an exact scan.
        nprobe: Clusters searched with ``index`` (default: the index's calibrated value).
        normalize: Retrieve by cosine scores.
        curvature: A curvature for ``store`` to retrieve with (rarely worth it: the
            reranker is the strong side).
    """

    store: GradientStore
    test_grads: object
    index: SearchIndex | None = None
    nprobe: int | None = None
    normalize: bool = False
    curvature: Curvature | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.store, GradientStore):
            raise InvalidTypeError(f"{current_caller('Retriever')}: store must be a "
                                   f"GradientStore, got {type(self.store).__name__}.")
        if self.index is not None and not isinstance(self.index, SearchIndex):
            raise InvalidTypeError(f"{current_caller('Retriever')}: index must be a "
                                   f"SearchIndex or None, got {type(self.index).__name__}.")

    def describe(self) -> str:
        how = (f"indexed_top_k ({self.index.kind}, nlist={self.index.nlist}"
               f"{'' if self.nprobe is None else f', nprobe={self.nprobe}'})"
               if self.index is not None else "top_k")
        return f"{how} on {describe_scorer(self.store, self.curvature, self.normalize)}"

    def __repr__(self) -> str:
        return f"Retriever({self.describe()})"


@dataclass(frozen=True, repr=False)
class Reranked:
    """The result of :func:`rerank`; unpacks as ``values, indices``.

    Attributes:
        values: ``[n_test, k]`` scores of the ranking scorer, best first.
        indices: ``[n_test, k]`` int64 rows of the store.
        candidates: ``[n_test, M]`` int64 rows retrieved (sorted by row), on the CPU.
        n_candidates: ``M``, candidates per test example.
        retrieved_by: How the candidates were found (function, projection, k, checkpoints).
        reranked_by: How they were ordered (projection, curvature kind and digest).
        contrast: The ranking query's contrast in words, or ``None``.
    """

    values: Array
    indices: Array
    candidates: Tensor
    n_candidates: int
    retrieved_by: str
    reranked_by: str
    contrast: str | None = None

    def __iter__(self) -> Iterator[Array]:
        return iter((self.values, self.indices))

    def __repr__(self) -> str:
        shape = list(self.values.shape)
        contrast = "" if self.contrast is None else f", contrast={self.contrast!r}"
        return (f"Reranked(values/indices {shape}, n_candidates={self.n_candidates}, "
                f"retrieved_by={self.retrieved_by!r}, reranked_by={self.reranked_by!r}"
                f"{contrast})")


def describe_scorer(store: GradientStore, curvature: Curvature | None, normalize: bool) -> str:
    """One line: ``"store (kronecker k=256, 2 checkpoints), curvature ekfac 1a2b3c4d"``."""
    meta = store.meta
    projection = meta.projection
    checkpoints = f"{meta.n_ckpt} checkpoint{'s' if meta.n_ckpt != 1 else ''}"
    words = f"store ({projection.kind} k={meta.k}, {checkpoints})"
    if curvature is not None:
        words += f", curvature {curvature.kind} {curvature.digest[:8]}"
    return words + (", cosine" if normalize else "")


@entry_point("rerank")
def rerank(
    retriever: Retriever,
    store: GradientStore,
    test_grads: GradientStore | Array | Contrast,
    k: int = 10,
    *,
    n_candidates: int,
    largest: bool = True,
    normalize: bool = False,
    curvature: Curvature | None = None,
    device: torch.device | str | None = None,
    progress: ProgressArg = None,
    output: str | None = None,
    like: object = None,
) -> Reranked:
    """Retrieve ``n_candidates`` rows per test example with ``retriever``, rank them exactly
    with ``store`` (and ``curvature``), keep the best ``k``.

    Args:
        retriever: The cheap side (:class:`Retriever`): a store of the same training rows,
            its test gradients, optionally its index.
        store: The ranking store (e.g. an identity-projection store, or the store a
            ``curvature`` was fitted for). Only the candidates' rows are read.
        test_grads: Test gradients for ``store``, as :func:`tracinfunc.score` takes them
            (a :class:`~tracinfunc.Contrast` included).
        k: Results per test example, ``1 <= k <= n_candidates``.
        n_candidates: ``M``, rows retrieved per test example, ``k <= M <= n_train``.
        largest: Proponents (``True``) or opponents, for both retrieval and ranking.
        normalize: Cosine scores in the ranking (the retriever has its own).
        curvature: A curvature for ``store``: curvature-aware ranking.
        device: As in :func:`tracinfunc.score`, for both sides.
        progress: As in :func:`tracinfunc.score`, for the retrieval's scan.
        output: As in :func:`tracinfunc.score`: the framework of ``values``/``indices``.
        like: As in :func:`tracinfunc.score`.

    Returns:
        A :class:`Reranked`: ``values``/``indices`` ``[n_test, k]`` exactly as
        ``top_k(store, test_grads, k, candidates=...)`` gives them, the candidates, ``M``, and
        how each side scored.

    Raises:
        InvalidTypeError: ``retriever`` is not a :class:`Retriever`.
        IncompatibleGradientsError: the two stores hold different numbers of rows or
            different dataset fingerprints.
        InvalidArgumentError: ``k`` or ``n_candidates`` out of range; as ``top_k`` for the rest.
    """
    n_train = _check_pair(retriever, store)
    k = check_int(k, "k", maximum=n_train, maximum_label="n_train")
    n_candidates = check_int(n_candidates, "n_candidates", minimum=k, maximum=n_train,
              maximum_label="n_train", fix="more candidates raise recall")
    if retriever.index is not None:
        found = indexed_top_k(retriever.store, retriever.test_grads, n_candidates,
                              index=retriever.index, nprobe=retriever.nprobe,
                              largest=largest, normalize=retriever.normalize,
                              curvature=retriever.curvature, device=device, progress=progress)
    else:
        found = top_k(retriever.store, retriever.test_grads, n_candidates, largest=largest,
                      normalize=retriever.normalize, curvature=retriever.curvature,
                      device=device, progress=progress)
    candidates = found[1].sort(dim=1).values.cpu()
    values, indices = top_k(store, test_grads, k, largest=largest, normalize=normalize,
                            curvature=curvature, device=device, candidates=candidates,
                            output=output, like=like)
    contrast = test_grads.describe() if isinstance(test_grads, Contrast) else None
    return Reranked(values, indices, candidates, n_candidates, retriever.describe(),
                    describe_scorer(store, curvature, normalize), contrast)


def _check_pair(retriever: object, store: GradientStore) -> int:
    if not isinstance(retriever, Retriever):
        raise InvalidTypeError(
            f"{current_caller()}: retriever must be a tif.Retriever(cheap_store, "
            f"cheap_test_grads), got {type(retriever).__name__}.")
    cheap, strong = retriever.store.meta, store.meta
    if cheap.n_train != strong.n_train:
        raise IncompatibleGradientsError(
            f"{current_caller()}: the retriever's store holds {cheap.n_train} rows but the "
            f"ranking store {strong.n_train}; both must hold the same training rows in the "
            "same order (build them from the same data).")
    if None not in (cheap.dataset_fingerprint, strong.dataset_fingerprint) and \
            cheap.dataset_fingerprint != strong.dataset_fingerprint:
        raise IncompatibleGradientsError(
            f"{current_caller()}: the retriever's store was built from dataset "
            f"{cheap.dataset_fingerprint!r} but the ranking store from "
            f"{strong.dataset_fingerprint!r}; build both from the same training data.")
    return strong.n_train
