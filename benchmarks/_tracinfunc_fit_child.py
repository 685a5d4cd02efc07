"""tracinfunc's EK-FAC fit for curvature_fit.py, in a process of its own (its peak RSS alone).

Reads the payload ``curvature_fit.py`` saved (the model, every checkpoint's weights, the
training data, the batch size), fits ``fit_curvature(kind="ekfac")`` at every checkpoint on
one thread, and prints ``RESULT {json}``: wall and process CPU seconds of the fit, the peak
RSS of the process and its RSS after the imports and the data, before the model (MiB).

    python _tracinfunc_fit_child.py PAYLOAD.pt
"""

from __future__ import annotations

import json
import resource
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from _common import peak_rss_mb

import tracinfunc as tif
from tracinfunc.curvature import fit_curvature


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def run_scenario(payload: dict, loss, ckpts, data, options) -> None:
    """The fit (``payload["scenario"]`` absent: EK-FAC), or a fit and the scores of the test
    sequences against the training ones through a store (curvature_fit.py --memory)."""
    scenario, batch = payload.get("scenario", "ekfac-fit"), payload["batch"]
    kind = "kfac" if scenario == "kfac-fit" else "ekfac"
    if scenario in ("ekfac-fit", "kfac-fit"):
        fit_curvature(loss, ckpts, data, kind=kind, options=options, batch_size=batch)
        return
    exact = tif.Projection(kind="identity")
    projection = exact if scenario.startswith("exact") else tif.Projection(
        dim=payload["k"], seed=0)
    target = payload["workdir"] + "/train.zarr" if scenario == "exact-disk" else None
    store = tif.build_store(loss, ckpts, data, projection=projection, options=options,
                            batch_size=batch, store=target, progress=False)
    if scenario == "projected":
        curvature = fit_curvature(loss, ckpts, data, kind="projected", options=options,
                                  projection=store.projection, batch_size=batch)
        tests = tif.build_store(loss, ckpts, payload["test"], projection=store.projection,
                                options=options, progress=False)
    else:
        curvature = fit_curvature(loss, ckpts, data, kind="ekfac", options=options,
                                  batch_size=batch)
        tests = tif.preconditioned_test_grads(loss, ckpts, payload["test"], curvature,
                                              projection=store.projection, options=options)
    tif.score(store, tests, curvature=curvature)


def main() -> None:
    payload = torch.load(sys.argv[1], weights_only=False)
    torch.set_num_threads(payload["threads"])
    warnings.simplefilter("ignore")
    before = rss_mib()  # after the imports and the data, before the model (as kronfluence's)
    if payload["task"] == "classification":
        model = torch.load(payload["model"], weights_only=False)
        loss = tif.loss_from_module(model.eval(), F.cross_entropy)
        data = tuple(payload["train"])
    else:
        import transformers

        config = transformers.LlamaConfig(**payload["config"])
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
        loss = tif.causal_lm_loss(model.eval())
        data = payload["train"]
    ckpts = []
    for c, state in enumerate(payload["checkpoints"]):
        model.load_state_dict(state, strict=False)
        ckpts.append(tif.Checkpoint.from_module(model, name=f"ckpt-{c}"))
    options = tif.GradientOptions(select=payload["select"])
    with_model = rss_mib()  # the model built (its classes imported) and the checkpoints
    wall, cpu = time.perf_counter(), time.process_time()
    run_scenario(payload, loss, ckpts, data, options)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = peak_rss_mb()  # this process's own (not its parent's RSS at fork)
    print("RESULT " + json.dumps({"version": tif.__version__, "fit_s": wall, "fit_cpu_s": cpu,
                                  "peak_rss_mib": peak, "rss_before_fit_mib": before,
                                  "rss_with_model_mib": with_model}),
          flush=True)


if __name__ == "__main__":
    main()
