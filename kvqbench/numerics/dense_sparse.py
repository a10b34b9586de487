"""Dense-and-sparse quantization of vectors: a few outliers per tail kept exactly, the rest normalized to
``[−1, 1]`` and snapped to the nearest level of a codebook (the per-vector scheme of arXiv:2401.18079 §3.4).

Per vector ``x`` of ``n`` values with ``k`` outliers per tail::

    outliers = the k largest and the k smallest entries (disjoint, even with ties)
    lo, hi = min and max of the other (dense) entries
    mid = (hi + lo) / 2,  half = (hi − lo) / 2
    y = (x − mid) / half           (0 where half = 0: a constant dense part)
    code = index of the nearest level of the codebook (a value on a midpoint goes to the lower level)

Invariant (tested): every entry is an outlier or lies in ``[lo, hi]``, so ``|y| ≤ 1`` on the dense part,
and decoding ``level[code]·half + mid`` with the outliers written back reproduces the outliers exactly.

:func:`calibration_samples` gives the data of a codebook's k-means (the normalized dense values).
:func:`quantize` is the reference step ``dense_sparse.quantize`` (:mod:`kvqbench.kernels`; a fast version
lives in :mod:`kvqbench.kernels.dense_sparse`).
"""

from __future__ import annotations

import math

import torch

from kvqbench import steps
from kvqbench.numerics.kmeans import SortedSamples, assign_nearest, sorted_samples

__all__ = ["outlier_count_per_tail", "split", "normalize", "dense_mask", "quantize", "calibration_samples"]


def outlier_count_per_tail(n: int, outlier_frac: float) -> int:
    """Outliers kept per tail of a vector of ``n`` entries: ``round_half_up(outlier_frac/2 · n)``, capped so
    at least one dense entry remains (``2·n_tail <= n − 1``)."""
    return 0 if n <= 0 else max(0, min(int(math.floor(outlier_frac / 2 * n + 0.5)), (n - 1) // 2))


def split(vec: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outliers of every vector of ``vec`` ``[..., n]`` (fp32), ``k ≥ 0`` per tail (``2k < n``).

    Returns ``(idx [..., 2k] int64 ascending, mid [..., 1], half [..., 1])``: the outliers' positions and
    the dense part's midpoint and half-range."""
    if k:
        top = torch.topk(vec, k, dim=-1, largest=True, sorted=False).indices
        rest = vec.scatter(-1, top, float("inf"))  # the top tail masked: the bottom tail is disjoint from it
        bottom = torch.topk(rest, k, dim=-1, largest=False, sorted=False).indices
        idx, _ = torch.sort(torch.cat([bottom, top], -1), -1)
        lo = rest.scatter_(-1, bottom, float("inf")).amin(-1, keepdim=True)
        hi = rest.scatter_(-1, idx, float("-inf")).amax(-1, keepdim=True)
    else:
        idx = torch.zeros(*vec.shape[:-1], 0, dtype=torch.int64, device=vec.device)
        lo, hi = vec.amin(-1, keepdim=True), vec.amax(-1, keepdim=True)
    return idx, (hi + lo) / 2, (hi - lo) / 2


def normalize(vec: torch.Tensor, mid: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """``(vec − mid) / half`` clamped to ``[−1, 1]``, 0 where ``half = 0`` (shapes broadcast as :func:`split`
    returns them). The clamp makes a vector's dense extremes exactly ±1 (unclamped, ``(hi − mid)/half`` may
    round to 1 ± 1 ulp, and k-means would spend levels on values one rounding apart); an outlier's value,
    which the decoder writes back exactly, clamps to ±1 too."""
    live = half > 0
    y = ((vec - mid) / torch.where(live, half, torch.ones_like(half))).clamp_(-1.0, 1.0)
    return y.masked_fill_(~live.expand_as(y), 0.0)


def dense_mask(vec: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``vec``'s shape, bool: True at the dense (non-outlier) positions, ``idx`` from :func:`split`."""
    return torch.ones_like(vec, dtype=torch.bool).scatter_(-1, idx, False)


@steps.reference("dense_sparse.quantize")
def quantize(vec: torch.Tensor, k: int, codebook: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense-and-sparse quantization of the vectors ``vec`` ``[B, N, n]`` (fp32) with ``k`` outliers per tail,
    the codes of layer ``b`` from the ascending levels ``codebook[b]`` (``[B, L]``, ``L ≤ 256``).

    Returns ``(codes [B, N, n] uint8, idx [B, N, 2k] int64, mid [B, N, 1], half [B, N, 1], values [B, N, 2k])``
    (``values``: the outliers, fp32). The codes at outlier positions are those of their normalized value
    (unused by a decoder, which writes the outliers back)."""
    idx, mid, half = split(vec, k)
    codes = assign_nearest(normalize(vec, mid, half).flatten(1), codebook, dtype=torch.uint8)
    return codes.view(vec.shape), idx, mid, half, torch.gather(vec, -1, idx)


def calibration_samples(vec: torch.Tensor, k: int, weights: torch.Tensor | None = None, *,
                        max_samples: int | None = None, generator: torch.Generator | None = None) -> SortedSamples:
    """The data of one 1-D k-means per layer (:func:`kvqbench.numerics.kmeans.sorted_samples`): the normalized
    dense values ``y`` of the vectors ``vec`` ``[B, N, n]`` (fp32; ``k`` outliers per tail left out), weighted by
    ``weights`` (``vec``'s shape, ``≥ 0``; ``None`` = unweighted), subsampled to ``max_samples`` per layer with
    ``generator``. A vector with zero half-range (zero or constant) decodes exactly whatever the codebook, so it
    gets weight 0."""
    idx, mid, half = split(vec, k)
    y, dense = normalize(vec, mid, half), dense_mask(vec, idx)
    live = (half > 0).expand_as(y)
    if not bool(live.all()):
        weights = live.to(y.dtype) if weights is None else weights * live
    n_layers = vec.shape[0]  # every vector has the same dense count: row-major selection keeps the layers apart
    w_dense = None if weights is None else weights.masked_select(dense).view(n_layers, -1)
    y_dense = y.masked_select(dense).view(n_layers, -1)
    del y, dense, weights, live  # only the selected values go on to the (fp64) sort
    return sorted_samples(y_dense, weights=w_dense, max_samples=max_samples, generator=generator)
