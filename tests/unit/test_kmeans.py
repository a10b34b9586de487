"""Seeded 1-D weighted k-means: planted mixtures, closed forms, Fisher weighting, determinism."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench.numerics.kmeans import assign_nearest, count_below, kmeans_1d, weighted_sse

CENTERS = torch.tensor([-3.0, 0.0, 2.0, 5.0])


def _mixture(seed: int = 0, n_per: int = 2000, sd: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(4).repeat_interleave(n_per)
    x = CENTERS[labels] + sd * torch.randn(labels.numel(), generator=g)
    perm = torch.randperm(x.numel(), generator=g)
    return x[perm], labels[perm]


def test_converges_to_planted_centroids() -> None:
    x, labels = _mixture()
    c = kmeans_1d(x, 4)
    assert torch.all(c[1:] > c[:-1])
    torch.testing.assert_close(c, CENTERS, rtol=0, atol=0.01)
    # at convergence every centroid is the mean of its cluster (here = the planted components)
    means = torch.stack([x[labels == j].mean() for j in range(4)])
    torch.testing.assert_close(c, means, rtol=0, atol=1e-5)


def test_one_centroid_is_the_weighted_mean() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(500, generator=g)
    w = torch.rand(500, generator=g)
    torch.testing.assert_close(kmeans_1d(x, 1), x.mean().reshape(1), rtol=0, atol=1e-6)
    torch.testing.assert_close(kmeans_1d(x, 1, weights=w), ((w * x).sum() / w.sum()).reshape(1), rtol=0, atol=1e-6)


def test_fisher_weighting_moves_centroids_toward_heavy_points() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.rand(4000, generator=g) * 2 - 1  # uniform on [-1, 1]
    heavy = (x > 0.55) & (x < 0.6)
    w = torch.where(heavy, torch.full_like(x, 1e4), torch.ones_like(x))
    plain = kmeans_1d(x, 4)
    weighted = kmeans_1d(x, 4, weights=w)
    target = float(x[heavy].mean())
    assert (weighted - target).abs().min() < (plain - target).abs().min()
    assert (weighted - target).abs().min() < 0.02
    assert weighted_sse(x, weighted, w) < weighted_sse(x, plain, w)


def test_lloyd_does_not_increase_error() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3000, generator=g) * torch.exp(torch.randn(3000, generator=g))  # heavy-tailed
    errs = [float(weighted_sse(x, kmeans_1d(x, 8, n_iter=i))) for i in (0, 1, 2, 5, 20, 100)]
    assert all(b <= a * (1 + 1e-6) for a, b in zip(errs, errs[1:]))
    assert errs[-1] < errs[0]


def test_rows_are_independent_problems() -> None:
    x1, _ = _mixture(0, 500)
    x2 = torch.randn(2000, generator=torch.Generator().manual_seed(5))
    both = kmeans_1d(torch.stack([x1, x2]), 4)
    torch.testing.assert_close(both[0], kmeans_1d(x1, 4))
    torch.testing.assert_close(both[1], kmeans_1d(x2, 4))


def test_centroids_sorted_and_inside_data_range() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(9)) ** 3
    c = kmeans_1d(x, 16)
    assert torch.all(c[1:] >= c[:-1])
    assert c.min() >= x.min() and c.max() <= x.max()


def test_subsample_is_seeded_and_deterministic() -> None:
    x = torch.randn(20000, generator=torch.Generator().manual_seed(6))
    a = kmeans_1d(x, 4, max_samples=1000, generator=torch.Generator().manual_seed(0))
    b = kmeans_1d(x, 4, max_samples=1000, generator=torch.Generator().manual_seed(0))
    c = kmeans_1d(x, 4, max_samples=1000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(kmeans_1d(x, 4), kmeans_1d(x, 4))


def test_degenerate_inputs() -> None:
    c = kmeans_1d(torch.full((100,), 2.5), 4)
    assert torch.equal(c, torch.full((4,), 2.5))
    zero_w = kmeans_1d(torch.tensor([0.0, 1.0, 2.0, 3.0]), 1, weights=torch.zeros(4))
    torch.testing.assert_close(zero_w, torch.tensor([1.5]))  # all-zero weights fall back to unweighted


def test_assign_nearest_matches_brute_force() -> None:
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 1000, generator=g) * 2
    c, _ = torch.sort(torch.randn(2, 8, generator=g), dim=-1)
    brute = (x[..., None] - c[:, None, :]).abs().argmin(-1)
    assert torch.equal(assign_nearest(x, c), brute)
    assert torch.equal(assign_nearest(x[0], c[0]), brute[0])


@pytest.mark.parametrize(
    ("kwargs", "err"),
    [
        ({"k": 0}, ValueError),
        ({"k": 2, "weights": -torch.ones(10)}, ValueError),
        ({"k": 2, "weights": torch.ones(3)}, ValueError),
        ({"k": 2, "weights": torch.full((10,), float("nan"))}, ValueError),
    ],
)
def test_bad_arguments_raise(kwargs: dict, err: type) -> None:
    with pytest.raises(err):
        kmeans_1d(torch.randn(10), **kwargs)


def test_rejects_empty_and_high_rank() -> None:
    with pytest.raises(ValueError):
        kmeans_1d(torch.empty(0), 2)
    with pytest.raises(ValueError):
        kmeans_1d(torch.randn(2, 2, 2), 2)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 40), rows=st.integers(0, 3), n=st.integers(1, 200), seed=st.integers(0, 2**31 - 1),
       ties=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]))
def test_count_below_comparisons_equal_binary_search(m: int, rows: int, n: int, seed: int, ties: bool,
                                                    dtype: torch.dtype) -> None:
    """Both paths of count_below (a comparison per threshold for small codebooks, searchsorted/bucketize
    for large) against torch.searchsorted itself, with values exactly on thresholds when ``ties``."""
    g = torch.Generator().manual_seed(seed)
    lead = (rows,) if rows else ()
    t, _ = torch.sort(torch.randn(*lead, m, generator=g).to(dtype), dim=-1)
    x = torch.randn(*lead, n, generator=g).to(dtype) * 1.5
    if ties:  # put every threshold (and its row) into x
        k = min(m, n)
        x[..., :k] = t[..., :k]
    ref = torch.searchsorted(t.expand(*x.shape[:-1], m).contiguous(), x, right=False)
    for out in (torch.int64, torch.uint8):
        got = count_below(x, t, dtype=out)
        assert got.dtype == out and torch.equal(got.to(torch.int64), ref)
        buf = torch.full(x.shape, 7, dtype=out)  # into a given tensor (stale contents overwritten)
        assert count_below(x, t, dtype=out, out=buf) is buf and torch.equal(buf.to(torch.int64), ref)
    if rows:  # one row: the shared (1-D, Python-scalar) path
        assert torch.equal(count_below(x[0], t[0]), ref[0])


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 3), n=st.integers(1, 300), seed=st.integers(0, 2**31 - 1), weighted=st.booleans(),
       ks=st.lists(st.integers(1, 12), min_size=2, max_size=4))
def test_sorted_samples_serve_every_k(rows: int, n: int, seed: int, weighted: bool, ks: list[int]) -> None:
    """One :func:`sorted_samples` reused for several k in a row gives, for each k, the centroids of a fresh
    ``kmeans_1d`` (the prepared data are not changed by a fit), bit for bit."""
    from kvqbench.numerics.kmeans import kmeans_sorted, sorted_samples

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g) * 4).round() / 4  # ties and repeated values
    w = torch.rand(rows, n, generator=g) if weighted else None
    s = sorted_samples(x, weights=w)
    for k in ks:
        assert torch.equal(kmeans_sorted(s, k), kmeans_1d(x, k, weights=w))
