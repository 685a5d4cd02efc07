"""A cosine index over a store holding a training row of float32 denormals (norm ~1e-42).

The index rows and the candidate sketch multiplied each row by ``1 / norm``, which is not a
float32 for a denormal norm (inf): ``build_index(normalize=True)`` failed inside FAISS
("input contains NaN's or Inf's"), and a sketch computed from denormal products refused the
store's own row as "replaced". They divide by the norm now, as ``score`` does. Reference:
``top_k`` (exact, itself checked against float64 in ``tests/hostile/test_atk43b_normalize.py``).
"""

from __future__ import annotations

import pytest
import torch

import tracinfunc as tif
from tracinfunc.store import MemoryStore
from tracinfunc.testing import reference_store

pytest.importorskip("faiss", reason="the search extra: pip install 'tracinfunc[search]'")

DENORMAL = 5


def _store(norm: float = 1e-42) -> tuple[MemoryStore, torch.Tensor]:
    base = reference_store(300, 16, n_ckpt=2)
    rows = torch.stack([base.read_rows(c, 0, 300) for c in range(2)]).double()
    rows[:, DENORMAL] *= norm / rows[:, DENORMAL].norm(dim=-1, keepdim=True)
    return MemoryStore(base.meta, rows.float(), rows.norm(dim=-1).float()), rows


@pytest.mark.parametrize("norm", [1e-42, 1e-39, 1.0])
def test_cosine_index_over_a_denormal_row_finds_what_top_k_finds(norm):
    store, rows = _store(norm)
    index = tif.search.build_index(store, normalize=True, seed=0)
    test = rows[:, [DENORMAL, 0, 7]].float()
    values, found = tif.search.indexed_top_k(store, test, 3, index=index, normalize=True,
                                             nprobe=index.nlist)
    exact_values, exact = tif.top_k(store, test, 3, normalize=True)
    assert torch.isfinite(values).all()
    assert torch.equal(found, exact)
    torch.testing.assert_close(values, exact_values, rtol=1e-5, atol=1e-6)
    assert found[0, 0] == DENORMAL  # the denormal row is its own nearest cosine


def test_the_denormal_row_still_checks_against_its_sketch_and_a_swap_is_refused():
    store, rows = _store()
    index = tif.search.build_index(store, normalize=True, seed=0)
    test = rows[:, [DENORMAL]].float()
    tif.search.indexed_top_k(store, test, 3, index=index, normalize=True, nprobe=index.nlist)
    swapped = rows.clone()
    swapped[:, DENORMAL] = rows[:, DENORMAL].flip(-1)  # another row of the very same norm
    other = MemoryStore(store.meta, swapped.float(), swapped.norm(dim=-1).float())
    with pytest.raises(tif.errors.IncompatibleGradientsError, match=f"rows \\[{DENORMAL}\\]"):
        tif.search.indexed_top_k(other, test, 3, index=index, normalize=True,
                                 nprobe=index.nlist)
