"""What a :class:`~tracinfunc.curvature.Curvature` is bound to, and the refusal of a mismatch.

A curvature is fitted at given checkpoints (names, learning rates, parameter fingerprints), over
one parameter layout, on gradients of one kind (``info["preconditioner"]``: ``None``, the raw
gradients :func:`~tracinfunc.fit_curvature` differentiates; a curvature saved before the key
existed was fitted on them too) and, for ``kind="projected"``, in one projected space. Applied
to another store or other checkpoints it would precondition with the wrong matrix and score
garbage, so every use checks the binding first and names the first difference.

An optimizer-aware store (``build_store(..., preconditioners=...)``: rows ``D_c g`` with Adam's
or TrackStar's diagonal ``D_c``) is refused: ``g_test^T (H_c + lambda I)^-1 D_c g_train`` mixes
the Fisher of raw gradients with rows in another metric, a combination with no definition here
(neither the curvature-aware score nor optimizer-aware TracIn).
"""

from __future__ import annotations

from collections.abc import Sequence

from tracinfunc._validate import current_caller
from tracinfunc.curvature.value import Curvature
from tracinfunc.errors import IncompatibleGradientsError, InvalidTypeError
from tracinfunc.projection.spec import Layout
from tracinfunc.store.meta import (
    CheckpointMeta,
    StoreMeta,
    describe_preconditioner,
    layout_differences,
)

__all__ = ["check_bound", "check_checkpoints", "check_curvature"]

_FIX = ("fit the curvature with the store's checkpoints, parameter selection and projection "
        "(fit_curvature(loss, checkpoints, data, projection=store.projection, ...))")


def check_curvature(curvature: object) -> Curvature:
    if not isinstance(curvature, Curvature):
        raise InvalidTypeError(
            f"{current_caller()}: curvature must be a tracinfunc.Curvature (from "
            f"tif.fit_curvature or tif.load_curvature), got {type(curvature).__name__}."
        )
    return curvature


def check_bound(curvature: Curvature, meta: StoreMeta) -> None:
    """Raise unless ``curvature`` was fitted for the store described by ``meta``.

    Raises:
        IncompatibleGradientsError: checkpoints (count, names, lrs, fingerprints), layout,
            the gradients' preconditioner (an optimizer-aware store) or (``"projected"``)
            projection and ``k`` differ; the message names the difference.
    """
    check_checkpoints(curvature, meta.checkpoints, what="the store's")
    _check_layout(curvature, meta.layout)
    _check_preconditioner(curvature, meta.preconditioner)
    if curvature.kind == "projected" and (curvature.projection != meta.projection
                                          or curvature.dim != meta.k):
        raise IncompatibleGradientsError(
            f"{current_caller()}: the curvature was fitted in the space of {curvature.projection}"
            f" (k={curvature.dim}) but the store was projected with {meta.projection} "
            f"(k={meta.k}); {_FIX}."
        )


def check_checkpoints(curvature: Curvature, checkpoints: Sequence[CheckpointMeta], *,
                      what: str = "the given") -> None:
    """Raise unless ``checkpoints`` are those the curvature was fitted at, in order."""
    ours = curvature.checkpoints
    if len(ours) != len(checkpoints):
        raise IncompatibleGradientsError(
            f"{current_caller()}: the curvature was fitted at {len(ours)} checkpoints but "
            f"{what} are {len(checkpoints)}; {_FIX}."
        )
    for position, (mine, theirs) in enumerate(zip(ours, checkpoints, strict=True)):
        for field in ("fingerprint", "name", "lr"):
            a, b = getattr(mine, field), getattr(theirs, field)
            if a != b:
                shown = (f"{a[:12]}…", f"{b[:12]}…") if field == "fingerprint" else (a, b)
                raise IncompatibleGradientsError(
                    f"{current_caller()}: checkpoint {position} differs: the curvature's "
                    f"{mine.name!r} has {field} {shown[0]!r}, {what} {theirs.name!r} has "
                    f"{shown[1]!r}; {_FIX}."
                )


def _check_layout(curvature: Curvature, layout: Layout) -> None:
    if curvature.layout != layout:
        raise IncompatibleGradientsError(
            f"{current_caller()}: the curvature covers other parameters than the store "
            f"({layout_differences(curvature.layout, layout)}); {_FIX}."
        )


def _check_preconditioner(curvature: Curvature, store_kind: str | None) -> None:
    fitted = curvature.info.get("preconditioner")
    if fitted != store_kind:
        raise IncompatibleGradientsError(
            f"{current_caller()}: the curvature was fitted on {_gradients(fitted)} but the "
            f"store's rows are {_gradients(store_kind)}; curvature-aware scores are defined "
            "for plain stores only. Build the store without preconditioners= for "
            "curvature-aware scores, or score this store without curvature= (optimizer-aware "
            "TracIn)."
        )


def _gradients(kind: str | None) -> str:
    return ("raw gradients (no optimizer preconditioner)" if kind is None
            else f"optimizer-preconditioned gradients, {describe_preconditioner(kind)}")
