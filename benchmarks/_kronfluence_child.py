"""kronfluence's EK-FAC influence for quality_lm.py, in kronfluence's own environment.

Run by ``quality_lm.py`` with ``.venv-kronfluence/bin/python`` (``make bench-setup``); imports
neither tracinfunc nor the benchmark (only its ``_common`` helpers). Reads the payload the
parent saved (the Llama config, the weights of every checkpoint, the train and test batches),
rebuilds the same model at each checkpoint, fits kronfluence's EK-FAC factors there on the
training sequences (true Fisher: next tokens sampled from the model) and computes pairwise
scores ``[n_test, n_train]`` of the test sequences' loss for each ``damping_factor`` asked
(named absolute values, and ``scales``: multiples of that checkpoint's mean EK-FAC eigenvalue,
tracinfunc's sweep). The loss is the benchmark's: each sequence's mean next-token cross-entropy
over its non-padding targets (summed over a batch, as kronfluence wants). Saves ``[{damping
name: scores}]`` (one per checkpoint) with torch.save and prints ``RESULT {json}``. With
``fit_only`` in the payload (``curvature_fit.py``) only the factors are fitted (wall and CPU
time, peak RSS); with ``kronfluence_dtype="float64"``, in float64 (``FLOAT64``).

    python _kronfluence_child.py PAYLOAD.pt OUT.pt WORKDIR
"""

from __future__ import annotations

import json
import logging
import sys
import time
import warnings

import torch
import torch.nn.functional as F
import transformers
from _common import peak_rss_mb
from kronfluence.analyzer import Analyzer, prepare_model
from kronfluence.arguments import FactorArguments, ScoreArguments
from kronfluence.task import Task
from torch.utils.data import Dataset

# ``payload["kronfluence_dtype"] = "float64"``: its covariances, per-sample gradients and
# eigenvalue sums in float64, as tracinfunc forms them (its own default: float32, with float64
# eigendecompositions), so a fit is compared with the same arithmetic.
FLOAT64 = {"activation_covariance_dtype": torch.float64,
           "gradient_covariance_dtype": torch.float64,
           "per_sample_gradient_dtype": torch.float64, "lambda_dtype": torch.float64}


def factor_arguments(payload: dict) -> FactorArguments:
    """EK-FAC with the true Fisher (labels drawn from the model), in the dtypes asked."""
    dtypes = FLOAT64 if payload.get("kronfluence_dtype") == "float64" else {}
    return FactorArguments(strategy="ekfac", use_empirical_fisher=False, **dtypes)


class Sequences(Dataset):
    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch

    def __len__(self) -> int:
        return len(self.batch["input_ids"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {key: value[i] for key, value in self.batch.items()}


def sequence_losses(model, batch, *, sample: bool) -> torch.Tensor:
    """Mean next-token cross-entropy per sequence, ``[b]`` (padding targets not counted)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, :-1]  # [b, T - 1, V]
    scored = batch["attention_mask"][:, 1:] == 1
    if sample:  # labels drawn from the model: the true Fisher
        with torch.no_grad():
            probs = logits.detach().float().softmax(-1)
            targets = torch.multinomial(probs.flatten(0, 1), 1).view(scored.shape)
    else:
        targets = batch["input_ids"][:, 1:]
    targets = targets.masked_fill(~scored, -100)
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                reduction="none").view(scored.shape)
    return per_token.sum(1) / scored.sum(1).clamp_min(1)


class LanguageModelTask(Task):
    def compute_train_loss(self, batch, model, sample: bool = False) -> torch.Tensor:
        return sequence_losses(model, batch, sample=sample).sum()

    def compute_measurement(self, batch, model) -> torch.Tensor:
        return sequence_losses(model, batch, sample=False).sum()

    def get_attention_mask(self, batch):
        return batch["attention_mask"]


class Pairs(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class ClassificationTask(Task):
    """``benchmarks/curvature.py``'s digits: cross-entropy to train (labels drawn from the
    model for the true Fisher) and to explain (the test example's own label), as tracinfunc's
    test gradients there."""

    def compute_train_loss(self, batch, model, sample: bool = False) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        if sample:
            with torch.no_grad():
                y = torch.multinomial(logits.detach().softmax(-1), 1).squeeze(1)
        return F.cross_entropy(logits, y, reduction="sum")

    def compute_measurement(self, batch, model) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="sum")


def mean_eigenvalue(factors) -> float:
    """EK-FAC's mean eigenvalue over every module (sum of eigenvalues / their count): what a
    multiple of the mean eigenvalue multiplies, as in tracinfunc's ``Damping``."""
    total, count = 0.0, 0
    lambdas, processed = factors["lambda_matrix"], factors["num_lambda_processed"]
    for module, matrix in lambdas.items():
        total += float(matrix.double().sum() / processed[module].double())
        count += matrix.numel()
    return total / count


def rss_mib() -> float:
    """The process's resident memory now (MiB)."""
    import resource

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    payload_path, out_path, workdir = sys.argv[1:4]
    payload = torch.load(payload_path, weights_only=False)
    torch.set_num_threads(payload.get("threads", 1))
    torch.manual_seed(0)  # the label draws
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    if payload.get("task") == "classification":  # a pickled nn.Sequential of torch modules
        task = ClassificationTask()
        train, test = Pairs(*payload["train"]), Pairs(*payload["test"])

        def make_model():
            return torch.load(payload["model"], weights_only=False)
    else:
        neo = payload.get("arch") == "gpt-neo"
        config = (transformers.GPTNeoConfig if neo else transformers.LlamaConfig)(
            **payload["config"])
        train, test = Sequences(payload["train"]), Sequences(payload["test"])
        task = LanguageModelTask()

        def make_model():
            causal_lm = transformers.GPTNeoForCausalLM if neo else transformers.LlamaForCausalLM
            return causal_lm._from_config(config,
                                          attn_implementation="eager" if neo else "sdpa")
    per_ckpt, fit_s, fit_cpu_s, seconds = [], [], [], {}
    before = with_model = rss_mib()
    for c, state in enumerate(payload["checkpoints"]):  # every checkpoint, as tracinfunc
        model = make_model()
        model.load_state_dict(state)
        model.eval()
        if payload.get("task") == "classification":  # a bare nn.Linear as the root module
            model = torch.nn.Sequential(model)  # sends prepare_model into endless recursion
        model = prepare_model(model, task)
        if c == 0:
            with_model = rss_mib()  # the fit's own memory is above it
        analyzer = Analyzer(f"checkpoint_{c}", model, task, cpu=True, disable_tqdm=True,
                            output_dir=workdir)
        start, cpu = time.perf_counter(), time.process_time()
        analyzer.fit_all_factors("ekfac", dataset=train, per_device_batch_size=payload["batch"],
                                 factor_args=factor_arguments(payload),
                                 overwrite_output_dir=True)
        fit_s.append(time.perf_counter() - start)
        fit_cpu_s.append(time.process_time() - cpu)
        if payload.get("fit_only"):  # curvature_fit.py: the fit's time and memory only
            continue
        mean = mean_eigenvalue(analyzer.load_all_factors("ekfac"))
        dampings = dict(payload["dampings"])  # named absolute values (None: its heuristic)
        dampings.update({f"{scale:g}x": scale * mean for scale in payload.get("scales", ())})
        scores = {}
        for name, damping in dampings.items():
            start = time.perf_counter()
            analyzer.compute_pairwise_scores(
                f"scores-{name}", "ekfac", query_dataset=test, train_dataset=train,
                per_device_query_batch_size=payload["batch"],
                per_device_train_batch_size=payload["batch"],
                score_args=ScoreArguments(damping_factor=damping), overwrite_output_dir=True)
            scores[name] = analyzer.load_pairwise_scores(f"scores-{name}")["all_modules"].double()
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        per_ckpt.append(scores)
    scores = per_ckpt
    torch.save(scores, out_path)
    import kronfluence

    peak = peak_rss_mb()  # this process's own (not its parent's RSS at fork)
    print("RESULT " + json.dumps({"version": kronfluence.__version__, "fit_s": sum(fit_s),
                                  "fit_cpu_s": sum(fit_cpu_s), "peak_rss_mib": peak,
                                  "rss_before_fit_mib": before, "rss_with_model_mib": with_model,
                                  "score_s": seconds}), flush=True)


if __name__ == "__main__":
    main()
