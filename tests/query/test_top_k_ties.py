"""top_k's per-block ``topk`` (CPU) picks exactly what a stable sort picks: equal scores by
row, whatever the chunking, with ties cut at the k-th value (issue 34)."""

from __future__ import annotations

import pytest
import torch

import tracinfunc as tif
from tracinfunc.store.meta import CheckpointMeta, StoreMeta


def tied_store(n_train: int, k: int, seed: int) -> tif.store.MemoryStore:
    """Rows of -1, 0, 1: integer scores, exact in float32, with many ties."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(-1, 2, (1, n_train, k), generator=generator).float()
    meta = StoreMeta(projection=tif.Projection(dim=k, seed=0),
                     checkpoints=(CheckpointMeta("c0", 1.0, "f"),), layout=(("w", (k,)),),
                     n_train=n_train, k=k)
    return tif.store.MemoryStore(meta, rows, rows.norm(dim=-1))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("largest", [True, False])
def test_top_k_with_ties_equals_a_stable_sort(seed, largest):
    store = tied_store(60, 3, seed)
    test = torch.randint(-1, 2, (1, 5, 3), generator=torch.Generator().manual_seed(seed + 9))
    scores = test[0].double() @ store.view_rows(0, 0, 60).double().T  # [5, 60], exact
    for k in (1, 4, 13):
        order = scores.argsort(dim=1, descending=largest, stable=True)[:, :k]
        for chunk_rows in (None, 7, 16, 60):
            values, indices = tif.top_k(store, test.float(), k=k, largest=largest,
                                        chunk_rows=chunk_rows)
            torch.testing.assert_close(indices, order, rtol=0, atol=0)
            torch.testing.assert_close(values.double(), scores.gather(1, order), rtol=0, atol=0)
