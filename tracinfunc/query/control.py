"""The control side of a :class:`~tracinfunc.Contrast`: checked as test gradients are, with
errors that say it was the control, and preconditioned by the same curvature."""

from __future__ import annotations

from torch import Tensor

from tracinfunc._validate import current_caller
from tracinfunc.curvature.value import Curvature
from tracinfunc.errors import InvalidArgumentError, TracInFuncError
from tracinfunc.query.checks import check_test_tensor
from tracinfunc.query.contrast import Contrast
from tracinfunc.query.curvature import precondition_queries
from tracinfunc.store.meta import StoreMeta, check_compatible
from tracinfunc.store.protocols import GradientStore

__all__ = ["control_rows"]


def control_rows(meta: StoreMeta, contrast: Contrast, n_test: int,
                 curvature: Curvature | None) -> GradientStore | Tensor:
    """``contrast.control`` checked against the store and ``n_test``, preconditioned by
    ``curvature`` when one is given.

    Raises:
        InvalidArgumentError: no control rows, or paired controls for another ``n_test``.
        IncompatibleGradientsError, NonFiniteGradientError, InvalidTypeError: as for test
            gradients, naming the control.
    """
    control = contrast.control
    try:
        if isinstance(control, Tensor):
            check_test_tensor(meta, control)
        else:
            check_compatible(meta, control.meta)
        n_ctrl = control.shape[1] if isinstance(control, Tensor) else control.meta.n_train
        if n_ctrl == 0:
            raise InvalidArgumentError(
                f"{current_caller()}: the contrast's control set is empty (n_ctrl=0); give at "
                "least one control example, or query without a Contrast.")
        if contrast.paired and n_ctrl != n_test:
            raise InvalidArgumentError(
                f"{current_caller()}: paired controls need one control per test example "
                f"({n_test}), got {n_ctrl}; pass paired=False to subtract their mean.")
        return precondition_queries(meta, control, curvature)
    except TracInFuncError as error:
        raise _about_control(error) from None


def _about_control(error: TracInFuncError) -> TracInFuncError:
    """The same error, its message saying that the control (not the test) was at fault."""
    message = str(error.args[0]) if error.args else str(error)
    if "control" not in message:
        caller, _, rest = message.partition(": ")
        rest = rest.replace("test gradients", "control gradients")
        message = f"{caller}: the contrast's control: {rest}"
    return type(error)(message)
