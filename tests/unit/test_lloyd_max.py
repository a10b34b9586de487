"""Lloyd–Max codebooks against independent values: Max (1960) for N(0, 1), closed forms for the
sphere density at dim = 2 (arcsine) and dim = 3 (uniform), and quadrature of the optimality
conditions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from kvqbench.numerics.lloyd_max import (
    gaussian_codebook,
    lloyd_max,
    nearest_centroid,
    sphere_codebook,
)

# J. Max, "Quantizing for minimum distortion", IRE Trans. Inf. Theory 6(1), 1960, Table I/II.
MAX_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}
MAX_POSITIVE_CENTROIDS = {
    1: (0.7979,),
    2: (0.4528, 1.510),
    3: (0.2451, 0.7560, 1.344, 2.152),
    4: (0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733),
}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gaussian_centroids_match_max_1960(bits: int) -> None:
    cent, thr = gaussian_codebook(bits, 1.0)
    assert cent.shape == (2**bits,) and thr.shape == (2**bits - 1,)
    positive = cent[2 ** (bits - 1) :].tolist()
    assert positive == pytest.approx(MAX_POSITIVE_CENTROIDS[bits], abs=6e-4)
    # symmetric about 0 with the middle threshold at exactly 0
    assert torch.equal(cent, -cent.flip(0))
    assert float(thr[2 ** (bits - 1) - 1]) == 0.0


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gaussian_mse_matches_max_1960(bits: int) -> None:
    # Max's table carries 4 significant digits (his 16-level value is 0.009497; the exact optimum is
    # 0.0095010), so compare at 1e-3 relative
    assert lloyd_max("gaussian", bits, (1.0,)).mse == pytest.approx(MAX_MSE[bits], rel=1e-3)


# B(1/2, 15/2): the normalizer of the dim = 16 sphere-coordinate density (1 − x²)^(13/2)
_BETA_HALF_7_5 = math.exp(math.lgamma(0.5) + math.lgamma(7.5) - math.lgamma(8.0))


def _quad_cells(pdf, lo: float, hi: float, centroids, thresholds):
    edges = [lo, *thresholds, hi]
    out = []
    for i, c in enumerate(centroids):
        a, b = edges[i], edges[i + 1]
        m0 = integrate.quad(pdf, a, b, epsabs=1e-15, epsrel=1e-12)[0]
        m1 = integrate.quad(lambda x: x * pdf(x), a, b, epsabs=1e-15, epsrel=1e-12)[0]
        err = integrate.quad(lambda x, c=c: (x - c) ** 2 * pdf(x), a, b, epsabs=1e-15, epsrel=1e-12)[0]
        out.append((m0, m1, err))
    return out


@pytest.mark.parametrize(
    ("density", "params", "pdf", "support"),
    [
        ("gaussian", (1.0,), stats.norm.pdf, (-math.inf, math.inf)),
        ("gaussian", (0.25,), stats.norm(scale=0.25).pdf, (-math.inf, math.inf)),
        # x² ~ Beta(1/2, (dim−1)/2); written out here independently of the module
        ("sphere", (16,), lambda x: (1 - x * x) ** 6.5 / _BETA_HALF_7_5, (-1.0, 1.0)),
    ],
)
@pytest.mark.parametrize("bits", [1, 2, 3])
def test_optimality_conditions_by_quadrature(density, params, pdf, support, bits) -> None:
    cb = lloyd_max(density, bits, params)
    c = np.array(cb.centroids)
    t = np.array(cb.thresholds)
    np.testing.assert_allclose(t, 0.5 * (c[1:] + c[:-1]), rtol=0, atol=1e-15)
    cells = _quad_cells(pdf, *support, cb.centroids, cb.thresholds)
    assert sum(m0 for m0, _, _ in cells) == pytest.approx(1.0, abs=1e-9)
    for (m0, m1, _), ci in zip(cells, c):
        assert m1 / m0 == pytest.approx(ci, rel=1e-8, abs=1e-12)  # centroid = conditional mean
    assert sum(e for _, _, e in cells) == pytest.approx(cb.mse, rel=1e-8)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
def test_sphere_dim3_is_uniform_quantizer(bits: int) -> None:
    # in R^3 one coordinate of a uniform unit vector is uniform on [−1, 1] (Archimedes): the optimal
    # quantizer is the uniform one, MSE = (2/L)²/12
    n = 2**bits
    cent, thr = sphere_codebook(bits, 3)
    expected = -1 + (2 * torch.arange(n, dtype=torch.float64) + 1) / n
    torch.testing.assert_close(cent, expected, atol=1e-10, rtol=0)
    assert lloyd_max("sphere", bits, (3,)).mse == pytest.approx((2 / n) ** 2 / 12, rel=1e-9)


def test_sphere_dim2_one_bit_is_arcsine_mean() -> None:
    # in R^2 a coordinate is cos θ (arcsine law); the 1-bit centroid is E|cos θ| = 2/π
    cent, _ = sphere_codebook(1, 2)
    assert float(cent[1]) == pytest.approx(2 / math.pi, rel=1e-12)
    assert lloyd_max("sphere", 1, (2,)).mse == pytest.approx(0.5 - 4 / math.pi**2, rel=1e-10)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_sphere_tends_to_gaussian_limit(bits: int) -> None:
    # dim · MSE → Max's distortion as dim grows; it is below it at finite dim (lighter tails)
    at_128 = 128 * lloyd_max("sphere", bits, (128,)).mse
    at_4096 = 4096 * lloyd_max("sphere", bits, (4096,)).mse
    assert at_128 < at_4096 < MAX_MSE[bits] * 1.001
    assert at_4096 == pytest.approx(MAX_MSE[bits], rel=1.5e-3)
    assert at_128 == pytest.approx(MAX_MSE[bits], rel=0.03)


def test_gaussian_scale_equivariance() -> None:
    unit, unit_t = gaussian_codebook(3, 1.0)
    scaled, scaled_t = gaussian_codebook(3, 0.125)
    torch.testing.assert_close(scaled, 0.125 * unit, rtol=1e-12, atol=0)
    torch.testing.assert_close(scaled_t, 0.125 * unit_t, rtol=1e-12, atol=1e-15)
    assert lloyd_max("gaussian", 3, (0.125,)).mse == pytest.approx(0.125**2 * MAX_MSE[3], rel=1e-3)


@pytest.mark.parametrize("bits", [6, 8, 12])
def test_high_rate_solves_fast_and_approaches_panter_dite(bits: int) -> None:
    # high-rate theory (Panter & Dite 1951): MSE · 4^b → √3·π/2 ≈ 2.7207 for N(0, 1)
    cb = lloyd_max("gaussian", bits, (1.0,))
    assert cb.iterations < 200
    assert np.all(np.diff(cb.centroids) > 0)
    assert cb.mse * 4**bits == pytest.approx(math.sqrt(3) * math.pi / 2, rel=0.06 if bits == 6 else 0.02)


def test_monte_carlo_mse_matches_table() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2_000_000, generator=g, dtype=torch.float64)
    for bits in (1, 2, 3, 4):
        cent, thr = gaussian_codebook(bits)
        err = float(((cent[nearest_centroid(x, thr)] - x) ** 2).mean())
        assert err == pytest.approx(MAX_MSE[bits], rel=0.01)


def test_nearest_centroid_is_argmin_distance() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10_000, generator=g, dtype=torch.float64) * 1.5
    cent, thr = gaussian_codebook(3)
    brute = torch.argmin((x[:, None] - cent[None, :]).abs(), dim=1)
    assert torch.equal(nearest_centroid(x, thr), brute)
    assert nearest_centroid(x.float(), thr).dtype == torch.int64


def test_results_are_cached() -> None:
    assert lloyd_max("gaussian", 4, (1.0,)) is lloyd_max("gaussian", 4, (1.0,))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("gaussian", 0, (1.0,)), "bits"),
        (("gaussian", 13, (1.0,)), "bits"),
        (("gaussian", 2, (0.0,)), "sigma"),
        (("gaussian", 2, ()), "sigma"),
        (("sphere", 2, (1,)), "dim"),
        (("sphere", 2, (2.5,)), "dim"),
        (("laplace", 2, (1.0,)), "unknown density"),
    ],
)
def test_bad_arguments_raise(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        lloyd_max(*args)
