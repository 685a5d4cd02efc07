"""Default search settings chosen from the data: ``nprobe`` (and re-rank candidates) that reach
a target recall@10 on a sample of the store's own rows used as queries.

A fixed ``nprobe = nlist // 16`` works on well-separated clusters (recall@10 1.000 on the
synthetic mixture benchmark) but not on real gradient stores, whose rows are anisotropic and
overlap: it gave 0.68 on a LoRA language model's store (issue 22). So ``build_index`` measures:

1. a seeded sample of ``queries`` rows is drawn from the store and weighted as queries are;
2. their exact top-``at`` rows (``at = 10``, fewer for tiny stores) are found by a scan of the
   whole store, **the query row itself left out** (a test example is not in the store, and a
   row always finds itself);
3. for growing ``nprobe`` (1, 2, 3, 4, 6, 8, 12, ... up to ``nlist``) FAISS is searched for
   the number of candidates ``indexed_top_k`` fetches by default, and recall@``at`` is the
   fraction of the exact top rows among them. The exact re-rank keeps every exact top row
   that is a candidate (fewer than ``at`` candidates can score above it), so this is the
   recall ``indexed_top_k`` returns, without re-ranking anything.

The smallest ``nprobe`` that reaches the target is kept. Where even ``nprobe = nlist`` does not
(product-quantised codes rank candidates coarsely), the candidates are doubled (``rerank``,
candidates per result) and the search repeated, up to 8 times the default: scanning more
codes is cheaper than reading more rows from the store to re-rank.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tracinfunc.errors import InvalidArgumentError
from tracinfunc.search.rows import index_rows
from tracinfunc.store.protocols import GradientStore

__all__ = ["DEFAULT_TARGET", "Calibration", "calibrate", "default_candidates", "default_rerank",
           "probe_steps"]

DEFAULT_TARGET = 0.95
RECALL_AT = 10
_QUERIES = 256
_MAX_RERANK_DOUBLINGS = 3  # up to 8x the default candidates
_SCAN_BYTES = 32 * 2**20  # float32 store rows held at once by the exact scan


def default_rerank(kind: str) -> int:
    """Candidates fetched per requested result: 2 for ``"ivf_flat"`` (its float32 scores rank
    candidates almost exactly), 10 for ``"ivf_pq"`` (codes rank coarsely)."""
    return 10 if kind == "ivf_pq" else 2


def default_candidates(kind: str, rerank: int, k: int, n_train: int) -> int:
    """Rows re-ranked per test example for ``k`` results: ``rerank * k``, at least 16 (100
    for ``"ivf_pq"``), at most ``n_train``."""
    floor = 100 if kind == "ivf_pq" else 16
    return min(n_train, max(rerank * k, floor))


def probe_steps(nlist: int) -> list[int]:
    """``nprobe`` values tried, ascending: 1, 2, 3, 4, 6, 8, 12, 16, ... and ``nlist``."""
    steps, power = set(), 1
    while power <= nlist:
        steps.update(value for value in (power, power + power // 2) if value <= nlist)
        power *= 2
    return sorted(steps | {nlist})


@dataclass(frozen=True)
class Calibration:
    """Default query settings measured when the index was built.

    Attributes:
        nprobe: Clusters searched per test example by default.
        rerank: Candidates fetched per requested result (``candidates = rerank * k``, see
            :func:`default_candidates`).
        recall: recall@``at`` measured with these settings on the sample of store rows.
        target: The recall asked for (``build_index(target_recall=)``).
        at: The ``k`` of the recall (10, fewer for stores under 11 rows).
        queries: Store rows used as queries.
    """

    nprobe: int
    rerank: int
    recall: float
    target: float
    at: int
    queries: int

    def to_dict(self) -> dict[str, Any]:
        return {"nprobe": self.nprobe, "rerank": self.rerank, "recall": self.recall,
                "target": self.target, "at": self.at, "queries": self.queries}

    @classmethod
    def from_dict(cls, data: Any, nlist: int) -> Calibration | None:
        """Inverse of :meth:`to_dict`, strict (the dict comes from a file): ``None`` when a
        field is missing or out of range (the caller says where)."""
        if not isinstance(data, dict) or set(data) != {"nprobe", "rerank", "recall", "target",
                                                        "at", "queries"}:
            return None
        ints = {name: data[name] for name in ("nprobe", "rerank", "at", "queries")}
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in ints.values()) \
                or ints["nprobe"] > nlist:
            return None
        reals = (data["recall"], data["target"])
        if any(isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1
               for v in reals):
            return None
        return cls(ints["nprobe"], ints["rerank"], float(data["recall"]), float(data["target"]),
                   ints["at"], ints["queries"])


def check_target(target: object) -> float:
    """``target`` as a float in (0, 1].

    Raises:
        InvalidArgumentError: not a number in (0, 1].
    """
    if isinstance(target, bool) or not isinstance(target, int | float) or not 0 < target <= 1:
        raise InvalidArgumentError(
            f"build_index: target_recall must be a number in (0, 1] (recall@10 the default "
            f"query settings should reach, e.g. 0.95) or None for fixed defaults, got "
            f"{target!r}."
        )
    return float(target)


def calibrate(faiss_index: Any, store: GradientStore, *, kind: str, nlist: int, normalize: bool,
              target: float, seed: int, queries: int = _QUERIES) -> Calibration:
    """The smallest ``nprobe`` (then ``rerank``) whose recall on the store's rows reaches
    ``target``; warns when none does.

    Args:
        faiss_index: The trained and filled ``faiss.IndexIVF`` over ``store``.
        store: The indexed store, ``[n_ckpt, n_train, k]``.
        kind, nlist, normalize: As the index was built.
        target: recall@10 to reach, in (0, 1].
        seed: Seeds the sample of query rows.
        queries: Store rows used as queries (at most ``n_train``).

    Returns:
        The :class:`Calibration` chosen.
    """
    import faiss

    n_train = store.meta.n_train
    at = min(RECALL_AT, n_train - 1)
    base = default_rerank(kind)
    if at < 1:  # one row: nothing to find but itself
        return Calibration(nlist, base, 1.0, target, 1, 1)
    sample = np.sort(np.random.default_rng(seed + 1).choice(n_train, min(queries, n_train),
                                                            replace=False))
    sample_t = torch.from_numpy(sample)
    query = index_rows(store, sample_t, normalize, query=True)  # [q, n_ckpt * k] float32
    exact = _exact_neighbours(store, query, sample_t, at, normalize)  # [q, at]
    best = None
    for doubling in range(_MAX_RERANK_DOUBLINGS + 1):
        rerank = base * 2**doubling
        candidates = min(n_train - 1, default_candidates(kind, rerank, at, n_train))
        for nprobe in probe_steps(nlist):
            found = _candidates(faiss_index, faiss, query, sample, nprobe, candidates)
            recall = _recall(found, exact)
            if best is None or recall > best.recall:
                best = Calibration(nprobe, rerank, recall, target, at, len(sample))
            if recall >= target:
                return Calibration(nprobe, rerank, recall, target, at, len(sample))
        if candidates >= n_train - 1:
            break
    warnings.warn(
        f"build_index: no default search settings reach recall@{at} {target:g} on this store "
        f"(best {best.recall:.3f} at nprobe={best.nprobe} of nlist={nlist}, "
        f"{best.rerank * at} candidates); those are kept. Use kind='ivf_flat', a larger m, "
        "or pass n_candidates= to indexed_top_k.", UserWarning, stacklevel=5)
    return best


def _exact_neighbours(store: GradientStore, query: np.ndarray, sample: torch.Tensor, at: int,
                      normalize: bool) -> torch.Tensor:
    """``[q, at]`` rows of the highest inner products with each query, itself left out."""
    n_train, dim = store.meta.n_train, query.shape[1]
    queries = torch.from_numpy(query)
    best_values = torch.full((len(sample), 0), -math.inf)
    best_rows = torch.empty((len(sample), 0), dtype=torch.int64)
    step = max(1, _SCAN_BYTES // (4 * dim))
    for start in range(0, n_train, step):
        stop = min(start + step, n_train)
        rows = torch.from_numpy(index_rows(store, torch.arange(start, stop), normalize))
        scores = queries @ rows.T  # [q, stop - start]
        inside = (sample >= start) & (sample < stop)
        scores[inside.nonzero().flatten(), sample[inside] - start] = -math.inf  # itself
        values = torch.cat([best_values, scores], dim=1)
        ids = torch.cat([best_rows, torch.arange(start, stop).expand(len(sample), -1)], dim=1)
        best_values, order = values.topk(min(at, values.shape[1]), dim=1)
        best_rows = ids.gather(1, order)
    return best_rows


def _candidates(faiss_index: Any, faiss: Any, query: np.ndarray, sample: np.ndarray,
                nprobe: int, candidates: int) -> np.ndarray:
    """``[q, candidates]`` rows FAISS returns per query, the query row itself left out
    (``-1`` where the clusters searched ran out)."""
    _, found = faiss_index.search(query, candidates + 1,
                                  params=faiss.SearchParametersIVF(nprobe=nprobe))
    own = found == sample[:, None]
    # The first ``candidates`` rows that are not the query itself: drop it where found,
    # else the last one.
    keep = ~own
    keep[~own.any(axis=1), -1] = False
    return found[keep].reshape(len(sample), candidates)


def _recall(found: np.ndarray, exact: torch.Tensor) -> float:
    hits = (torch.from_numpy(found)[:, :, None] == exact[:, None, :]).any(dim=1)  # [q, at]
    return float(hits.double().mean())
