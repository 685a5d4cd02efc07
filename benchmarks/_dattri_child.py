"""dattri 0.3.0's TracInAttributor on a saved problem; run by vs_dattri.py in dattri's own venv.

Imports only torch, numpy, dattri and ``_common`` (no tracinfunc). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Timer, current_rss_mb, emit, linear_model, peak_rss_mb, tiny


def attribute(problem: dict, seed: int):
    """dattri's scores ``[n_test, n_train]``, its Timer (wall and CPU seconds), and the RSS
    before the timed part."""
    from dattri.algorithm.tracin import TracInAttributor
    from dattri.task import AttributionTask

    (x_train, y_train), (x_test, y_test) = problem["train"], problem["test"]
    model = linear_model(problem["d_in"], problem["n_classes"]).eval()
    batch = problem["batch"]
    train_loader = DataLoader(TensorDataset(x_train, y_train), batch_size=batch, shuffle=False)
    test_loader = DataLoader(TensorDataset(x_test, y_test), batch_size=batch, shuffle=False)
    baseline = current_rss_mb()

    with Timer() as timer:
        def loss_func(params, data):
            image, label = data
            yhat = torch.func.functional_call(model, params, image)
            return nn.functional.cross_entropy(yhat, label)

        task = AttributionTask(loss_func=loss_func, model=model,
                               checkpoints=list(problem["states"]))
        attributor = TracInAttributor(
            task=task, weight_list=torch.tensor(problem["lrs"]), normalized_grad=False,
            projector_kwargs={"device": "cpu", "proj_dim": problem["k"],
                              "proj_seed": seed},
            device="cpu",
        )
        scores = attributor.attribute(train_loader, test_loader)  # [n_train, n_test]
    return scores.T.contiguous(), timer, baseline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--problem", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    problem = torch.load(args.problem, weights_only=False)
    for run in (tiny(problem), problem):  # warm up, then the timed run
        scores, timer, baseline = attribute(run, args.seed)
    np.save(args.out, scores.numpy())
    emit({"seconds": timer.seconds, "cpu": timer.cpu, "peak_rss_mb": peak_rss_mb(),
          "baseline_rss_mb": baseline})


if __name__ == "__main__":
    main()
