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

import tracinfunc as tif
from tracinfunc.curvature import fit_curvature


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


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
    wall, cpu = time.perf_counter(), time.process_time()
    fit_curvature(loss, ckpts, data, kind="ekfac", options=options,
                  batch_size=payload["batch"])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    print("RESULT " + json.dumps({"version": tif.__version__, "fit_s": wall, "fit_cpu_s": cpu,
                                  "peak_rss_mib": peak, "rss_before_fit_mib": before}),
          flush=True)


if __name__ == "__main__":
    main()
