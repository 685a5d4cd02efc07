"""K-FAC and EK-FAC: per-layer Kronecker factors of the Fisher and their damped inverses.

For a layer with per-example gradient ``G = delta^T [x, 1]`` ``[d_out, d_a]`` (``d_a = d_in``
plus a bias column), K-FAC approximates the layer's block of the Fisher by ``S (x) A`` with
``A = E[x x^T]`` (mean over tokens) and ``S = E[sum_t delta delta^T]`` (row-major ``vec(G)``).
Damping means what it means for every kind, ``(S (x) A + lambda I)^-1``, solved exactly in the
Kronecker eigenbasis: with ``A = Q_A diag(a) Q_A^T`` and ``S = Q_S diag(s) Q_S^T``,
``G -> Q_S [(Q_S^T G Q_A) / (s_i a_j + lambda)] Q_A^T`` (two small eigendecompositions per layer,
cached). Martens & Grosse's factored Tikhonov damping ``(S + sqrt(lambda)/pi I) (x) (A + pi
sqrt(lambda) I)`` kept the Kronecker form but solved another system (0.51 off ``(H + lambda
I)^-1`` on digits, issue 33), so it is not used.

An ``nn.Embedding`` is a Linear layer on one-hot inputs: its ``A`` is diagonal (the weighted
token frequencies), stored as a vector ``[d_in]`` and inverted elementwise, and its eigenbasis
is the identity (never stored); ``x`` arrives as token ids.

EK-FAC (George et al., 2018) keeps K-FAC's eigenbases ``A = Q_A L_A Q_A^T``,
``S = Q_S L_S Q_S^T`` but refits the eigenvalues, ``E[(Q_S^T G Q_A)^2]`` (a second pass), and
damps them exactly: ``G -> Q_S [(Q_S^T G Q_A) / (L + lambda)] Q_A^T``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import torch
from torch import Tensor

from tracinfunc.curvature.capture import KfacLayer

__all__ = ["EigenBatch", "FactorBatch", "augmented", "ekfac_mean_eigenvalue", "input_key",
           "input_keys", "kfac_mean_eigenvalue", "kron_eigensystem", "precondition_ekfac"]


def augmented(x: Tensor, layer: KfacLayer) -> Tensor:
    """``[..., d_in] -> [..., d_a]``: a column of ones for the bias, float64."""
    x = x.double()
    if layer.bias is None:
        return x
    return torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)


class FactorBatch:
    """Adds one labelled batch's weighted ``A`` and ``S`` sums into ``sums`` (float64), one
    layer at a time, in any order (a batched capture hands each layer's output gradient over
    as its backward produces it, so no batch holds every layer's at once).

    The sums are updated in place (``addmm_`` on the flattened ``[b T, d]`` rows, as
    kronfluence accumulates its covariances): no ``[d, d]`` temporary per batch.

    Args:
        weights: ``[b]``, each input's weights summing to 1.
        keys: Per layer, the key of its input (:func:`input_keys`): layers of one key read
            one input, whose ``A`` term is multiplied once.
    """

    def __init__(self, sums: dict[str, Tensor], layers: list[KfacLayer], weights: Tensor,
                 keys: list[tuple]) -> None:
        self.sums, self.layers, self.weights, self.keys = sums, layers, weights, keys
        self.readers, self.left = Counter(keys), Counter(keys)
        self.done: dict[tuple, Tensor] = {}  # an input's A term, for layers reading it

    def __call__(self, index: int, x: Tensor, delta: Tensor) -> None:
        """Add layer ``index``'s terms: ``x [b, T, d_in]``, ``delta [b, T, d_out]``."""
        layer, same = self.layers[index], self.keys[index]
        w = self.weights.to(delta.device, torch.float64)[:, None, None]  # [b, 1, 1]
        # One side at a time, each in a function of its own: a layer's float64 copies are
        # freed before the next are made (a [b T, d] input's two, then a delta's two).
        _add_input_factor(self.sums, layer, x, w, self.readers[same] > 1, same, self.done)
        _add_output_factor(self.sums, layer, delta, w)
        self.left[same] -= 1
        if not self.left[same]:
            self.done.pop(same, None)  # [d_a, d_a] no later layer reads


def _add_input_factor(sums: dict[str, Tensor], layer: KfacLayer, x: Tensor, w: Tensor,
                      shared: bool, same: tuple, done: dict[tuple, Tensor]) -> None:
    """Add a layer's weighted ``A`` sum ``[d_a, d_a]`` (``[d_in]`` for an embedding) into
    ``sums``; an input that several layers read (``shared``, key ``same``) is multiplied
    once (kept in ``done``). The float64 rows are formed a slice of the batch at a time."""
    key = f"{layer.weight}:A"
    if layer.rule == "embedding":  # diag(E[onehot onehot^T]): token counts / T
        share = (w[:, :, 0] / x.shape[1]).expand(x.shape)  # [b, T]
        _add_into(sums, key, torch.zeros(layer.d_in, dtype=torch.float64,
                                         device=w.device).index_add_(
            0, x.reshape(-1), share.reshape(-1)))  # [d_in]
        return
    if same in done:  # q, k and v of one attention read one input: its A term once
        _add_into(sums, key, done[same])
        return
    term = torch.zeros(layer.d_a, layer.d_a, dtype=torch.float64, device=x.device) \
        if shared else None
    for rows in _slices(x.shape[0], 2 * x.shape[1] * layer.d_a):
        xa = augmented(x[rows], layer)  # [b', T, d_a]
        left = (xa * (w[rows] / xa.shape[1])).reshape(-1, layer.d_a)  # [b' T, d_a]
        if term is None:
            _addmm_into(sums, key, left, xa.reshape(-1, layer.d_a))  # [d_a, d_a]
        else:
            term.addmm_(left.T, xa.reshape(-1, layer.d_a))
        del xa, left  # before the next slice's
    if term is not None:
        done[same] = term
        _add_into(sums, key, term)


def _add_output_factor(sums: dict[str, Tensor], layer: KfacLayer, delta: Tensor,
                       w: Tensor) -> None:
    """Add a layer's weighted ``S`` sum ``[d_out, d_out]`` into ``sums``, a slice of the
    batch at a time."""
    for rows in _slices(delta.shape[0], 2 * delta.shape[1] * layer.d_out):
        d = delta[rows].double()  # [b', T, d_out]
        _addmm_into(sums, f"{layer.weight}:S", (d * w[rows]).reshape(-1, layer.d_out),
                    d.reshape(-1, layer.d_out))  # [d_out, d_out]
        del d  # before the next slice's


def _slices(b: int, per_example: int) -> Iterator[slice]:
    """Slices of ``b`` examples whose float64 temporaries (``per_example`` numbers each)
    hold at most ``_TEMP_BYTES`` (one example at least)."""
    step = max(1, _TEMP_BYTES // max(8 * per_example, 1))
    for start in range(0, b, step):
        yield slice(start, start + step)


# A layer's float64 temporaries are formed this many bytes of the batch at a time: a batched
# capture hands layers over during its backward, while the forward's activations are alive.
_TEMP_BYTES = 16 * 2**20


def input_key(x: Tensor, layer: KfacLayer) -> tuple:
    """Equal for two layers reading the same memory the same way (so the same ``A``); a
    tensor without memory (meta, empty: address 0) is only ever equal to itself."""
    where = x.data_ptr() or ("object", id(x))
    return (where, x.device, x.dtype, tuple(x.shape), x.stride(), layer.rule,
            layer.bias is None)


def input_keys(io: list[tuple[Tensor, Tensor]], layers: list[KfacLayer]) -> list[tuple]:
    """Per layer, :func:`input_key` of its input."""
    return [input_key(x, layer) for layer, (x, _) in zip(layers, io, strict=True)]


def _addmm_into(sums: dict[str, Tensor], key: str, left: Tensor, right: Tensor) -> None:
    """``sums[key] += left^T @ right`` in place (created on first use), on the CPU."""
    if key not in sums:
        sums[key] = torch.zeros(left.shape[1], right.shape[1], dtype=torch.float64)
    if left.device == sums[key].device:
        sums[key].addmm_(left.T, right)
    else:
        sums[key] += (left.T @ right).cpu()


def _add_into(sums: dict[str, Tensor], key: str, value: Tensor) -> None:
    """``sums[key] += value`` in place, on the CPU; created on first use as a copy of its
    own (``value`` may be an input's ``A`` term that other layers' sums add too)."""
    if key in sums:
        sums[key] += value.cpu()
    else:
        sums[key] = value.to("cpu", copy=True)


def eigenbases(estimate: dict[str, Tensor], layers: list[KfacLayer]) -> dict[str, Tensor]:
    """``{weight:QA, weight:QS}`` eigenvectors of each layer's factors (a factor equal to the
    one before it, as the ``A`` of layers reading one input, is decomposed once)."""
    out: dict[str, Tensor] = {}
    last: tuple[Tensor, Tensor] | None = None  # (factor, its eigenvectors)
    for layer in layers:
        for side in ("A", "S") if layer.rule != "embedding" else ("S",):  # diagonal A: I
            factor = estimate[f"{layer.weight}:{side}"]
            if last is not None and last[0].shape == factor.shape and torch.equal(last[0],
                                                                                   factor):
                vectors = last[1].clone()
            else:
                _, vectors = torch.linalg.eigh(factor)
            out[f"{layer.weight}:Q{side}"] = vectors
            last = (factor, vectors)
    return out


class EigenBatch:
    """Adds one batch's weighted ``(Q_S^T G Q_A)^2`` ``[d_out, d_a]`` per layer into
    ``sums``, one layer at a time, in any order.

    The weights are folded into the rotated deltas as ``sqrt(w)`` (weights are ``>= 0``), so
    ``sum_b w_b R_b^2 = sum_b (sqrt(w_b) R_b)^2``. With one row per example (``T = 1``: an
    MLP) ``R_b = dq_b xq_b^T`` is rank one and ``sum_b (dq_b^2)(xq_b^2)^T`` is one matmul;
    otherwise the ``[b', d_out, d_a]`` rotated gradients are formed and squared in place. A
    slice of the batch at a time (``_TEMP_BYTES`` of float64 temporaries).

    Args:
        keys: Per layer, the key of its input (:func:`input_keys`): layers of one key and
            one eigenbasis share ``x Q_A`` (held for the batch, dropped after the last).
    """

    def __init__(self, sums: dict[str, Tensor], layers: list[KfacLayer], weights: Tensor,
                 bases: dict[str, Tensor], keys: list[tuple]) -> None:
        self.sums, self.layers, self.weights, self.bases = sums, layers, weights, bases
        self.keys, self.readers, self.left = keys, Counter(keys), Counter(keys)
        self.rotated_inputs: dict[tuple, tuple[Tensor, Tensor]] = {}  # key -> (Q_A, x Q_A)

    def __call__(self, index: int, x: Tensor, delta: Tensor) -> None:
        """Add layer ``index``'s term: ``x [b, T, d_in]``, ``delta [b, T, d_out]``."""
        same = self.keys[index]
        self.left[same] -= 1
        shared = self.rotated_inputs if self.readers[same] > 1 else None
        # A function of its own: the layer's float64 rotations are freed before the next's.
        _add_layer_eigenvalues(self.sums, self.layers[index], x, delta, self.weights,
                               self.bases, same, shared)
        if not self.left[same]:
            self.rotated_inputs.pop(same, None)  # [b, T, d_a] float64 no later layer reads


def _add_layer_eigenvalues(sums: dict[str, Tensor], layer: KfacLayer, x: Tensor, delta: Tensor,
                           weights: Tensor, bases: dict[str, Tensor], same: tuple,
                           shared: dict[tuple, tuple[Tensor, Tensor]] | None) -> None:
    """Add one layer's weighted ``(Q_S^T G Q_A)^2`` ``[d_out, d_a]`` into ``sums``, a slice
    of the batch at a time; ``x Q_A`` of an input several layers read is computed once for
    the batch and kept in ``shared`` under ``same``."""
    q_s = bases[f"{layer.weight}:QS"].to(x.device)
    root = weights.to(x.device, torch.float64).sqrt()[:, None, None]  # [b, 1, 1]
    key, t = f"{layer.weight}:eigen", delta.shape[1]
    if layer.rule == "embedding":  # Q_A = I: sum each token's rotated deltas
        for rows in _slices(x.shape[0], 2 * t * layer.d_out + layer.d_in * layer.d_out):
            dq = torch.matmul(delta[rows].double(), q_s).mul_(root[rows])  # [b', T, d_out]
            index = x[rows][..., None].expand(dq.shape)  # [b', T, d_out]
            rotated = torch.zeros(dq.shape[0], layer.d_in, layer.d_out, dtype=torch.float64,
                                  device=x.device).scatter_add_(1, index, dq).transpose(1, 2)
            _add_into(sums, key, rotated.square_().sum(0))
            del dq, rotated  # before the next slice's
        return
    q_a = bases[f"{layer.weight}:QA"].to(x.device)
    whole = None  # x Q_A [b, T, d_a] of an input several layers read
    if shared is not None:
        if same not in shared or not torch.equal(shared[same][0], q_a):
            shared[same] = (q_a, augmented(x, layer) @ q_a)
        whole = shared[same][1]
    for rows in _slices(x.shape[0], t * (2 * layer.d_out + layer.d_a) + (
            layer.d_out * layer.d_a if t > 1 else 0)):
        dq = torch.matmul(delta[rows].double(), q_s).mul_(root[rows])  # [b', T, d_out]
        xq = whole[rows] if whole is not None else augmented(x[rows], layer) @ q_a
        if t == 1:  # rank one per example: (dq^2)^T (xq^2)
            _addmm_into(sums, key, dq[:, 0].square(), xq[:, 0].square())
        else:
            rotated = torch.bmm(dq.transpose(1, 2), xq)  # [b', d_out, d_a]
            _add_into(sums, key, rotated.square_().sum(0))
            del rotated
        del dq, xq  # before the next slice's


def kfac_mean_eigenvalue(estimate: dict[str, Tensor], layers: list[KfacLayer]) -> float:
    """Mean eigenvalue of the block-diagonal ``A (x) S``: ``sum tr A tr S / sum d_a d_out``."""
    trace = sum(_trace(estimate[f"{layer.weight}:A"]) * _trace(estimate[f"{layer.weight}:S"])
                for layer in layers)
    return trace / sum(layer.d_a * layer.d_out for layer in layers)


def ekfac_mean_eigenvalue(estimate: dict[str, Tensor], layers: list[KfacLayer]) -> float:
    return sum(float(estimate[f"{layer.weight}:eigen"].sum()) for layer in layers) / sum(
        layer.d_a * layer.d_out for layer in layers)


def kron_eigensystem(estimate: dict[str, Tensor], layer: KfacLayer) -> dict[str, Tensor]:
    """K-FAC's ``S (x) A`` in its Kronecker eigenbasis, in EK-FAC's keys: ``{weight:QS
    [d_out, d_out], weight:QA [d_a, d_a] (not for an embedding's diagonal A: Q_A = I),
    weight:eigen [d_out, d_a] = s_i a_j}``, float64."""
    a, s = estimate[f"{layer.weight}:A"], estimate[f"{layer.weight}:S"]
    values_s, q_s = _eigh(s)
    out = {f"{layer.weight}:QS": q_s}
    if a.dim() == 1:  # an embedding's diagonal A: its own eigenvalues, eigenbasis I
        values_a = a
    else:
        values_a, out[f"{layer.weight}:QA"] = _eigh(a)
    out[f"{layer.weight}:eigen"] = torch.outer(values_s, values_a)
    return out


def _eigh(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues and eigenvectors of a symmetric factor; NaN ones where it is not finite
    (refused by the conditioning check, never a raw LinAlgError)."""
    if bool(torch.isfinite(matrix).all()):
        try:
            return torch.linalg.eigh(matrix)
        except torch.linalg.LinAlgError:
            pass
    nan = torch.full((matrix.shape[0],), torch.nan, dtype=matrix.dtype)
    return nan, torch.eye(matrix.shape[0], dtype=matrix.dtype)


def precondition_ekfac(matrix: Tensor, estimate: dict[str, Tensor], layer: KfacLayer,
                       damping: float) -> Tensor:
    """``Q_S [(Q_S^T G Q_A) / (eigen + lambda)] Q_A^T`` for ``G [b, d_out, d_a]``: EK-FAC's
    estimate, or K-FAC's in its Kronecker eigenbasis (:func:`kron_eigensystem`)."""
    q_s = estimate[f"{layer.weight}:QS"].to(matrix.device)
    eigen = estimate[f"{layer.weight}:eigen"].to(matrix.device)
    if f"{layer.weight}:QA" not in estimate:  # an embedding: Q_A = I
        return q_s @ ((q_s.T @ matrix) / (eigen + damping))
    q_a = estimate[f"{layer.weight}:QA"].to(matrix.device)
    rotated = q_s.T @ matrix @ q_a
    return q_s @ (rotated / (eigen + damping)) @ q_a.T


def _trace(factor: Tensor) -> float:
    """Trace of a factor stored as a matrix, or as its diagonal (a vector)."""
    return float(factor.sum() if factor.dim() == 1 else factor.trace())
