"""The tracinfunc exception hierarchy.

Every error derives from :class:`TracInFuncError` and from the builtin it refines
(``ValueError``, ``TypeError``, ...), so ``except ValueError`` keeps working for callers who
do not know this library (``tests/test_conventions.py`` checks every ``raise`` in the
package). A missing optional dependency raises ``ImportError`` with the install command.
Messages name the function, what was expected, what was got and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "CorruptRecordingError",
    "CorruptStoreError",
    "EmptyDataError",
    "ForeignArtifactError",
    "IllConditionedError",
    "IncompatibleGradientsError",
    "IncompleteStoreError",
    "InvalidArgumentError",
    "InvalidProjectionError",
    "InvalidTypeError",
    "LossFunctionError",
    "MemoryBudgetError",
    "MissingDependencyError",
    "MissingParametersError",
    "NonFiniteGradientError",
    "OutputPathError",
    "ParameterSelectionError",
    "ReadOnlyStoreError",
    "RecordingExistsError",
    "RowRangeError",
    "StageMismatchError",
    "StoreExistsError",
    "StoreLockedError",
    "StoreNotFoundError",
    "StoreWriteError",
    "TracInFuncError",
    "TrainModeError",
    "UnsupportedPrecisionError",
]


class TracInFuncError(Exception):
    """Base class of every error raised by tracinfunc."""


class InvalidProjectionError(TracInFuncError, ValueError):
    """A projection spec is malformed, or gradients do not match its parameter layout."""


class IncompatibleGradientsError(TracInFuncError, ValueError):
    """Train and test gradients were not made the same way (projection, checkpoints, k)."""


class NonFiniteGradientError(TracInFuncError, ValueError):
    """A per-example gradient contains NaN or infinity."""


class IllConditionedError(TracInFuncError, ValueError):
    """A damped curvature's solve has a condition number so large that its result (and every
    score made with it) would be rounding noise; the message gives the damping that fixes it."""


class EmptyDataError(TracInFuncError, ValueError):
    """The data passed to build a store holds no examples."""


class LossFunctionError(TracInFuncError, TypeError):
    """The loss function does not accept the parameters/example given, or is not scalar."""


class TrainModeError(TracInFuncError, RuntimeError):
    """A module that updates state in train mode (BatchNorm) was used under vmap."""


class ReadOnlyStoreError(TracInFuncError, PermissionError):
    """An attempt was made to modify a finished, read-only gradient store."""


class StoreExistsError(TracInFuncError, FileExistsError):
    """A finished store already exists where a new one was to be written."""


class StoreWriteError(TracInFuncError, OSError):
    """Writing a store failed (disk full, I/O error); what was stored before is kept."""


class StoreLockedError(TracInFuncError, RuntimeError):
    """Another writer (another build) is writing to the same store path right now."""


class IncompleteStoreError(TracInFuncError, RuntimeError):
    """A store was left unfinished by an interrupted build; resume it with ``build_store``."""


class CorruptStoreError(TracInFuncError, OSError):
    """Stored bytes fail their checksum or are missing: the store is damaged on disk."""


class CorruptRecordingError(CorruptStoreError):
    """A recorded checkpoint's file differs from its manifest entry (size, hash, order)."""


class RecordingExistsError(TracInFuncError, FileExistsError):
    """A recorder would mix runs or write over a recorded (or foreign) file in its directory."""


class ParameterSelectionError(TracInFuncError, ValueError):
    """A parameter selection matches no parameter, or names parameters the model lacks."""


class UnsupportedPrecisionError(TracInFuncError, ValueError):
    """Mixed precision was asked in a dtype that autocast does not support on the device."""


class StageMismatchError(TracInFuncError, ValueError):
    """A list of stages does not reproduce the model's output (or its loss)."""


class MemoryBudgetError(TracInFuncError, ValueError):
    """A memory budget cannot hold even one example's gradient, or a result cannot fit in
    the device's free memory."""


class InvalidArgumentError(TracInFuncError, ValueError):
    """An argument has an accepted type but a value the function cannot take (a size, a
    mode, a shape), where no more specific error applies."""


class InvalidTypeError(TracInFuncError, TypeError):
    """An argument has a type the function does not take."""


class StoreNotFoundError(TracInFuncError, FileNotFoundError):
    """No gradient store exists at the path given."""


class RowRangeError(TracInFuncError, IndexError):
    """A checkpoint index or row range lies outside the store."""


class MissingParametersError(TracInFuncError, KeyError):
    """A state dict lacks parameters of the model it should fill."""


class OutputPathError(TracInFuncError, OSError):
    """A result file cannot be written where asked: it exists, or its directory is missing
    or not writable."""


class MissingDependencyError(TracInFuncError, ImportError):
    """An optional feature needs a package that is not installed; the message gives the
    ``pip install`` command (e.g. ``pip install 'tracinfunc[hf]'``)."""


class ForeignArtifactError(StoreExistsError, OutputPathError, InvalidArgumentError):
    """A writer was pointed at, inside, or above an artefact it may not replace (a gradient
    store, an index, a saved curvature, a recording, ...: anything another writer made), or at
    a place no writer replaces (the file system root, the home or working directory).

    It derives from ``FileExistsError`` and ``ValueError`` (through the errors writers raised
    before the one guard existed), so earlier ``except`` clauses still catch it."""
