"""Block-diagonal ``"projected"`` (issue 26): per-layer blocks of the projected Fisher, against
an explicit block-diagonal float64 solve; their layout, refusals and saved format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracinfunc as tif
from tracinfunc.curvature import classification_sampler, fit_curvature
from tracinfunc.curvature.blocks import layer_blocks
from tracinfunc.errors import CorruptStoreError, InvalidArgumentError

IDENTITY = tif.Projection(kind="identity")
EXACT = classification_sampler(exact=True)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)).double().eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(20, 4, dtype=torch.float64, generator=g), torch.randint(0, 3, (20,))
    ckpts = [tif.Checkpoint.from_module(model, lr=0.5, name="a")]
    with torch.no_grad():
        model[2].weight.mul_(2.0)
    ckpts.append(tif.Checkpoint.from_module(model, lr=0.25, name="b"))
    store = tif.build_store(loss, ckpts, (x[:16], y[:16]), projection=IDENTITY,
                            dtype=torch.float64, progress=False)
    tests = tif.build_store(loss, ckpts, (x[16:], y[16:]), projection=IDENTITY,
                            dtype=torch.float64, progress=False)
    return loss, ckpts, (x[:16], y[:16]), store, tests


def test_block_diagonal_equals_an_explicit_block_diagonal_solve(setup):
    loss, ckpts, train, store, tests = setup
    full = fit_curvature(loss, ckpts, train, projection=IDENTITY, sampler=EXACT)
    blocks = fit_curvature(loss, ckpts, train, projection=IDENTITY, sampler=EXACT,
                           block_diagonal=True)
    # Sorted layout: 0.bias [3], 0.weight [3, 4], 2.bias [3], 2.weight [3, 3] -> p = 27.
    assert blocks.blocks == (("0", ((0, 15),)), ("2", ((15, 27),)))
    assert blocks.dim == 27 and set(blocks.estimates[0]) == {"block:0", "block:1"}
    expected, influence = 0, 0
    for c, lr in enumerate(store.meta.lrs):
        fisher = full.estimates[c]["matrix"]
        masked = torch.zeros_like(fisher)
        masked[:15, :15], masked[15:, 15:] = fisher[:15, :15], fisher[15:, 15:]
        torch.testing.assert_close(blocks.estimates[c]["block:0"], fisher[:15, :15])
        torch.testing.assert_close(blocks.estimates[c]["block:1"], fisher[15:, 15:])
        lam = float(fisher.trace()) / 27  # the default: 1 x the mean eigenvalue, as unblocked
        assert blocks.damping[c] == pytest.approx(lam)
        damped = masked + lam * torch.eye(27, dtype=torch.float64)
        rows, queries = store.read_rows(c, 0, 16), tests.read_rows(c, 0, 4)
        expected = expected + lr * torch.linalg.solve(damped, queries.T).T @ rows.T
        influence = influence + lr * (torch.linalg.solve(damped, rows.T).T * rows).sum(1)
    got = tif.score(store, tests, curvature=blocks)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(tif.self_influence(store, curvature=blocks), influence)
    values, _ = tif.top_k(store, tests, 3, curvature=blocks)
    torch.testing.assert_close(values, expected.sort(1, descending=True).values[:, :3])
    assert not torch.allclose(got, tif.score(store, tests, curvature=full))


def test_layer_blocks_join_a_layers_parameters_around_a_submodules():
    layout = (("a.bias", (3,)), ("a.sub.bias", (2,)), ("a.sub.weight", (2, 3)),
              ("a.weight", (3, 4)), ("b", (5,)))
    assert layer_blocks(layout, IDENTITY) == (
        ("a", ((0, 3), (11, 23))), ("a.sub", ((3, 11),)), ("b", ((23, 28),)))


def test_interleaved_blocks_precondition_their_own_coordinates():
    layout = (("a.bias", (2,)), ("a.sub.weight", (1, 2)), ("a.weight", (2, 1)))
    blocks = layer_blocks(layout, IDENTITY)  # a: [0, 1, 4, 5], a.sub: [2, 3]
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(n, n, dtype=torch.float64, generator=g) for n in (4, 2)]
    mats = [m @ m.T for m in mats]
    meta = tif.store.meta.CheckpointMeta("c", 1.0, "f" * 64)
    curvature = tif.Curvature("projected", (meta,), layout, IDENTITY, (0.5,),
                              ({"block:0": mats[0], "block:1": mats[1]},), blocks=blocks)
    rows = torch.randn(3, 6, dtype=torch.float64, generator=g)
    dense = torch.zeros(6, 6, dtype=torch.float64)
    a, sub = torch.tensor([0, 1, 4, 5]), torch.tensor([2, 3])
    dense[a[:, None], a] = mats[0]
    dense[sub[:, None], sub] = mats[1]
    expected = torch.linalg.solve(dense + 0.5 * torch.eye(6, dtype=torch.float64), rows.T).T
    torch.testing.assert_close(curvature.precondition_rows(0, rows), expected)


def test_block_diagonal_refusals(setup):
    loss, ckpts, train, _, _ = setup
    with pytest.raises(InvalidArgumentError,
                       match=r"fit_curvature: block_diagonal=True needs a projection in which "
                             r"each layer owns its outputs, but kind='rademacher'"):
        fit_curvature(loss, ckpts, train, projection=tif.Projection(dim=8),
                      block_diagonal=True)
    with pytest.raises(InvalidArgumentError, match="applies to kind='projected'.*got "
                                                   "kind='kfac'"):
        fit_curvature(loss, ckpts, train, kind="kfac", block_diagonal=True)
    with pytest.raises(tif.errors.InvalidTypeError, match="block_diagonal must be True or False"):
        fit_curvature(loss, ckpts, train, projection=IDENTITY, block_diagonal="yes")


def test_saved_blocks_round_trip_and_newer_formats_are_refused(setup, tmp_path):
    loss, ckpts, train, store, tests = setup
    blocks = fit_curvature(loss, ckpts, train, projection=IDENTITY, block_diagonal=True)
    path = tif.save_curvature(blocks, tmp_path / "blocks.zarr")
    loaded = tif.load_curvature(path)
    assert loaded.blocks == blocks.blocks and loaded.digest == blocks.digest
    torch.testing.assert_close(tif.score(store, tests, curvature=loaded),
                               tif.score(store, tests, curvature=blocks))
    saved = json.loads((Path(path) / "zarr.json").read_text())
    assert saved["attributes"]["tracinfunc_curvature"]["format"] == 2
    # Without blocks, the file is the first format exactly: older readers still read it.
    plain = fit_curvature(loss, ckpts, train, projection=IDENTITY)
    assert "blocks" not in plain.metadata()
    plain_path = tif.save_curvature(plain, tmp_path / "plain.zarr")
    attrs = json.loads((Path(plain_path) / "zarr.json").read_text())["attributes"]
    assert attrs["tracinfunc_curvature"]["format"] == 1
    saved["attributes"]["tracinfunc_curvature"]["format"] = 3
    (Path(path) / "zarr.json").write_text(json.dumps(saved))
    with pytest.raises(CorruptStoreError, match=r"format 3, but this version of tracinfunc "
                                                r"reads formats 1 to 2; upgrade tracinfunc"):
        tif.load_curvature(path)
