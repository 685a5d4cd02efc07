"""Checks on test gradients every query makes, and the dtype and device it computes in."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tracinfunc._devices import usable_device
from tracinfunc._norms import row_norms
from tracinfunc._validate import current_caller
from tracinfunc.errors import (
    IncompatibleGradientsError,
    InvalidArgumentError,
    InvalidTypeError,
    NonFiniteGradientError,
)
from tracinfunc.store.meta import StoreMeta, check_compatible
from tracinfunc.store.protocols import GradientStore, store_meta

__all__ = ["check_not_empty", "check_test_shape", "check_test_tensor", "check_test_type",
           "compute_dtype", "norm_divisors", "query_matrix", "resolve_device",
           "safe_reciprocal"]


def query_matrix(
    meta: StoreMeta, test_grads: GradientStore | Tensor, *, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Test gradients ``[n_ckpt, n_test, k]`` and their norms ``[n_ckpt, n_test]``, validated,
    on ``device`` (where they are multiplied; they may arrive on any device)."""
    if isinstance(test_grads, Tensor):
        check_test_tensor(meta, test_grads)
        norms = row_norms(test_grads.to(compute_dtype(test_grads.dtype)))
        return test_grads.to(device), norms.to(device)
    check_test_type(test_grads)
    check_compatible(meta, test_grads.meta)
    n_test = test_grads.meta.n_train
    # Read straight into one tensor (a copy of the rows, not a copy per checkpoint stacked).
    rows = torch.empty(meta.n_ckpt, n_test, meta.k, dtype=test_grads.meta.torch_dtype)
    for c in range(meta.n_ckpt):
        got = test_grads.read_rows(c, 0, n_test, out=rows[c])
        if got is not None:  # None: written into out, as the protocol allows
            _check_read(got, c, n_test, meta.k)
            if got.data_ptr() != rows[c].data_ptr():  # a store that returned its own tensor
                rows[c].copy_(got)
    check_test_tensor(meta, rows)  # finite, as test rows given as a tensor are
    norms = torch.stack([test_grads.read_norms(c, 0, n_test) for c in range(meta.n_ckpt)])
    return rows.to(device), norms.to(device)


def _check_read(got: object, ckpt: int, n_test: int, k: int) -> None:
    """A test store's ``read_rows`` result is ``[n_test, k]``: copied into ``out``, anything
    else would broadcast (one row for all) or fail deep in torch."""
    if not isinstance(got, Tensor):
        raise InvalidTypeError(
            f"{current_caller()}: test_grads.read_rows({ckpt}, 0, {n_test}) returned "
            f"{type(got).__name__}; a store's read_rows returns a torch tensor "
            f"[stop - start, k] (or fills out= and returns it); fix the store's read_rows."
        )
    if tuple(got.shape) != (n_test, k):
        raise IncompatibleGradientsError(
            f"{current_caller()}: test_grads.read_rows({ckpt}, 0, {n_test}) returned shape "
            f"{list(got.shape)}, expected [{n_test}, {k}]; fix the store's read_rows."
        )


def check_test_type(test_grads: object) -> None:
    if not isinstance(test_grads, Tensor | GradientStore):
        raise InvalidTypeError(
            f"{current_caller()}: test_grads must be a GradientStore or a tensor "
            f"[n_ckpt, n_test, k] (or a NumPy, JAX or CuPy array), got "
            f"{type(test_grads).__name__}."
        )
    if isinstance(test_grads, GradientStore):
        store_meta(test_grads, "test_grads")


def check_test_tensor(meta: StoreMeta, test: Tensor) -> None:
    check_test_shape(meta, test)
    if not _all_finite(test):
        # where, only now: a mask as large as the rows is not built for finite ones
        bad = (~torch.isfinite(test)).any(dim=2).nonzero().tolist()  # [[ckpt, example]]
        shown = ", ".join(f"example {i} at checkpoint {c}" for c, i in bad[:5])
        raise NonFiniteGradientError(
            f"{current_caller()}: test gradients contain NaN or inf ({shown}"
            f"{', ...' if len(bad) > 5 else ''}; {len(bad)} row(s) in all); check the loss "
            "on those examples."
        )


def _all_finite(test: Tensor) -> bool:
    """Whether ``test`` holds no NaN/inf: one pass of ``aminmax`` (NaN propagates to both,
    an inf is one of them), as ``check_block`` does; ``isfinite(test).all()`` writes a bool
    mask as large as the rows first (~15x the time on a CPU: a few percent of a score)."""
    if not test.numel():
        return True
    low, high = torch.aminmax(test)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def check_test_shape(meta: StoreMeta, test: Tensor) -> None:
    if test.ndim != 3 or test.shape[0] != meta.n_ckpt or test.shape[2] != meta.k:
        raise IncompatibleGradientsError(
            f"{current_caller()}: test gradients must be [n_ckpt={meta.n_ckpt}, n_test, "
            f"k={meta.k}], got {list(test.shape)}; build them with "
            "projection=store.projection and the store's checkpoints (e.g. "
            "tif.build_store(loss, checkpoints, test_batch, projection=store.projection))."
        )
    if test.is_meta:
        raise InvalidArgumentError(
            f"{current_caller()}: test gradients are on the meta device (shapes, no values); "
            "compute them with build_store or projected_grads on a real device."
        )
    if not test.is_floating_point():
        raise InvalidTypeError(
            f"{current_caller()}: test gradients must be floating point, got {test.dtype}; "
            "pass the rows projected_grads or build_store made."
        )


def check_not_empty(meta: StoreMeta) -> None:
    if meta.n_train < 1:
        raise InvalidArgumentError(
            f"{current_caller()}: the store holds no rows (n_train=0); nothing to score. Build it "
            "from non-empty training data."
        )


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    # float32 accumulation always; float64 only when asked for by float64 inputs (exactness).
    return torch.float64 if torch.float64 in dtypes else torch.float32


def norm_divisors(norms: Tensor) -> Tensor:
    """``norms`` to divide by, ``inf`` where a norm is 0 (a zero row's cosine is 0). Dividing,
    not multiplying by ``1 / norms``: the reciprocal of a denormal norm (a float32 row of
    entries near 1e-42) is not a float32, and inf times the row's tiny dot products was NaN."""
    return torch.where(norms > 0, norms, torch.full_like(norms, math.inf))


def safe_reciprocal(norms: Tensor) -> Tensor:
    """``1 / norms``, 0 where a norm is 0 (a zero gradient has cosine 0 with everything)."""
    return torch.where(norms > 0, norms.reciprocal(), torch.zeros_like(norms))


def resolve_device(device: torch.device | str | None, test_grads: object) -> torch.device:
    """``device`` (checked to exist and be usable here), else the test tensor's accelerator,
    else CUDA when available, else CPU."""
    if device is not None:
        return usable_device(device)
    if isinstance(test_grads, Tensor) and test_grads.device.type != "cpu":
        return test_grads.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
