"""The GradientStore conformance suite, shipped so your own store can run it (as zarr.testing).

Subclass :class:`StoreConformance` in a pytest file, name the class ``Test...`` and implement
:meth:`~StoreConformance.make_store`; every built-in store runs the same suite::

    from tracinfunc.testing import StoreConformance

    class TestMyStore(StoreConformance):
        def make_store(self, reference, tmp_path):
            return MyStore.from_rows(reference.meta, ...)  # the same rows as ``reference``

The suite checks the protocol (``meta``, ``read_rows`` with and without ``out``, ``read_norms``),
that reads hand out copies, refuse bad ranges, and that ``score``, ``top_k``,
``self_influence`` and ``score_chunks`` over your store equal those over an in-memory store
holding the same rows. Needs pytest.
"""

from __future__ import annotations

from pathlib import Path

try:
    import pytest
except ImportError as error:  # pragma: no cover - pytest is what runs this module
    from tracinfunc.errors import MissingDependencyError

    raise MissingDependencyError(
        "tracinfunc.testing is a pytest suite: pip install pytest (or 'tracinfunc[dev]')."
    ) from error
import torch

from tracinfunc.errors import InvalidTypeError
from tracinfunc.projection.spec import Projection
from tracinfunc.query.chunks import score_chunks
from tracinfunc.query.score import score
from tracinfunc.query.self_influence import self_influence
from tracinfunc.query.top_k import top_k
from tracinfunc.store.codes import dequantize, quantize
from tracinfunc.store.memory.dense import MemoryStore
from tracinfunc.store.memory.quantized import QuantizedMemoryStore
from tracinfunc.store.meta import CheckpointMeta, StoreMeta
from tracinfunc.store.protocols import GradientStore

__all__ = ["StoreConformance", "reference_store"]


def reference_store(n_train: int = 40, k: int = 16, *, n_ckpt: int = 3, seed: int = 0,
                    dtype: torch.dtype = torch.float32, quantization: str | None = None
                    ) -> MemoryStore | QuantizedMemoryStore:
    """An in-memory store of seeded random rows, ``[n_ckpt, n_train, k]``, with norms.

    With ``quantization`` (``"int8"``, ``"sign"``) a quantised store (float32) of rows that
    lie on its quantisation grid (random rows, quantised and dequantised), so that the norms,
    which a quantised store keeps for the rows before quantisation, are those of the rows it
    reads back, as for a float store.
    """
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(n_ckpt, n_train, k, generator=generator, dtype=torch.float64)
    meta = StoreMeta(
        projection=Projection(dim=k, seed=seed),
        checkpoints=tuple(CheckpointMeta(f"epoch-{c}", 0.1 * (c + 1), f"{c:064x}")
                          for c in range(n_ckpt)),
        layout=(("weight", (k, 4)),), n_train=n_train, k=k,
        dtype=str(dtype).removeprefix("torch."), quantization=quantization)
    if quantization is None:
        return MemoryStore(meta, rows.to(dtype), rows.norm(dim=-1).to(dtype))
    codes, scales = quantize(rows, quantization)
    exact = dequantize(codes, scales, quantization, k)  # rows on the quantisation grid
    return QuantizedMemoryStore(meta, codes, scales, exact.double().norm(dim=-1).float())


class StoreConformance:
    """Tests every GradientStore must pass; subclass it as ``Test<YourStore>``.

    Attributes:
        n_train, k: Size of the reference store (40 rows span several chunks of most layouts;
            override for stores that need more).
        quantization: ``None``, or ``"int8"``/``"sign"`` for a quantised store: the
            reference is then a quantised store whose rows are exactly representable (see
            :func:`reference_store`).
    """

    n_train = 40
    k = 16
    quantization: str | None = None

    def make_store(self, reference: MemoryStore, tmp_path: Path) -> GradientStore:
        """Your store holding exactly ``reference``'s metadata, rows and norms."""
        raise InvalidTypeError(
            f"{type(self).__name__}: implement make_store(reference, tmp_path) to return your "
            "store holding reference's rows (or override the store fixture)."
        )

    @pytest.fixture
    def reference(self) -> MemoryStore | QuantizedMemoryStore:
        return reference_store(self.n_train, self.k, quantization=self.quantization)

    @pytest.fixture
    def store(self, reference: MemoryStore, tmp_path: Path) -> GradientStore:
        return self.make_store(reference, tmp_path)

    def test_is_a_gradient_store_with_the_reference_meta(self, store, reference):
        assert isinstance(store, GradientStore)
        assert store.meta == reference.meta and store.meta.complete

    def test_any_row_range_reads_the_same(self, store, reference):
        last, n = store.meta.n_ckpt - 1, self.n_train
        for start, stop in [(0, n), (3, n - 11), (n // 2, n), (5, 6), (n - 1, n), (7, 7)]:
            assert torch.equal(store.read_rows(last, start, stop),
                               reference.read_rows(last, start, stop))
            assert torch.equal(store.read_norms(0, start, stop),
                               reference.read_norms(0, start, stop))

    def test_reads_hand_out_copies(self, store):
        before = store.read_rows(1, 3, 9)
        before.fill_(123.0)
        assert not torch.equal(before, store.read_rows(1, 3, 9))
        store.read_norms(1, 3, 9).zero_()
        assert (store.read_norms(1, 3, 9) > 0).all()

    def test_read_rows_into_out_buffer(self, store):
        buffer = torch.empty(10, self.k, dtype=store.meta.torch_dtype)
        view = store.read_rows(0, 30, 37, out=buffer)
        assert view.data_ptr() == buffer.data_ptr() and tuple(view.shape) == (7, self.k)
        assert torch.equal(view, store.read_rows(0, 30, 37))
        with pytest.raises(ValueError):
            store.read_rows(0, 0, 12, out=buffer)

    def test_norms_match_rows(self, store):
        rows = store.read_rows(0, 0, self.n_train).double()
        torch.testing.assert_close(store.read_norms(0, 0, self.n_train).double(),
                                   rows.norm(dim=-1), rtol=1e-3, atol=1e-6)

    def test_out_of_range_reads_are_refused(self, store):
        with pytest.raises(IndexError):
            store.read_rows(store.meta.n_ckpt, 0, 1)
        with pytest.raises(IndexError):
            store.read_rows(0, 5, self.n_train + 1)
        with pytest.raises(IndexError):
            store.read_norms(0, -1, 2)

    @pytest.mark.parametrize("normalize", [False, True])
    def test_scores_equal_the_reference(self, store, reference, normalize):
        test = reference_store(7, self.k)  # same metadata but n_train: compatible
        expected = score(reference, test, normalize=normalize)
        for chunk_rows in (None, 7):
            torch.testing.assert_close(
                score(store, test, normalize=normalize, chunk_rows=chunk_rows), expected,
                rtol=1e-6, atol=1e-6)
        values, indices = top_k(store, test, k=5, chunk_rows=6, normalize=normalize)
        expected_values, expected_indices = top_k(reference, test, k=5, normalize=normalize)
        assert torch.equal(indices, expected_indices)
        torch.testing.assert_close(values, expected_values, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(self_influence(store), self_influence(reference))

    def test_score_chunks_cover_every_row_once(self, store, reference):
        test = reference_store(7, self.k)
        out = torch.full((7, self.n_train), float("nan"))
        starts = [start for start, _ in score_chunks(store, test, out=out, chunk_rows=16)]
        assert starts == list(range(0, self.n_train, 16))
        torch.testing.assert_close(out, score(reference, test), rtol=1e-6, atol=1e-6)
