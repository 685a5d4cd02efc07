"""Store metadata: what a set of projected gradients was made from, and compatibility checks.

Metadata is plain JSON-able data (no pickle) so any process, language or framework can read
it, and a query against gradients made differently fails loudly instead of scoring garbage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tracinfunc._validate import as_real, current_caller
from tracinfunc.errors import IncompatibleGradientsError, InvalidArgumentError, InvalidTypeError
from tracinfunc.projection.spec import Layout, Projection

__all__ = [
    "FORMAT_VERSION",
    "QUANTIZATIONS",
    "CheckpointMeta",
    "StoreMeta",
    "check_compatible",
    "check_lr",
    "describe_preconditioner",
    "dtype_name",
    "layout_differences",
    "norm_dtype",
]

# 2: finished stores carry an integrity block (store/zarr/integrity.py); 1 had none.
FORMAT_VERSION = 2

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# Quantised row storage (store/codes.py): int8 codes or packed sign bits, with per-row scales.
QUANTIZATIONS = ("int8", "sign")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16 -> "float16"``; raises ``ValueError`` for unsupported storage dtypes."""
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise InvalidArgumentError(
        f"unsupported storage dtype {dtype}; expected one of torch.{', torch.'.join(_DTYPES)}."
    )


def check_lr(lr: Any) -> float:
    """A checkpoint's TracIn weight as a float: a finite positive real scalar (torch and JAX).

    Python numbers, NumPy scalars and 0-d real arrays of any framework (a JAX scalar from an
    optax schedule, ``np.float32(0.1)``, a 0-d torch tensor) are accepted and read as a float.

    Raises:
        InvalidTypeError: not a real scalar (``True``/``False``, complex, an array with
            elements, a traced value inside ``jax.jit`` included).
        InvalidArgumentError: NaN, infinite, zero or negative, or outside float32's normal range
            (scores are float32: a larger lr makes them inf/NaN, a smaller one rounds them to 0
            or to a few bits of precision).
    """
    value = as_real(lr)
    if value is None:
        got = type(lr).__name__
        shape = getattr(lr, "shape", None)
        got += f" of shape {list(shape)}" if shape is not None else ""
        raise InvalidTypeError(
            f"{current_caller()}: lr must be a number (a real scalar of any framework: a Python "
            f"number, a NumPy scalar or a 0-d array; the learning rate weighting this "
            f"checkpoint), got {got}; e.g. lr=0.1, "
            "or lr=float(schedule(step)) outside jax.jit."
        )
    if not math.isfinite(value) and not isinstance(lr, int):  # a huge int: the range check
        raise InvalidArgumentError(
            f"{current_caller()}: lr must be finite, got {value}; e.g. lr=0.1.")
    if value <= 0:  # documented positive: a zero or negative weight silently flips or drops scores
        raise InvalidArgumentError(
            f"{current_caller()}: lr must be positive (the learning rate at this checkpoint), got "
            f"{value}; e.g. lr=0.1."
        )
    if not _F32_TINY <= value <= _F32_MAX:
        raise InvalidArgumentError(
            f"{current_caller()}: lr must lie in float32's normal range [{_F32_TINY:.3g}, "
            f"{_F32_MAX:.4g}] (scores are computed in float32, where it would be "
            f"{'inf' if value > _F32_MAX else '0 or subnormal'}), got {_short(lr)}; rescale "
            "the learning rates (TracIn scores are relative), e.g. lr=0.1."
        )
    return value


def _short(lr: Any) -> str:
    text = repr(lr)
    return text if len(text) <= 40 else f"{text[:12]}... ({len(text)} characters)"


_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_TINY = float(torch.finfo(torch.float32).tiny)  # smallest normal float32


@dataclass(frozen=True)
class CheckpointMeta:
    """What a store records of one checkpoint: its name, TracIn weight and a params hash."""

    name: str
    lr: float
    fingerprint: str


@dataclass(frozen=True)
class StoreMeta:
    """Everything needed to check that two sets of gradients can be scored together.

    Attributes:
        projection: The projection spec the rows were made with.
        checkpoints: One entry per checkpoint, in store order (``n_ckpt`` of them).
        layout: Parameter names and shapes that were differentiated, sorted by name.
        n_train: Number of rows (examples) per checkpoint.
        k: Projected dimension (row length).
        dtype: Storage dtype name (``"float32"``, ``"float16"``, ``"bfloat16"``, ``"float64"``).
        complete: False while a writer is still filling the store.
        library_version: tracinfunc version that wrote the store.
        format_version: On-disk/metadata format version.
        dataset_fingerprint: Optional user-supplied identifier of the data rows.
        preconditioner: Kind of optimizer preconditioning of the rows (``"adam"``,
            ``"trackstar"``: the exact diagonal second moment; ``"adam-factored"``,
            ``"trackstar-factored"``: matrices' second moment in Adafactor's row/column form,
            ``Preconditioner.as_factored()``), or ``None`` for plain gradients (stores
            written before the field existed read as ``None``; stores built with a factored
            preconditioner before the form was recorded read as the plain kind).
        quantization: How rows are stored when quantised: ``"int8"`` (codes with a per-row
            scale) or ``"sign"`` (1 bit per value with a per-row scale), read back as
            ``dtype`` float32; ``None`` (the default, and stores written before the field
            existed) stores rows as ``dtype``.
    """

    projection: Projection
    checkpoints: tuple[CheckpointMeta, ...]
    layout: Layout
    n_train: int
    k: int
    dtype: str = "float32"
    complete: bool = True
    library_version: str = ""
    format_version: int = FORMAT_VERSION
    dataset_fingerprint: str | None = None
    preconditioner: str | None = None
    quantization: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.quantization is not None and (self.quantization not in QUANTIZATIONS
                                              or self.dtype != "float32"):
            raise InvalidArgumentError(
                f"StoreMeta: quantization must be None or one of {list(QUANTIZATIONS)} with "
                f"dtype 'float32' (the dtype quantised rows are read in), got "
                f"quantization={self.quantization!r}, dtype={self.dtype!r}; e.g. "
                "quantization='int8', dtype='float32'."
            )

    @property
    def n_ckpt(self) -> int:
        return len(self.checkpoints)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def lrs(self) -> tuple[float, ...]:
        return tuple(ckpt.lr for ckpt in self.checkpoints)

    def replace(self, **changes: Any) -> StoreMeta:
        """A copy with ``changes`` applied (metadata is immutable)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only, for zarr attributes or any other serialisation."""
        return {
            "format_version": self.format_version,
            "library_version": self.library_version,
            "projection": self.projection.to_dict(),
            "checkpoints": [
                {"name": c.name, "lr": c.lr, "fingerprint": c.fingerprint}
                for c in self.checkpoints
            ],
            "layout": [[name, list(shape)] for name, shape in self.layout],
            "n_train": self.n_train,
            "k": self.k,
            "dtype": self.dtype,
            "complete": self.complete,
            "dataset_fingerprint": self.dataset_fingerprint,
            "preconditioner": self.preconditioner,
            "quantization": self.quantization,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StoreMeta:
        """Inverse of :meth:`to_dict`; strict, since the dict may come from an edited file.

        Raises:
            InvalidArgumentError, InvalidTypeError, KeyError: a field is missing or has a
                value no writer produces (``complete: "no"``, a negative lr, ...).
        """
        return cls(
            projection=Projection.from_dict(data["projection"]),
            checkpoints=tuple(
                CheckpointMeta(_stored_str(c["name"], "checkpoint name"), _stored_lr(c["lr"]),
                               _stored_str(c["fingerprint"], "checkpoint fingerprint"))
                for c in data["checkpoints"]
            ),
            layout=tuple((name, tuple(shape)) for name, shape in data["layout"]),
            n_train=_stored_int(data["n_train"], "n_train", minimum=0),
            k=_stored_int(data["k"], "k", minimum=1),
            dtype=_stored_str(data["dtype"], "dtype"),
            complete=_stored_bool(data["complete"], "complete"),
            library_version=_stored_str(data.get("library_version", ""), "library_version"),
            format_version=_stored_int(data.get("format_version", FORMAT_VERSION),
                                       "format_version", minimum=1),
            dataset_fingerprint=_stored_str(data.get("dataset_fingerprint"),
                                            "dataset_fingerprint", optional=True),
            preconditioner=_stored_str(data.get("preconditioner"), "preconditioner",
                                       optional=True),
            quantization=data.get("quantization"),  # checked in __post_init__
            extra=dict(data.get("extra", {})),
        )


def _stored_int(value: Any, what: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(
            f"StoreMeta.from_dict: {what} must be an integer >= {minimum}, got {value!r}."
        )
    return value


def _stored_str(value: Any, what: str, *, optional: bool = False) -> str | None:
    if not (isinstance(value, str) or (optional and value is None)):
        raise InvalidTypeError(f"StoreMeta.from_dict: {what} must be a string, got {value!r}.")
    return value


def _stored_bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidTypeError(f"StoreMeta.from_dict: {what} must be true or false, got {value!r}.")
    return value


def _stored_lr(value: Any) -> float:
    return check_lr(value)

def check_compatible(train: StoreMeta, test: StoreMeta) -> None:
    """Raise :class:`IncompatibleGradientsError` unless ``test`` was made like ``train``.

    Compared: projection spec, k, parameter layout, checkpoint count, names and parameter
    fingerprints. Learning rates are taken from the train store, so they are not compared.
    Test gradients must be plain (``preconditioner=None``): optimizer-aware TracIn
    preconditions the training side only.
    """
    fix = "build them with projection=store.projection and the same checkpoints"
    if test.preconditioner is not None:
        raise IncompatibleGradientsError(
            f"{current_caller()}: test gradients were preconditioned ({test.preconditioner!r}) "
            f"and the store's training gradients {_describe_preconditioner(train)}; test gradients "
            "must be plain: build them without preconditioners=."
        )
    if test.projection != train.projection:
        raise IncompatibleGradientsError(
            f"{current_caller()}: test gradients were projected with {test.projection} but the "
            f"store with {train.projection}; {fix}."
        )
    if test.k != train.k:
        raise IncompatibleGradientsError(
            f"{current_caller()}: test gradients have k={test.k} but the store was projected to "
            f"k={train.k}; {fix}."
        )
    if test.layout != train.layout:
        raise IncompatibleGradientsError(
            f"{current_caller()}: test gradients cover parameters {_describe_layout(test.layout)} "
            f"but the store covers {_describe_layout(train.layout)} "
            f"({layout_differences(test.layout, train.layout)}); differentiate the same "
            "parameters (same model and layer selection; JAX trees mapped to torch names and "
            "shapes with tracinfunc.jax.ParamMapping)."
        )
    _check_checkpoints(train.checkpoints, test.checkpoints)
    train_names = [c.name for c in train.checkpoints]
    test_names = [c.name for c in test.checkpoints]
    if train.projection.per_checkpoint and train_names != test_names:
        raise IncompatibleGradientsError(
            f"{current_caller()}: the store's projection is drawn per checkpoint, by name, and its "
            f"checkpoints are {train_names} but the test gradients' are {test_names}; name "
            "the test checkpoints as the store's (the same Checkpoint objects)."
        )


def _check_checkpoints(
    train: Sequence[CheckpointMeta], test: Sequence[CheckpointMeta]) -> None:
    if len(test) != len(train):
        raise IncompatibleGradientsError(
            f"{current_caller()}: test gradients come from {len(test)} checkpoints but the store "
            f"has {len(train)}; use the store's checkpoints, in the same order."
        )
    for position, (ours, theirs) in enumerate(zip(train, test, strict=True)):
        if ours.fingerprint != theirs.fingerprint:
            raise IncompatibleGradientsError(
                f"{current_caller()}: checkpoint {position} differs: the store's {ours.name!r} has "
                f"parameter fingerprint {ours.fingerprint[:12]}…, the test gradients' "
                f"{theirs.name!r} has {theirs.fingerprint[:12]}…; compute test gradients with "
                "the same checkpoint weights, in the same order."
            )


def layout_differences(ours: Layout, theirs: Layout) -> str:
    """What ``ours`` lacks, adds or shapes differently from ``theirs``, as one line."""
    a, b = dict(ours), dict(theirs)
    problems = [f"missing {n!r}" for n in sorted(set(b) - set(a))]
    problems += [f"extra {n!r}" for n in sorted(set(a) - set(b))]
    for name in sorted(set(a) & set(b)):
        if a[name] != b[name]:
            transposed = sorted(a[name]) == sorted(b[name])
            hint = " (transposed: a Flax kernel [in, out] not mapped to torch's [out, in]?)"
            problems.append(f"{name!r} is {list(a[name])}, expected {list(b[name])}"
                            f"{hint if transposed else ''}")
    return "; ".join(problems)


def describe_preconditioner(kind: str | None) -> str:
    """``kind`` in words: ``"'adam-factored' (Adam, second moment in factored form)"``."""
    if kind is None:
        return "none (plain gradients)"
    base, _, form = kind.partition("-")
    what = {"adam": "Adam", "trackstar": "TrackStar"}.get(base, base)
    detail = ("second moment in factored (Adafactor) form on matrices" if form == "factored"
              else "exact diagonal second moment")
    return f"{kind!r} ({what}, {detail})"


def _describe_preconditioner(meta: StoreMeta) -> str:
    kind = meta.preconditioner
    return ("are plain" if kind is None
            else f"were preconditioned ({describe_preconditioner(kind)})")


def _describe_layout(layout: Layout) -> str:
    names = [name for name, _ in layout]
    shown = ", ".join(names[:4]) + (f", … ({len(names)} in all)" if len(names) > 4 else "")
    return f"[{shown}]"


def norm_dtype(meta: StoreMeta) -> torch.dtype:
    """Dtype of stored row norms: float32, float64 for float64 stores."""
    # float64 stores are for exactness checks; keep their norms exact too.
    return torch.float64 if meta.dtype == "float64" else torch.float32
