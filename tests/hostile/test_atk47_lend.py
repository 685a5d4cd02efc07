"""atk47: outside pass over ZarrStore.lend_rows, raw norms/scales reads and per-query precision.

Written from docs/concepts/stores.md, CHANGELOG.md (session 47) and docstrings only.
Attacks that hold are ``test_held_*``; findings (fail now) are ``test_finding_*``.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import tracinfunc as tif
import tracinfunc.testing as tt
from tracinfunc.errors import CorruptStoreError

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- helpers
def make(tmp, n=1000, k=16, n_ckpt=2, chunk=256, shard=512, q=None, name="s.zarr", seed=0):
    src = tt.reference_store(n_train=n, k=k, n_ckpt=n_ckpt, seed=seed, quantization=q)
    z = tif.save_store(src, tmp / name, chunk_rows=chunk, shard_rows=shard, progress=False)
    return src, z


def brute(src, T, normalize=False):
    n = src.shape[1]
    out = 0
    for c, cm in enumerate(src.meta.checkpoints):
        R = src.read_rows(c, 0, n).double()
        t = T[c].double()
        if normalize:
            R = R / src.read_norms(c, 0, n).double()[:, None].clamp_min(1e-300)
            t = t / t.norm(dim=1, keepdim=True)
        out = out + cm.lr * t @ R.T
    return out


def store_fds(path):
    path = str(Path(path).resolve())
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            tgt = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if tgt.startswith(path):
            out.append(tgt)
    return out


def store_maps(path):
    path = str(Path(path).resolve())
    with open("/proc/self/maps") as f:
        return [ln for ln in f if path in ln]


def tree_hash(path):
    h = hashlib.sha256()
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def shard(z_path, ckpt, i, kind="rows"):
    if kind == "rows":
        return Path(z_path) / "rows" / str(ckpt) / "c" / str(i) / "0"
    return Path(z_path) / kind / str(ckpt) / "c" / str(i)


def run_child(code, timeout=60):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    return r


CHILD_PRELUDE = """
import os, sys, shutil, gc
from pathlib import Path
import torch
import tracinfunc as tif, tracinfunc.testing as tt
from tracinfunc.errors import CorruptStoreError
torch.set_num_threads(1)
def make(tmp, n=1000, k=16, n_ckpt=2, chunk=256, shard=512, name='s.zarr', seed=0):
    src = tt.reference_store(n_train=n, k=k, n_ckpt=n_ckpt, seed=seed)
    z = tif.save_store(src, tmp / name, chunk_rows=chunk, shard_rows=shard, progress=False)
    return src, z
def shard(p, c, i): return Path(p) / 'rows' / str(c) / 'c' / str(i) / '0'
"""




@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ============================================================ surface 1: lend_rows
def test_held_lend_rows_every_chunk_equals_read_rows(tmp_path):
    src, z = make(tmp_path, n=1000, chunk=256, shard=512)
    pieces = [(c, s, min(s + 256, 1000)) for c in range(2) for s in range(0, 1000, 256)]
    got = list()
    for lend, (c, s, e) in zip(z.lend_rows(pieces), pieces, strict=False):
        assert lend is not None
        rows, release = lend
        assert torch.equal(rows, src.read_rows(c, s, e))
        got.append((c, s, e))
        release()
    assert got == pieces


def test_held_lend_rows_generator_of_pieces_and_empty(tmp_path):
    src, z = make(tmp_path)
    assert list(z.lend_rows([])) == []
    g = z.lend_rows(p for p in [(1, 768, 1000), (0, 0, 256)])
    a = next(g)
    assert torch.equal(a[0], src.read_rows(1, 768, 1000))
    a[1]()
    b = next(g)
    assert torch.equal(b[0], src.read_rows(0, 0, 256))
    b[1]()
    g.close()
    del a, b, g
    gc.collect()
    assert store_fds(z_path := tmp_path / "s.zarr") == []
    assert store_maps(z_path) == []


def _window_store(tmp_path):
    # 4 chunks of 256 rows in one shard file: one window holds them all
    return make(tmp_path, n=2048, k=16, chunk=256, shard=1024)


def test_held_same_chunk_twice_write_isolated(tmp_path):
    src, z = _window_store(tmp_path)
    before = tree_hash(tmp_path / "s.zarr")
    orig = src.read_rows(0, 0, 256)
    pieces = [(0, 0, 256), (0, 256, 512), (0, 0, 256), (0, 0, 256)]
    views = []
    for lend in z.lend_rows(pieces):
        assert lend is not None
        rows, release = lend
        views.append(rows)
        if len(views) != 2:
            assert torch.equal(rows, orig), f"lend {len(views)} saw an earlier write"
        with contextlib.suppress(RuntimeError, ValueError):
            rows.fill_(1e9)
        release()
    assert tree_hash(tmp_path / "s.zarr") == before
    assert torch.equal(z.read_rows(0, 0, 256), orig)
    T = torch.randn(2, 3, 16)
    assert torch.allclose(tif.score(z, T, device="cpu", chunk_rows=256).double(), brute(src, T), rtol=1e-5, atol=1e-5)


def test_held_write_into_lent_views_reaches_no_later_query(tmp_path):
    src, z = _window_store(tmp_path)
    T = torch.randn(2, 4, 16)
    base = tif.score(z, T, device="cpu", chunk_rows=256)
    pieces = [(c, s, s + 256) for c in range(2) for s in range(0, 2048, 256)]
    for rows, release in z.lend_rows(pieces):
        rows.mul_(-3.0).add_(7.0)
        release()
    assert torch.equal(tif.score(z, T, device="cpu", chunk_rows=256), base)
    v, _i = tif.top_k(z, T, k=5, device="cpu", chunk_rows=256)
    assert torch.equal(v, base.topk(5, dim=1).values)
    si = tif.self_influence(z, device="cpu", chunk_rows=256)
    assert torch.allclose(si.double(), tif.self_influence(src, chunk_rows=256).double(), rtol=1e-6)


@pytest.mark.parametrize(
    "piece",
    [(-1, 0, 256), (0, -256, 0), (0, 0.0, 256), (True, 0, 256), (0, 0, 256.0), (2, 0, 256),
     (0, 1024, 1280), (0, 256, 0), (0, False, 256), (0, 0, True), ("0", 0, 256)],
)
def test_held_bad_pieces_are_refused(tmp_path, piece):
    _, z = make(tmp_path)
    with pytest.raises((tif.errors.InvalidTypeError, tif.errors.RowRangeError)):
        for _lend in z.lend_rows([piece]):
            pass
    assert store_fds(tmp_path / "s.zarr") == []


@pytest.mark.parametrize("piece", [(0, 0), (0, 0, 256, 1), 5, None, "abc"])
def test_held_malformed_pieces_are_refused_clearly(tmp_path, piece):
    _, z = make(tmp_path)
    with pytest.raises((TypeError, ValueError)):
        for _lend in z.lend_rows([piece]):
            pass
    gc.collect()
    assert store_fds(tmp_path / "s.zarr") == []


def test_held_numpy_int_pieces_accepted(tmp_path):
    src, z = make(tmp_path)
    (lend,) = list(z.lend_rows([(np.int64(1), np.int32(256), np.int64(512))]))
    assert lend is not None and torch.equal(lend[0], src.read_rows(1, 256, 512))
    lend[1]()


@pytest.mark.parametrize("piece", [(0, 0, 100), (0, 0, 512), (0, 100, 356), (0, 0, 0), (0, 1000, 1000)])
def test_held_piece_not_one_chunk_gives_none_or_error_never_wrong_rows(tmp_path, piece):
    src, z = make(tmp_path)
    try:
        out = list(z.lend_rows([piece]))
    except (tif.errors.InvalidTypeError, tif.errors.RowRangeError, ValueError):
        return
    assert len(out) == 1
    if out[0] is not None:
        assert torch.equal(out[0][0], src.read_rows(*piece))
        out[0][1]()


def test_held_generator_closed_early_gc_throw_leave_no_fd(tmp_path):
    _, z = _window_store(tmp_path)
    p = tmp_path / "s.zarr"
    pieces = [(c, s, s + 256) for c in range(2) for s in range(0, 2048, 256)]
    # closed early
    g = z.lend_rows(pieces)
    r = next(g)
    r[1]()
    assert store_fds(p)  # documented: kept open until closed
    g.close()
    del r, g
    gc.collect()
    assert store_fds(p) == [] and store_maps(p) == []
    # abandoned without close
    g = z.lend_rows(pieces)
    next(g)
    next(g)
    del g
    gc.collect()
    assert store_fds(p) == [] and store_maps(p) == []
    # exception thrown into it
    g = z.lend_rows(pieces)
    next(g)
    with pytest.raises(KeyError):
        g.throw(KeyError("x"))
    del g
    gc.collect()
    assert store_fds(p) == [] and store_maps(p) == []


def test_held_queries_leave_no_fd_or_mapping(tmp_path):
    _src, z = make(tmp_path, n=2048, chunk=256, shard=1024)
    p = tmp_path / "s.zarr"
    T = torch.randn(2, 3, 16)
    tif.score(z, T, device="cpu", chunk_rows=256)
    tif.top_k(z, T, k=3, device="cpu")
    tif.self_influence(z, device="cpu")
    for _ in tif.score_chunks(z, T, device="cpu", chunk_rows=256):
        pass
    gc.collect()
    assert store_fds(p) == [] and store_maps(p) == []
    # score_chunks abandoned mid-way and closed / dropped
    g = tif.score_chunks(z, T, device="cpu", chunk_rows=256)
    next(g)
    g.close()
    g = tif.score_chunks(z, T, device="cpu", chunk_rows=256)
    next(g)
    del g
    gc.collect()
    assert store_fds(p) == [] and store_maps(p) == []


def test_held_many_queries_no_fd_leak(tmp_path):
    _src, z = make(tmp_path, n=512, chunk=256, shard=256)
    T = torch.randn(2, 2, 16)
    n0 = len(os.listdir("/proc/self/fd"))
    for i in range(600):
        tif.score(z, T, device="cpu", chunk_rows=256)
        if i % 100 == 0:
            g = tif.score_chunks(z, T, device="cpu", chunk_rows=256)
            next(g)
            del g
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= n0 + 2
    assert store_fds(tmp_path / "s.zarr") == []


def test_held_two_threads_query_one_store(tmp_path):
    _src, z = make(tmp_path, n=2048, chunk=256, shard=512)
    T = torch.randn(2, 3, 16)
    base = tif.score(z, T, device="cpu", chunk_rows=256)
    errs, bad = [], []

    def work():
        try:
            for _ in range(15):
                s = tif.score(z, T, device="cpu", chunk_rows=256)
                if not torch.equal(s, base):
                    bad.append(1)
                v, _i = tif.top_k(z, T, k=4, device="cpu", chunk_rows=256)
                if not torch.equal(v, base.topk(4, dim=1).values):
                    bad.append(2)
        except Exception as e:
            errs.append(e)

    ts = [threading.Thread(target=work) for _ in range(3)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errs and not bad


@pytest.mark.parametrize("n,chunk,shard", [(1281, 256, 256), (257, 256, 256), (300, 1, 3), (40, 7, 14), (256, 256, 256)])
def test_held_shapes_match_brute_force(tmp_path, n, chunk, shard):
    src, z = make(tmp_path, n=n, chunk=chunk, shard=shard)
    T = torch.randn(2, 3, 16)
    ref = brute(src, T)
    for cr in (None, chunk):
        s = tif.score(z, T, device="cpu", chunk_rows=cr).double()
        assert torch.allclose(s, ref, rtol=1e-5, atol=1e-5)
        _v, i = tif.top_k(z, T, k=3, device="cpu", chunk_rows=cr)
        assert torch.equal(i, ref.topk(3, dim=1).indices)
        blocks = torch.cat([b.clone() for _, b in tif.score_chunks(z, T, device="cpu", chunk_rows=cr)], 1)
        assert torch.allclose(blocks.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(tif.score(z, T, normalize=True, device="cpu").double(), brute(src, T, True), rtol=1e-5, atol=1e-6)


def test_held_interleaved_passes_and_dirty_lends_isolated(tmp_path):
    src, z = _window_store(tmp_path)
    T = torch.randn(2, 3, 16)
    want = tif.score(src, T, device="cpu", chunk_rows=256)
    g1 = z.lend_rows([(0, 0, 256), (0, 256, 512)])
    r1, _ = next(g1)
    r1.fill_(7)
    g2 = z.lend_rows([(0, 0, 256)])
    r2, _ = next(g2)
    assert torch.equal(r2, src.read_rows(0, 0, 256))
    r2.fill_(9)
    assert torch.equal(tif.score(z, T, device="cpu", chunk_rows=256), want)
    out = torch.empty(3, 2048)
    for _s, _b in tif.score_chunks(z, T, device="cpu", chunk_rows=256, out=out):
        pass
    assert torch.equal(out, want)
    r1b, _ = next(g1)
    assert torch.equal(r1b, src.read_rows(0, 256, 512))
    g1.close()
    g2.close()
    for rows in [(100, 900), (256, 512), (2047, 2048), (0, 1)]:
        a = tif.score(z, T, rows=rows, device="cpu", chunk_rows=256)
        assert torch.equal(a, tif.score(src, T, rows=rows, device="cpu", chunk_rows=256)), rows


def test_held_store_directory_replaced_between_lends(tmp_path):
    src, z = _window_store(tmp_path)
    g = z.lend_rows([(0, 0, 256), (0, 256, 512), (1, 1024, 1280)])
    r, rel = next(g)
    rel()
    os.rename(tmp_path / "s.zarr", tmp_path / "old.zarr")
    _src2, _ = make(tmp_path, n=2048, chunk=256, shard=1024, seed=9)
    try:
        for (r, rel), pc in zip(g, [(0, 256, 512), (1, 1024, 1280)], strict=False):
            assert torch.equal(r, src.read_rows(*pc))  # the old store's rows, never the new one's
            rel()
    except CorruptStoreError:
        pass
    with pytest.raises(CorruptStoreError):
        tif.score(z, torch.randn(2, 2, 16), device="cpu")
    with pytest.raises(CorruptStoreError):
        z.read_norms(0, 0, 10)


def test_held_multi_window_shard_unaligned_chunks(tmp_path):
    # one 88 MB shard file (two 64 MiB windows), chunks of 4,197,376 bytes (not page-aligned)
    n, k = 5220, 4099
    src = tt.reference_store(n_train=n, k=k, n_ckpt=1)
    z = tif.save_store(src, tmp_path / "w.zarr", chunk_rows=256, shard_rows=5376, progress=False)
    assert z.mapped_chunk_rows == 256
    pieces = [(0, s, min(s + 256, n)) for s in range(0, n, 256)]
    rng = np.random.default_rng(0)
    order = pieces + [pieces[i] for i in rng.permutation(len(pieces))] + pieces[::-1]
    keep = []
    for (rows, rel), pc in zip(z.lend_rows(order), order, strict=False):
        assert torch.equal(rows, src.read_rows(*pc)), pc
        rows.add_(1.0)
        keep.append((rows, pc))
        rel()
    assert all(torch.equal(r, src.read_rows(*pc) + 1.0) for r, pc in keep)
    del keep, rows
    T = torch.randn(1, 2, k)
    assert torch.equal(tif.score(z, T, device="cpu", chunk_rows=256), tif.score(src, T, device="cpu", chunk_rows=256))
    gc.collect()
    assert store_maps(tmp_path / "w.zarr") == [] and store_fds(tmp_path / "w.zarr") == []


# ------------------------------------------------------ file changes (one child process)
# Every scenario that could end a process (SIGBUS) or hang runs in one child, each on its own
# store, printing ``SCEN <name> <result>`` as it finishes; a scenario missing from the output
# means the child died there (its return code is reported).
CHILD_SCENARIOS = r"""
import random
T = torch.randn(2, 3, 16)
def fresh(name, **kw):
    return make(tmp, n=2048, chunk=256, shard=1024, name=name + '.zarr', **kw)
def flip(p, off):
    with open(p, 'r+b') as f:
        f.seek(off); b = f.read(1); f.seek(-1, 1); f.write(bytes([b[0] ^ 0xFF]))
def scen(fn):
    try:
        r = fn()
        out = 'NOERROR' if r is None else r
    except CorruptStoreError as e:
        out = 'CORRUPT'
    except BaseException as e:
        out = 'OTHER:' + type(e).__name__ + ':' + str(e)[:100].replace('\n', ' ')
    print('SCEN', fn.__name__, out, flush=True)

def truncated_between_lends():
    src, z = fresh('a')
    g = z.lend_rows([(0, 0, 256), (0, 256, 512), (0, 768, 1024)])
    r = next(g); r[1](); del r
    os.truncate(shard(tmp / 'a.zarr', 0, 0), 4096)
    for r in g:
        float(r[0].sum()); r[1]()

def truncated_while_view_held_then_release():
    src, z = fresh('b')
    g = z.lend_rows([(0, 0, 256), (0, 256, 512)])
    rows, rel = next(g)
    os.truncate(shard(tmp / 'b.zarr', 0, 0), 4096)
    rel()

def truncated_between_queries():
    src, z = fresh('c')
    tif.score(z, T, device='cpu', chunk_rows=256)
    p = shard(tmp / 'c.zarr', 1, 1)
    os.truncate(p, os.path.getsize(p) - 4)
    tif.score(z, T, device='cpu', chunk_rows=256)

def truncated_between_score_chunks_blocks():
    src, z = fresh('d')
    for i, (s, b) in enumerate(tif.score_chunks(z, T, device='cpu', chunk_rows=256)):
        if i == 0:
            for c in range(2):
                for j in range(2):
                    os.truncate(shard(tmp / 'd.zarr', c, j), 100)
        float(b.sum())

def truncated_between_top_k_queries_to_zero():
    src, z = fresh('e')
    tif.top_k(z, T, k=3, device='cpu', chunk_rows=256)
    os.truncate(shard(tmp / 'e.zarr', 0, 0), 0)
    tif.top_k(z, T, k=3, device='cpu', chunk_rows=256)

def _replace(how, name):
    src, z = fresh(name)
    src2, z2 = make(tmp, n=2048, chunk=256, shard=1024, name=name + 'o.zarr', seed=5)
    p = shard(tmp / (name + '.zarr'), 0, 0)
    other = shard(tmp / (name + '.zarr'), 1, 0) if how != 'other_store' else shard(tmp / (name + 'o.zarr'), 0, 0)
    g = z.lend_rows([(0, 0, 256), (0, 256, 512)])
    r = next(g); r[1](); del r
    x = str(p) + '.x'
    if how == 'hardlink':
        os.link(other, x)
    elif how == 'symlink':
        os.symlink(other, x)
    else:
        shutil.copy(other, x)
    os.replace(x, p)
    r = next(g); ok = torch.equal(r[0], src.read_rows(0, 256, 512)); r[1]()
    tif.score(z, T, device='cpu', chunk_rows=256)
    return 'NOERROR-same-rows=%s' % ok

def replaced_by_copy_of_other_ckpt(): return _replace('copy', 'f')
def replaced_by_hardlink_of_other_ckpt(): return _replace('hardlink', 'g')
def replaced_by_symlink_to_other_ckpt(): return _replace('symlink', 'h')
def replaced_by_same_position_of_other_store(): return _replace('other_store', 'i')

def byte_flipped_between_lend_and_release():
    src, z = fresh('j')
    g = z.lend_rows([(0, 0, 256), (0, 256, 512)])
    rows, rel = next(g)
    flip(shard(tmp / 'j.zarr', 0, 0), 256 * 16 * 4 + 100)
    rel()

def byte_flipped_in_next_chunk_of_same_window():
    src, z = fresh('k')
    g = z.lend_rows([(0, 0, 256), (0, 256, 512)])
    rows, rel = next(g); rel()
    flip(shard(tmp / 'k.zarr', 0, 0), 256 * 16 * 4 + 100)
    r = next(g); r[1]()

def fifo_in_place_of_shard():
    src, z = fresh('l')
    p = shard(tmp / 'l.zarr', 0, 1)
    os.unlink(p); os.mkfifo(p)
    tif.score(z, T, device='cpu', chunk_rows=256)

def fifo_in_place_of_norms():
    src, z = fresh('m')
    p = tmp / 'm.zarr' / 'norms' / '0' / 'c' / '1'
    os.unlink(p); os.mkfifo(p)
    z.read_norms(0, 0, 2048)

def devzero_in_place_of_norms():
    src, z = fresh('n')
    p = tmp / 'n.zarr' / 'norms' / '1' / 'c' / '0'
    os.unlink(p); os.symlink('/dev/zero', p)
    tif.score(z, T, device='cpu', chunk_rows=256)

def views_readable_after_generator_and_store_dropped():
    src, z = make(tmp, n=2048, chunk=256, shard=1024, name='o.zarr')
    pieces = [(c, s, s + 256) for c in range(2) for s in range(0, 2048, 256)]
    pieces = pieces + pieces[::-1]
    keep = []
    g = z.lend_rows(pieces)
    for rows, rel in g:
        keep.append(rows); rel()
    g.close(); del g, z; gc.collect()
    ok = all(torch.equal(v, src.read_rows(*pc)) for v, pc in zip(keep, pieces))
    return 'OK' if ok else 'DIFF'

def fork_while_lending():
    src, z = fresh('p')
    want = tif.score(src, T, device='cpu', chunk_rows=256)
    g = z.lend_rows([(0, 0, 256), (0, 256, 512), (1, 0, 256)])
    r = next(g); r[1]()
    pid = os.fork()
    if pid == 0:
        try:
            torch.set_num_threads(1)
            s = tif.score(z, T, device='cpu', chunk_rows=256)
            r2 = next(g); ok2 = torch.equal(r2[0], src.read_rows(0, 256, 512)); r2[1]()
            os._exit(0 if torch.equal(s, want) and ok2 else 3)
        except BaseException:
            os._exit(4)
    _, st = os.waitpid(pid, 0)
    r = next(g); ok = torch.equal(r[0], src.read_rows(0, 256, 512)); r[1]()
    return 'child=%s parent_ok=%s' % (os.waitstatus_to_exitcode(st), ok)

for fn in [truncated_between_lends, truncated_while_view_held_then_release, truncated_between_queries,
           truncated_between_score_chunks_blocks, truncated_between_top_k_queries_to_zero,
           replaced_by_copy_of_other_ckpt, replaced_by_hardlink_of_other_ckpt,
           replaced_by_symlink_to_other_ckpt, replaced_by_same_position_of_other_store,
           byte_flipped_between_lend_and_release, byte_flipped_in_next_chunk_of_same_window,
           fifo_in_place_of_shard, fifo_in_place_of_norms, devzero_in_place_of_norms,
           views_readable_after_generator_and_store_dropped, fork_while_lending]:
    scen(fn)
print('DONE', flush=True)
"""


@pytest.fixture(scope="module")
def child_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("atk47child")
    code = CHILD_PRELUDE + f"tmp = Path({str(tmp)!r})\n" + CHILD_SCENARIOS
    try:
        r = run_child(code, timeout=50)
        out, rc, err = r.stdout, r.returncode, r.stderr
    except subprocess.TimeoutExpired as e:
        out, rc, err = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout", ""
    res = {}
    for ln in out.splitlines():
        if ln.startswith("SCEN "):
            _, name, val = ln.split(" ", 2)
            res[name] = val
    return res, rc, err[-3000:]


@pytest.mark.parametrize(
    "name,expected",
    [
        ("truncated_between_lends", "CORRUPT"),
        ("truncated_while_view_held_then_release", "CORRUPT"),
        ("truncated_between_queries", "CORRUPT"),
        ("truncated_between_score_chunks_blocks", "CORRUPT"),
        ("truncated_between_top_k_queries_to_zero", "CORRUPT"),
        ("replaced_by_copy_of_other_ckpt", "CORRUPT"),
        ("replaced_by_hardlink_of_other_ckpt", "CORRUPT"),
        ("replaced_by_symlink_to_other_ckpt", "CORRUPT"),
        ("replaced_by_same_position_of_other_store", "CORRUPT"),
        ("byte_flipped_between_lend_and_release", "CORRUPT"),
        ("byte_flipped_in_next_chunk_of_same_window", "CORRUPT"),
        ("fifo_in_place_of_shard", "CORRUPT"),
        ("fifo_in_place_of_norms", "CORRUPT"),
        ("devzero_in_place_of_norms", "CORRUPT"),
        ("views_readable_after_generator_and_store_dropped", "OK"),
        ("fork_while_lending", "child=0 parent_ok=True"),
    ],
)
def test_held_file_changes_in_child(child_results, name, expected):
    res, rc, err = child_results
    assert name in res, f"child died before/in {name}: rc={rc} (SIGBUS is -7)\n{err}"
    assert res[name] == expected, (res[name], rc, err)


def test_held_symlink_to_identical_copy_scores(tmp_path):
    _src, z = make(tmp_path, n=2048, chunk=256, shard=1024)
    T = torch.randn(2, 3, 16)
    base = tif.score(z, T, device="cpu", chunk_rows=256)
    p = shard(tmp_path / "s.zarr", 0, 1)
    cp = tmp_path / "copy"
    shutil.copy(p, cp)
    os.unlink(p)
    os.symlink(cp, p)
    assert torch.equal(tif.score(z, T, device="cpu", chunk_rows=256), base)


# ============================================================ surface 2: norms and scales
@pytest.mark.parametrize("chunk,shard", [(256, 512), (1, 64), (7, 700), (1000, 1000)])
def test_held_read_norms_ranges_equal_source(tmp_path, chunk, shard):
    src, z = make(tmp_path, n=1000, chunk=chunk, shard=shard)
    for c in range(2):
        for s, e in [(0, 1000), (0, 0), (999, 1000), (255, 257), (511, 513), (300, 900), (1000, 1000)]:
            assert torch.equal(z.read_norms(c, s, e), src.read_norms(c, s, e)), (c, s, e)
        assert torch.equal(z.read_norms(c, np.int64(3), np.int64(9)), src.read_norms(c, 3, 9))


@pytest.mark.parametrize("args", [(0, -1, 5), (0, 0, 1001), (0, 0.0, 5), (0, True, 5), (2, 0, 5), (-1, 0, 5), (0, 5, 3)])
def test_held_read_norms_bad_args(tmp_path, args):
    _, z = make(tmp_path)
    with pytest.raises((tif.errors.InvalidTypeError, tif.errors.RowRangeError)):
        z.read_norms(*args)


def _norm_file(p, c, i):
    return Path(p) / "norms" / str(c) / "c" / str(i)


@pytest.mark.parametrize("fault", ["flip", "truncate", "missing", "swap_ckpt", "swap_shards", "other_store", "grow", "dir"])
def test_held_norms_fault_is_corrupt(tmp_path, fault):
    _src, z = make(tmp_path)
    _, _z2 = make(tmp_path, name="o.zarr", seed=3)
    p = tmp_path / "s.zarr"
    z.read_norms(0, 0, 1000)  # verified once with the old identity
    f = _norm_file(p, 0, 0)
    if fault == "flip":
        b = bytearray(f.read_bytes())
        b[40] ^= 0x01
        f.write_bytes(bytes(b))
    elif fault == "truncate":
        os.truncate(f, os.path.getsize(f) - 8)
    elif fault == "grow":
        with open(f, "ab") as fh:
            fh.write(b"\0" * 8)
    elif fault == "missing":
        f.unlink()
    elif fault == "swap_ckpt":
        g = _norm_file(p, 1, 0)
        tmp = f.with_suffix(".x")
        os.replace(f, tmp)
        os.replace(g, f)
        os.replace(tmp, g)
    elif fault == "swap_shards":
        g = _norm_file(p, 0, 1)
        tmp = f.with_suffix(".x")
        os.replace(f, tmp)
        os.replace(g, f)
        os.replace(tmp, g)
    elif fault == "other_store":
        shutil.copy(_norm_file(tmp_path / "o.zarr", 0, 0), f)
    elif fault == "dir":
        f.unlink()
        f.mkdir()
    with pytest.raises(CorruptStoreError):
        z.read_norms(0, 0, 1000)
    with pytest.raises(CorruptStoreError):
        tif.self_influence(z, device="cpu")
    z3 = tif.GradientStore.open(p)
    with pytest.raises(CorruptStoreError):
        tif.score(z3, torch.randn(2, 2, 16), device="cpu", normalize=True)


def test_held_norms_flip_only_in_second_shard_caught_by_score(tmp_path):
    _src, z = make(tmp_path)
    f = _norm_file(tmp_path / "s.zarr", 1, 1)
    b = bytearray(f.read_bytes())
    b[100] ^= 0x40
    f.write_bytes(bytes(b))
    with pytest.raises(CorruptStoreError):
        tif.score(z, torch.randn(2, 2, 16), device="cpu")
    with pytest.raises(CorruptStoreError):
        tif.top_k(z, torch.randn(2, 2, 16), k=2, device="cpu")


@pytest.mark.parametrize("q,k", [("int8", 64), ("sign", 64), ("sign", 63), ("int8", 5)])
def test_held_quantised_store_scores_and_scales(tmp_path, q, k):
    src, z = make(tmp_path, n=1000, k=k, q=q, chunk=256, shard=512)
    for c in range(2):
        for s, e in [(0, 1000), (255, 513), (999, 1000), (0, 0)]:
            a, b = z.read_codes(c, s, e), src.read_codes(c, s, e)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            assert torch.equal(z.read_norms(c, s, e), src.read_norms(c, s, e))
    T = torch.randn(2, 3, k)
    assert torch.allclose(tif.score(z, T, device="cpu").double(), brute(src, T), rtol=1e-5, atol=1e-5)
    assert torch.allclose(tif.self_influence(z, device="cpu"), tif.self_influence(src))


@pytest.mark.parametrize("fault", ["flip", "truncate", "swap_ckpt", "missing"])
def test_held_quantised_scales_fault_is_corrupt(tmp_path, fault):
    _src, z = make(tmp_path, n=1000, k=64, q="int8", chunk=256, shard=512)
    z.read_codes(0, 0, 1000)
    f = _norm_file(tmp_path / "s.zarr", 0, 1, ) if False else Path(tmp_path / "s.zarr") / "scales" / "0" / "c" / "1"
    assert f.exists(), sorted(str(x) for x in (tmp_path / "s.zarr").rglob("*"))
    if fault == "flip":
        b = bytearray(f.read_bytes())
        b[20] ^= 0x08
        f.write_bytes(bytes(b))
    elif fault == "truncate":
        os.truncate(f, 50)
    elif fault == "missing":
        f.unlink()
    else:
        g = Path(tmp_path / "s.zarr") / "scales" / "1" / "c" / "1"
        t = f.with_suffix(".x")
        os.replace(f, t)
        os.replace(g, f)
        os.replace(t, g)
    with pytest.raises(CorruptStoreError):
        z.read_codes(0, 256, 1000)
    with pytest.raises(CorruptStoreError):
        tif.score(z, torch.randn(2, 2, 64), device="cpu")


def test_held_norms_swapped_between_checkpoints_rows_too(tmp_path):
    # class 3: a binding that compares too little; swap rows and norms of ckpt 0 and 1 wholesale
    _src, _z = make(tmp_path)
    p = tmp_path / "s.zarr"
    for kind in ("rows", "norms"):
        a, b = p / kind / "0", p / kind / "1"
        os.replace(a, p / kind / "x")
        os.replace(b, a)
        os.replace(p / kind / "x", b)
    with pytest.raises(CorruptStoreError):
        tif.score(tif.GradientStore.open(p), torch.randn(2, 2, 16), device="cpu")


# ============================================================ surface 3: precision
_NEW_API = [
    ("backends", lambda: torch.backends),
    ("cuda.matmul", lambda: torch.backends.cuda.matmul),
    ("mkldnn.matmul", lambda: torch.backends.mkldnn.matmul),
    ("mkldnn", lambda: torch.backends.mkldnn),
    ("cudnn", lambda: torch.backends.cudnn),
]


def _knobs():
    """The precision settings, read through torch's new API only (the legacy getter raises
    once both APIs were used)."""
    out = tuple(f().fp32_precision for _, f in _NEW_API)
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = "mixed"
    return (*out, legacy)


@pytest.fixture
def restore_knobs():
    saved_new = [(f(), f().fp32_precision) for _, f in _NEW_API]
    saved_legacy = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(saved_legacy)
    for obj, v in saved_new:
        obj.fp32_precision = v
    torch.get_float32_matmul_precision()  # consistent again


def _set(mode):
    where, value = mode.split("=")
    if where == "legacy":
        torch.set_float32_matmul_precision(value)
    else:
        dict((n, f) for n, f in _NEW_API)[where]().fp32_precision = value


def _precision_case(tmp_path, mode):
    src, z = make(tmp_path, n=1024, k=512, chunk=256, shard=512)
    T = torch.randn(2, 64, 512)
    base = tif.score(z, T, device="cpu", chunk_rows=256)
    bv, bi = tif.top_k(z, T, k=5, device="cpu", chunk_rows=256)
    bsi = tif.self_influence(z, device="cpu", chunk_rows=256)
    bblocks = [b.clone() for _, b in tif.score_chunks(z, T, device="cpu", chunk_rows=256)]
    ref = brute(src, T)
    _set(mode)
    before = _knobs()
    s = tif.score(z, T, device="cpu", chunk_rows=256)
    assert _knobs() == before
    v, i = tif.top_k(z, T, k=5, device="cpu", chunk_rows=256)
    assert _knobs() == before
    si = tif.self_influence(z, device="cpu", chunk_rows=256)
    assert _knobs() == before
    blocks = []
    for _, b in tif.score_chunks(z, T, device="cpu", chunk_rows=256):
        assert _knobs() == before
        blocks.append(b.clone())
    assert _knobs() == before
    assert torch.equal(s, base)
    assert torch.equal(v, bv) and torch.equal(i, bi)
    assert torch.equal(si, bsi)
    assert all(torch.equal(a, b) for a, b in zip(blocks, bblocks, strict=False))
    assert ((s.double() - ref).abs().max() / ref.abs().max()).item() < 2e-6
    ms = tif.score(src, T, device="cpu", chunk_rows=256)  # a memory store too
    assert torch.allclose(ms, base, rtol=0, atol=1e-5 * base.abs().max().item())
    assert _knobs() == before


@pytest.mark.parametrize("mode", ["legacy=medium", "legacy=high"])
def test_held_caller_precision_does_not_change_scores(tmp_path, restore_knobs, mode):
    _precision_case(tmp_path, mode)


@pytest.mark.parametrize(
    "mode", ["mkldnn.matmul=bf16", "mkldnn.matmul=tf32", "backends=tf32", "cuda.matmul=tf32"]
)
def test_finding_new_fp32_precision_api_makes_queries_raise(tmp_path, restore_knobs, mode):
    """Expected: a caller who set a float32 precision through torch's current API
    (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``, ``torch.backends.fp32_precision
    = "tf32"``, ``torch.backends.cuda.matmul.fp32_precision = "tf32"``) gets IEEE float32 scores
    (bit-equal to the default run) from ``score``/``top_k``/``score_chunks``, and their settings
    back. Observed: each raises torch's ``RuntimeError: PyTorch is checking the matmul precision
    without a specific backend name ... mix of the legacy and new APIs`` (the query reads the
    legacy ``torch.get_float32_matmul_precision()``), over Zarr and memory stores alike;
    ``self_influence`` runs. The legacy ``set_float32_matmul_precision("medium")`` works."""
    _precision_case(tmp_path, mode)


def test_held_precision_restored_after_failing_query(tmp_path, restore_knobs):
    _, z = make(tmp_path)
    torch.set_float32_matmul_precision("medium")
    before = _knobs()
    with pytest.raises(tif.errors.TracInFuncError):
        tif.score(z, torch.randn(2, 3, 15), device="cpu")
    with pytest.raises(tif.errors.TracInFuncError):
        tif.top_k(z, torch.randn(2, 3, 16), k=0, device="cpu")
    assert _knobs() == before


def _between_blocks(tmp_path, mode):
    _src, z = make(tmp_path, n=2048, k=512, chunk=256, shard=512)
    T = torch.randn(2, 64, 512)
    base = [b.clone() for _, b in tif.score_chunks(z, T, device="cpu", chunk_rows=256)]
    got, seen, set_ = [], [], []
    for j, (_s, b) in enumerate(tif.score_chunks(z, T, device="cpu", chunk_rows=256)):
        got.append(b.clone())
        seen.append(_knobs())
        if j % 2 == 0:
            _set(mode)
        else:
            torch.set_float32_matmul_precision("highest")
            for _, f in _NEW_API:
                f().fp32_precision = "none"
        set_.append(_knobs())
    for a, b in zip(got, base, strict=False):
        assert torch.equal(a, b)
    # user code between blocks sees the user's own last setting; it is kept afterwards
    assert seen[1:] == set_[:-1]
    assert _knobs() == set_[-1]


def test_held_score_chunks_user_changes_precision_between_blocks(tmp_path, restore_knobs):
    _between_blocks(tmp_path, "legacy=medium")


def test_finding_score_chunks_user_sets_new_api_precision_between_blocks(tmp_path, restore_knobs):
    """Expected: user code that sets ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``
    between ``score_chunks`` blocks gets later blocks in IEEE float32 (bit-equal to an
    undisturbed run) and keeps its setting. Observed: the next block raises torch's
    ``RuntimeError`` about mixing the legacy and new precision APIs."""
    _between_blocks(tmp_path, "mkldnn.matmul=bf16")


def test_held_score_chunks_abandoned_restores_caller_precision(tmp_path, restore_knobs):
    _, z = make(tmp_path, n=2048, k=64, chunk=256, shard=512)
    torch.set_float32_matmul_precision("medium")
    before = _knobs()
    g = tif.score_chunks(z, torch.randn(2, 3, 64), device="cpu", chunk_rows=256)
    next(g)
    assert _knobs() == before
    next(g)
    assert _knobs() == before
    g.close()
    assert _knobs() == before
    g = tif.score_chunks(z, torch.randn(2, 3, 64), device="cpu", chunk_rows=256)
    next(g)
    del g
    gc.collect()
    assert _knobs() == before


# ============================================================ class 4: integer kinds in pieces and ranges
def _u8_store(tmp_path, chunk=250, shard=250, q=None, k=4):
    return make(tmp_path, n=300, k=k, n_ckpt=1, chunk=chunk, shard=shard, q=q)


def _same_or_refused(call, want):
    """A numpy integer bound either reads the right values or is refused by type."""
    try:
        with np.errstate(over="ignore"):
            got = call()
    except (tif.errors.InvalidTypeError, tif.errors.RowRangeError):
        return
    if isinstance(want, tuple):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=False)), "silently wrong values"
    else:
        assert torch.equal(got, want), "silently wrong values"


@pytest.mark.parametrize("chunk,shard", [(250, 250), (255, 255)])
def test_finding_read_norms_numpy_uint8_bounds_silently_wrong(tmp_path, chunk, shard):
    """Expected: ``ZarrStore.read_norms(0, np.uint8(130), np.uint8(140))`` gives the norms of rows
    130..139, as ``MemoryStore.read_norms`` does (NumPy integers are accepted elsewhere), or an
    ``InvalidTypeError``. Observed: other norms come back, with only NumPy's ``RuntimeWarning:
    overflow encountered in scalar multiply`` (the raw read computes the byte offset in uint8)."""
    src, z = _u8_store(tmp_path, chunk, shard)
    assert torch.equal(src.read_norms(0, np.uint8(130), np.uint8(140)), src.read_norms(0, 130, 140))
    _same_or_refused(lambda: z.read_norms(0, np.uint8(130), np.uint8(140)), src.read_norms(0, 130, 140))
    _same_or_refused(lambda: z.read_norms(0, np.uint8(240), np.uint8(250)), src.read_norms(0, 240, 250))


def test_finding_read_codes_numpy_uint8_scales_silently_wrong(tmp_path):
    """Expected: ``read_codes(0, np.uint8(130), np.uint8(140))`` of a Zarr int8 store equals the
    memory store's codes and scales (or is refused by type). Observed: other codes and scales,
    silently (NumPy overflow warning only)."""
    src, z = _u8_store(tmp_path, q="int8", k=8)
    _same_or_refused(lambda: z.read_codes(0, np.uint8(130), np.uint8(140)), src.read_codes(0, 130, 140))


def test_finding_read_rows_numpy_uint8_bounds_silently_wrong(tmp_path):
    """Expected: ``ZarrStore.read_rows(0, np.uint8(130), np.uint8(140))`` equals
    ``MemoryStore.read_rows`` (or a type refusal). Observed: other rows, silently (the raw row
    read shares the uint8 offset arithmetic; this may predate session 47)."""
    src, z = _u8_store(tmp_path)
    _same_or_refused(lambda: z.read_rows(0, np.uint8(130), np.uint8(140)), src.read_rows(0, 130, 140))


@pytest.mark.parametrize("chunk,shard,bounds", [(250, 250, (0, 250)), (7, 252, (0, 250)), (100, 200, (0, 250))])
def test_finding_read_norms_numpy_uint8_errors_misleading(tmp_path, chunk, shard, bounds):
    """Expected: the right norms, or ``InvalidTypeError`` naming the argument. Observed: a raw
    ``OverflowError: Python integer 1000 out of bounds for uint8`` (chunk 250) or a
    ``CorruptStoreError`` telling the user the (intact) store is damaged and to rebuild it
    (chunk 7, shard 252)."""
    src, z = _u8_store(tmp_path, chunk, shard)
    a, b = bounds
    try:
        got = z.read_norms(0, np.uint8(a), np.uint8(b))
    except (tif.errors.InvalidTypeError, tif.errors.RowRangeError):
        return
    assert torch.equal(got, src.read_norms(0, a, b))
    assert torch.equal(z.read_norms(0, 0, 300), src.read_norms(0, 0, 300))  # the store is intact


def test_finding_lend_rows_tensor_bounds_blamed_on_store(tmp_path):
    """Expected: a piece ``(0, torch.tensor(0), torch.tensor(256))`` (0-d integer tensors, which
    ``read_rows`` accepts) is lent, or refused with ``InvalidTypeError``. Observed:
    ``CorruptStoreError``: "shard file .../rows/0/c/tensor(0)/0 ... is missing. The store is
    damaged on disk; rebuild it" - the intact store is blamed (``map_rows`` alike)."""
    src, z = make(tmp_path)
    assert torch.equal(z.read_rows(0, torch.tensor(0), torch.tensor(256)), src.read_rows(0, 0, 256))
    for call in (lambda: list(z.lend_rows([(0, torch.tensor(0), torch.tensor(256))])),
                 lambda: [z.map_rows(0, torch.tensor(0), torch.tensor(256))]):
        try:
            out = call()
        except tif.errors.InvalidTypeError:
            continue
        assert out[0] is None or torch.equal(out[0][0], src.read_rows(0, 0, 256))


@pytest.mark.parametrize("kind", ["uint8", "int16", "uint16"])
def test_finding_lend_rows_small_numpy_int_piece_raw_error(tmp_path, kind):
    """Expected: a piece of small NumPy integers lends the chunk (or yields None, or refuses the
    type), as ``read_rows`` with the same bounds reads it. Observed: uint8
    ``(0, np.uint8(0), np.uint8(250))`` on 250-row chunks: torch's ``RuntimeError: shape
    '[250, -1]' is invalid for input of size 40``; int16/uint16 ``(0, 512, 768)`` at k = 64:
    NumPy's ``ValueError: both buffer length (0) and count (-1) must not be 0`` (byte offsets
    computed in the piece's dtype wrap)."""
    if kind == "uint8":
        src, z = _u8_store(tmp_path)
        a, b = 0, 250
    else:
        src, z = make(tmp_path, n=1024, k=64, n_ckpt=1, chunk=256, shard=1024)
        a, b = 512, 768
    t = getattr(np, kind)
    assert torch.equal(z.read_rows(0, 0, 0), src.read_rows(0, 0, 0))
    try:
        with np.errstate(over="ignore"):
            out = list(z.lend_rows([(0, t(a), t(b))]))
    except (tif.errors.InvalidTypeError, tif.errors.RowRangeError):
        return
    assert out[0] is None or torch.equal(out[0][0], src.read_rows(0, a, b))


def test_held_queries_normalise_numpy_rows_bounds(tmp_path):
    src, z = _u8_store(tmp_path)
    T = torch.randn(1, 2, 4)
    for rows in [(np.uint8(130), np.uint8(140)), (np.uint8(0), np.uint8(250)), (np.int16(240), np.int64(300))]:
        got = tif.score(z, T, rows=rows, device="cpu", chunk_rows=250)
        assert torch.equal(got, tif.score(src, T, rows=(int(rows[0]), int(rows[1])), device="cpu", chunk_rows=250))


def test_held_threads_lend_and_write_concurrently(tmp_path):
    src, z = _window_store(tmp_path)
    pieces = [(c, s, s + 256) for c in range(2) for s in range(0, 2048, 256)]
    want = {pc: src.read_rows(*pc) for pc in pieces}
    bad, errs = [], []

    def work(seed):
        try:
            order = [pieces[i] for i in np.random.default_rng(seed).permutation(len(pieces))] * 2
            for (rows, rel), pc in zip(z.lend_rows(order), order, strict=False):
                if not torch.equal(rows, want[pc]):
                    bad.append(pc)
                rows.fill_(float(seed))
                rel()
            for _ in range(5):
                if not torch.equal(z.read_norms(1, 0, 2048), src.read_norms(1, 0, 2048)):
                    bad.append("norms")
        except Exception as e:
            errs.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errs and not bad
    gc.collect()
    assert store_fds(tmp_path / "s.zarr") == [] and store_maps(tmp_path / "s.zarr") == []


def test_held_norms_and_self_influence_loops_leak_nothing(tmp_path):
    _src, z = make(tmp_path, n=1000, chunk=256, shard=256)
    n0 = len(os.listdir("/proc/self/fd"))
    for _ in range(300):
        z.read_norms(0, 0, 1000)
        z.read_norms(1, 255, 257)
    for _ in range(50):
        tif.self_influence(z, device="cpu")
        tif.top_k(z, torch.randn(2, 1, 16), k=2, device="cpu", normalize=True)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= n0 + 2
    assert store_fds(tmp_path / "s.zarr") == [] and store_maps(tmp_path / "s.zarr") == []


@pytest.mark.parametrize("cr", [512, 768, 300, 1, 2048])
def test_held_chunk_rows_multiples_and_non_multiples(tmp_path, cr):
    src, z = make(tmp_path, n=2000, chunk=256, shard=512)
    T = torch.randn(2, 3, 16)
    got = torch.cat([b.clone() for _, b in tif.score_chunks(z, T, device="cpu", chunk_rows=cr)], 1)
    mem = torch.cat([b.clone() for _, b in tif.score_chunks(src, T, device="cpu", chunk_rows=cr)], 1)
    assert torch.equal(got, mem)
    assert torch.allclose(got.double(), brute(src, T), rtol=1e-5, atol=1e-5)
    assert torch.equal(tif.score(z, T, device="cpu", chunk_rows=cr), tif.score(src, T, device="cpu", chunk_rows=cr))


def test_held_fsspec_memory_store_norms_raw(tmp_path):
    """Object-storage-like store (fsspec ``memory://``): norms read raw equal the source; a
    flipped byte is caught on the open store; swapped checkpoint norms are caught at open.
    (A swap of two objects *after* the open store has read them is not caught on the open
    store - documented: size and tail are compared once per object on object storage.)"""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    root = f"/atk47/{tmp_path.name}/s.zarr"
    src = tt.reference_store(n_train=1000, k=16, n_ckpt=2)
    z = tif.save_store(src, "memory://" + root, chunk_rows=256, shard_rows=512, progress=False)
    try:
        for c in range(2):
            for s, e in [(0, 1000), (255, 513), (999, 1000)]:
                assert torch.equal(z.read_norms(c, s, e), src.read_norms(c, s, e))
        a, b = fs.cat(root + "/norms/0/c/0"), fs.cat(root + "/norms/1/c/0")
        flipped = bytearray(a)
        flipped[40] ^= 1
        fs.pipe(root + "/norms/0/c/0", bytes(flipped))
        with pytest.raises(CorruptStoreError):
            z.read_norms(0, 0, 1000)
        fs.pipe(root + "/norms/0/c/0", b)
        fs.pipe(root + "/norms/1/c/0", a)
        with pytest.raises(CorruptStoreError):
            tif.GradientStore.open("memory://" + root).read_norms(0, 0, 1000)
    finally:
        fs.rm("/atk47/" + tmp_path.name, recursive=True)
