"""Factorised plans shared between gradient functions: discovery and proofs done once.

A plan (:class:`~tracinfunc.grads.factorized._Plan`) is what the factorised kronecker path
learns about a loss before its first row: which weights its layers apply (one forward), that
their gradients are the layers' ``left.T @ right`` (one per-example backward), the projection
factors, and which batched mode gives the per-example rows (the first batch's proof, about one
batch of work). None of it depends on parameter values, so every gradient function made for
the same loss, layout, projection, preconditioner and buffers reuses one plan: a
``build_store`` per checkpoint, a test-gradient build per query.

The key must never name another loss. It holds:

- for a :class:`~tracinfunc.loss.ModuleLoss`: its module (by a weak reference, so a freed
  model's address reused by a new one is a miss), criterion, form and buffers (each by
  name and the digest of its values: a checkpoint's own buffers, whose values may change
  which layers run or whether a batched forward mixes examples, get a plan of their own;
  equal values, as the new buffer tensors of every build are, share one);
- for any other callable: the callable itself (weakly), its code, the objects its closure,
  defaults and ``functools.partial`` arguments hold (by identity);
- for every module reached that way: its structure (each submodule's name, identity, class,
  forward, train/eval mode and hooks), so a model changed in place is proved again;
- the selected and frozen parameters' names, shapes and dtype, the device, the projection
  and the preconditioner (weakly).

A cached plan for a plain callable is also re-checked cheaply before reuse: one no-grad forward
of one example must call the same layers in the same order with the same output shapes as when
it was proved (a ModuleLoss's module is fixed, and its submodules' identities are in the key).
"""

from __future__ import annotations

import functools
import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tracinfunc.loss import ModuleLoss
from tracinfunc.projection import Projection, canonical_layout
from tracinfunc.types import Params

__all__ = ["cached_plan", "clear_plans"]

_MAX_PLANS = 8  # plans hold projection factors: a few MiB each at most
_PLANS: OrderedDict[tuple, tuple[list, Any]] = OrderedDict()  # key -> (referents, plan)
_lock = threading.Lock()


def cached_plan(loss: Callable, projection: Projection, chosen: Params, frozen: Params,
                precondition: Any, make: Callable[[], Any], still_valid: Callable[[Any], bool]):
    """The shared plan for this loss and layout, made by ``make()`` on a miss.

    ``still_valid(plan)`` re-checks a cached plan on this call's inputs (a cheap forward); a
    plan that fails it is replaced. An uncacheable loss (no weak reference possible) always
    gets a new plan.
    """
    identity = _identity(loss)
    if identity is None:
        return make()
    key_loss, referents = identity
    first = next(iter(chosen.values()))
    key = (key_loss, canonical_layout(chosen), _layout(frozen), first.device, first.dtype,
           projection, id(precondition))
    if precondition is not None:
        referents = [*referents, _ref(precondition)]
    with _lock:
        entry = _PLANS.get(key)
        if entry is not None and not _alive(entry[0]):
            del _PLANS[key]
            entry = None
        if entry is not None:
            _PLANS.move_to_end(key)
    # A ModuleLoss's module is fixed and its structure (submodules by identity) is in the
    # key; a plain callable may reach another model through state the key cannot see.
    if entry is not None and (isinstance(loss, ModuleLoss) or still_valid(entry[1])):
        return entry[1]
    plan = make()
    with _lock:
        _PLANS[key] = (referents, plan)
        _PLANS.move_to_end(key)
        while len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    return plan


def clear_plans() -> None:
    """Forget every shared plan (the next gradient function discovers and proves again)."""
    with _lock:
        _PLANS.clear()


def _identity(loss: Callable) -> tuple[tuple, list] | None:
    """``(hashable key, referents)`` naming ``loss`` and what it runs, or ``None``."""
    if isinstance(loss, ModuleLoss):
        criterion = loss.criterion
        key = ("module", id(loss.module), _structure(loss.module), id(criterion),
               _code(criterion), loss.pair, loss.skip_keys,
               tuple((name, _content(value)) for name, value in sorted(loss.buffers.items())))
        referents = [_ref(loss.module), _ref(criterion)]
        return None if any(ref is None for ref in referents) else (key, referents)
    held = _held(loss)
    referents = [_ref(loss), *(_ref(value) for value in held)]
    if any(ref is None for ref in referents):  # a mutable value we cannot watch: no cache
        return None
    modules = [value for value in held if isinstance(value, nn.Module)]
    key = ("callable", id(loss), _code(loss), tuple(id(value) for value in held),
           tuple(_structure(module) for module in modules))
    return key, referents


def _content(value: Any) -> tuple:
    """A buffer by its values (dtype, shape, device and a digest of its bytes): a build's
    checkpoint buffers are new tensor objects each time, equal values must share a plan,
    and different ones (a flag that changes which layers run) must not."""
    if not isinstance(value, torch.Tensor):
        return ("object", id(value))
    if value.device.type == "meta" or value.is_sparse or value.layout != torch.strided:
        return ("tensor", id(value))  # no bytes to read: only itself
    data = value.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return (str(value.dtype), tuple(value.shape), str(value.device),
            hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest())


def _held(loss: Callable) -> list:
    """The objects a callable's behaviour depends on besides its code (one level deep)."""
    if isinstance(loss, functools.partial):
        return [loss.func, *loss.args, *loss.keywords.values()]
    target = getattr(loss, "__func__", loss)
    held = [getattr(loss, "__self__", None)]
    held += [cell.cell_contents for cell in getattr(target, "__closure__", None) or ()
             if _filled(cell)]
    held += list(getattr(target, "__defaults__", None) or ())
    if not hasattr(target, "__code__"):  # an object with __call__: its attributes
        held += list(getattr(loss, "__dict__", {}).values())
    return [value for value in held if value is not None]


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def _code(fn: Any) -> Any:
    target = getattr(fn, "__func__", fn)
    return getattr(target, "__code__", type(fn))


def _structure(module: nn.Module) -> tuple:
    """Each submodule's name, identity, class, forward, mode and hook counts (not parameter
    values)."""
    return tuple((name, id(sub), type(sub), sub.__dict__.get("forward"), sub.training,
                  len(sub._forward_hooks), len(sub._forward_pre_hooks))
                 for name, sub in module.named_modules(remove_duplicate=False))


def _layout(params: Params) -> tuple:
    return tuple(sorted((name, tuple(value.shape), value.dtype)
                        for name, value in params.items()))


class _Strong:
    """Stands in for a weak reference to an object that cannot be weakly referenced
    (builtins): held strongly, always alive."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self) -> Any:
        return self.value


def _ref(value: Any):
    if value is None:
        return _Strong(None)
    try:
        return weakref.ref(value)
    except TypeError:
        return _Strong(value) if _immutable(value) else None


def _immutable(value: Any) -> bool:
    return isinstance(value, (int, float, str, bytes, bool, tuple, frozenset, type)) or \
        (callable(value) and not hasattr(value, "__dict__"))


def _alive(referents: list) -> bool:
    return all(ref is not None and ref() is not None for ref in referents)
