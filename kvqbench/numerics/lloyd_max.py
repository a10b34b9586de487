"""Lloyd–Max scalar quantizers for a known 1-D density, solved numerically.

A ``2**b``-level quantizer of a density ``f`` is given by sorted centroids ``c_0 < … < c_{L-1}`` and
decision thresholds ``t_1 < … < t_{L-1}``; cell ``i`` is ``(t_i, t_{i+1}]`` with ``t_0 = lo``,
``t_L = hi`` the support. The MSE-optimal (Lloyd–Max) quantizer satisfies, at once:

* every threshold is the midpoint of its two neighbouring centroids (so "nearest centroid" and
  "bucket by thresholds" are the same map), and
* every centroid is the conditional mean of its cell, ``c_i = M1_i / M0_i``.

Invariant kept (and tested): at the returned solution both conditions hold to ~1e-12, and
``mse = Σ_i (M2_i − 2 c_i M1_i + c_i² M0_i)`` with ``Mk_i = ∫_cell x^k f(x) dx``. The solution is
found by Lloyd's fixed-point iteration (Max 1960; Lloyd 1982) on closed-form partial moments, in
float64, on the negative half-line (both densities are symmetric; the result is mirrored), started
from the high-rate (companding) solution and accelerated by Newton steps on the tridiagonal Jacobian
of the Lloyd map (a plain Lloyd step is taken whenever Newton's would not keep the centroids ordered).

Densities (``density`` name, ``params``):

* ``"gaussian"``, ``(sigma,)`` — ``N(0, sigma²)``. Partial moments from ``Φ``/``φ``:
  ``∫x f = −σφ(x/σ)``, ``∫x² f = σ²(Φ(z) − zφ(z))``. Reproduces Max's (1960) table for ``N(0,1)``:
  ``b=1 ±0.7979``, ``b=2 ±0.4528, ±1.510``; MSE 0.3634 / 0.1175 / 0.03454 / 0.009497 for b = 1..4.
* ``"sphere"``, ``(dim,)`` — one coordinate of a uniformly random unit vector in ``R^dim``:
  ``f(x) = (1 − x²)^((dim−3)/2) / B(1/2, (dim−1)/2)`` on ``[−1, 1]`` (``x²`` is
  ``Beta(1/2, (dim−1)/2)``); tends to ``N(0, 1/dim)`` as ``dim`` grows. Partial moments from the
  regularized incomplete beta ``I``: ``∫x f = −(1−x²)^((dim−1)/2) / ((dim−1) B)``,
  ``∫_0^x t² f = I_{x²}(3/2, (dim−1)/2) / (2 dim)``. This is the exact density TurboQuant
  (arXiv:2504.19874, §3.1) solves its codebook for.

Results are cached with :func:`functools.lru_cache` keyed on ``(density, bits, params)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np
import torch
from scipy import linalg, special

from kvqbench import steps
from kvqbench.numerics.kmeans import count_below

__all__ = [
    "Codebook",
    "DENSITIES",
    "lloyd_max",
    "gaussian_codebook",
    "sphere_codebook",
    "nearest_centroid",
    "reconstruct",
]

DENSITIES: tuple[str, ...] = ("gaussian", "sphere")
MAX_BITS = 12
_TOL = 1e-14
_MAX_ITER = 10_000


@dataclass(frozen=True)
class Codebook:
    """A scalar quantizer for one density.

    Attributes:
        centroids: ``2**bits`` reconstruction levels, ascending (float, density units).
        thresholds: ``2**bits − 1`` decision boundaries, ascending (midpoints of the centroids).
        mse: expected squared error per scalar under the density (density units²).
        density, bits, params: what was solved.
        iterations: Lloyd iterations used (diagnostic).
    """

    centroids: tuple[float, ...]
    thresholds: tuple[float, ...]
    mse: float
    density: str
    bits: int
    params: tuple[float, ...]
    iterations: int

    def tensors(
        self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(centroids, thresholds)`` as tensors of ``dtype`` on ``device`` (shapes ``(L,)``, ``(L−1,)``)."""
        c = torch.tensor(self.centroids, dtype=torch.float64).to(device=device, dtype=dtype)
        t = torch.tensor(self.thresholds, dtype=torch.float64).to(device=device, dtype=dtype)
        return c, t


# --- partial moments on the negative half-line --------------------------------------------------
# Both densities are symmetric, so the quantizer is solved on (lo, 0] (half of the 2**b cells, the
# middle threshold is exactly 0) and mirrored. F_k(x) is an antiderivative of x^k f(x) for x <= 0,
# written with lower-tail functions only (ndtr(z) for z <= 0, the complementary incomplete beta) so
# that tail cells keep full relative precision.
Moments = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
Pdf = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class _Density:
    moments: Moments  # x <= 0 -> (F0, F1, F2)
    pdf: Pdf
    lo: float  # lower end of the support
    init: Pdf  # p in (0, 1/2) -> high-rate (companding) starting centroid


def _gaussian(sigma: float) -> _Density:
    def pdf(x: np.ndarray) -> np.ndarray:
        return np.exp(-0.5 * (x / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))

    def moments(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        z = np.maximum(x / sigma, -1e300)
        finite = np.isfinite(z) & (z > -1e150)
        zf = np.where(finite, z, 0.0)
        phi = np.where(finite, np.exp(-0.5 * zf * zf) / math.sqrt(2 * math.pi), 0.0)
        f0 = special.ndtr(z)
        return f0, -sigma * phi, sigma**2 * (f0 - zf * phi)

    def init(p: np.ndarray) -> np.ndarray:
        # point density ∝ f^(1/3): quantiles of N(0, 3σ²)
        return math.sqrt(3.0) * sigma * special.ndtri(p)

    return _Density(moments, pdf, -math.inf, init)


def _sphere(dim: int) -> _Density:
    a = (dim - 1) / 2.0
    log_b = special.betaln(0.5, a)

    def pdf(x: np.ndarray) -> np.ndarray:
        u = np.minimum(x * x, 1.0)
        with np.errstate(divide="ignore"):
            return np.where(u < 1.0, np.exp((a - 1.0) * np.log1p(-u) - log_b), 0.0)

    def moments(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        u = np.minimum(x * x, 1.0)
        f0 = 0.5 * special.betaincc(0.5, a, u)
        with np.errstate(divide="ignore"):
            f1 = np.where(u < 1.0, -np.exp(a * np.log1p(-u) - log_b) / (dim - 1), 0.0)
        f2 = special.betaincc(1.5, a, u) / (2.0 * dim)
        return f0, f1, f2

    def init(p: np.ndarray) -> np.ndarray:
        # point density ∝ f^(1/3) ∝ (1 − x²)^((dim−3)/6), whose x² is Beta(1/2, (dim+3)/6)
        return -np.sqrt(special.betaincinv(0.5, (dim + 3) / 6.0, np.abs(2.0 * p - 1.0)))

    return _Density(moments, pdf, -1.0, init)


def _density(density: str, params: tuple[float, ...]) -> _Density:
    if density == "gaussian":
        if len(params) != 1 or not float(params[0]) > 0 or not math.isfinite(float(params[0])):
            raise ValueError(f"gaussian density needs params=(sigma,) with sigma > 0, got {params!r}")
        return _gaussian(float(params[0]))
    if density == "sphere":
        if len(params) != 1 or int(params[0]) != params[0] or int(params[0]) < 2:
            raise ValueError(f"sphere density needs params=(dim,) with an int dim >= 2, got {params!r}")
        return _sphere(int(params[0]))
    raise ValueError(f"unknown density {density!r}; choose one of {DENSITIES}")


@lru_cache(maxsize=256)
def lloyd_max(density: str, bits: int, params: tuple[float, ...]) -> Codebook:
    """Solve the ``2**bits``-level Lloyd–Max quantizer of ``density`` (see module doc).

    Args:
        density: ``"gaussian"`` (params ``(sigma,)``) or ``"sphere"`` (params ``(dim,)``).
        bits: 1..12.
        params: density parameters (a hashable tuple; the cache key).

    Returns:
        A :class:`Codebook`, symmetric about 0 (the middle threshold is exactly 0).

    Raises:
        ValueError: unknown density, bad params, or ``bits`` outside 1..12.
    """
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an int in 1..{MAX_BITS}, got {bits!r}")
    dens = _density(density, tuple(params))
    half = 1 << (bits - 1)

    def edges_of(c: np.ndarray) -> np.ndarray:
        return np.concatenate([[dens.lo], 0.5 * (c[1:] + c[:-1]), [0.0]])

    c = dens.init((np.arange(half) + 0.5) / (2 * half))
    best, best_res, since_best, it = c, math.inf, 0, 0
    for it in range(1, _MAX_ITER + 1):  # noqa: B007 (reported after the loop)
        edges = edges_of(c)
        m0, tc = _cell_means(dens.moments, edges)
        res = float(np.max(np.abs(tc - c)))
        if res < best_res:
            best, best_res, since_best = tc, res, 0
        else:
            since_best += 1
        # converged, or at the float64 noise floor (no progress for a while)
        if res <= _TOL * float(np.max(np.abs(c))) or since_best >= 8:
            break
        new = _newton_step(c, edges[1:-1], tc, m0, dens.pdf(edges[1:-1]))
        c = tc if new is None else new  # a plain Lloyd step when Newton's is unusable
    c_half = best
    t_half = 0.5 * (c_half[1:] + c_half[:-1])
    f0, f1, f2 = dens.moments(edges_of(c_half))
    m0, m1, m2 = np.diff(f0), np.diff(f1), np.diff(f2)
    mse = float(2.0 * np.sum(m2 - 2 * c_half * m1 + c_half * c_half * m0))
    centroids = np.concatenate([c_half, -c_half[::-1]])
    thresholds = np.concatenate([t_half, [0.0], -t_half[::-1]])
    return Codebook(
        centroids=tuple(float(v) for v in centroids),
        thresholds=tuple(float(v) for v in thresholds),
        mse=mse,
        density=density,
        bits=bits,
        params=tuple(params),
        iterations=it,
    )


def _cell_means(moments: Moments, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(M0, M1/M0)`` per cell (cell masses and conditional means)."""
    f0, f1, _ = moments(edges)
    m0 = np.diff(f0)
    m1 = np.diff(f1)
    mid = 0.5 * (np.maximum(edges[1:], -1e300) + np.maximum(edges[:-1], -1e300))
    # an (astronomically) empty cell keeps its midpoint instead of dividing 0 by 0
    return m0, np.where(m0 > 0, m1 / np.where(m0 > 0, m0, 1.0), mid)


def _newton_step(
    c: np.ndarray, t: np.ndarray, tc: np.ndarray, m0: np.ndarray, p: np.ndarray
) -> np.ndarray | None:
    """One Newton step on ``T(c) − c = 0`` for the half-line cells, ``T`` the Lloyd map (conditional
    means of the midpoint cells). ``T``'s Jacobian is tridiagonal: ``∂T_i/∂t_upper = f(t)(t − T_i)/M0_i``,
    ``∂T_i/∂t_lower = f(t)(T_i − t)/M0_i``; an interior threshold moves by half of either neighbour
    and the last upper edge is pinned at 0 by symmetry. Returns ``None`` when the step would break the
    ordering (or leave the half-line) or the system is singular."""
    n = c.size
    if n == 1:
        return tc
    safe = np.where(m0 > 0, m0, np.inf)
    up = np.zeros(n)
    low = np.zeros(n)
    up[:-1] = p * (t - tc[:-1]) / safe[:-1]
    low[1:] = p * (tc[1:] - t) / safe[1:]
    ab = np.zeros((3, n))
    ab[0, 1:] = -0.5 * up[:-1]  # superdiagonal of (I − J)
    ab[1, :] = 1.0 - 0.5 * (up + low)
    ab[2, :-1] = -0.5 * low[1:]  # subdiagonal
    try:
        step = linalg.solve_banded((1, 1), ab, tc - c)
    except (linalg.LinAlgError, ValueError):
        return None
    new = c + step
    if not np.all(np.isfinite(new)) or np.any(np.diff(new) <= 0) or new[-1] >= 0:
        return None
    return new


def gaussian_codebook(bits: int, sigma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd–Max codebook of ``N(0, sigma²)`` at ``bits`` bits (Max 1960).

    Returns:
        ``(centroids, thresholds)``: float64 CPU tensors of shapes ``(2**bits,)`` and
        ``(2**bits − 1,)``, ascending. Cached; the returned tensors are fresh copies.

    Raises:
        ValueError: ``bits`` outside 1..12 or ``sigma <= 0``.
    """
    return lloyd_max("gaussian", bits, (float(sigma),)).tensors(dtype=torch.float64)


def sphere_codebook(bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd–Max codebook of one coordinate of a uniform random unit vector in ``R^dim`` (the scaled
    Beta density of the module doc). Same return layout as :func:`gaussian_codebook`.

    Raises:
        ValueError: ``bits`` outside 1..12 or ``dim < 2``.
    """
    return lloyd_max("sphere", bits, (int(dim),)).tensors(dtype=torch.float64)


@steps.reference("lloyd_max.nearest_centroid")
def nearest_centroid(x: torch.Tensor, thresholds: torch.Tensor, *, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Index of the nearest centroid for every entry of ``x`` given the midpoint ``thresholds``
    (``(L−1,)``, ascending): ``#{t : t < x}``, a ``dtype`` (default int64) tensor of ``x``'s shape in
    ``[0, L−1]``. A tie exactly on a threshold goes to the lower cell.

    Counted by :func:`kvqbench.numerics.kmeans.count_below`: one comparison per threshold up to 15
    thresholds (4-bit codebooks; cheaper than the binary search of :func:`torch.bucketize`, same result),
    a binary search beyond."""
    return count_below(x, thresholds, dtype=dtype)


@steps.reference("lloyd_max.reconstruct")
def reconstruct(centroids: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``centroids[idx]``: the centroid (``(L,)``, any float dtype) of every code of ``idx`` (``uint8``, any
    shape); a tensor of ``idx``'s shape in ``centroids``' dtype."""
    return centroids.index_select(0, idx.reshape(-1).to(torch.int32)).view(idx.shape)
