"""Labels drawn from the model's distribution (``_draw_labels``): the draws of an inverse-CDF
loop over the same uniforms, bit for bit, and each row's distribution in frequency."""

from __future__ import annotations

import torch

from tracinfunc.curvature.samplers import _draw_labels


def _reference(probs: torch.Tensor, samples: int, seed: int) -> torch.Tensor:
    """A Python loop: for each draw, the first class whose running sum exceeds its uniform
    (scaled by the row's total), with the uniforms ``_draw_labels`` takes from the seed."""
    uniforms = torch.rand(probs.shape[0], samples, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(seed))
    out = torch.empty(probs.shape[0], samples, dtype=torch.int64)
    for r in range(probs.shape[0]):
        total = float(probs[r].cumsum(0)[-1])
        for s in range(samples):
            u = float(uniforms[r, s]) * total
            cdf = probs[r].cumsum(0)
            choice = next(c for c in range(probs.shape[1]) if float(cdf[c]) > u)
            out[r, s] = choice
    return out


def test_draws_equal_an_inverse_cdf_loop_over_the_same_uniforms():
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(40, 7, dtype=torch.float64, generator=g)
    probs[:, 2] = 0  # a class of probability 0
    probs = probs / probs.sum(-1, keepdim=True)
    got = _draw_labels(probs, 5, torch.Generator().manual_seed(11))
    assert got.shape == (40, 5) and got.dtype == torch.int64
    assert torch.equal(got, _reference(probs, 5, 11))
    assert not bool((got == 2).any())


def test_each_rows_frequencies_follow_its_probabilities():
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.0, 0.0, 0.0, 1.0], [0.25, 0.25, 0.25, 0.25]],
                         dtype=torch.float64)
    n = 200_000
    draws = _draw_labels(probs, n, torch.Generator().manual_seed(0))
    for row, p in enumerate(probs):
        freq = torch.bincount(draws[row], minlength=4).double() / n
        sigma = (p * (1 - p) / n).sqrt()
        assert bool(((freq - p).abs() <= 5 * sigma + 1e-12).all()), (row, freq, p)


def test_rows_whose_probabilities_do_not_sum_to_one_still_draw_every_class_in_range():
    """Rounded softmax rows sum to 1 within a few ulps either way: the uniform is scaled by the
    row's own total, so the last class is reachable and no index falls past it."""
    probs = torch.full((4, 3), 1 / 3, dtype=torch.float64)
    probs[1] *= 1 - 1e-15
    probs[2] *= 1 + 1e-15
    probs[3] = torch.tensor([0.0, 0.0, 1.0 - 2**-52], dtype=torch.float64)
    draws = _draw_labels(probs, 50_000, torch.Generator().manual_seed(1))
    assert int(draws.max()) == 2 and int(draws.min()) >= 0
    assert bool((draws[3] == 2).all())
    assert set(draws[1].tolist()) == {0, 1, 2}
