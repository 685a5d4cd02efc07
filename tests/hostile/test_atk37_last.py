"""atk37 last black-box pass (mapped 2 MiB spans, batch-size record). Every attack HELD;
these are cheap regression guards, not failing findings."""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.errors import IncompatibleGradientsError
from tracinfunc.store import ZarrWriter


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 3)).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ck = [tif.Checkpoint.from_module(model, lr=1.0, name="c0")]
    g = torch.Generator().manual_seed(1)
    return loss, ck, torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_held_chunk_straddling_a_2mib_boundary_scores_like_a_matmul(tmp_path, dtype):
    loss, ck, x, y = _setup()
    x = x.repeat(6, 1)[:360]
    y = y.repeat(6)[:360]
    proj = tif.Projection(dim=6000, seed=0, kind="rademacher")  # 24000 / 12000 bytes a row
    path = tmp_path / "g.zarr"
    chunk = 150 if dtype == torch.float32 else 250  # chunk 1 spans a 2 MiB boundary, unaligned start
    tif.build_store(loss, ck, (x, y), projection=proj, dtype=dtype, batch_size=64,
                    store=functools.partial(ZarrWriter, path, chunk_rows=chunk, shard_rows=2 * chunk))
    store = tif.open_store(path)
    q = tif.build_store(loss, ck, (x[:3], y[:3]), projection=proj)
    ref = q.read_rows(0, 0, 3).float() @ store.read_rows(0, 0, 360).float().T
    torch.testing.assert_close(tif.score(store, q), ref, rtol=1e-5, atol=1e-4)


def test_held_resume_with_another_first_batch_is_refused_naming_both(tmp_path):
    loss, ck, x, y = _setup()
    proj = tif.Projection(dim=16, seed=0, kind="rademacher")
    path = tmp_path / "g.zarr"

    def loader(sizes, stop=None):
        i = 0
        for j, b in enumerate(sizes):
            if j == stop:
                raise KeyboardInterrupt
            yield x[i:i + b], y[i:i + b]
            i += b

    build = functools.partial(tif.build_store, loss, ck, projection=proj,
                              store=functools.partial(ZarrWriter, path, chunk_rows=4, shard_rows=8))
    with pytest.raises(KeyboardInterrupt):
        build(loader([8] * 8, stop=3))
    with pytest.raises(IncompatibleGradientsError, match=r"8 examples when started, 4 now"):
        build(loader([4, 4] + [8] * 7))
