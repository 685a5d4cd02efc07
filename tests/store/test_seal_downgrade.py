"""A sealed format is never downgradable by editing a field (issue 25 item 5): a finished store
without its seal is refused unless the user opts in, loudly, with allow_unsealed=True."""

from __future__ import annotations

import pytest
import torch

import tracinfunc as tif
from tests.store.test_tamper import LAYOUTS, edit_meta, memory_store


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "g.zarr"
    tif.save_store(memory_store(), path, progress=False, **LAYOUTS["raw-sharded"])
    return path


def _downgrade_and_raise_the_lr(meta):
    meta["format_version"] = 1
    meta["checkpoints"][1]["lr"] = 100.0


def test_editing_the_format_version_down_does_not_switch_the_seal_off(saved):
    """Before: format_version 2 -> 1 plus an lr of 100 opened, verified and scored."""
    edit_meta(saved, _downgrade_and_raise_the_lr)
    with pytest.raises(tif.errors.CorruptStoreError, match="does not match its checksum"):
        tif.open_store(saved)


def test_a_store_without_its_seal_is_refused_and_names_the_opt_in(saved):
    """Before: dropping the integrity block (and the version) let swapped rows score."""
    def unseal(meta):
        meta["format_version"] = 1
        del meta["integrity"]

    edit_meta(saved, unseal)
    rows0, rows1 = saved / "rows" / "0", saved / "rows" / "1"
    rows0.rename(saved / "swap")
    rows1.rename(rows0)
    (saved / "swap").rename(rows1)
    with pytest.raises(tif.errors.CorruptStoreError, match="allow_unsealed=True"):
        tif.open_store(saved)
    with pytest.raises(tif.errors.CorruptStoreError, match="allow_unsealed=True"):
        tif.store.read_store_meta(saved)


def test_an_unsealed_store_opens_only_when_asked_and_says_so(saved):
    def unseal(meta):
        meta["format_version"] = 1
        del meta["integrity"]

    edit_meta(saved, unseal)
    with pytest.warns(UserWarning, match="unsealed"):
        store = tif.open_store(saved, allow_unsealed=True)
    expected = memory_store()
    assert torch.equal(store.read_rows(0, 0, store.n_train),
                       expected.read_rows(0, 0, expected.n_train))


@pytest.mark.parametrize("kind", ["norms", "rows"])
def test_an_empty_shard_file_present_at_commit_is_corruption_not_zeros(tmp_path, kind):
    """Before (issue 25 item 6): an empty norms shard file present at commit was sealed with
    size 0, read back as zeros, and verify_store passed."""
    source = memory_store()
    meta = source.meta.replace(n_train=0, complete=False)
    writer = tif.store.ZarrWriter(tmp_path / "g.zarr", meta, **LAYOUTS["raw-sharded"])
    rows = torch.stack([source.read_rows(c, 0, source.n_train) for c in range(source.n_ckpt)])
    norms = torch.stack([source.read_norms(c, 0, source.n_train) for c in range(source.n_ckpt)])
    writer.append(rows, norms)
    target = tmp_path / "g.zarr" / kind / "1" / "c" / "1"
    target = target / "0" if kind == "rows" else target
    target.write_bytes(b"")  # a lost write, or an attacker
    with pytest.raises(tif.errors.CorruptStoreError, match=f"{kind}/1/c/1.*empty"):
        writer.finish()
    with pytest.raises(tif.errors.TracInFuncError):
        tif.open_store(tmp_path / "g.zarr")
