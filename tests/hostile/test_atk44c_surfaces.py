"""Outside pass atk44c: MemoryStore norm checks, forward-time parametrization, extreme learning rates."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrize as P

import tracinfunc as tif
import tracinfunc.testing as tt
from tracinfunc.errors import InvalidArgumentError, LossFunctionError
from tracinfunc.store import MemoryStore, PinnedStore


def _meta(dtype=torch.float32, n=3, k=4, n_ckpt=1):
    return tt.reference_store(n, k, n_ckpt=n_ckpt, dtype=dtype).meta


_ROWS = torch.tensor([[[1.0, 0, 0, 0], [0, 1.0, 0, 0], [1, 1, 0, 0]]])
_TEST = torch.tensor([[[0.0, 1, 0, 0], [1, 0, 0, 0]]])


# ---------------------------------------------------------------- surface 1: MemoryStore norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e-13, 1e-20])
def test_norm_zero_for_tiny_row_that_torch_norms_nonzero_is_refused_or_keeps_cosine(dtype, scale):
    """A row whose own rows.norm() is nonzero (1e-13, 1e-20) given norm 0: refused, or its cosine kept."""
    rows = _ROWS.clone()
    rows[0, 1, 1] = scale
    rows = rows.to(dtype)
    assert rows[0, 1].float().norm() > 0  # torch's own norm is not 0 here
    norms = rows.double().norm(dim=-1)
    norms[0, 1] = 0.0
    try:
        store = MemoryStore(_meta(dtype), rows, norms.to(dtype))
    except InvalidArgumentError:
        return
    got = tif.score(store, _TEST.to(dtype), normalize=True).float()
    lr = _meta().checkpoints[0].lr
    # test row 0 is the same direction as training row 1: cosine 1, times lr
    assert got[0, 1].item() == pytest.approx(lr, rel=1e-2), got


def test_wildly_wrong_positive_norm_is_refused_or_documented():
    """Norm 100 for a unit row is a norm that cannot be the row's: cosine 0.001 came back silently."""
    norms = torch.tensor([[100.0, 1.0, 2**0.5]])
    try:
        store = MemoryStore(_meta(), _ROWS.clone(), norms)
    except InvalidArgumentError:
        return
    got = tif.score(store, _TEST, normalize=True)
    assert got[1, 0].item() == pytest.approx(_meta().checkpoints[0].lr, rel=1e-3), got


def test_positive_norm_for_an_all_zero_row_is_refused():
    """A zero row cannot have norm 5; MemoryStore refuses norms that cannot be the rows'."""
    rows = _ROWS.clone()
    rows[0, 1] = 0
    with pytest.raises(InvalidArgumentError):
        MemoryStore(_meta(), rows, torch.tensor([[1.0, 5.0, 2**0.5]]))


def test_negative_infinite_norm_for_a_nan_row_is_refused():
    """A norm of -inf is negative: refused even for a NaN row (inf or NaN are the documented norms there)."""
    rows = _ROWS.clone()
    rows[0, 0, 0] = float("nan")
    with pytest.raises(InvalidArgumentError):
        MemoryStore(_meta(), rows, torch.tensor([[-float("inf"), 1.0, 2**0.5]]))


def test_pinned_store_refusal_names_pinned_store():
    """PinnedStore's refusal of a bad norm names PinnedStore, not MemoryStore."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(InvalidArgumentError) as e:
            PinnedStore(_meta(), _ROWS.clone(), torch.tensor([[-1.0, 1.0, 2**0.5]]))
    assert "PinnedStore" in str(e.value), str(e.value)


def test_norm_zero_message_names_row_checkpoint_given_true_and_fix():
    """Held: norm 0 for a row of norm 2e-12 names row, checkpoint, both norms and the fix."""
    rows = torch.ones(1, 3, 4) * 1e-12
    norms = rows.norm(dim=-1)
    norms[0, 1] = 0
    with pytest.raises(InvalidArgumentError) as e:
        MemoryStore(_meta(), rows, norms)
    msg = str(e.value)
    assert "row 1" in msg and "checkpoint 0" in msg and "2e-12" in msg and "0.0" in msg and "norm(" in msg


def test_negative_zero_norm_for_an_ordinary_row_is_refused():
    """Held: -0.0 for a unit row is refused."""
    with pytest.raises(InvalidArgumentError):
        MemoryStore(_meta(), _ROWS.clone(), torch.tensor([[-0.0, 1.0, 2**0.5]]))


@pytest.mark.parametrize("norm", [1.0, 0.0])
def test_finite_norm_for_a_nan_or_inf_row_is_refused(norm):
    """Held: a finite norm for a NaN or inf row is refused, naming NaN or inf."""
    for bad in (float("nan"), float("inf")):
        rows = _ROWS.clone()
        rows[0, 0, 0] = bad
        with pytest.raises(InvalidArgumentError, match="NaN or inf"):
            MemoryStore(_meta(), rows, torch.tensor([[norm, 1.0, 2**0.5]]))


def test_float64_rows_of_1e_40_given_norm_zero_are_refused():
    """Held: float64 rows of 1e-40 (a normal float64 norm) given 0 are refused."""
    rows = torch.ones(1, 3, 4, dtype=torch.float64) * 1e-40
    norms = rows.norm(dim=-1)
    norms[0, 1] = 0
    with pytest.raises(InvalidArgumentError):
        MemoryStore(_meta(torch.float64), rows, norms)


def test_save_store_and_to_memory_round_trip_a_zero_norm_denormal_row(tmp_path):
    """Held: a store with a float32 denormal row of norm 0 round-trips through save_store and to_memory."""
    rows = _ROWS.clone()
    rows[0, 1, 1] = 1e-40
    norms = torch.tensor([[1.0, 0.0, 2**0.5]])
    store = MemoryStore(_meta(), rows, norms)
    a = tif.score(store, _TEST, normalize=True)
    b = tif.score(tif.save_store(store, str(tmp_path / "s.zarr")), _TEST, normalize=True)
    c = tif.score(tif.to_memory(store), _TEST, normalize=True)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)


# ---------------------------------------------------------------- surface 2: parametrization


class _Ident(nn.Module):
    def forward(self, w):
        return w


class _ParamInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 3)

    def forward(self, x):
        if not P.is_parametrized(self.l, "weight"):
            P.register_parametrization(self.l, "weight", _Ident())
        return self.l(x)


class _OwnKeyError(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 3)

    def forward(self, x):
        raise KeyError("attribute 'x' already exists")


class _DictLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 3)
        self.d = {}

    def forward(self, x):
        return self.l(x) * self.d["missing"]


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_parametrizing_forward_leaves_parameter_order_as_it_was():
    """After the refused call the module is restored: named_parameters/state_dict order unchanged."""
    model = _ParamInForward()
    before = [n for n, _ in model.named_parameters()]
    sd_before = list(model.state_dict())
    with pytest.raises(LossFunctionError):
        tif.per_sample_grads(tif.loss_from_module(model, F.cross_entropy))(_params(model), _batch())
    assert [n for n, _ in model.named_parameters()] == before
    assert list(model.state_dict()) == sd_before


def test_parametrizing_forward_error_names_it_and_model_stays_usable():
    """Held: LossFunctionError names register_parametrization and the fix; model(x) works, not parametrized."""
    model = _ParamInForward()
    w0 = model.l.weight
    with pytest.raises(LossFunctionError) as e:
        tif.per_sample_grads(tif.loss_from_module(model, F.cross_entropy))(_params(model), _batch())
    msg = str(e.value)
    assert "register_parametrization" in msg and "before" in msg
    assert not P.is_parametrized(model.l)
    assert model.l.weight is w0
    model(_batch()[0])


def test_parametrizing_forward_build_store_raises_loss_function_error():
    """Held: build_store refuses the parametrizing forward with the same LossFunctionError."""
    model = _ParamInForward()
    ck = tif.Checkpoint.from_module(model, lr=0.1)
    with pytest.raises(LossFunctionError, match="register_parametrization"):
        tif.build_store(tif.loss_from_module(model, F.cross_entropy), [ck], _batch(),
                        projection=tt.reference_store(2, 4, n_ckpt=1).meta.projection)
    assert not P.is_parametrized(model.l)


@pytest.mark.parametrize("cls", [_OwnKeyError, _DictLookup])
def test_other_key_errors_are_not_called_parametrizations(cls):
    """Held: a forward's own KeyError (even 'already exists') or a failed dict lookup is not a parametrization."""
    model = cls()
    with pytest.raises(LossFunctionError) as e:
        tif.per_sample_grads(tif.loss_from_module(model, F.cross_entropy))(_params(model), _batch())
    assert "parametriz" not in str(e.value)


# ---------------------------------------------------------------- surface 3: extreme learning rates


def _lr_store(lrs, dtype):
    st = tt.reference_store(5, 4, n_ckpt=len(lrs), dtype=dtype)
    m = st.meta
    m = dataclasses.replace(
        m, checkpoints=tuple(dataclasses.replace(c, lr=lr) for c, lr in zip(m.checkpoints, lrs, strict=False))
    )
    rows = torch.stack([st.read_rows(c, 0, st.n_train) for c in range(st.n_ckpt)])
    norms = torch.stack([st.read_norms(c, 0, st.n_train) for c in range(st.n_ckpt)])
    return MemoryStore(m, rows.clone(), norms.clone()), rows.double()


@pytest.mark.parametrize("lrs", [(1e-310,), (5e-324, 1e-310), (1e300,), (-1e-40,), (1e300, -1e300, 1.0)])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("numpy_in", [False, True])
def test_float64_test_rows_at_extreme_lr_match_brute_force_and_are_not_modified(lrs, normalize, numpy_in):
    """Held: float64 test rows at lr 1e-310/1e300/-1e-40 match sum_c lr_c t_c @ r_c.T; input untouched."""
    store, R = _lr_store(lrs, torch.float32)
    g = torch.Generator().manual_seed(1)
    test = torch.randn(len(lrs), 3, 4, generator=g, dtype=torch.float64)
    T = test.clone()
    if normalize:
        R = R / R.norm(dim=-1, keepdim=True)
        T = T / T.norm(dim=-1, keepdim=True)
    ref = sum(lr * T[c] @ R[c].T for c, lr in enumerate(lrs))
    inp = test.numpy().copy() if numpy_in else test.clone()
    keep = torch.as_tensor(inp).clone()
    got = torch.as_tensor(np.asarray(tif.score(store, inp, normalize=normalize))).double()
    scale = ref.abs().max()
    assert ((got - ref).abs().max() / scale).item() < 1e-6
    vals, _ = tif.top_k(store, inp, k=2, normalize=normalize)
    vals = torch.as_tensor(np.asarray(vals)).double()
    assert ((vals - ref.topk(2, dim=1).values).abs().max() / scale).item() < 1e-6
    cand = tif.score(store, inp, normalize=normalize, candidates=[[0, 1], [2, 3], [4, 0]])
    cand = torch.as_tensor(np.asarray(cand)).double()
    exp = torch.stack([ref[0, [0, 1]], ref[1, [2, 3]], ref[2, [4, 0]]])
    assert ((cand - exp).abs().max() / scale).item() < 1e-6
    assert torch.equal(torch.as_tensor(inp), keep)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_test_tensor_unmodified_at_extreme_lrs(dtype):
    """Held: the caller's test tensor is never modified, every query, lr 1e-310 / 1e300 / -1e-40."""
    for lrs in [(1e-310,), (1e300,), (-1e-40,), (5e-324,)]:
        store, _ = _lr_store(lrs, dtype)
        test = torch.randn(1, 3, 4, dtype=dtype)
        keep = test.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for nz in (False, True):
                tif.score(store, test, normalize=nz)
                with contextlib.suppress(Exception):
                    tif.top_k(store, test, k=2, normalize=nz)
                tif.score(store, test, normalize=nz, candidates=[[0], [1], [2]])
        assert torch.equal(test, keep), lrs


@pytest.mark.parametrize("lr", [1e39, 1e300])
def test_cosine_scores_overflowed_by_a_huge_lr_warn(lr):
    """score(normalize=True) at lr 1e39/1e300 on float32 returns inf: it must warn as the dot product does."""
    store, _ = _lr_store((lr,), torch.float32)
    test = torch.randn(1, 2, 4, generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = tif.score(store, test, normalize=True)
    assert not torch.isinf(got).any() or any(issubclass(x.category, RuntimeWarning) for x in w), got


def test_self_influence_overflow_warning_names_the_learning_rate_not_the_rows():
    """self_influence at lr 1e300 over rows of norm ~3 blames 'rows' norms too large'; it should name the lr."""
    store, _ = _lr_store((1e300,), torch.float32)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tif.self_influence(store)
    msgs = " ".join(str(x.message) for x in w)
    assert msgs
    assert "learning rate" in msgs or "lr=" in msgs or "1e+300" in msgs, msgs
