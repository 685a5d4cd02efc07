"""Faults around writes (issue 16): overwriting in place, results over stores, lost writes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from pathlib import Path

import pytest
import torch

import tracinfunc as tif
from tests.store.test_tamper import LAYOUTS, N_TRAIN, memory_store
from tracinfunc.cli import commands, main


def rows_of(store) -> torch.Tensor:
    return torch.stack([store.read_rows(c, 0, store.n_train) for c in range(store.n_ckpt)])


def run_cli(*args: str, cwd: Path) -> tuple[int, str]:
    stderr = io.StringIO()
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            try:
                code = main(list(args))
            except SystemExit as exit_:
                code = exit_.code
    finally:
        os.chdir(previous)
    return code, stderr.getvalue()


@pytest.mark.parametrize("how", ["save_store", "save_store-zstd"])
def test_overwriting_a_store_with_itself_keeps_its_rows(tmp_path, how):
    source = memory_store()
    store = tif.save_store(source, tmp_path / "g.zarr", progress=False, **LAYOUTS["raw-sharded"])
    options = {"compression": "zstd"} if how.endswith("zstd") else {}
    again = tif.save_store(store, store.path, overwrite=True, progress=False, **options)
    assert again.path == store.path
    assert torch.equal(rows_of(tif.open_store(store.path)), rows_of(source))
    tif.verify_store(again, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zarr"]  # no temporaries left


def test_overwrite_refuses_a_directory_that_is_not_a_store(tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "thesis.tex").write_text("years of work")
    with pytest.raises(tif.errors.StoreExistsError, match="not a (tracinfunc|gradient) store"):
        tif.save_store(memory_store(), target, overwrite=True, progress=False)
    assert (target / "thesis.tex").read_text() == "years of work"


@pytest.fixture
def store_dir(tmp_path):
    tif.save_store(memory_store(), tmp_path / "g.zarr", progress=False)
    return tmp_path


@pytest.mark.parametrize("command", ["self-influence", "score"])
def test_cli_output_over_its_own_input_store_is_refused(store_dir, command):
    extra = ["--test-store", "g.zarr"] if command == "score" else []
    code, stderr = run_cli(command, "g.zarr", *extra, "--output", "g.zarr", "--overwrite",
                           cwd=store_dir)
    assert code != 0 and "gradient store" in stderr, stderr
    assert torch.equal(rows_of(tif.open_store(store_dir / "g.zarr")), rows_of(memory_store()))


def test_cli_overwrite_refuses_a_directory_it_did_not_write(store_dir):
    other = store_dir / "notes.zarr"
    other.mkdir()
    (other / "keep.txt").write_text("keep")
    code, stderr = run_cli("self-influence", "g.zarr", "--output", "notes.zarr", "--overwrite",
                           cwd=store_dir)
    assert code != 0 and re.search("not a (CLI )?result", stderr), stderr
    assert (other / "keep.txt").read_text() == "keep"
    # a result directory the CLI wrote itself is still replaced
    assert run_cli("self-influence", "g.zarr", "--output", "si.zarr", cwd=store_dir)[0] == 0
    code, stderr = run_cli("self-influence", "g.zarr", "--output", "si.zarr", "--overwrite",
                           cwd=store_dir)
    assert code == 0, stderr
    attrs = json.loads((store_dir / "si.zarr" / "zarr.json").read_text())["attributes"]
    assert attrs.get("tracinfunc_results") is True


def test_an_empty_shard_in_a_finished_store_fails_verify_in_the_cli(store_dir):
    """Finding 1 end to end: `info --verify` exited 0 on a store with an emptied norms shard."""
    os.truncate(store_dir / "g.zarr" / "norms" / "0" / "c" / "0", 0)
    code, stderr = run_cli("info", "g.zarr", "--verify", cwd=store_dir)
    assert code != 0 and "norms/0/c/0" in stderr, stderr


def test_self_influence_is_exact_after_a_round_trip(store_dir):
    store = tif.open_store(store_dir / "g.zarr")
    rows = rows_of(memory_store()).double()
    lrs = torch.tensor(store.meta.lrs, dtype=torch.float64)
    expected = torch.einsum("c,cnk->n", lrs, rows * rows)
    torch.testing.assert_close(tif.self_influence(store).double(), expected, rtol=1e-5,
                               atol=1e-6)
    assert expected.shape == (N_TRAIN,)


def _batches(x, y, size=6):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def _tiny(path, **options):
    import functools

    return functools.partial(tif.store.ZarrWriter, path, chunk_rows=4, shard_rows=8, **options)


def test_rerunning_a_finished_build_returns_the_store_untouched(mlp_setup32, tmp_path):
    loss, ckpts, train, _ = mlp_setup32
    projection = tif.Projection(dim=16, seed=0)
    first = tif.build_store(loss, ckpts, _batches(*train), projection=projection,
                            store=_tiny(tmp_path / "g.zarr"))
    stamps = {p: p.stat().st_mtime_ns for p in first.path.rglob("*") if p.is_file()}
    again = tif.build_store(loss, ckpts, _batches(*train), projection=projection,
                            store=_tiny(tmp_path / "g.zarr"))
    assert isinstance(again, tif.store.ZarrStore) and again.meta == first.meta
    assert torch.equal(rows_of(again), rows_of(first))
    assert {p: p.stat().st_mtime_ns for p in first.path.rglob("*") if p.is_file()} == stamps
    # A plain path works the same way (the CLI-less user's re-run after a crash).
    plain = tif.build_store(loss, ckpts, train, projection=projection, store=tmp_path / "p.zarr")
    assert torch.equal(rows_of(tif.build_store(loss, ckpts, train, projection=projection,
                                               store=tmp_path / "p.zarr")), rows_of(plain))


def test_rerunning_with_other_arguments_is_refused_naming_the_difference(mlp_setup32, tmp_path):
    loss, ckpts, train, _ = mlp_setup32
    projection = tif.Projection(dim=16, seed=0)
    path = tmp_path / "g.zarr"
    tif.build_store(loss, ckpts, _batches(*train), projection=projection, store=_tiny(path))
    with pytest.raises(tif.errors.StoreExistsError, match="projection"):
        tif.build_store(loss, ckpts, _batches(*train), projection=tif.Projection(dim=16, seed=1),
                        store=_tiny(path))
    with pytest.raises(tif.errors.StoreExistsError, match="dataset fingerprint"):
        tif.build_store(loss, ckpts, _batches(*train), projection=projection, store=_tiny(path),
                        dataset_fingerprint="v2")
    x, y = train
    more = (torch.cat([x, x[:3]]), torch.cat([y, y[:3]]))
    with pytest.raises(tif.errors.StoreExistsError, match="40 rows"):
        tif.build_store(loss, ckpts, _batches(*more), projection=projection, store=_tiny(path))
    with pytest.raises(tif.errors.EmptyDataError, match="40 rows"):
        tif.build_store(loss, ckpts, _batches(x[:30], y[:30]), projection=projection,
                        store=_tiny(path))
    tif.verify_store(tif.open_store(path), progress=False)  # refusals changed nothing


def _fail_writes_after(monkeypatch, n_writes: int) -> list[str]:
    """Make zarr's local store raise ENOSPC from its ``n_writes``-th chunk write on."""
    import errno

    from zarr.storage import LocalStore

    original, seen = LocalStore._set, []

    async def failing(self, key, value, exclusive=False):
        if "/c/" in key:
            seen.append(key)
            if len(seen) >= n_writes:
                raise OSError(errno.ENOSPC, "No space left on device")
        return await original(self, key, value, exclusive=exclusive)

    monkeypatch.setattr(LocalStore, "_set", failing)
    return seen


def test_disk_full_stops_with_path_and_rows_then_resumes_bit_identically(
        mlp_setup32, tmp_path, monkeypatch):
    loss, ckpts, train, _ = mlp_setup32
    projection = tif.Projection(dim=16, seed=0)
    reference = tif.build_store(loss, ckpts, _batches(*train), projection=projection,
                                batch_size=6)  # the same calls as the Zarr build
    path = tmp_path / "g.zarr"
    with monkeypatch.context() as patch:
        _fail_writes_after(patch, 3 * 2 * 2 + 1)  # 3 ckpts x (rows, norms) x 2 shards, then full
        with pytest.raises(tif.errors.StoreWriteError) as caught:
            tif.build_store(loss, ckpts, _batches(*train), projection=projection,
                            store=_tiny(path))
    message = str(caught.value)
    assert "No space left" in message and str(path) in message and "16 rows" in message
    assert "resume" in message
    with pytest.raises(tif.errors.IncompleteStoreError, match="16 rows"):
        tif.open_store(path)
    resumed = tif.build_store(loss, ckpts, _batches(*train), projection=projection,
                              store=_tiny(path))
    assert torch.equal(rows_of(resumed), rows_of(reference))
    tif.verify_store(resumed, progress=False)


def test_disk_full_during_save_store_keeps_the_old_store(tmp_path, monkeypatch):
    source = memory_store()
    path = tmp_path / "g.zarr"
    store = tif.save_store(source, path, progress=False, **LAYOUTS["raw-sharded"])
    with monkeypatch.context() as patch:
        _fail_writes_after(patch, 2)
        with pytest.raises(tif.errors.StoreWriteError, match="No space left"):
            tif.save_store(store, path, overwrite=True, progress=False)
    assert torch.equal(rows_of(tif.open_store(path)), rows_of(source))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zarr"]


def _interrupted(loss, ckpts, batches, projection, path, *, after: int) -> None:
    """A build whose data fails after ``after`` batches (as a SIGKILL would stop it)."""

    def dying():
        yield from batches[:after]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tif.build_store(loss, ckpts, dying(), projection=projection, store=_tiny(path))


@pytest.mark.parametrize("change", ["data", "order", "mixed_precision"])
def test_resuming_with_other_data_or_precision_is_refused(mlp_setup32, tmp_path, change):
    loss, ckpts, train, _ = mlp_setup32
    projection, path = tif.Projection(dim=16, seed=0), tmp_path / "g.zarr"
    batches = _batches(*train)
    _interrupted(loss, ckpts, batches, projection, path, after=4)
    assert tif.store.read_store_meta(path).n_train == 24
    x, y = train
    options = {}
    if change == "data":
        batches = _batches(x + 1, y)
    elif change == "order":
        batches = _batches(x.flip(0), y.flip(0))
    else:
        options = {"options": tif.GradientOptions(mixed_precision=torch.bfloat16)}
    # another precision is refused from the build record, before any row is compared
    said = "mixed_precision=None when started" if options else "does not match the store"
    with pytest.raises(tif.errors.IncompatibleGradientsError, match=said):
        tif.build_store(loss, ckpts, batches, projection=projection, store=_tiny(path),
                        **options)
    assert tif.store.read_store_meta(path).n_train == 24  # nothing merged
    resumed = tif.build_store(loss, ckpts, _batches(*train), projection=projection,
                              store=_tiny(path))
    reference = tif.build_store(loss, ckpts, _batches(*train), projection=projection,
                                batch_size=6)  # the same calls as the Zarr build
    assert torch.equal(rows_of(resumed), rows_of(reference))
    with pytest.raises(tif.errors.IncompatibleGradientsError, match="does not match the store"):
        tif.build_store(loss, ckpts, _batches(x + 1, y), projection=projection,
                        store=_tiny(path))  # a re-run of a finished build checks data too


def test_a_shuffling_dataloader_is_refused(mlp_setup32):
    from torch.utils.data import DataLoader, TensorDataset

    loss, ckpts, train, _ = mlp_setup32
    loader = DataLoader(TensorDataset(*train), batch_size=8, shuffle=True)
    with pytest.raises(tif.errors.InvalidArgumentError, match="shuffle=True.*shuffle=False"):
        tif.build_store(loss, ckpts, loader, projection=tif.Projection(dim=16, seed=0))
    ordered = DataLoader(TensorDataset(*train), batch_size=8, shuffle=False)
    assert tif.build_store(loss, ckpts, ordered, projection=tif.Projection(dim=16)).n_train == 40


def test_ctrl_c_during_a_cli_build_says_how_to_resume_and_resume_is_bit_identical(
        tmp_path, monkeypatch):
    spec = str(Path(__file__).resolve().parents[1] / "data" / "tiny_spec.py") + ":make"
    args = ["build", "--spec", spec, "--projection", "rademacher:32:7", "--batch-size", "10",
            "--quiet"]
    assert run_cli(*args, "--out", "straight.zarr", cwd=tmp_path)[0] == 0
    original, calls = tif.store.ZarrWriter.append, []

    def interrupted(self, rows, norms):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what SIGINT raises in the main thread
        return original(self, rows, norms)

    with monkeypatch.context() as patch:
        patch.setattr(tif.store.ZarrWriter, "append", interrupted)
        code, stderr = run_cli(*args, "--out", "g.zarr", cwd=tmp_path)
    assert code == 130 and len(stderr.strip().splitlines()) == 1
    assert "--resume" in stderr and "g.zarr" in stderr
    code, stderr = run_cli(*args, "--out", "g.zarr", "--resume", cwd=tmp_path)
    assert code == 0, stderr
    assert torch.equal(rows_of(tif.open_store(tmp_path / "g.zarr")),
                       rows_of(tif.open_store(tmp_path / "straight.zarr")))


def test_a_build_that_failed_before_storing_anything_does_not_block_the_next(
        mlp_setup32, tmp_path):
    loss, ckpts, train, _ = mlp_setup32
    path = tmp_path / "g.zarr"

    def broken(params, batch):
        raise ValueError("bug in my loss")

    with pytest.raises(tif.TracInFuncError):
        tif.build_store(broken, ckpts, train, projection=tif.Projection(dim=16), store=path)
    # the fixed call differs (another projection, say): a 0-row leftover is simply replaced
    store = tif.build_store(loss, ckpts, train, projection=tif.Projection(dim=8), store=path)
    assert store.n_train == 40 and store.k == 8


@pytest.mark.parametrize("suffix", [".json", ".npy", ".zarr"])
def test_disk_full_while_writing_cli_results_names_the_file_and_keeps_the_old(
        store_dir, monkeypatch, suffix):
    import errno

    output = f"si{suffix}"
    assert run_cli("self-influence", "g.zarr", "--output", output, cwd=store_dir)[0] == 0
    before = sorted((p.relative_to(store_dir), p.read_bytes()) for p in
                    [store_dir / output, *(store_dir / output).rglob("*")] if p.is_file())

    def full(path, *args):  # the device fills up after half the bytes are written
        path.mkdir() if suffix == ".zarr" else path.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        for name in ("_write_json", "_write_npy", "_write_zarr"):
            patch.setattr(f"tracinfunc.cli.results.{name}", full)
        code, stderr = run_cli("self-influence", "g.zarr", "--output", output, "--overwrite",
                               cwd=store_dir)
    assert code == 1 and "No space left" in stderr and output in stderr, stderr
    assert "unchanged" in stderr and len(stderr.strip().splitlines()) == 1
    after = sorted((p.relative_to(store_dir), p.read_bytes()) for p in
                   [store_dir / output, *(store_dir / output).rglob("*")] if p.is_file())
    assert after == before
    assert sorted(p.name for p in store_dir.iterdir()) == ["g.zarr", output]


def test_top_k_into_npy_is_refused_before_any_scoring(store_dir, monkeypatch):
    def no_scoring(*args, **kwargs):
        raise AssertionError("scored before checking the output format")

    monkeypatch.setattr(commands, "top_k", no_scoring)
    monkeypatch.setattr(commands, "open_store", no_scoring)
    code, stderr = run_cli("score", "g.zarr", "--test-store", "g.zarr", "--top-k", "3",
                           "--output", "top.npy", cwd=store_dir)
    assert code == 1 and ".npy file holds one array" in stderr, stderr
    assert not (store_dir / "top.npy").exists()


def test_a_store_in_an_unwritable_directory_is_refused_clearly():
    with pytest.raises(tif.errors.StoreWriteError, match="'/proc'.*writable directory"):
        tif.save_store(memory_store(), "/proc/g.zarr", progress=False)  # /proc refuses root too
