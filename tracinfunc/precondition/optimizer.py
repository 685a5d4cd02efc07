"""Optimizer-aware TracIn: training gradients preconditioned by the saved optimizer state.

Plain TracIn weights ``<grad L(test), grad L(train)>``, but an Adam-trained model moved along
Adam's update direction, not the gradient. LESS (Xia et al., 2024) therefore replaces each
*training* gradient by the Adam update it would have caused at the checkpoint; TrackStar
(Chang et al., 2024) divides it by the square root of Adam's second moment. Test gradients
stay plain in both.

A :class:`Preconditioner` holds, per parameter name, the optimizer state saved with one
checkpoint, and maps an example's gradient dict elementwise (so it runs inside ``vmap``,
before the projection). Build one from an optimizer, its ``state_dict()``, a saved file
(a HF Trainer's ``optimizer.pt`` has the same format) and pass one per checkpoint to
``build_store(..., preconditioners=[...])``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from tracinfunc._validate import check_bool, current_caller, entry_point
from tracinfunc.errors import (
    IncompatibleGradientsError,
    InvalidArgumentError,
    InvalidTypeError,
    MissingDependencyError,
    MissingParametersError,
    TracInFuncError,
)
from tracinfunc.precondition.factored import (
    FactoredTerms,
    apply_factored,
    factored_terms,
    is_factored,
)

# Public: the optimizer state and its preconditioner. check_preconditioners is build_store's
# helper (importable by build/, not part of the API).
__all__ = ["PRECONDITIONER_KINDS", "AdamState", "Preconditioner", "optimizer_param_names",
           "trainer_param_names"]

PRECONDITIONER_KINDS = ("adam", "trackstar")


@dataclass(frozen=True, eq=False)
class AdamState:
    """One parameter's Adam/AdamW state after ``step`` optimizer steps.

    Attributes:
        exp_avg: First moment ``m``, the parameter's shape.
        exp_avg_sq: Second moment ``v``, the parameter's shape.
        step: Updates taken so far (``t``).
        beta1, beta2, eps: The parameter group's hyper-parameters.
    """

    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: float
    beta1: float
    beta2: float
    eps: float

    def __repr__(self) -> str:
        return (f"AdamState(shape={list(self.exp_avg_sq.shape)}, step={self.step:g}, "
                f"beta1={self.beta1:g}, beta2={self.beta2:g}, eps={self.eps:g})")


@dataclass(frozen=True, eq=False)
class Preconditioner:
    """The map applied to each training gradient at one checkpoint.

    ``kind="adam"`` (LESS): the direction of the Adam update the example's gradient ``g``
    would cause from the saved state, with ``torch.optim.Adam``/``AdamW``'s bias correction::

        m' = b1 m + (1 - b1) g,   v' = b2 v + (1 - b2) g**2,   t' = t + 1
        direction = (m' / (1 - b1**t')) / (sqrt(v' / (1 - b2**t')) + eps)

    i.e. the update without ``-lr`` (AdamW's weight decay is not a gradient term and is left
    out). The LESS paper defines the same ``m'``, ``v'`` with bias correction; its code drops
    the correction and puts ``eps`` under the square root. Not linear in ``g``.

    ``kind="trackstar"`` (TrackStar's second-moment normalisation, linear in ``g``)::

        g / sqrt(v + eps)

    with ``v`` as saved (no bias correction; constant per parameter group anyway).

    The factorised ``kind="kronecker"`` projection path cannot apply a per-element map to
    gradient factors, so with an exact preconditioner ``projected_grads`` materialises each
    example's gradient and projects it with the same Kronecker matrix (generic path). With
    ``factored=True`` (:meth:`as_factored`) matrix parameters use Adam's second moment in
    Adafactor's row/column form (:mod:`tracinfunc.precondition.factored`), which keeps the
    factorised path (vectors keep the exact diagonal); every path gives the same rows.
    Parameters named in ``exact`` keep the exact diagonal too: by default the embedding
    tables, whose factored form loses the ranking (see :meth:`as_factored`).

    Attributes:
        kind: ``"adam"`` or ``"trackstar"``.
        state: ``{parameter name: AdamState}``, read-only.
        factored: Matrix parameters use the factored second moment (an approximation).
        exact: Matrix parameters that keep the exact diagonal when ``factored``.
        embeddings: The names of embedding tables (``nn.Embedding`` weights, tied heads
            included) of the module the state was read with; :meth:`as_factored`'s default
            ``exact``.
    """

    kind: str
    state: Mapping[str, AdamState]
    factored: bool = False
    exact: frozenset[str] = frozenset()
    embeddings: frozenset[str] = frozenset()

    @entry_point("Preconditioner")
    def __post_init__(self) -> None:
        if self.kind not in PRECONDITIONER_KINDS:
            raise InvalidArgumentError(
                f"Preconditioner: kind must be one of {list(PRECONDITIONER_KINDS)}, got "
                f"{self.kind!r}; use "
                "'adam' (LESS's Adam update direction) or 'trackstar' (g / sqrt(v + eps))."
            )
        check_bool(self.factored, "factored")
        if not isinstance(self.state, Mapping) or not self.state:
            raise InvalidTypeError(
                "Preconditioner: state must be a non-empty dict {name: AdamState}, got "
                f"{type(self.state).__name__}; build one with Preconditioner.from_optimizer."
            )
        for name, value in self.state.items():
            if not isinstance(value, AdamState):
                raise InvalidTypeError(
                    f"Preconditioner: state[{name!r}] must be an AdamState, got "
                    f"{type(value).__name__}."
                )
        object.__setattr__(self, "state", MappingProxyType(dict(self.state)))
        for field_name in ("exact", "embeddings"):
            names = getattr(self, field_name)
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise InvalidTypeError(
                    f"Preconditioner: {field_name} must be a collection of parameter names, "
                    f"got {names!r}; e.g. exact=['transformer.wte.weight']."
                )
            object.__setattr__(self, field_name, frozenset(names))
        unknown = sorted(self.exact - set(self.state))
        if unknown:
            raise InvalidArgumentError(
                f"Preconditioner: exact names {unknown[:5]} have no optimizer state (it covers "
                f"{_few(self.state)}); name parameters of the state."
            )
        # State copied to the gradients' device/dtype once, not on every call (a cache only).
        object.__setattr__(self, "_moved", {})

    @property
    def names(self) -> tuple[str, ...]:
        """Parameter names covered, sorted."""
        return tuple(sorted(self.state))

    def __repr__(self) -> str:
        # A summary: the dataclass default would print every moment tensor.
        states = list(self.state.values())
        values = sum(s.exp_avg_sq.numel() for s in states)
        steps = sorted({int(s.step) for s in states})
        hyper = sorted({(s.beta1, s.beta2, s.eps) for s in states})
        shown = (f"betas=({hyper[0][0]:g}, {hyper[0][1]:g}), eps={hyper[0][2]:g}"
                 if len(hyper) == 1 else f"{len(hyper)} parameter groups")
        step = f"step={steps[0]}" if len(steps) == 1 else f"steps={steps[0]}..{steps[-1]}"
        return (f"Preconditioner(kind={self.kind!r}, {len(states)} parameters, "
                f"{values:,} values, {step}, {shown})")

    def as_factored(self, *, exact: Sequence[str] | None = None) -> Preconditioner:
        """The same state with ``factored=True`` (Adafactor-style second moment on matrices).

        The factored LESS direction leaves out the example's own ``(1 - b2) g**2`` term of the
        new second moment (see :mod:`tracinfunc.precondition.factored`). Where an example's
        gradient is large against the saved ``v`` (an embedding row of a token the optimizer
        has rarely seen) the exact direction saturates near ``(1 - b1) / sqrt(1 - b2)`` while
        the factored one grows as ``g / sqrt(v)``: on an embedding table it dominates the
        scores and loses the ranking (GPT-2 4x128, all parameters: Pearson 0.23 with exact
        Adam on ``wte`` alone, ``benchmarks/llm_throughput.py``). Embedding tables therefore
        keep the exact diagonal by default (their per-example gradients are materialised);
        the transformer blocks' matrices, where the form agrees (r >= 0.98), stay factored.

        Args:
            exact: Matrix parameters kept exact; ``None``: :attr:`embeddings` (known when
                the state was read with its module: :meth:`from_optimizer`,
                :meth:`from_state_dict` or :meth:`load` given the module), ``[]``: none.
        """
        keep = self.embeddings if exact is None else frozenset(exact)
        return Preconditioner(self.kind, self.state, factored=True,
                              exact=keep & set(self.state), embeddings=self.embeddings)

    def factorises(self, name: str) -> bool:
        """Whether parameter ``name`` uses the factored second moment (a matrix, ``factored``,
        not in :attr:`exact`)."""
        return (self.factored and name not in self.exact
                and is_factored(self.state[name].exp_avg_sq.shape))

    def factored_terms(self, name: str, like: Tensor) -> FactoredTerms:
        """``(a [r], b [c], g_scale, offset)`` of matrix parameter ``name`` (see
        :func:`~tracinfunc.precondition.factored.factored_terms`), cached per device/dtype."""
        key = ("factored", name, like.device, like.dtype)
        if key not in self._moved:
            self._moved[key] = factored_terms(self.kind, self.state[name], like)
        return self._moved[key]

    def apply(self, grads: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Precondition one example's gradients (elementwise; safe inside ``vmap``).

        Args:
            grads: ``{name: [*shape]}`` for some or all of :attr:`names`.

        Returns:
            ``{name: [*shape]}``, same dtype and device as ``grads``.
        """
        return {name: self._one(name, g) for name, g in grads.items()}

    def _constants(self, name: str, like: Tensor) -> tuple[Tensor, ...]:
        """Per-parameter terms that do not depend on ``g``, on ``like``'s device and dtype."""
        key = (name, like.device, like.dtype)
        if key not in self._moved:
            s = self.state[name]
            m, v = (x.to(device=like.device, dtype=like.dtype) for x in (s.exp_avg, s.exp_avg_sq))
            if self.kind == "trackstar":
                self._moved[key] = (torch.rsqrt(v + s.eps),)
            else:
                t = s.step + 1  # the update this gradient would join
                scale_m = 1 / (1 - s.beta1**t)
                self._moved[key] = (m * (s.beta1 * scale_m), v * s.beta2)
        return self._moved[key]

    def _one(self, name: str, g: Tensor) -> Tensor:
        s = self.state[name]
        if self.factorises(name):
            return apply_factored(self.factored_terms(name, g), g)
        if self.kind == "trackstar":
            (inv_root,) = self._constants(name, g)
            return g * inv_root
        # (b1 m + (1-b1) g) / (1-b1^t) over sqrt((b2 v + (1-b2) g^2) / (1-b2^t)) + eps, with
        # the g-free terms precomputed: 6 elementwise passes per example instead of 12.
        m_part, v_part = self._constants(name, g)
        t = s.step + 1
        scale_m = 1 / (1 - s.beta1**t)
        numerator = torch.add(m_part, g, alpha=(1 - s.beta1) * scale_m)
        denominator = torch.addcmul(v_part, g, g, value=1 - s.beta2).sqrt_()
        denominator = denominator.mul_((1 - s.beta2**t) ** -0.5).add_(s.eps)
        return numerator.div_(denominator)

    def check(self, shapes: Mapping[str, Sequence[int]], selected: Sequence[str]) -> None:
        """Raise unless the state fits a checkpoint's parameters and covers the selection.

        State for parameters the checkpoint lacks is ignored when the selection is covered:
        the optimizer that trained a model before some of it was frozen holds state for the
        frozen parameters too, while ``Checkpoint.from_module`` keeps the trainable ones; the
        subset is taken by name.

        Args:
            shapes: ``{name: shape}`` of the checkpoint's parameters.
            selected: Names that are differentiated (the store's layout).

        Raises:
            MissingParametersError: selected parameters have no optimizer state.
            IncompatibleGradientsError: selected parameters have no state while the state
                names parameters the checkpoint lacks (names from another model), or state
                of other shapes.
        """
        extra = sorted(set(self.state) - set(shapes))
        missing = sorted(set(selected) - set(self.state))
        if missing and extra:
            raise IncompatibleGradientsError(
                f"{current_caller()}: the preconditioner's names do not match the checkpoint's: "
                f"no optimizer state for selected parameters {_few(missing)}, while it has state "
                f"for {_few(extra)}, which the checkpoint lacks; build it with the names the "
                "checkpoint uses (Preconditioner.from_optimizer(optimizer, model) with the "
                "model the checkpoint was taken from)."
            )
        if missing:
            raise MissingParametersError(
                f"{current_caller()}: the preconditioner has no optimizer state for selected "
                f"parameters {missing} (it covers {_few(self.state)}); select only parameters the "
                "optimizer trained, or save the optimizer state after they were stepped."
            )
        for name, s in self.state.items():
            if name in shapes and tuple(s.exp_avg_sq.shape) != tuple(shapes[name]):
                raise IncompatibleGradientsError(
                    f"{current_caller()}: optimizer state for {name!r} has shape "
                    f"{list(s.exp_avg_sq.shape)} but the parameter is {list(shapes[name])}; "
                    "the names are probably not in optimizer order (pass "
                    "Preconditioner.from_optimizer(optimizer, model), or the names in "
                    "param_groups order)."
                )

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any], names: Sequence[str] | nn.Module,
                        *, kind: str = "adam", eps: float | None = None) -> Preconditioner:
        """Read an Adam/AdamW ``optimizer.state_dict()``.

        Args:
            state_dict: ``{"state": {index: {"step", "exp_avg", "exp_avg_sq"}},
                "param_groups": [...]}``; indices count parameters in ``param_groups`` order.
            names: Parameter names in that order, or the module, whose
                ``named_parameters()`` order is used when the optimizer has one param group
                (names recorded in the state dict, ``param_groups[i]["param_names"]``, win).
            kind: ``"adam"`` or ``"trackstar"``.
            eps: Overrides the optimizer's ``eps`` (e.g. a larger floor for TrackStar).

        Raises:
            InvalidArgumentError: not an Adam-style state dict, or names cannot be matched.
        """
        ordered, groups = _ordered_names(state_dict, names)
        states = state_dict["state"]
        result = {}
        for index, (name, group) in enumerate(zip(ordered, groups, strict=True)):
            entry = states.get(index, states.get(str(index)))
            if entry is None:
                continue  # never stepped (frozen or unused): selecting it fails in check()
            result[name] = _adam_state(entry, group, eps, name)
        embeddings = _embedding_names(names) if isinstance(names, nn.Module) else frozenset()
        return cls(kind, result, embeddings=embeddings & set(result))

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, module: nn.Module, *,
                       kind: str = "adam", eps: float | None = None) -> Preconditioner:
        """Read a live optimizer, naming its parameters by identity with ``module``'s."""
        names = optimizer_param_names(optimizer, module)
        made = cls.from_state_dict(optimizer.state_dict(), names, kind=kind, eps=eps)
        return cls(made.kind, made.state, embeddings=_embedding_names(module) & set(made.state))

    @classmethod
    def load(cls, path: str | PathLike, names: Sequence[str] | nn.Module, *,
             kind: str = "adam", eps: float | None = None) -> Preconditioner:
        """Load a saved ``optimizer.state_dict()`` (``torch.save``, or HF's ``optimizer.pt``;
        for a Trainer's file pass ``names=trainer_param_names(model)``)."""
        state_dict = torch.load(Path(path), map_location="cpu", weights_only=True)
        return cls.from_state_dict(state_dict, names, kind=kind, eps=eps)


def optimizer_param_names(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[str]:
    """Names of ``optimizer``'s parameters in ``param_groups`` order, matched by identity."""
    by_id = {id(p): name for name, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    unknown = [i for i, p in enumerate(params) if id(p) not in by_id]
    if unknown:
        raise InvalidArgumentError(
            f"optimizer_param_names: optimizer parameters at indices {unknown[:5]} are not "
            f"parameters of {type(module).__name__}; pass the module the optimizer trains."
        )
    return [by_id[id(p)] for p in params]


def _embedding_names(module: nn.Module) -> frozenset[str]:
    """Names of ``module``'s parameters that some ``nn.Embedding`` uses as its table (a
    weight tied to a head keeps the name ``named_parameters`` gives it)."""
    tables = {id(sub.weight) for sub in module.modules() if isinstance(sub, nn.Embedding)}
    return frozenset(name for name, p in module.named_parameters() if id(p) in tables)


def trainer_param_names(model: nn.Module) -> list[str]:
    """The order in which a HF ``Trainer``'s default optimizer holds ``model``'s parameters.

    The Trainer makes two groups, weight-decayed parameters then the rest (biases, norms),
    each in ``named_parameters()`` order, trainable ones only; its ``optimizer.pt`` indexes
    parameters in that order.
    """
    try:
        from transformers import Trainer
    except ImportError as error:
        raise MissingDependencyError(
            "trainer_param_names: needs transformers; install it with "
            "pip install 'tracinfunc[hf]'."
        ) from error
    decay = set(Trainer.get_decay_parameter_names(None, model))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    return [n for n in trainable if n in decay] + [n for n in trainable if n not in decay]


def _ordered_names(state_dict: Mapping[str, Any], names: Sequence[str] | nn.Module
                   ) -> tuple[list[str], list[Mapping[str, Any]]]:
    """Parameter names and their param group, in optimizer index order."""
    caller = "Preconditioner.from_state_dict"
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise InvalidArgumentError(
            f"{caller}: expected an optimizer state dict with 'state' and 'param_groups', got "
            f"{type(state_dict).__name__}; pass optimizer.state_dict(), not a model's."
        )
    groups = [g for g in state_dict["param_groups"] for _ in g["params"]]
    recorded = [n for g in state_dict["param_groups"] for n in g.get("param_names", [])]
    if isinstance(names, nn.Module):
        module = names
        if len(recorded) == len(groups):
            names = recorded
        elif len(state_dict["param_groups"]) > 1:
            raise InvalidArgumentError(
                f"{caller}: the optimizer has {len(state_dict['param_groups'])} param groups, "
                f"so its order need not follow {type(module).__name__}.named_parameters(); "
                "pass the names in optimizer order (optimizer_param_names(optimizer, model) "
                "when saving, trainer_param_names(model) for a HF Trainer's optimizer.pt)."
            )
        else:
            names = _module_names(module, len(groups))
    names = list(names)
    if len(names) != len(groups) or not all(isinstance(n, str) for n in names):
        raise InvalidArgumentError(
            f"{caller}: the optimizer holds {len(groups)} parameters but {len(names)} names "
            f"were given; pass one str name per optimizer parameter, in param_groups order."
        )
    return names, groups


def _module_names(module: nn.Module, count: int) -> list[str]:
    every = [name for name, _ in module.named_parameters()]
    trainable = [name for name, p in module.named_parameters() if p.requires_grad]
    for candidate in (every, trainable):
        if len(candidate) == count:
            return candidate
    raise InvalidArgumentError(
        f"{current_caller()}: the optimizer holds {count} parameters but {type(module).__name__} "
        f"has {len(every)} ({len(trainable)} trainable); pass the names in optimizer order."
    )


def _adam_state(entry: Mapping[str, Any], group: Mapping[str, Any], eps: float | None,
                name: str) -> AdamState:
    if "exp_avg_sq" not in entry or "exp_avg" not in entry:
        raise InvalidArgumentError(
            f"Preconditioner.from_state_dict: the state of {name!r} has keys "
            f"{sorted(entry)}, not Adam's exp_avg/exp_avg_sq; save an Adam or AdamW optimizer."
        )
    if group.get("amsgrad") or group.get("maximize"):
        raise InvalidArgumentError(
            f"Preconditioner.from_state_dict: {name!r} was trained with "
            f"amsgrad={group.get('amsgrad')}, maximize={group.get('maximize')}; only the plain "
            "Adam/AdamW update is supported, so train without them or precondition by hand."
        )
    beta1, beta2 = (float(b) for b in group.get("betas", (0.9, 0.999)))
    return AdamState(
        exp_avg=entry["exp_avg"].detach().clone(),
        exp_avg_sq=entry["exp_avg_sq"].detach().clone(),
        step=float(entry.get("step", 0)), beta1=beta1, beta2=beta2,
        eps=float(group.get("eps", 1e-8) if eps is None else eps),
    )


def _few(names: Mapping[str, Any] | Sequence[str]) -> str:
    shown = sorted(names)
    return str(shown[:6])[:-1] + (f", … ({len(shown)} in all)]" if len(shown) > 6 else "]")


def _recorded_kind(precondition: Preconditioner, has_matrix: bool) -> str:
    """What a store records for ``precondition``: its kind, ``"-factored"`` added when its
    second moment is in Adafactor form (``factored=True``) and a differentiated parameter is a
    matrix (vectors keep the exact diagonal, so the form changes nothing without one)."""
    return f"{precondition.kind}-factored" if precondition.factored and has_matrix \
        else precondition.kind


def check_preconditioners(
    preconditioners: Sequence[Preconditioner] | None,
    params: Sequence[Mapping[str, Tensor]],
    selected: Sequence[str],
) -> str | None:
    """Check one preconditioner per checkpoint, all of one kind; return what the store
    records (:func:`_recorded_kind`: ``"adam"``, ``"adam-factored"``, ...) or None.

    Args:
        preconditioners: ``n_ckpt`` preconditioners, or ``None`` (plain gradients).
        params: Each checkpoint's parameters, ``n_ckpt`` dicts.
        selected: The differentiated parameter names.
    """
    if preconditioners is None:
        return None
    if not isinstance(preconditioners, Sequence):
        raise InvalidTypeError(
            f"{current_caller()}: preconditioners must be a list with one "
            "tracinfunc.Preconditioner per "
            f"checkpoint, got {type(preconditioners).__name__}; wrap a single one in a list."
        )
    if len(preconditioners) != len(params) or not all(
            isinstance(p, Preconditioner) for p in preconditioners):
        raise InvalidArgumentError(
            f"{current_caller()}: preconditioners must be one tracinfunc.Preconditioner per "
            f"checkpoint ({len(params)}), got {[type(p).__name__ for p in preconditioners]}; e.g. "
            "load_recorded_preconditioners(directory, model)."
        )
    has_matrix = any(is_factored(tuple(params[0][name].shape)) for name in selected
                     if name in params[0])
    kinds = sorted({_recorded_kind(p, has_matrix) for p in preconditioners})
    if len(kinds) > 1:
        raise InvalidArgumentError(
            f"{current_caller()}: preconditioners mix kinds {kinds}; the store records one kind, "
            "so use one kind (and one form: all factored, via as_factored(), or none) for "
            "every checkpoint."
        )
    for position, (precondition, values) in enumerate(zip(preconditioners, params,
                                                           strict=True)):
        shapes = {name: tuple(value.shape) for name, value in values.items()}
        try:
            precondition.check(shapes, selected)
        except TracInFuncError as error:  # say which of the n_ckpt preconditioners it was
            raise type(error)(f"{error} (the preconditioner of checkpoint {position})") from error
    return kinds[0]
