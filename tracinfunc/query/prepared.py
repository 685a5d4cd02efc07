"""One prepared query: test gradients as every query function takes them, built once per call.

``score``, ``top_k``, ``score_chunks`` and ``indexed_top_k`` each call :func:`prepare_query`
exactly once. It checks ``test_grads`` (type, shape, finite values, a store's metadata against
the training store's), applies a ``curvature=`` (:mod:`tracinfunc.query.curvature`), folds
``lr_c`` (and, for cosine TracIn, ``1/|test_c|``) into the rows and puts them on the compute
device. The result, a frozen :class:`PreparedQuery`, is then only read or split by rows (the
blocked ``top_k`` path), never prepared again. Errors name the function the user called
(:func:`~tracinfunc._validate.current_caller`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tracinfunc._norms import directions, row_norms
from tracinfunc.curvature.value import Curvature
from tracinfunc.interop import tensor_if_array
from tracinfunc.query.checks import (
    check_not_empty,
    check_test_type,
    compute_dtype,
    query_matrix,
    resolve_device,
)
from tracinfunc.query.contrast import Contrast
from tracinfunc.query.control import control_rows
from tracinfunc.query.curvature import precondition_queries
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import GradientStore, store_meta

__all__ = ["PreparedQuery", "prepare_query"]


@dataclass(frozen=True)
class PreparedQuery:
    """Test gradients ready to multiply with training rows.

    Attributes:
        rows: ``[n_ckpt, n_test, k]`` ``lr_c * test_c`` (``lr_c * test_c / |test_c|`` with
            ``normalize``; a zero row stays zero), curvature-preconditioned when asked, in
            ``dtype``, on ``device``.
        norms: ``[n_ckpt, n_test]`` norms of the (preconditioned) unweighted test rows, on
            ``device``.
        lrs: The store's ``n_ckpt`` TracIn weights folded into ``rows``.
        normalize: Whether ``rows`` are unit-normalised per checkpoint (cosine TracIn).
        dtype: The accumulation dtype: float64 when the store or the test rows are float64,
            else float32.
        device: Where ``rows`` and ``norms`` live (where the scores are computed).
        contrast: The :class:`~tracinfunc.Contrast` folded into ``rows`` (``norms`` stay
            the test rows'), or ``None``.
        scales: ``n_ckpt`` factors each checkpoint's products are multiplied by: 1.0 where
            ``lr_c`` is folded into ``rows`` (every ordinary query), ``lr_c`` where folding it
            would take a row out of ``dtype``'s normal range (entries of 1e36 at lr 1e3, or
            1e-25 at lr 1e-20): the product of the unscaled rows fits, and is scaled after.
    """

    rows: Tensor
    norms: Tensor
    lrs: tuple[float, ...]
    normalize: bool
    dtype: torch.dtype
    device: torch.device
    contrast: Contrast | None = None
    scales: tuple[float, ...] = ()

    def scale(self, ckpt: int) -> float:
        """The factor of checkpoint ``ckpt``'s products (1.0: ``lr_c`` is in the rows)."""
        return self.scales[ckpt] if self.scales else 1.0

    def scaled(self, ckpt: int, products: Tensor) -> Tensor:
        """``products`` of checkpoint ``ckpt`` times its :meth:`scale` (the same tensor when
        it is 1.0)."""
        return scale_products(products, self.scale(ckpt))

    @property
    def n_test(self) -> int:
        return self.rows.shape[1]

    def split(self, lo: int, hi: int) -> PreparedQuery:
        """Test rows ``[lo, hi)`` (views, nothing prepared again)."""
        return PreparedQuery(self.rows[:, lo:hi], self.norms[:, lo:hi], self.lrs,
                             self.normalize, self.dtype, self.device, self.contrast, self.scales)


def fits(value: float, dtype: torch.dtype) -> bool:
    """Whether ``value`` is 0 or a normal number of ``dtype`` (a factor it can apply)."""
    info = torch.finfo(dtype)
    return value == 0.0 or info.tiny <= abs(value) <= info.max


def scale_products(products: Tensor, scale: float) -> Tensor:
    """``products * scale``, in float64 where ``scale`` is no normal number of their dtype
    (``lr=1e-40`` is a float32 denormal, ``1e-46`` is 0 and ``1e40`` inf in float32)."""
    if scale == 1.0:
        return products
    if fits(scale, products.dtype):
        return products * scale
    return (products.double() * scale).to(products.dtype)


def prepare_query(store: GradientStore, test_grads: object, *, normalize: bool = False,
                  device: torch.device | str | None = None,
                  curvature: Curvature | None = None) -> PreparedQuery:
    """``test_grads`` checked against ``store``, preconditioned, lr-weighted, on ``device``.

    Args:
        store: The training store (its whole metadata; a row range of it has the same).
        test_grads: A GradientStore or an array ``[n_ckpt, n_test, k]`` (a tensor or any
            ``__dlpack__`` array: NumPy, JAX, CuPy), or a :class:`~tracinfunc.Contrast` of
            two such: its test and control rows are each prepared as below and combined,
            ``test - weight * control`` (the control's mean unless paired).
        normalize: Fold ``1/|test_c|`` in (cosine TracIn).
        device: Where to compute. Default: the test tensor's accelerator, else CUDA when
            available, else CPU.
        curvature: A :class:`~tracinfunc.Curvature` for ``store``, or ``None``.

    Raises:
        InvalidTypeError: ``test_grads`` is neither a store nor an array.
        IncompatibleGradientsError: shape, projection, checkpoints or layout differ from the
            store's, or the curvature does not fit (see :mod:`tracinfunc.query.curvature`).
        NonFiniteGradientError: test rows hold NaN or inf.
        InvalidArgumentError: the store holds no rows; a contrast's control is empty, or
            paired with another number of test examples.
    """
    meta = store_meta(store)
    check_not_empty(meta)
    contrast = test_grads if isinstance(test_grads, Contrast) else None
    test_grads = tensor_if_array(test_grads if contrast is None else contrast.test)
    check_test_type(test_grads)
    test_grads = precondition_queries(meta, test_grads, curvature)
    device = resolve_device(device, test_grads)
    rows, norms, scales = _weighted(meta, test_grads, normalize, device)
    if contrast is not None:
        control = control_rows(meta, contrast, rows.shape[1], curvature)
        control, _, _ = _weighted(meta, control, normalize, device, scales=scales)
        if not contrast.paired:
            control = control.mean(dim=1, keepdim=True)  # [n_ckpt, 1, k]
        dtype = compute_dtype(rows.dtype, control.dtype)
        rows = rows.to(dtype) - contrast.weight * control.to(dtype)
    return PreparedQuery(rows, norms, meta.lrs, bool(normalize), rows.dtype, device, contrast,
                         scales)


def _weighted(meta: StoreMeta, grads: GradientStore | Tensor, normalize: bool,
              device: torch.device, scales: tuple[float, ...] | None = None
              ) -> tuple[Tensor, Tensor, tuple[float, ...]]:
    """``lr_c * rows_c`` (over ``|rows_c|`` with ``normalize``) ``[n_ckpt, n, k]``, the norms
    ``[n_ckpt, n]`` and the factors left to the products (:attr:`PreparedQuery.scales`;
    ``scales`` given: those), validated, on ``device``."""
    test, norms = query_matrix(meta, grads, device=device)
    dtype = compute_dtype(meta.torch_dtype, test.dtype)
    if normalize:
        # The direction in float64: a finite float32 row can have a norm float32 cannot hold
        # (entries near 3e38: inf, cosine 0) or a reciprocal it cannot (denormal entries:
        # inf times the row, NaN); every float32 or float16 row's norm fits float64. Rows
        # given as a tensor are measured here; a store's are its own recorded norms.
        wide = test.to(torch.float64, copy=True)  # never the caller's own tensor
        own = row_norms(wide) if isinstance(grads, Tensor) else norms.double()
        test = directions(wide, own)  # divided; float64 denormal rows from their own entries
    if scales is None:
        scales = _scales(meta.lrs, test, None if normalize else norms, dtype)
    # lr_c (and, above, the test side of the cosine) folded in once, not per chunk.
    folded = [lr if scale == 1.0 else 1.0 for lr, scale in zip(meta.lrs, scales, strict=True)]
    # In float64 where a folded lr is no normal number of the compute dtype (lr=1e40 with
    # rows of 1e-20: the rows fit, the lr alone would be inf in float32)
    wide = normalize or not all(fits(lr, dtype) for lr in folded)
    factor = torch.tensor(folded, dtype=torch.float64 if wide else dtype,
                          device=device)[:, None, None]
    if wide:
        # a new tensor either way: never the caller's own (float64 rows are not copied by .to)
        test = test if normalize else test.to(torch.float64, copy=True)
        return test.mul_(factor).to(dtype), norms, scales
    test = test.to(dtype)
    if isinstance(grads, Tensor):  # the caller's rows: never written to
        return test * factor, norms, scales
    return test.mul_(factor), norms, scales  # read from a store into a new tensor: in place


def _scales(lrs: tuple[float, ...], rows: Tensor, norms: Tensor | None,
            dtype: torch.dtype) -> tuple[float, ...]:
    """Per checkpoint, 1.0 where ``lr_c`` may be folded into ``rows`` ``[n_ckpt, n, k]``, or
    ``lr_c`` where folding it could take an entry past ``dtype``'s largest value, or every
    entry of a row below its smallest normal one (keeping a few bits), when they were inside.

    ``norms`` ``[n_ckpt, n]`` of ``rows`` (``None``: unit rows): a row's largest entry is at
    least its norm over ``sqrt(k)``, so one pass (the largest entry) and the norms suffice.
    """
    if rows.is_meta or rows.numel() == 0:  # (meta: the tests' stand-in device, no values)
        return (1.0,) * len(lrs)
    info = torch.finfo(dtype)
    root_k = rows.shape[-1] ** 0.5
    scales = []
    for c, lr in enumerate(lrs):
        low, high = torch.aminmax(rows[c])
        top = max(-float(low), float(high))  # the largest |entry|
        if norms is None:
            least = 1.0 / root_k  # a unit row's largest entry is at least this
        else:
            nonzero = norms[c][norms[c] > 0]
            least = float(nonzero.double().min()) / root_k if len(nonzero) else 0.0
        over = top <= info.max and top * abs(lr) > info.max
        under = info.tiny <= least and least * abs(lr) < info.tiny
        scales.append(float(lr) if lr != 0.0 and (over or under) else 1.0)
    return tuple(scales)
