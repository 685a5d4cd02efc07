"""Session 38 black-box attacks on test gradients passed as a GradientStore (``normalize=True`` too).

Written from the docs only (README "The pieces", docs/concepts/stores.md "The protocol",
docs/concepts/layout.md "Bringing your own store", docs/concepts/faults.md). Contract attacked:
a test store — a ``MemoryStore`` or a user's own object with ``meta``, ``read_rows(ckpt, start,
stop, *, out=None)`` and ``read_norms`` — scores as the same rows passed as a tensor
``[n_ckpt, n_test, k]`` (to float rounding), and nothing the store or the user owns is changed.
A store breaking the protocol's return contract is refused with the library's error naming
``read_rows``, never scored silently wrong.

The first tests FAIL today (findings); the ones marked ``held`` guard regressions.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracinfunc as tif

N_TEST, K = 6, 16


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    loss = tif.loss_from_module(model.eval(), F.cross_entropy)
    ckpts = [tif.Checkpoint.from_module(model, lr=0.1, name="a")]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    ckpts.append(tif.Checkpoint.from_module(model, lr=0.05, name="b"))
    x, y = torch.randn(40, 5), torch.randint(0, 3, (40,))
    xt, yt = torch.randn(N_TEST, 5), torch.randint(0, 3, (N_TEST,))
    store = tif.build_store(loss, ckpts, (x, y), projection=tif.Projection(dim=K, seed=0))
    test = tif.build_store(loss, ckpts, (xt, yt), projection=store.projection)
    rows = torch.stack([test.read_rows(c, 0, N_TEST) for c in range(2)])  # [n_ckpt, n_test, k]
    return store, test, rows


class UserStore:
    """A user's store per the documented protocol; ``rows_fn`` says what read_rows returns."""

    def __init__(self, inner, rows_fn=None, meta=None):
        self.inner, self.rows_fn, self._meta = inner, rows_fn, meta or inner.meta

    @property
    def meta(self):
        return self._meta

    def read_rows(self, ckpt, start, stop, *, out=None):
        rows = self.inner.read_rows(ckpt, start, stop)
        return rows if self.rows_fn is None else self.rows_fn(rows, out)

    def read_norms(self, ckpt, start, stop):
        return self.inner.read_norms(ckpt, start, stop)


def _ref(store, rows, normalize):
    return tif.score(store, rows.clone(), normalize=normalize)


# ---------------------------------------------------------------- findings (fail today)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda r, out: r[:1], id="one_row_for_six"),
        pytest.param(lambda r, out: r.sum(0), id="flat_k_vector"),
        pytest.param(lambda r, out: r[:, :1].clone(), id="one_column"),
    ],
)
def test_a_read_rows_of_the_wrong_shape_is_refused_not_broadcast(setup, bad, normalize):
    """Finding: rows of a broadcastable wrong shape ([1, k], [k], [n, 1]) were broadcast into
    the query's buffer and scored silently wrong (max error ~1 on scores ~1)."""
    store, test, _ = setup
    with pytest.raises(tif.TracInFuncError, match="read_rows"):
        tif.score(store, UserStore(test, bad), normalize=normalize)


@pytest.mark.parametrize("normalize", [False, True])
def test_a_read_rows_of_the_wrong_k_names_read_rows(setup, normalize):
    """Finding: rows [n, 2k] gave a raw RuntimeError from a tensor copy."""
    store, test, _ = setup
    doubled = UserStore(test, lambda r, out: torch.cat([r, r], 1))
    with pytest.raises(tif.TracInFuncError, match="read_rows"):
        tif.score(store, doubled, normalize=normalize)


@pytest.mark.parametrize("normalize", [False, True])
def test_a_store_that_writes_out_and_returns_none_is_scored_or_refused_clearly(setup, normalize):
    """Finding: "(or written into out)" read as "write out, return nothing" gave a raw
    AttributeError ('NoneType' object has no attribute 'data_ptr')."""
    store, test, rows = setup

    def write_only(r, out):
        if out is None:
            return r
        out.copy_(r)
        return None

    try:
        got = tif.score(store, UserStore(test, write_only), normalize=normalize)
    except tif.TracInFuncError as err:
        assert "read_rows" in str(err)
    else:
        torch.testing.assert_close(got, _ref(store, rows, normalize))


@pytest.mark.parametrize("normalize", [False, True])
def test_a_store_returning_a_numpy_array_is_scored_or_refused_clearly(setup, normalize):
    """Finding: a NumPy array from read_rows gave a raw AttributeError (no data_ptr)."""
    store, test, rows = setup
    try:
        got = tif.score(store, UserStore(test, lambda r, out: r.numpy()), normalize=normalize)
    except tif.TracInFuncError as err:
        assert "read_rows" in str(err)
    else:
        torch.testing.assert_close(got, _ref(store, rows, normalize))


@pytest.mark.parametrize("query", ["score", "top_k"])
def test_a_test_store_with_nan_rows_is_refused_as_a_tensor_is(setup, query):
    """Finding: the same NaN passed as a tensor raises NonFiniteGradientError; from a test
    store ``score`` returned NaN scores, silently (faults.md refuses NaN train-store rows).
    The ``top_k`` case held (refused) and guards that."""
    store, test, rows = setup

    def with_nan(r, out):
        r = r.clone()
        r[1, 2] = float("nan")
        return r

    bad = rows.clone()
    bad[:, 1, 2] = float("nan")
    fn = tif.score if query == "score" else (lambda s, t, **kw: tif.top_k(s, t, k=3, **kw))
    with pytest.raises(tif.errors.NonFiniteGradientError):
        fn(store, bad, normalize=True)
    with pytest.raises(tif.errors.NonFiniteGradientError):
        fn(store, UserStore(test, with_nan), normalize=True)


# ---------------------------------------------------------------- held (regression guards)


class Recording(UserStore):
    """Ignores ``out`` and keeps every tensor it hands out, with a copy to compare."""

    def __init__(self, inner):
        super().__init__(inner)
        self.handed = []

    def read_rows(self, ckpt, start, stop, *, out=None):
        rows = self.inner.read_rows(ckpt, start, stop)
        self.handed.append((rows, rows.clone()))
        return rows


class Views(UserStore):
    """Hands out views of its own data and norms (ignores ``out``)."""

    def __init__(self, inner):
        super().__init__(inner)
        n = inner.meta.n_train
        self.data = torch.stack([inner.read_rows(c, 0, n) for c in range(2)])
        self.norms = torch.stack([inner.read_norms(c, 0, n) for c in range(2)])

    def read_rows(self, ckpt, start, stop, *, out=None):
        return self.data[ckpt, start:stop]

    def read_norms(self, ckpt, start, stop):
        return self.norms[ckpt, start:stop]


def _reused_buffer():
    buf = torch.empty(64, K)

    def fn(r, out):
        buf[: r.shape[0]] = r
        return buf[: r.shape[0]]

    return fn


def _write_out_return_other(r, out):
    if out is not None:
        out.copy_(r)
    return r.clone()


def _noncontiguous(r, out):
    t = torch.empty(r.shape[1], r.shape[0]).T
    t.copy_(r)
    return t


@pytest.mark.parametrize("normalize", [False, True])
def test_held_a_store_ignoring_out_is_scored_and_its_tensors_untouched(setup, normalize):
    store, test, rows = setup
    user = Recording(test)
    first = tif.score(store, user, normalize=normalize)
    second = tif.score(store, user, normalize=normalize)
    torch.testing.assert_close(first, _ref(store, rows, normalize))
    assert torch.equal(first, second)
    assert user.handed and all(torch.equal(t, c) for t, c in user.handed)


@pytest.mark.parametrize("normalize", [False, True])
def test_held_a_store_lending_views_of_its_data_keeps_its_data(setup, normalize):
    store, test, rows = setup
    user = Views(test)
    data, norms = user.data.clone(), user.norms.clone()
    got = tif.score(store, user, normalize=normalize)
    vals, idx = tif.top_k(store, user, k=3, normalize=normalize)
    ref_vals, ref_idx = tif.top_k(store, rows.clone(), k=3, normalize=normalize)
    torch.testing.assert_close(got, _ref(store, rows, normalize))
    torch.testing.assert_close(vals, ref_vals)
    assert torch.equal(idx, ref_idx)
    assert torch.equal(user.data, data) and torch.equal(user.norms, norms)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(_reused_buffer, id="reused_internal_buffer"),
        pytest.param(lambda: _write_out_return_other, id="writes_out_returns_other"),
        pytest.param(lambda: _noncontiguous, id="noncontiguous"),
        pytest.param(lambda: lambda r, out: r.double(), id="float64_rows"),
    ],
)
def test_held_odd_but_valid_returns_score_as_the_tensor(setup, make, normalize):
    store, test, rows = setup
    got = tif.score(store, UserStore(test, make()), normalize=normalize)
    torch.testing.assert_close(got, _ref(store, rows, normalize))


@pytest.mark.parametrize("normalize", [False, True])
def test_held_float16_rows_score_as_the_float16_tensor(setup, normalize):
    store, test, rows = setup
    got = tif.score(store, UserStore(test, lambda r, out: r.half()), normalize=normalize)
    torch.testing.assert_close(
        got, _ref(store, rows.half().float(), normalize), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("normalize", [False, True])
def test_held_a_memory_test_store_is_unchanged_and_scores_twice_alike(setup, normalize):
    store, test, rows = setup
    first = tif.score(store, test, normalize=normalize)
    second = tif.score(store, test, normalize=normalize)
    tif.top_k(store, test, k=3, normalize=normalize)
    after = torch.stack([test.read_rows(c, 0, N_TEST) for c in range(2)])
    assert torch.equal(after, rows)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, _ref(store, rows, normalize))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_held_a_plain_tensor_is_not_scaled_in_place(setup, dtype):
    store, _, rows = setup
    mine = rows.to(dtype)
    kept = mine.clone()
    tif.score(store, mine, normalize=True)
    tif.top_k(store, mine, k=3, normalize=True)
    assert torch.equal(mine, kept)


@pytest.mark.parametrize("normalize", [False, True])
def test_held_a_test_store_of_zero_rows_gives_empty_results(setup, normalize):
    store, test, _ = setup
    empty = UserStore(test, meta=test.meta.replace(n_train=0))
    assert tuple(tif.score(store, empty, normalize=normalize).shape) == (0, 40)
    vals, idx = tif.top_k(store, empty, k=3, normalize=normalize)
    assert tuple(vals.shape) == (0, 3) and tuple(idx.shape) == (0, 3)


@pytest.mark.parametrize("kind", ["zarr", "pinned"])
def test_held_zarr_and_pinned_test_stores_are_unchanged_by_a_cosine_query(setup, kind, tmp_path):
    store, test, rows = setup
    made = tif.save_store(test, tmp_path / "test.zarr") if kind == "zarr" else tif.to_pinned(test)
    first = tif.score(store, made, normalize=True)
    assert torch.equal(first, tif.score(store, made, normalize=True))
    torch.testing.assert_close(first, _ref(store, rows, True))
    assert torch.equal(torch.stack([made.read_rows(c, 0, N_TEST) for c in range(2)]), rows)
    if kind == "zarr":
        reopened = tif.GradientStore.open(tmp_path / "test.zarr")
        assert torch.equal(torch.stack([reopened.read_rows(c, 0, N_TEST) for c in range(2)]), rows)
