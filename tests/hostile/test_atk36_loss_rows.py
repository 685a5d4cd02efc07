"""Outside black-box attack (wave 36): per-example rows of `loss_from_module` with user criteria.

Ground truth: a Python loop over examples calling the criterion on `model(x[i:i+1])`,
`y[i:i+1]` with `torch.autograd.grad` in float64 (identity projection), or, for
`kind="kronecker"`, the same loss built one row at a time (one row per batch).

FAILING NOW (attacks that did not hold): test_unvmappable_criterion_* -- a criterion that calls
`.item()`, branches with `if` on a tensor, or draws `torch.randn` leaks torch's raw vmap
RuntimeError from `build_store` (identity and kronecker), neither the right rows (the brief's
per-row fallback) nor tracinfunc's `LossFunctionError` naming the criterion and the fix (as a
non-scalar criterion already gets).

HELD (regression guards): every other test in this file.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import tracinfunc as tif
from tracinfunc.errors import LossFunctionError
from tracinfunc.grads.factorized_batched import LossFormWarning

N = 12
ID = tif.Projection(kind="identity")
KR = tif.Projection(dim=4, seed=0, kind="kronecker")


def _setup():
    torch.manual_seed(0)
    m = torch.nn.Linear(6, 3).double().eval()
    x = torch.randn(N, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (N,))
    return m, x, y, tif.Checkpoint.from_module(m, lr=1.0, name="c")


def _rows(s):
    return s.read_rows(0, 0, s.meta.n_train).double()


def _brute(m, crit, x, y):
    rows = []
    for i in range(len(x)):
        g = torch.autograd.grad(crit(m(x[i : i + 1]), y[i : i + 1]), [m.bias, m.weight])
        rows.append(torch.cat([t.reshape(-1) for t in g]))
    return torch.stack(rows)


def _kr_per_row(m, ck, crit, x, y):
    return torch.cat(
        [
            _rows(
                tif.build_store(
                    tif.loss_from_module(m, crit), [ck], (x[i : i + 1], y[i : i + 1]), projection=KR
                )
            )
            for i in range(len(x))
        ]
    )


def _item_crit(o, t):
    lv = F.cross_entropy(o, t)
    return lv * (2.0 if lv.item() > 1.0 else 1.0)


def _item_equiv(o, t):
    lv = F.cross_entropy(o, t)
    return lv * torch.where(lv > 1.0, 2.0, 1.0)


def _if_crit(o, t):
    if o.sum() > 0:
        return F.cross_entropy(o, t) * 2
    return F.cross_entropy(o, t)


def _if_equiv(o, t):
    return F.cross_entropy(o, t) * torch.where(o.sum() > 0, 2.0, 1.0)


def _randn_crit(o, t):
    return F.cross_entropy(o, t) + 0 * torch.randn(())


UNVMAPPABLE = {
    "item": (_item_crit, _item_equiv),
    "if_on_tensor": (_if_crit, _if_equiv),
    "randn": (_randn_crit, F.cross_entropy),
}


# ---------------- FAILING NOW ----------------
@pytest.mark.parametrize("name", sorted(UNVMAPPABLE))
def test_unvmappable_criterion_identity_right_rows_or_clear_error(name):
    m, x, y, ck = _setup()
    crit, _ = UNVMAPPABLE[name]
    truth = _brute(m, crit, x, y)
    try:
        s = tif.build_store(tif.loss_from_module(m, crit), [ck], (x, y), projection=ID)
    except LossFunctionError:
        return  # a clear, library-named refusal is acceptable
    assert torch.allclose(_rows(s), truth, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(UNVMAPPABLE))
def test_unvmappable_criterion_kronecker_right_rows_or_clear_error(name):
    m, x, y, ck = _setup()
    crit, equiv = UNVMAPPABLE[name]
    truth = _kr_per_row(m, ck, equiv, x, y)
    try:
        s = tif.build_store(tif.loss_from_module(m, crit), [ck], (x, y), projection=KR)
    except LossFunctionError:
        return
    assert torch.allclose(_rows(s), truth, atol=1e-5, rtol=1e-4)


# ---------------- HELD (regression guards) ----------------
def _crits():
    w = torch.tensor([1.0, 2.0, 5.0], dtype=torch.float64)
    return {
        "ce": (F.cross_entropy, None),
        "sum": (lambda o, t: F.cross_entropy(o, t, reduction="sum"), None),
        "mean": (lambda o, t: F.cross_entropy(o, t, reduction="mean"), None),
        "class_weights": (lambda o, t: F.cross_entropy(o, t, weight=w), None),
        "label_smoothing": (lambda o, t: F.cross_entropy(o, t, label_smoothing=0.2), None),
        "ignore_index": (F.cross_entropy, "ignore"),
        "target_shape0": (lambda o, t: F.cross_entropy(o, t, reduction="sum") / t.shape[0], None),
        "len_output": (lambda o, t: F.cross_entropy(o, t, reduction="sum") / len(o), None),
        "times_shape0": (lambda o, t: F.cross_entropy(o, t) * t.shape[0], None),
        "batch_mean_of_output": (
            lambda o, t: F.cross_entropy(o - o.mean(0, keepdim=True), t),
            None,
        ),
        "inplace_on_output": (lambda o, t: F.cross_entropy(o.mul_(2.0), t), None),
        "mse_2d": (F.mse_loss, "2d"),
        "mse_2d_sum": (lambda o, t: F.mse_loss(o, t, reduction="sum"), "2d"),
        "target_int32": (lambda o, t: F.cross_entropy(o, t.long()), "int32"),
        "target_float16": (lambda o, t: F.mse_loss(o, t.to(o.dtype)), "f16"),
    }


def _targets(kind, y):
    g = torch.Generator().manual_seed(1)
    if kind == "ignore":
        y = y.clone()
        y[::3] = -100
        return y
    if kind == "2d":
        return torch.randn(N, 3, dtype=torch.float64, generator=g)
    if kind == "int32":
        return y.to(torch.int32)
    if kind == "f16":
        return torch.randn(N, 3, generator=g).half()
    return y


@pytest.mark.parametrize("name", sorted(_crits()))
def test_held_identity_rows_match_brute_force(name):
    m, x, y, ck = _setup()
    crit, kind = _crits()[name]
    yy = _targets(kind, y)
    s = tif.build_store(tif.loss_from_module(m, crit), [ck], (x, yy), projection=ID)
    assert torch.allclose(_rows(s), _brute(m, crit, x, yy), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "name",
    [
        "sum",
        "target_shape0",
        "len_output",
        "batch_mean_of_output",
        "inplace_on_output",
        "mse_2d",
        "ignore_index",
        "class_weights",
    ],
)
def test_held_kronecker_batched_rows_match_one_row_batches(name):
    m, x, y, ck = _setup()
    crit, kind = _crits()[name]
    yy = _targets(kind, y)
    s = tif.build_store(tif.loss_from_module(m, crit), [ck], (x, yy), projection=KR)
    assert torch.allclose(_rows(s), _kr_per_row(m, ck, crit, x, yy), atol=1e-5, rtol=1e-4)


def test_held_stateful_counter_criterion_rows():
    m, x, y, ck = _setup()
    calls = []

    def crit(o, t):
        calls.append(o.shape)
        return F.cross_entropy(o, t)

    s = tif.build_store(tif.loss_from_module(m, crit), [ck], (x, y), projection=ID)
    assert calls and all(tuple(c) == (1, 3) for c in calls)  # always sees a batch of one
    assert torch.allclose(_rows(s), _brute(m, F.cross_entropy, x, y), atol=1e-5, rtol=1e-4)


def test_held_dict_output_module_kronecker():
    m, x, y, _ = _setup()

    class D(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = m

        def forward(self, x):
            return {"logits": self.lin(x)}

    dm = D().eval()
    ck = tif.Checkpoint.from_module(dm, lr=1.0, name="d")
    crit = lambda o, t: F.cross_entropy(o["logits"], t)  # noqa: E731
    r = _rows(tif.build_store(tif.loss_from_module(dm, crit), [ck], (x, y), projection=KR))
    r1 = torch.cat(
        [
            _rows(
                tif.build_store(
                    tif.loss_from_module(dm, crit),
                    [ck],
                    (x[i : i + 1], y[i : i + 1]),
                    projection=KR,
                )
            )
            for i in range(N)
        ]
    )
    assert torch.allclose(r, r1, atol=1e-5, rtol=1e-4)
    ri = _rows(tif.build_store(tif.loss_from_module(dm, crit), [ck], (x, y), projection=ID))
    assert torch.allclose(ri, _brute(m, F.cross_entropy, x, y), atol=1e-5, rtol=1e-4)


def test_held_nonscalar_criterion_is_a_clear_error():
    m, x, y, ck = _setup()
    with pytest.raises(LossFunctionError, match="scalar"):
        tif.build_store(
            tif.loss_from_module(m, lambda o, t: F.cross_entropy(o, t, reduction="none")),
            [ck],
            (x, y),
            projection=ID,
        )


def test_held_loss_form_warning_once_per_plain_loss_never_for_module_loss():
    m, x, y, ck = _setup()

    def plain(params, ex):
        xi, yi = ex
        return F.cross_entropy(functional_call(m, params, (xi[None],)), yi[None])

    ck2 = tif.Checkpoint.from_module(m, lr=0.5, name="c2")
    for loss, expected in ((plain, 1), (tif.loss_from_module(m, F.cross_entropy), 0)):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(3):
                tif.build_store(loss, [ck], (x, y), projection=KR)
            tif.build_store(loss, [ck, ck2], [(x[:6], y[:6]), (x[6:], y[6:])], projection=KR)
            tif.build_store(loss, [ck], (x, y), projection=ID)
        assert sum(issubclass(i.category, LossFormWarning) for i in w) == expected


def test_held_constant_criterion_gives_zero_rows():
    m, x, y, ck = _setup()
    loss = tif.loss_from_module(m, lambda o, t: torch.tensor(1.0, dtype=o.dtype))
    for proj in (ID, KR):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s = tif.build_store(loss, [ck], (x, y), projection=proj)
        assert _rows(s).abs().max().item() == 0.0
