"""GPU figures in one command, each ratio measured side by side in the same run.

* **PinnedStore** ``score`` throughput (GB/s of rows) against the pinned host-to-device copy
  bandwidth of the same bytes (target >= 0.8x);
* **ZarrStore** ``score``, warm (page cache) and cold (``posix_fadvise(DONTNEED)``), against
  the same pinned copy bandwidth;
* **projected gradients** (``kronecker``, ``sjlt``): examples/s of ``projected_grads``
  against one batched forward + backward of the same batch (the cost of training on it);
* **issue 23 items 12-14**: bytes a PinnedStore pins against the bytes it holds (the caching
  host allocator rounded a 20.5 GB store to 32 GB); quantised stores (int8 pinned, int8
  Zarr) scored from codes dequantised on the device, their ``score`` time against the float32
  PinnedStore's; a GPU ``build_store`` with its copy-out and writes overlapped against the
  serial loop (same rows, bit for bit);
* **tracinfunc.jax** on JAX's default device: exact rows against the torch CPU build, also
  with the caller asking for TF32 (JAX's GPU default);
* **GPT-2 small's shape**, every parameter, kronecker with ``vectors="kronecker"``:
  examples/s of ``causal_lm_loss`` and of a hand-written ``functional_call`` loss (its
  attention folded into the fused kernels under ``vmap``) against forward + backward;
* **dattri PR #257 configuration** (784 -> 10 logistic regression, 10k train / 2k test,
  batch 100, 2 checkpoints, k=512) end to end, gradients to the score matrix:
  ``build_store`` + ``score`` against the naive torch.func reference (``vmap(grad)``, a dense
  Gaussian ``[p, k]`` per checkpoint, ``test @ train.T``), both on the GPU.

Every figure is also checked against the CPU path (scores, projected rows), printed as
``PASS``/``FAIL``; the exit status is 1 if any check failed, so the first run on a GPU gives
a verdict in one command. Without CUDA, ``--quick`` runs the CPU checks and says which GPU
parts it skipped (exit 0 when they pass).

    python benchmarks/gpu.py            # needs CUDA for the measurements
    python benchmarks/gpu.py --quick
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


FAILURES: list[str] = []


def check(name: str, got: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """Print PASS/FAIL: ``got`` (any device) against ``expected`` (the CPU path)."""
    got, expected = got.detach().double().cpu(), expected.detach().double().cpu()
    error = float((got - expected).norm() / expected.norm().clamp_min(1e-30))
    ok = got.shape == expected.shape and error <= rtol
    print(f"  {'PASS' if ok else 'FAIL'} {name}: relative error {error:.2e} (<= {rtol:.0e})")
    if not ok:
        FAILURES.append(name)


def cuda_time(fn, repeat: int = 3) -> float:
    """Best wall time of ``fn()`` in seconds, synchronising the device around each run."""
    fn()  # warm-up: allocations, kernels, thread pools
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def h2d_bandwidth(nbytes: int) -> float:
    """Pinned host -> device copy bandwidth in GB/s, in 64 MiB pieces like the streamer."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    device = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    step = device.numel()

    def copy():
        for start in range(0, nbytes, step):
            piece = host[start : start + step]
            device[: piece.numel()].copy_(piece, non_blocking=True)

    return nbytes / cuda_time(copy) / 1e9


def random_meta(tif, n: int, k: int):
    from tracinfunc.build.loop import new_store_meta

    return new_store_meta([("c0", 1.0, "f")], tif.projection.canonical_layout({"w": (k,)}),
                          tif.Projection(dim=None, kind="identity"), torch.float32, None)


def fill(writer, n: int, k: int):
    g = torch.Generator().manual_seed(0)
    for start in range(0, n, 65536):
        rows = torch.randn(1, min(65536, n - start), k, generator=g)
        writer.append(rows, rows.norm(dim=-1))
    return writer.finish()


def drop_cache(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def bench_stores(tif, n: int, k: int, *, measure: bool) -> None:
    """Score throughput (with CUDA), and scores checked against the CPU path (always)."""
    device = "cuda" if measure else "cpu"
    nbytes = n * k * 4
    test = torch.randn(1, 64, k, generator=torch.Generator().manual_seed(1))
    print(f"stores: {n} x {k} float32 ({nbytes / 1e9:.2f} GB), 64 test rows, on {device}")
    pinned = fill(tif.store.PinnedWriter(random_meta(tif, n, k), n_train=n), n, k)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        path = Path(tmp) / "grads.zarr"
        store = fill(tif.store.ZarrWriter(path, random_meta(tif, n, k)), n, k)
        rows = (0, min(n, 50_000))  # the CPU reference on part of the rows keeps it quick
        expected = tif.score(pinned, test, device="cpu", rows=rows)
        top_values, _ = tif.top_k(pinned, test, k=10, device="cpu", rows=rows)
        on_device = test.to(device)  # test gradients on the device, as a user has them
        for name, source in (("PinnedStore", pinned), ("ZarrStore", store)):
            check(f"{name} score on {device} vs CPU",
                  tif.score(source, on_device, rows=rows, device=device), expected, 1e-5)
            values, _ = tif.top_k(source, on_device, k=10, rows=rows, device=device)
            check(f"{name} top_k on {device} vs CPU", values, top_values, 1e-5)
        if measure:
            measure_stores(tif, pinned, store, path, on_device, nbytes)


def measure_stores(tif, pinned, store, path: Path, test, nbytes: int) -> None:
    bandwidth = h2d_bandwidth(nbytes)
    print(f"  pinned H2D copy                  {bandwidth:6.1f} GB/s")
    rate = nbytes / cuda_time(lambda: tif.score(pinned, test, device="cuda")) / 1e9
    print(f"  PinnedStore score                {rate:6.1f} GB/s   {rate / bandwidth:.2f}x "
          "(target >= 0.8x)")
    warm = nbytes / cuda_time(lambda: tif.score(store, test, device="cuda")) / 1e9
    print(f"  ZarrStore score, warm            {warm:6.1f} GB/s   {warm / bandwidth:.2f}x")

    def cold():
        drop_cache(path)
        torch.cuda.synchronize()
        start = time.perf_counter()
        tif.score(store, test, device="cuda")
        torch.cuda.synchronize()
        return time.perf_counter() - start

    cold_rate = nbytes / min(cold() for _ in range(2)) / 1e9
    print(f"  ZarrStore score, cold            {cold_rate:6.1f} GB/s   "
          f"{cold_rate / bandwidth:.2f}x")


def bench_pinned_bytes(tif, n: int, k: int) -> None:
    """Bytes pinned for a PinnedStore against the bytes of its rows (item 12): counted at
    the registration (``cudaHostRegister`` with CUDA, a counter without)."""
    from tracinfunc.store.memory import pinned as pinned_module

    real, requested = pinned_module.host_pinning, []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def register(self, address, nbytes):
            requested.append(nbytes)
            if self.inner is not None:
                self.inner.register(address, nbytes)

        def unregister(self, address):
            if self.inner is not None:
                self.inner.unregister(address)

    pinned_module.host_pinning = lambda: Counting(real())
    try:
        store = fill(tif.store.PinnedWriter(random_meta(tif, n, k), n_train=n), n, k)
    finally:
        pinned_module.host_pinning = real
    needed = n * k * 4
    ratio = sum(requested) / needed
    print(f"pinned memory: {needed / 2**20:.1f} MiB of rows, {sum(requested) / 2**20:.1f} MiB "
          f"pinned ({ratio:.4f}x; the caching allocator: "
          f"{2 ** (needed - 1).bit_length() / needed:.2f}x)")
    ok = ratio <= 1 + 2 * pinned_module.PAGE / needed and store.meta.n_train == n
    print(f"  {'PASS' if ok else 'FAIL'} PinnedStore pins its own size")
    if not ok:
        FAILURES.append("PinnedStore pins its own size")


def bench_quantised(tif, n: int, k: int, *, measure: bool) -> None:
    """int8 stores scored from codes sent to the device (item 13), checked against the CPU
    path; with CUDA, their ``score`` time against the float32 PinnedStore's."""
    device = "cuda" if measure else "cpu"
    meta = random_meta(tif, n, k)
    test = torch.randn(1, 64, k, generator=torch.Generator().manual_seed(1)).to(device)
    pinned = fill(tif.store.PinnedWriter(meta, n_train=n), n, k)
    quantised = tif.to_pinned(pinned, dtype="int8")
    print(f"quantised stores: {n} x {k} int8 codes, 64 test rows, on {device}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        zarr = tif.save_store(quantised, Path(tmp) / "q.zarr")
        expected = tif.score(quantised, test.cpu(), device="cpu")
        for name, store in (("QuantizedPinnedStore", quantised), ("int8 ZarrStore", zarr)):
            check(f"{name} score on {device} vs CPU", tif.score(store, test, device=device),
                  expected, 1e-5)
        if measure:
            base = cuda_time(lambda: tif.score(pinned, test, device="cuda"))
            for name, store in (("QuantizedPinnedStore", quantised), ("int8 ZarrStore", zarr)):
                took = cuda_time(lambda store=store: tif.score(store, test, device="cuda"))
                print(f"  {name:<24} score {took * 1e3:8.1f} ms   {base / took:.2f}x the "
                      "float32 PinnedStore's speed")


def bench_build_overlap(tif, n: int) -> None:
    """A GPU build_store with the copy-out pipeline against the serial loop (item 14)."""
    import torch.nn.functional as F
    from torch import nn

    from tracinfunc.build import copy_out

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)).eval()
    loss = tif.loss_from_module(model, F.cross_entropy)
    ckpts = [tif.Checkpoint.from_module(model)]
    data = (torch.randn(n, 512), torch.randint(0, 10, (n,)))
    projection = tif.Projection(dim=4096, seed=0)
    print(f"build_store on cuda: MLP 512-512-10, {n} examples, k=4096, Zarr store")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        runs = iter(range(10**6))

        def build():
            return tif.build_store(loss, ckpts, data, projection=projection, device="cuda",
                                   batch_size=256, store=Path(tmp) / f"{next(runs)}.zarr",
                                   progress=False)

        overlapped = build()
        took = cuda_time(build, repeat=2)
        real = copy_out.copy_backend
        copy_out.copy_backend = lambda device: None  # the serial loop
        try:
            serial = build()
            serial_took = cuda_time(build, repeat=2)
        finally:
            copy_out.copy_backend = real
        print(f"  overlapped {n / took:10.0f} ex/s   serial {n / serial_took:10.0f} ex/s   "
              f"{serial_took / took:.2f}x")
        check("overlapped build rows vs the serial build", overlapped.read_rows(0, 0, n),
              serial.read_rows(0, 0, n), 0.0)


def bench_projected(tif, batch: int) -> None:
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                          nn.Linear(1024, 10)).cuda().eval()
    x = torch.randn(batch, 1024, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")
    params = {name: p.detach() for name, p in model.named_parameters()}
    loss = tif.loss_from_module(model, F.cross_entropy)

    def forward_backward():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    base = batch / cuda_time(forward_backward)
    print(f"projected gradients: MLP 1024-1024-1024-10, batch {batch}")
    print(f"  batched forward + backward       {base:10.0f} examples/s")
    cpu_model = copy.deepcopy(model).cpu()
    cpu_loss = tif.loss_from_module(cpu_model, F.cross_entropy)
    cpu_params = {name: p.detach() for name, p in cpu_model.named_parameters()}
    part = (x[:32].cpu(), y[:32].cpu())
    for projection in (tif.Projection(dim=1024, kind="kronecker", seed=0),
                       tif.Projection(dim=4096, kind="sjlt", nnz=4, seed=0)):
        fn = tif.projected_grads(loss, projection)
        rate = batch / cuda_time(lambda fn=fn: fn(params, (x, y)))
        print(f"  {projection.kind:<10} k={projection.dim:<5}            {rate:10.0f} "
              f"examples/s   {rate / base:.2f}x of forward + backward")
        check(f"{projection.kind} rows on cuda vs CPU", fn(params, (x[:32], y[:32])),
              tif.projected_grads(cpu_loss, projection)(cpu_params, part), 1e-5)


def bench_language_model(tif, batch: int, tokens: int) -> None:
    """GPT-2 small's shape (124M), every parameter, ``kind="kronecker"`` with
    ``vectors="kronecker"``: examples/s of ``projected_grads`` for ``causal_lm_loss`` (one
    batched forward) and for a hand-written ``functional_call`` loss (``vmap(loss)``, its
    attention folded into the fused kernels: tracinfunc/_attention.py), against one batched
    forward + backward; the two losses' rows checked against each other and the CPU's."""
    import warnings

    import torch.nn.functional as F
    import transformers
    from torch.func import functional_call
    from torch.utils._pytree import tree_map

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_positions=max(tokens, 1024))  # 12 x 768, vocab 50,257
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    model = model.cuda().eval()
    ids = torch.randint(0, config.vocab_size, (batch, tokens), device="cuda")
    params = {name: p.detach() for name, p in model.named_parameters()}

    def hand_written(p, example):
        one = example[None]
        return functional_call(model, p, (), {"input_ids": one, "labels": one}).loss

    def forward_backward():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()

    base = batch / cuda_time(forward_backward)
    model.zero_grad(set_to_none=True)
    projection = tif.Projection(dim=4096, kind="kronecker", vectors="kronecker", seed=0)
    print(f"language model: GPT-2 small shape (124M), batch {batch} x {tokens} tokens, every "
          f"parameter, kronecker k=4096, vectors='kronecker'")
    print(f"  batched forward + backward       {base:10.1f} examples/s")
    rows = {}
    for label, loss, data in (("causal_lm_loss", tif.causal_lm_loss(model), {"input_ids": ids}),
                              ("hand-written", hand_written, ids)):
        fn = tif.projected_grads(loss, projection)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # LossFormWarning: the point of the row
            rate = batch / cuda_time(lambda fn=fn, data=data: fn(params, data))
            rows[label] = fn(params, tree_map(lambda x: x[:2], data))
        print(f"  {label:<16}                 {rate:10.1f} examples/s   "
              f"{rate / base:.2f}x of forward + backward")
    # HF computes its own loss from float32 logits as the adapter does: the same value.
    check("hand-written rows vs causal_lm_loss rows", rows["hand-written"],
          rows["causal_lm_loss"], 1e-4)
    cpu_model = copy.deepcopy(model).cpu()
    cpu_params = {name: p.detach() for name, p in cpu_model.named_parameters()}
    check("causal_lm_loss rows on cuda vs CPU", rows["causal_lm_loss"],
          tif.projected_grads(tif.causal_lm_loss(cpu_model), projection)(
              cpu_params, {"input_ids": ids[:2].cpu()}), 1e-4)


def bench_dattri(tif, n_train: int, n_test: int) -> None:
    import torch.nn.functional as F
    from torch import nn
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Linear(784, 10).cuda().eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n_train + n_test, 784, generator=g).cuda()
    y = torch.randint(0, 10, (n_train + n_test,), generator=g).cuda()
    train, test = (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])
    states = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    states.append({n: v + 0.01 * torch.randn_like(v) for n, v in states[0].items()})
    lrs, k, batch = (0.1, 0.05), 512, 100

    def batches(data):
        return [(data[0][i : i + batch], data[1][i : i + batch])
                for i in range(0, len(data[1]), batch)]

    def tracinfunc_run(device="cuda"):
        loss = tif.loss_from_module(model, F.cross_entropy)
        ckpts = [tif.Checkpoint(params=s, lr=lr, name=f"e{i}")
                 for i, (s, lr) in enumerate(zip(states, lrs, strict=True))]
        store = tif.build_store(loss, ckpts, batches(train), projection=tif.Projection(dim=k),
                                store="pinned", progress=False, device=device)
        test_grads = tif.build_store(loss, ckpts, batches(test), projection=store.projection,
                                     progress=False, device=device)
        return tif.score(store, test_grads, device=device)

    def per_example_loss(params, xi, yi):
        return F.cross_entropy(functional_call(model, params, (xi[None],)), yi[None])

    per_example = vmap(grad(per_example_loss), in_dims=(None, 0, 0))

    def naive_run():
        scores = torch.zeros(n_test, n_train, device="cuda")
        for c, (params, lr) in enumerate(zip(states, lrs, strict=True)):
            p = sum(v.numel() for v in params.values())
            gen = torch.Generator(device="cuda").manual_seed(c)
            gauss = torch.randn(p, k, generator=gen, device="cuda") / k**0.5  # [p, k]

            def project(data, params=params, gauss=gauss):
                rows = []
                for xb, yb in batches(data):
                    grads = per_example(params, xb, yb)
                    flat = torch.cat([grads[n].reshape(len(yb), -1) for n in sorted(grads)], 1)
                    rows.append(flat @ gauss)  # [b, p] @ [p, k]
                return torch.cat(rows)

            scores += lr * project(test) @ project(train).T
        return scores

    ours, naive = cuda_time(tracinfunc_run, repeat=2), cuda_time(naive_run, repeat=2)
    print(f"dattri PR #257 configuration: {n_train} train / {n_test} test, 784->10, batch "
          f"{batch}, 2 checkpoints, k={k}, end to end")
    print(f"  naive torch.func reference       {naive:7.3f} s")
    print(f"  tracinfunc build_store + score   {ours:7.3f} s   {naive / ours:.2f}x faster")
    check("dattri configuration scores on cuda vs CPU", tracinfunc_run(),
          tracinfunc_run("cpu"), 1e-4)


def bench_jax(tif, n_train: int) -> None:
    """tracinfunc.jax on JAX's default device (the GPU where JAX has one): exact (identity)
    rows of a float32 MLP from JAX against the torch CPU build of the same weights, also with
    the caller asking for TF32. JAX's default float32 matmul on a GPU is TF32 (~1e-4 off);
    tracinfunc.jax compiles in IEEE float32, so this passes at 1e-5 (found on an H100)."""
    try:
        import jax
        import jax.numpy as jnp

        import tracinfunc.jax as tj
    except ImportError:
        print("tracinfunc.jax: skipped (JAX is not installed: pip install 'tracinfunc[jax]')")
        return
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 10)).eval()
    g = torch.Generator().manual_seed(1)
    train = (torch.randn(n_train, 32, generator=g), torch.randint(0, 10, (n_train,), generator=g))
    test = (torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g))
    identity = tif.Projection(kind="identity")
    ckpt = tif.Checkpoint.from_module(model)
    loss = tif.loss_from_module(model, F.cross_entropy)
    expected = tif.score(tif.build_store(loss, [ckpt], train, projection=identity),
                         tif.build_store(loss, [ckpt], test, projection=identity), device="cpu")

    def jax_loss(params, example):  # the same MLP, torch names and layouts
        x, y = example
        for layer in ("0", "2"):
            x = jnp.tanh(x @ params[f"{layer}.weight"].T + params[f"{layer}.bias"])
        logits = x @ params["4.weight"].T + params["4.bias"]
        return -jax.nn.log_softmax(logits)[y]

    device = jax.devices()[0]
    params = {name: jax.device_put(value.numpy(), device) for name, value in ckpt.params.items()}
    jax_ckpt = tj.Checkpoint(params)

    def build(batch):
        on_device = tuple(jax.device_put(leaf.numpy(), device) for leaf in batch)
        return tj.build_store(jax_loss, [jax_ckpt], on_device, projection=identity,
                              progress=False)

    print(f"tracinfunc.jax on {device.platform} ({device.device_kind}): MLP 32-64-64-10, "
          f"{n_train} examples, exact rows")
    check("tracinfunc.jax scores vs the torch CPU build", tif.score(
        build(train), build(test), device="cpu"), expected, 1e-5)
    with jax.default_matmul_precision("tensorfloat32"):
        check("tracinfunc.jax scores vs the torch CPU build, caller asking for TF32",
              tif.score(build(train), build(test), device="cpu"), expected, 1e-5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    args = parser.parse_args()
    import tracinfunc as tif

    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("benchmarks/gpu.py needs a CUDA device for its measurements; none is available "
              "here. Run it with --quick for the CPU checks (exit 0).")
        return 0
    name = torch.cuda.get_device_name() if cuda else "CPU only"
    print(f"device: {name}, torch {torch.__version__}, tracinfunc {tif.__version__}")
    if not cuda:
        print("no CUDA device: GPU measurements and GPU-vs-CPU checks skipped; running the "
              "CPU checks (streamed stores against in-memory ones).")
    n = 1_000_000 if not args.quick else (200_000 if cuda else 20_000)
    bench_stores(tif, n, 1024 if cuda else 256, measure=cuda)
    bench_pinned_bytes(tif, int(20.5 * 2**20) // 1024, 256)  # 20.5 MiB of rows
    bench_quantised(tif, n, 1024 if cuda else 256, measure=cuda)
    if cuda:
        bench_build_overlap(tif, 50_000 if not args.quick else 8_192)
        bench_projected(tif, 1024 if not args.quick else 256)
        bench_language_model(tif, 8, 512)
        bench_dattri(tif, 10_000, 2_000)
        bench_jax(tif, 4_096)
    else:
        print("build_store copy-out overlap: skipped (needs CUDA)")
        print("projected gradients: skipped (needs CUDA)")
        print("language model collection: skipped (needs CUDA)")
        print("dattri PR #257 configuration: skipped (needs CUDA)")
        bench_jax(tif, 256)  # JAX's default device: the CPU here
    verdict = f"FAIL: {', '.join(FAILURES)}" if FAILURES else "PASS: every check"
    print(f"verdict: {verdict}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
