"""Build a per-example ``loss(params, example)`` from an ``nn.Module``.

Two builders share one :class:`ModuleLoss`: :func:`loss_from_module` for ``(inputs, target)``
examples and a ``criterion(outputs, target)``, and :func:`loss_from_model` for examples of any
structure (a dict of tensors such as ``input_ids``/``attention_mask``/``labels``, a tuple, a
tensor), passed to the model as it expects (keyword arguments for a dict), with
``criterion(outputs, example)`` or the model's own ``outputs.loss``.

Both run attention with PyTorch's math kernel: ``vmap`` has no batching rule for the fused
CPU/flash kernels of ``scaled_dot_product_attention`` and would fall back to a slow
per-example loop (same numbers, up to float rounding). A Hugging Face model given a 2-D
``attention_mask`` gets it as a 4-D boolean mask (causal when the model's attention is),
because HF inspects the 2-D mask's values (``.all()``), which vmap cannot do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from tracinfunc._attention import vmap_attention
from tracinfunc._validate import current_caller, entry_point
from tracinfunc.errors import LossFunctionError, TrainModeError
from tracinfunc.types import Example, Params

__all__ = ["ModuleLoss", "check_eval_mode", "class_targets", "loss_from_model",
           "loss_from_module"]

_STATEFUL_IN_TRAIN_MODE = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


# torch.func.functional_call swaps the checkpoint's tensors into the module's attributes for the
# duration of a forward: two threads doing it on one module at once read each other's
# weights (silently wrong rows). Every forward tracinfunc runs through a module holds that
# module's lock (re-entrant: a loss may call tracinfunc inside). Nested calls on two models in
# two threads the other way round would each hold one lock and wait for the other for ever
# (atk42b); one lock for the process instead hung a forward that waits for tracinfunc in a
# worker thread (atk42c). So the locks know who waits for what, and the wait that would close
# a cycle is refused. Another thread calling the module itself meanwhile is not covered: it
# sees the checkpoint's weights (docs/language-models.md).
class _ModuleLocks:
    """Re-entrant per-module locks whose waits are checked for cycles."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._owners: dict[int, list[int]] = {}  # id(module) -> [thread, depth] while held
        self._waiting: dict[int, int] = {}  # thread -> id(module) it waits for

    @contextlib.contextmanager
    def held(self, *modules: nn.Module) -> Iterator[None]:
        """Every module given and every submodule of them, taken together once none is held
        by another thread: a forward through a model swaps tensors into its submodules, so a
        loss naming only ``model.b`` excludes a forward through ``model`` too."""
        keys = sorted({id(sub) for module in modules for sub in module.modules()})
        me = threading.get_ident()
        with self._changed:
            while (busy := next((key for key in keys if (owner := self._owners.get(key))
                                 is not None and owner[0] != me), None)) is not None:
                self._refuse_cycle(self._owners[busy][0], me)
                self._waiting[me] = busy
                try:
                    self._changed.wait()
                finally:
                    del self._waiting[me]
            for key in keys:
                owner = self._owners.setdefault(key, [me, 0])
                owner[1] += 1
        try:
            yield
        finally:
            with self._changed:
                for key in keys:
                    owner = self._owners[key]
                    owner[1] -= 1
                    if owner[1] == 0:
                        del self._owners[key]
                self._changed.notify_all()

    def _refuse_cycle(self, thread: int, me: int) -> None:
        """Raise if ``thread`` (holding what this thread wants) waits, through other threads'
        locks, for one this thread holds."""
        seen = set()
        while thread in self._waiting and thread not in seen:
            seen.add(thread)
            owner = self._owners.get(self._waiting[thread])
            if owner is None:
                return
            thread = owner[0]
            if thread == me:
                raise LossFunctionError(
                    f"{current_caller()}: this thread, inside a forward tracinfunc runs, asks "
                    "for a model that another thread holds while that thread waits for one "
                    "this thread holds (nested tracinfunc calls on two models, in two threads "
                    "the other way round): both would wait for ever. Make the nested calls in "
                    "one thread, or on a copy of one of the models (copy.deepcopy(model))."
                )


_LOCKS = _ModuleLocks()


def modules_reached(loss: Callable[..., Any]) -> list[nn.Module]:
    """The modules a hand-written loss names directly, found without calling it, in the order
    of their ``id``: its closure cells, its default arguments, the globals its code (and the
    code of functions defined inside it) reads, the arguments of a ``functools.partial``, the
    object of a bound method and that object's own attributes (``self.model``), a callable
    object's own attributes, and the same for every function reached that way that is not a
    library's (torch's functions are not walked; tracinfunc's wrappers, such as a
    checkpoint's loss, are). A module reached only through another object (a list, an
    attribute of a config) is not found."""
    found: dict[int, nn.Module] = {}
    inner = loss
    while isinstance(inner, functools.partial) or inspect.ismethod(inner):
        inner = inner.func if isinstance(inner, functools.partial) else inner.__func__
    pending, seen = [loss], set()
    while pending:
        fn = pending.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        if isinstance(fn, nn.Module):
            found.setdefault(id(fn), fn)
        elif isinstance(fn, functools.partial):
            pending.extend([fn.func, *fn.args, *fn.keywords.values()])
        elif inspect.ismethod(fn):
            pending.extend([fn.__self__, fn.__func__, *_attribute_modules(fn.__self__)])
        elif inspect.isfunction(fn) and (fn is inner or not _library(fn)):
            values = [cell.cell_contents for cell in fn.__closure__ or () if _filled(cell)]
            values += [fn.__globals__[name] for name in _global_names(fn.__code__)
                       if name in fn.__globals__]
            values += [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
            pending.extend(value for value in values
                           if isinstance(value, (nn.Module, functools.partial))
                           or inspect.isfunction(value) or inspect.ismethod(value))
        elif fn is loss and callable(fn) and not isinstance(fn, (type, ModuleLoss)):
            # a callable object (functions were taken above): its attributes and __call__
            # (a ModuleLoss locks its module in each forward itself)
            pending.extend(_attribute_modules(fn))
            call = inspect.getattr_static(type(fn), "__call__", None)
            if inspect.isfunction(call):
                pending.append(call)
    return [found[key] for key in sorted(found)]


# Packages whose functions a loss may name (torch.func.functional_call, F.cross_entropy) but
# whose globals hold no user's model: not walked (torch's own would be thousands of functions).
_LIBRARIES = frozenset({"torch", "transformers", "peft", "accelerate", "numpy", "jax", "jaxlib",
                        "flax", "optax", "functorch", "safetensors"})


def _library(fn: Any) -> bool:
    top = (getattr(fn, "__module__", None) or "").partition(".")[0]
    return top in _LIBRARIES or top in sys.stdlib_module_names


def _attribute_modules(obj: Any) -> list[nn.Module]:
    """The modules among ``obj``'s own attributes (one level: a bound method's ``self``, a
    callable object holding its model)."""
    if isinstance(obj, nn.Module):
        return []  # the module itself is locked with all its submodules
    try:
        values = list(vars(obj).values())
    except TypeError:  # no __dict__ (slots, builtins)
        return []
    return [value for value in values if isinstance(value, nn.Module)]


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 -- an empty cell raises
    except ValueError:
        return False
    return True


def _global_names(code: Any) -> set[str]:
    """Names a code object and the code objects nested in it read as globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _global_names(const)
    return names


@contextlib.contextmanager
def holding(modules: list[nn.Module]) -> Iterator[None]:
    """The locks of ``modules`` (those a forward through them holds, :func:`swapped_call`)
    for the duration: a hand-written ``functional_call`` loss swaps a checkpoint's tensors
    into its module as tracinfunc's own forwards do, and two threads doing it on one module
    at once would read each other's weights."""
    with _LOCKS.held(*modules):
        yield


def holds_loss_modules(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a public function with a ``loss`` argument) holding the locks of the modules
    its loss names (:func:`modules_reached`) for the whole call: for functions that run a
    hand-written loss themselves, outside :func:`~tracinfunc.per_sample_grads` and
    :func:`~tracinfunc.projected_grads` (which hold them per batch), such as a K-FAC fit."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def locked(*args: Any, **kwargs: Any) -> Any:
        try:
            loss = signature.bind_partial(*args, **kwargs).arguments.get("loss")
        except TypeError:  # fn's own call raises the clear error below
            loss = None
        with holding(modules_reached(loss) if loss is not None else []):
            return fn(*args, **kwargs)

    return locked


def swapped_call(module: nn.Module, state: Mapping[str, Tensor], args: Any = (),
                 kwargs: Mapping[str, Any] | None = None, *,
                 owner: nn.Module | None = None) -> Any:
    """``functional_call(module, (state,), args, kwargs)`` under the lock of ``owner`` (the
    model ``module`` is part of, for a stage; default ``module``), with every submodule's own
    parameters and buffers put back afterwards.

    ``functional_call`` ties weights by name and restores them one name at a time: a
    submodule registered under two names (``self.b = self.a``) is swapped twice and left
    holding the checkpoint's tensor (the user's module silently corrupted). The tensors,
    submodules and class each submodule had before the call are its own again after it,
    whatever happened; what the forward registered is removed."""
    with _LOCKS.held(module if owner is None else owner):
        own = [(sub, type(sub), dict(sub._modules), dict(sub._parameters), dict(sub._buffers))
               for sub in module.modules()
               if isinstance(sub._parameters, dict)]  # not a scripted module's C++ wrapper
        try:
            return functional_call(module, (dict(state),), args, kwargs)
        finally:
            for sub, kind, modules, parameters, buffers in own:
                if type(sub) is not kind:  # a parametrization registered by the forward
                    sub.__class__ = kind
                for held, before in ((sub._modules, modules), (sub._parameters, parameters),
                                     (sub._buffers, buffers)):
                    # What the forward registered goes (a transformed tensor), what it removed
                    # or replaced comes back, in the order it had (state_dict's keys)
                    if list(held) != list(before) or any(
                            held[name] is not value for name, value in before.items()):
                        held.clear()
                        held.update(before)


@dataclass(frozen=True, eq=False)
class ModuleLoss:
    """``loss(params, example)`` for one example, keeping the module it is made of.

    A plain :data:`~tracinfunc.types.LossFn` to every other function. Build it with
    :func:`loss_from_module` or :func:`loss_from_model`; :meth:`with_buffers` gives the same
    loss with a checkpoint's own buffers (BatchNorm statistics).

    Attributes:
        module: The model (eval mode); its own parameters are never used or changed.
        criterion: ``(inputs, target)`` form: ``criterion(outputs [1, ...], target [1, ...])``;
            any-example form: ``criterion(outputs, example)`` with every leaf ``[1, ...]``,
            or ``None`` for the model's own ``outputs.loss``.
        buffers: Non-trainable state by name, read-only.
        pair: ``True`` for ``(inputs, target)`` examples (:func:`loss_from_module`).
        skip_keys: Keys of a dict example not passed to the model (e.g. ``labels``).
    """

    module: nn.Module
    criterion: Callable[..., Tensor] | None
    buffers: Mapping[str, Tensor]
    pair: bool = True
    skip_keys: frozenset[str] = frozenset()
    # Names fixed when the loss is made, checked on every call: functional_call silently
    # takes the module's own weight for a name missing from ``params`` and ignores unknown
    # ones, which would give gradients of the wrong model without an error.
    trainable: frozenset[str] = field(init=False, repr=False)
    known: frozenset[str] = field(init=False, repr=False)
    shapes: Mapping[str, torch.Size] = field(init=False, repr=False)
    dtypes: Mapping[str, torch.dtype] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        refuse_lazy(self.module, "loss_from_module")
        named = dict(self.module.named_parameters())
        trainable = frozenset(name for name, value in named.items() if value.requires_grad)
        object.__setattr__(self, "trainable", trainable)
        object.__setattr__(self, "known", frozenset(named))
        object.__setattr__(self, "shapes", MappingProxyType(
            {name: value.shape for name, value in named.items()}))
        object.__setattr__(self, "dtypes", MappingProxyType(
            {name: value.dtype for name, value in named.items()}))

    def __call__(self, params: Params, example: Example) -> Tensor:
        """The loss of one ``example`` (no batch dimension) at ``params``.

        Raises:
            TrainModeError: the module was put back in train mode (dropout) after the loss
                was made, and vmap met a random operation.
        """
        try:
            return self._loss(params, example)
        except RuntimeError as error:
            if "random operation" in str(error):
                check_eval_mode(self.module)  # names the layers and the fix
            if in_place_mismatch(str(error)):
                _refuse_recurrent(self.module, error)
            if "dtype" in str(error):
                self._refuse_dtypes(params, error)
            raise

    def _loss(self, params: Params, example: Example) -> Tensor:
        outputs, batched = self.outputs(params, example)
        if self.pair:
            return self.criterion(outputs, class_targets(self.criterion, batched[1]))
        if self.criterion is not None:
            return self.criterion(outputs, batched)
        return _own_loss(outputs)

    def outputs(self, params: Params, example: Example) -> tuple[Any, Example]:
        """The module's outputs for one ``example`` at ``params`` (a batch of one,
        ``[1, ...]``), and the example with that batch dimension: what the criterion is given
        (its target for the ``(inputs, target)`` form is ``batched[1]``)."""
        self._check_names(params)
        state = {**self.buffers, **params}
        batched = tree_map(lambda leaf: leaf.unsqueeze(0), example)
        with vmap_attention():
            if self.pair:
                return swapped_call(self.module, state, (batched[0],)), batched
            args, kwargs = _model_arguments(self.module, batched, self.skip_keys)
            return swapped_call(self.module, state, args, kwargs), batched

    def per_example(self, params: Params, batch: Any) -> Tensor:
        """The losses ``[b]`` of a batch from one batched forward of the module.

        Equal to ``vmap(self)(params, batch)`` when the model's rows do not interact (eval
        mode, no cross-example layer); callers check that (the batched kronecker path
        compares with its vmapped path on the first batch). Attention uses any SDPA kernel.

        Raises:
            LossFunctionError: the loss is the model's own ``outputs.loss`` (a batch mean).
        """
        if self.criterion is None:
            raise LossFunctionError(
                "ModuleLoss.per_example: the model's own outputs.loss is a mean over the "
                "batch, not per example; pass criterion=."
            )
        check_eval_mode(self.module)  # batched, dropout would run silently: no vmap to refuse it
        self._check_names(params)
        state = {**self.buffers, **params}
        if self.pair:
            inputs, target = batch
            outputs = swapped_call(self.module, state, (inputs,))
            return _per_row(self.criterion, outputs, class_targets(self.criterion, target))
        args, kwargs = _model_arguments(self.module, batch, self.skip_keys)
        outputs = swapped_call(self.module, state, args, kwargs)
        size = tree_leaves(batch)[0].shape[0]
        return torch.stack([self.criterion(row, example) for row, example in zip(
            _rows(outputs, size), _rows(batch, size), strict=True)])

    def check_buffers(self, buffers: Mapping[str, Tensor]) -> None:
        """Refuse a checkpoint's ``buffers`` of another shape than the model's, or giving some
        of the model's persistent floating-point buffers but not all (the rest would silently
        come from the module as it is now).

        Raises:
            LossFunctionError: naming the buffer.
        """
        wrong = [(name, list(buffers[name].shape), list(self.buffers[name].shape))
                 for name in buffers if name in self.buffers and isinstance(buffers[name], Tensor)
                 and buffers[name].shape != self.buffers[name].shape]
        if wrong:
            raise LossFunctionError(
                f"{current_caller()}: buffer {wrong[0][0]!r} has shape {wrong[0][1]} in the "
                f"checkpoint, but {wrong[0][2]} in the model; was the checkpoint saved from "
                "another model?"
            )
        # non-persistent buffers (a rotary embedding's inv_freq) are in no state dict: they
        # are part of the model, not of a checkpoint
        persistent = {f"{prefix}.{name}" if prefix else name
                      for prefix, sub in self.module.named_modules()
                      for name in sub._buffers if name not in sub._non_persistent_buffers_set}
        missing = sorted(name for name, value in self.buffers.items() if name not in buffers
                         and name in persistent and value.is_floating_point())
        if buffers and missing:
            raise LossFunctionError(
                f"{current_caller()}: the checkpoint gives some of the model's buffers but "
                f"not {missing[:5]}, which would be taken from the module as it is now, beside "
                "the checkpoint's others; give every buffer (Checkpoint.from_module keeps them "
                "all) or none."
            )

    def with_buffers(self, buffers: Mapping[str, Tensor]) -> ModuleLoss:
        """The same loss with ``buffers`` (e.g. a checkpoint's) replacing those of that name.

        Returns ``self`` when the buffers equal the loss's own.

        Raises:
            LossFunctionError: a name is not a buffer of the module.
        """
        unknown = sorted(set(buffers) - set(self.buffers))
        if unknown:
            raise LossFunctionError(
                f"ModuleLoss.with_buffers: {unknown[:5]} are not buffers of "
                f"{type(self.module).__name__} (its buffers are {sorted(self.buffers)[:5]}); "
                "was the checkpoint saved from another model?"
            )
        self.check_buffers(buffers)
        if all(_same(buffers[name], self.buffers[name]) for name in buffers):
            return self  # shared: build_store then reuses one gradient function
        merged = MappingProxyType({**self.buffers, **buffers})
        return dataclasses.replace(self, buffers=merged)

    def _refuse_dtypes(self, params: Params, error: RuntimeError) -> None:
        """Name the parameters whose dtype is not the model's, when torch failed on a dtype
        (a float64 checkpoint tensor in a float32 model); return if there are none."""
        other = [(name, value.dtype, self.dtypes[name]) for name, value in params.items()
                 if name in self.dtypes and value.dtype != self.dtypes[name]]
        if other:
            name, got, expected = other[0]
            raise LossFunctionError(
                f"loss_from_module: parameter {name!r} is {got} in the parameters passed, but "
                f"{expected} in the model ({len(other)} parameter(s) differ; torch said: "
                f"{error}). Cast the checkpoint to the model's dtype ({{n: v.to({expected}) "
                "...}) or the model to the checkpoint's."
            ) from error

    def _check_names(self, params: Params) -> None:
        names = params.keys()
        missing, unknown = self.trainable - names, names - self.known
        if missing or unknown:
            raise LossFunctionError(
                f"loss_from_module: the parameters passed do not match the model: missing "
                f"{sorted(missing)[:5]}, unknown {sorted(unknown)[:5]} (expected the "
                f"{len(self.trainable)} trainable parameter names of model.named_parameters()). "
                "Build checkpoints with Checkpoint.from_module/from_state_dict(..., model) "
                "so that they hold exactly those."
            )
        wrong = [(name, tuple(params[name].shape), tuple(self.shapes[name])) for name in names
                 if name in self.shapes and params[name].shape != self.shapes[name]]
        if wrong:
            name, got, expected = wrong[0]
            raise LossFunctionError(
                f"loss_from_module: parameter {name!r} has shape {list(got)} in the parameters "
                f"passed, but {list(expected)} in the model"
                + (f" (and {len(wrong) - 1} more of another shape)" if len(wrong) > 1 else "")
                + "; was the checkpoint saved from another model, or a layer transposed? "
                "Build checkpoints with Checkpoint.from_module/from_state_dict(..., model)."
            )


@entry_point("loss_from_module")
def loss_from_module(
    module: nn.Module,
    criterion: Callable[[Tensor, Tensor], Tensor],
    *,
    buffers: Mapping[str, Tensor] | None = None,
) -> ModuleLoss:
    """Turn a module and a criterion into ``loss(params, example)`` for one example.

    The example is ``(inputs, target)`` with no batch dimension; the module is called on
    ``inputs[None]`` with ``torch.func.functional_call`` so the parameters come from ``params``
    (the checkpoint) and the module's own weights are never touched. For dict or other
    examples (language models), use :func:`loss_from_model`.

    Args:
        module: The model, in eval mode (dropout in train mode would make each gradient
            random; BatchNorm would update running statistics per example).
        criterion: ``criterion(outputs [1, ...], target [1, ...]) -> scalar``, e.g.
            ``torch.nn.functional.cross_entropy``.
        buffers: Non-trainable state by name (BatchNorm statistics). Defaults to a copy of
            the module's buffers taken now; they are passed explicitly, never mutated.
            A checkpoint's own buffers replace them in ``build_store``.

    Returns:
        A :class:`ModuleLoss`: ``loss(params, example) -> scalar tensor``.

    Raises:
        TrainModeError: the module is in train mode with dropout, BatchNorm or another
            layer whose output depends on the mode (see :func:`check_eval_mode`).
    """
    check_eval_mode(module)
    return ModuleLoss(module, criterion, _buffers_of(module, buffers))


@entry_point("loss_from_model")
def loss_from_model(
    model: nn.Module,
    *,
    criterion: Callable[[Any, Example], Tensor] | None = None,
    buffers: Mapping[str, Tensor] | None = None,
    skip_keys: tuple[str, ...] = (),
) -> ModuleLoss:
    """``loss(params, example)`` for examples of any structure, e.g. a dict of token tensors.

    The example (no batch dimension) gets a leading batch dimension of 1 on every leaf and is
    passed to ``model`` as it expects: a dict as keyword arguments, a tuple or list as
    positional arguments, a tensor as the one argument. Ready-made losses for language models
    are in :mod:`tracinfunc.lm.losses` (:func:`~tracinfunc.causal_lm_loss`,
    :func:`~tracinfunc.sequence_classification_loss`).

    Args:
        model: The model, in eval mode.
        criterion: ``criterion(outputs, example) -> scalar`` with the example's leaves
            ``[1, ...]``; ``None``: the model's own ``outputs.loss`` (a Hugging Face model
            given ``labels``).
        buffers: As for :func:`loss_from_module`.
        skip_keys: Keys of a dict example that are not passed to the model (the criterion
            still sees them), e.g. ``("labels",)`` when the criterion computes the loss.

    Returns:
        A :class:`ModuleLoss`.

    Raises:
        TrainModeError: the model is in train mode with dropout, BatchNorm or another
            layer whose output depends on the mode (see :func:`check_eval_mode`).

    Example:
        >>> loss = loss_from_model(gpt2)                       # outputs.loss from labels
        >>> loss(params, {"input_ids": ids, "labels": ids})
    """
    check_eval_mode(model)
    if isinstance(skip_keys, str) or not all(isinstance(key, str) for key in skip_keys):
        raise LossFunctionError(
            f"loss_from_model: skip_keys must be a tuple of dict keys, got {skip_keys!r}; "
            "e.g. skip_keys=('labels',)."
        )
    return ModuleLoss(model, criterion, _buffers_of(model, buffers), pair=False,
                      skip_keys=frozenset(skip_keys))


def _per_row(criterion: Callable[..., Tensor], outputs: Any, target: Tensor) -> Tensor:
    """``criterion`` on every (output row, target row), each with a batch dimension of 1:
    ``[b]``. One vmapped call (a Python call per row cost ~30 us, more than a small model's
    whole batched forward), or row by row where the criterion has no batching rule."""
    rows = _cross_entropy_rows(criterion, outputs, target)
    if rows is not None:
        return rows
    if isinstance(outputs, Tensor) and outputs.shape[:1] == target.shape[:1]:
        try:
            return vmap(lambda row, t: criterion(row.unsqueeze(0), t.unsqueeze(0)))(
                outputs, target)
        except (RuntimeError, TypeError, ValueError):
            pass  # e.g. .item() or data-dependent control flow: the loop below says what fails
    return torch.stack([criterion(row, t) for row, t in zip(
        _rows(outputs, target.shape[0]), target.split(1), strict=True)])


def class_targets(criterion: Callable[..., Tensor], target: Any) -> Any:
    """``target`` as int64 where it is uint8 class indices of a cross-entropy or NLL criterion:
    torch takes those ("Long or Byte") one example at a time, but under vmap the criterion's
    ``gather`` refuses a uint8 index. Anything else is returned as it is."""
    if isinstance(target, Tensor) and target.dtype == torch.uint8 and (
            criterion in (F.cross_entropy, F.nll_loss)
            or isinstance(criterion, nn.CrossEntropyLoss | nn.NLLLoss)):
        return target.long()
    return target


def _cross_entropy_rows(criterion: Callable[..., Tensor], outputs: Any,
                        target: Tensor) -> Tensor | None:
    """``F.cross_entropy(outputs, target, reduction="none")`` ``[b]`` where it equals, bit for
    bit (values and gradients), the criterion on each row alone with a batch dimension of 1,
    as ``_per_row``'s vmapped call gives it; else ``None``.

    It does for ``F.cross_entropy`` (or an ``nn.CrossEntropyLoss`` with its defaults) on CPU
    logits ``[b, C]`` and int64 class targets ``[b]`` none of which is the ignored class (a
    row alone with an ignored target is a mean over no element: NaN, where ``"none"`` gives
    0). vmap runs the criterion through its decomposition, several dispatches per operation:
    most of a small model's forward. On an accelerator the ignored-class check would be a
    host sync, so the vmapped call stays."""
    if criterion is F.cross_entropy:
        ignore_index = -100
    elif (type(criterion) is nn.CrossEntropyLoss and criterion.weight is None
          and criterion.reduction == "mean" and criterion.label_smoothing == 0.0):
        ignore_index = criterion.ignore_index
    else:
        return None
    if not isinstance(outputs, Tensor) or outputs.dim() != 2 or not outputs.is_floating_point() \
            or outputs.device.type != "cpu" or target.dtype != torch.int64 \
            or target.shape != outputs.shape[:1] or target.device != outputs.device \
            or not bool((target != ignore_index).all()):
        return None
    return F.cross_entropy(outputs, target, reduction="none")


def _rows(tree: Any, size: int) -> list[Any]:
    """``size`` trees: row ``i`` of every tensor leaf whose first dimension is ``size``,
    keeping a batch dimension of 1 (one ``split`` per leaf, whose backward is one ``cat``)."""
    leaves, spec = tree_flatten(tree)
    pieces = [leaf.split(1) if isinstance(leaf, Tensor) and leaf.dim() and leaf.shape[0] == size
              else (leaf,) * size for leaf in leaves]
    return [tree_unflatten([parts[i] for parts in pieces], spec) for i in range(size)]


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device \
        and bool(torch.equal(a, b))


def refuse_lazy(module: nn.Module, who: str) -> None:
    """Refuse a model whose lazy modules (nn.LazyLinear, nn.LazyBatchNorm1d, ...) have not run:
    their parameters and buffers have no shape yet, and run inside tracinfunc's transforms they
    would initialise themselves with random weights (or fail, leaving an escaped tensor)."""
    names = [name for name, value in [*module.named_parameters(), *module.named_buffers()]
             if isinstance(value, nn.parameter.UninitializedTensorMixin)]
    if names:
        lazy = sorted({name.rpartition(".")[0] or "(the model)" for name in names})
        raise LossFunctionError(
            f"{who}: the lazy module(s) {lazy[:5]} have not run yet, so their parameters "
            f"{names[:5]} have no shape (nn.LazyLinear and the like get it on their first "
            "forward). Run the "
            "model once on an example batch first; a lazy module the forward never calls (an "
            "unused head) needs a call of its own (model.head(example_features)), or removing."
        )


def _buffers_of(module: nn.Module, buffers: Mapping[str, Tensor] | None) -> Mapping[str, Tensor]:
    refuse_lazy(module, current_caller())  # before its uninitialised buffers are copied
    if buffers is None:
        buffers = {key: value.detach().clone() for key, value in module.named_buffers()}
    return MappingProxyType(dict(buffers))


def in_place_mismatch(message: str) -> bool:
    """Whether torch's ``message`` is an in-place write of a value that does not fit (under
    ``vmap``: a per-example value into a tensor without the batch dimension)."""
    return "doesn't match the broadcast shape" in message or (
        "vmap" in message and "inplace" in message and "not possible" in message)


def _refuse_recurrent(module: nn.Module, error: RuntimeError) -> None:
    """Raise the way out when ``module`` has torch's recurrent layers, which write into
    unbatched state in place under ``vmap`` in some configurations (float64 nn.LSTM, nn.GRU,
    nn.RNN); return otherwise."""
    layers = [(name, type(layer).__name__) for name, layer in module.named_modules()
              if isinstance(layer, nn.RNNBase)]
    if not layers:
        return
    cells = sorted({f"nn.{kind}Cell" for _, kind in layers})
    raise LossFunctionError(
        f"{current_caller()}: the recurrent layer(s) {[name for name, _ in layers][:5]} "
        f"({', '.join(sorted({kind for _, kind in layers}))}) write per-example values "
        "in-place into state without the batch dimension under torch.func.vmap, which computes "
        f"the per-example gradients (torch said: {error}). Run the recurrence with "
        f"{' / '.join(cells)} in a loop over time steps, which vmap batches."
    ) from error


def _model_arguments(module: nn.Module, batched: Any, skip: frozenset[str]
                     ) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for the model from a batched example."""
    if isinstance(batched, Mapping):
        kwargs = {key: value for key, value in batched.items() if key not in skip}
        mask = kwargs.get("attention_mask")
        if isinstance(mask, Tensor) and mask.dim() == 2 and hasattr(module, "config"):
            kwargs["attention_mask"] = _attention_mask_4d(mask, causal=_is_causal(module))
        return (), kwargs
    if isinstance(batched, tuple | list):
        return tuple(batched), {}
    return (batched,), {}


def _attention_mask_4d(mask: Tensor, *, causal: bool) -> Tensor:
    """``[1, T]`` 0/1 padding mask -> ``[1, 1, T, T]`` (causal) or ``[1, 1, 1, T]`` bool."""
    keep = mask.bool()[:, None, None, :]  # [1, 1, 1, T]
    if not causal:
        return keep
    length = mask.shape[-1]
    lower = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    return keep & lower  # [1, 1, T, T]


def _is_causal(module: nn.Module) -> bool:
    """Whether the model's attention layers are causal (HF sets ``is_causal`` on them)."""
    return any(getattr(sub, "is_causal", False) is True for sub in module.modules())


def _own_loss(outputs: Any) -> Tensor:
    value = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if not isinstance(value, Tensor):
        raise LossFunctionError(
            "loss_from_model: criterion=None uses the model's own outputs.loss, but the model "
            f"returned {type(outputs).__name__} without one; give the example its labels "
            "(e.g. {'input_ids': ids, 'labels': ids}) or pass criterion(outputs, example)."
        )
    return value


def check_eval_mode(module: nn.Module) -> None:
    """Raise :class:`TrainModeError` if a layer of ``module`` computes differently in train mode.

    Refused: dropout modules (``nn.Dropout*``, peft's ``lora_dropout``) with ``p > 0``,
    BatchNorm and InstanceNorm layers that track running statistics, and any submodule with a
    positive ``*dropout*`` rate of its own (attention dropout such as Llama's) or in its
    config (a Hugging Face model, e.g. GPT-2's ``resid_pdrop``), while in train mode.
    Dropout would make each example's gradient random (``vmap`` refuses random operations);
    BatchNorm would use batch statistics and update its buffers.
    """
    offenders = [f"{name or type(layer).__name__} ({why})"
                 for name, layer in module.named_modules()
                 if layer.training and (why := _train_mode_effect(layer))]
    if not offenders:  # a rate only in a HF config (applied functionally): name the model once
        holders = [(name or type(layer).__name__, layer, why)
                   for name, layer in module.named_modules() if (why := _config_rate(layer))]
        # Only when every holder is in train mode: a wrapper (peft's PeftModel, a new module in
        # train mode) around an eval-mode HF model shares its config but runs no dropout.
        if holders and all(layer.training for _, layer, _ in holders):
            offenders = [f"{holders[0][0]} ({holders[0][2]})"]
    if offenders:
        shown = ", ".join(offenders[:4]) + (f", … ({len(offenders)} in all)"
                                            if len(offenders) > 4 else "")
        raise TrainModeError(
            f"{current_caller()}: the model is in train mode, where these layers compute "
            f"differently from eval mode: {shown}. Per-example gradients need the eval-mode "
            "model (no dropout, fixed statistics). Call model.eval() before building the loss "
            "or the store (a Hugging Face Trainer leaves the model in train mode after .train())."
        )


def _train_mode_effect(layer: nn.Module) -> str | None:
    """Why ``layer`` in train mode changes its output (or its buffers), else ``None``."""
    if isinstance(layer, _STATEFUL_IN_TRAIN_MODE):
        return "running statistics" if getattr(layer, "track_running_stats", False) else None
    if isinstance(layer, nn.modules.dropout._DropoutNd):
        return f"dropout p={layer.p}" if layer.p > 0 else None
    rates = sorted((key, value) for key, value in vars(layer).items() if _is_rate(key, value))
    return f"{rates[0][0]}={rates[0][1]}" if rates else None


def _config_rate(layer: nn.Module) -> str | None:
    """A positive dropout rate in the Hugging Face config ``layer`` holds, else ``None``."""
    config = getattr(layer, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    rates = sorted((key, value) for key, value in config.to_dict().items() if _is_rate(key, value))
    return f"config.{rates[0][0]}={rates[0][1]}" if rates else None


def _is_rate(key: str, value: Any) -> bool:
    """A positive dropout rate: ``attention_dropout=0.1``, GPT-2's ``resid_pdrop=0.1``."""
    named = "dropout" in key or key.endswith("pdrop")
    return named and isinstance(value, float | int) and not isinstance(value, bool) and value > 0
