"""Seeded, deterministic 1-D (weighted) k-means (Lloyd iterations) for scalar codebooks.

Used by KVQuant's non-uniform codebooks (arXiv:2401.18079, §3.4: sensitivity-weighted k-means on
normalized activations, weights = Fisher information ≈ squared gradients).

Invariants (tested):
  * the returned centroids are sorted ascending and each lies in ``[min x, max x]``;
  * every Lloyd step does not increase the weighted squared error ``Σ w (x − c[assign(x)])²``;
  * on data drawn from well separated clusters the centroids converge to the cluster means.

In 1-D the nearest-centroid cells are intervals between consecutive centroid midpoints, so once the
data are sorted every cluster is a contiguous run: cluster sums are differences of prefix sums and a
Lloyd step costs ``O(k log N)``. Accumulation is fp64 (fp32 on devices without fp64) and uses no
atomics, so results are deterministic on every device. Randomness (only the optional subsample of
large inputs) comes from an explicit ``torch.Generator``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["kmeans_1d", "SortedSamples", "sorted_samples", "kmeans_sorted", "assign_nearest", "count_below", "weighted_quantile_init", "weighted_sse",
           "distinct_levels"]


def _acc_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


#: at most this many thresholds are counted by comparisons (one pass each) instead of a binary search:
#: a comparison pass is several times cheaper than ``searchsorted``'s per-element search, which wins only
#: for large codebooks (docs/PERFORMANCE.md)
COMPARE_MAX_SCALAR = 15
#: the same for per-row threshold tensors (a broadcast comparison costs a little more than a scalar one)
COMPARE_MAX_ROWS = 7


def count_below(x: torch.Tensor, thresholds: torch.Tensor, *, dtype: torch.dtype = torch.int64,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``#{j : thresholds[…, j] < x}`` for every element of ``x`` — the cell index for ascending thresholds,
    a value exactly on a threshold counting to the lower cell (``searchsorted(…, right=False)``).

    Small codebooks are counted with one comparison pass per threshold (Python scalars for 1-D thresholds,
    a broadcast column per threshold for per-row ones), large ones with :func:`torch.searchsorted`; both
    give the same integers for every non-NaN ``x`` (tested against each other). In ``uint8`` the first
    comparison is written straight into the result and the others reuse one mask buffer.

    Args:
        x: ``[..., N]`` values.
        thresholds: ``[m]`` (shared) or ``[..., m]`` with ``x``'s leading dims (one row per row of ``x``),
            ascending; cast to ``x``'s dtype.
        dtype: integer dtype of the result (``torch.uint8`` saves the int64 widening when ``m < 256``).
        out: optional ``dtype`` tensor of ``x``'s shape that receives the result (returned).
    Returns:
        ``dtype`` tensor of ``x``'s shape with values in ``[0, m]``.
    """
    t = thresholds.to(device=x.device, dtype=x.dtype)
    m = t.shape[-1]
    if t.dim() > 1 and t.numel() == m:  # one row broadcast over every row of x: the shared thresholds
        t = t.reshape(m)
    if t.dim() == 1 and m <= COMPARE_MAX_SCALAR:
        cols: list = t.tolist()
    elif t.dim() > 1 and m <= COMPARE_MAX_ROWS:
        cols = [t[..., j : j + 1] for j in range(m)]
    else:
        cols = []
    if cols and dtype == torch.uint8:
        idx = torch.empty(x.shape, dtype=dtype, device=x.device) if out is None else out
        torch.gt(x, cols[0], out=idx.view(torch.bool))  # 0/1 bytes
        mask = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        for c in cols[1:]:
            idx.add_(torch.gt(x, c, out=mask))
        return idx
    if cols:
        idx = torch.zeros(x.shape, dtype=dtype, device=x.device)
        for c in cols:
            idx += x > c
    elif t.dim() == 1:
        idx = torch.bucketize(x, t, right=False).to(dtype)
    else:
        t = t.expand(*x.shape[:-1], m).contiguous()
        idx = torch.searchsorted(t, x.contiguous(), right=False).to(dtype)
    return idx if out is None else out.copy_(idx)


def assign_nearest(x: torch.Tensor, centroids: torch.Tensor, *, dtype: torch.dtype = torch.int64,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the nearest centroid for every element of ``x``.

    Args:
        x: ``[..., N]`` values.
        centroids: ``[..., k]`` sorted ascending (same leading dims as ``x``, or 1-D ``[k]``).
        dtype: integer dtype of the result (default int64; ``torch.uint8`` for ``k <= 256``).
        out: optional ``dtype`` tensor of ``x``'s shape that receives the result (returned).
    Returns:
        ``[..., N]`` in ``[0, k)``; a value exactly on a midpoint goes to the lower centroid
        (:func:`count_below` of the midpoints).
    """
    c = centroids.to(x.dtype)
    mids = (c[..., 1:] + c[..., :-1]) / 2
    return count_below(x, mids, dtype=dtype, out=out)


def weighted_sse(x: torch.Tensor, centroids: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``Σ w (x − nearest centroid)²`` over the last dim (``w = 1`` when ``weights`` is None)."""
    idx = assign_nearest(x, centroids)
    c = centroids.to(x.dtype)
    rec = torch.gather(c.expand(*x.shape[:-1], c.shape[-1]), -1, idx)
    err = (x - rec) ** 2
    if weights is not None:
        err = err * weights
    return err.sum(-1)


def weighted_quantile_init(xs: torch.Tensor, cw: torch.Tensor, k: int) -> torch.Tensor:
    """Centroids at the weighted quantiles ``(j + 0.5)/k`` of sorted data.

    Args:
        xs: ``[L, N]`` sorted ascending.
        cw: ``[L, N]`` cumulative weights of ``xs`` (last column = total weight, > 0).
        k: number of centroids.
    Returns:
        ``[L, k]`` (non-decreasing).
    """
    total = cw[:, -1:]
    targets = (torch.arange(k, device=xs.device, dtype=cw.dtype) + 0.5) / k * total
    pos = torch.searchsorted(cw.contiguous(), targets.contiguous(), right=False).clamp_max(xs.shape[1] - 1)
    return torch.gather(xs, 1, pos)


@dataclass(frozen=True)
class SortedSamples:
    """The data of a 1-D k-means problem in the form Lloyd's iterations read: every row sorted, with the
    prefix sums of its weights and weighted values. It does not depend on ``k``, so one instance serves
    the fits of every codebook size on the same data (:func:`sorted_samples`, :func:`kmeans_sorted`).

    Attributes:
        xs: ``[L, N]`` sorted values (fp64; fp32 on devices without fp64).
        ws: ``[L, N]`` their weights (all 1 when unweighted or for a row whose weights sum to 0).
        cw: ``[L, N+1]`` prefix sums of ``ws`` (``cw[:, 0] = 0``).
        cwx: ``[L, N+1]`` prefix sums of ``ws · xs``.
        squeeze: the input was 1-D (centroids are returned as ``[k]``).
    """

    xs: torch.Tensor
    ws: torch.Tensor
    cw: torch.Tensor
    cwx: torch.Tensor
    squeeze: bool = False


@torch.no_grad()
def sorted_samples(
    x: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    max_samples: int | None = None,
    generator: torch.Generator | None = None,
) -> SortedSamples:
    """Validate, subsample and sort the rows of ``x`` for :func:`kmeans_sorted` (the part of
    :func:`kmeans_1d` that does not depend on ``k``; arguments as there).

    Raises:
        ValueError: bad shapes, negative or non-finite weights, or empty ``x``.
    """
    squeeze = x.dim() == 1
    if x.dim() not in (1, 2):
        raise ValueError(f"x must be [N] or [L, N], got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError("x is empty")
    acc = _acc_dtype(x.device)
    xx = x.reshape(1, -1) if squeeze else x
    xx = xx.to(acc)
    if weights is not None:
        if weights.shape != x.shape:
            raise ValueError(f"weights shape {tuple(weights.shape)} != x shape {tuple(x.shape)}")
        ww = (weights.reshape(1, -1) if squeeze else weights).to(acc)
        if not bool(torch.isfinite(ww).all()) or bool((ww < 0).any()):
            raise ValueError("weights must be finite and >= 0")
    else:
        ww = torch.ones_like(xx)

    n = xx.shape[1]
    if max_samples is not None and n > max_samples:
        perm = torch.randint(0, n, (max_samples,), generator=generator, device="cpu").to(xx.device)
        xx, ww = xx[:, perm], ww[:, perm]

    zero_rows = ww.sum(1, keepdim=True) <= 0
    if bool(zero_rows.any()):  # rows with zero total weight -> unweighted
        ww = torch.where(zero_rows, torch.ones_like(ww), ww)

    # one [L, N] fp64 array at a time beyond the four returned (the prefix sums are written in place)
    xs, order = torch.sort(xx, dim=1)
    del xx
    ws = torch.gather(ww, 1, order)
    del ww, order
    cw = xs.new_zeros(xs.shape[0], xs.shape[1] + 1)  # [L, N+1]: a leading 0, then the prefix sums
    torch.cumsum(ws, 1, out=cw[:, 1:])
    cwx = xs.new_zeros(cw.shape)
    torch.mul(ws, xs, out=cwx[:, 1:]).cumsum_(1)
    return SortedSamples(xs, ws, cw, cwx, squeeze)


@torch.no_grad()
def kmeans_sorted(s: SortedSamples, k: int, *, n_iter: int = 100, tol: float = 1e-7) -> torch.Tensor:
    """:func:`kmeans_1d` on data already prepared by :func:`sorted_samples` (``k``, ``n_iter``, ``tol``
    as there): the same centroids, bit for bit, as ``kmeans_1d`` with the same data and arguments.
    ``s`` is not modified.

    Raises:
        ValueError: bad ``k``.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    c = weighted_quantile_init(s.xs, s.cw[:, 1:], k)
    c = _lloyd(s.xs, s.cw, s.cwx, c, n_iter, tol)
    if k > 1:
        c = _repair_empty(s.xs, s.ws, s.cw, s.cwx, c, n_iter, tol)
    c = c.to(torch.float32)
    return c[0] if s.squeeze else c


@torch.no_grad()
def kmeans_1d(
    x: torch.Tensor,
    k: int,
    *,
    weights: torch.Tensor | None = None,
    n_iter: int = 100,
    tol: float = 1e-7,
    max_samples: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Weighted 1-D k-means on each row of ``x``.

    Initialization: weighted quantiles (deterministic). Lloyd iterations until the largest centroid
    move is below ``tol × (max − min)`` or ``n_iter`` steps. An empty cluster keeps its centroid during
    the iterations; if clusters are still empty at the end (duplicate centroids from a tied
    initialization) and the row holds at least ``k`` distinct values, each empty centroid is re-seeded at
    the point of largest error and Lloyd continues, so the centroids are distinct and every cluster holds
    a point. A row with fewer than ``k`` distinct values keeps repeated centroids.

    The two halves are public: :func:`sorted_samples` (sort and prefix sums, independent of ``k``) and
    :func:`kmeans_sorted` (the iterations), so that fits of several ``k`` on the same data sort it once.

    Args:
        x: ``[N]`` or ``[L, N]`` values (one independent problem per row); computed in fp32/fp64.
        k: number of centroids (>= 1).
        weights: same shape as ``x``, ``>= 0`` (e.g. Fisher information); ``None`` = unweighted. A row
            whose weights sum to 0 falls back to unweighted.
        n_iter: maximum Lloyd iterations.
        tol: relative convergence tolerance.
        max_samples: if set and ``N`` exceeds it, each row is subsampled (uniformly with replacement,
            the same positions for every row) to this many points using ``generator``.
        generator: the source of the subsample (required for reproducibility when subsampling;
            a ``torch.Generator`` seeded by the caller). Unused otherwise.

    Returns:
        Centroids ``[k]`` or ``[L, k]`` (matching ``x``'s rank), sorted ascending, fp32.

    Raises:
        ValueError: bad ``k``/shapes, negative or non-finite weights, or empty ``x``.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    s = sorted_samples(x, weights=weights, max_samples=max_samples, generator=generator)
    return kmeans_sorted(s, k, n_iter=n_iter, tol=tol)


def _cluster_weights(xs: torch.Tensor, cw: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pos [L, k+1], w_sum [L, k])``: cluster ``j`` holds the sorted positions ``[pos[j], pos[j+1])``."""
    n = xs.shape[1]
    mids = (c[:, 1:] + c[:, :-1]) / 2  # [L, k-1]
    cut = torch.searchsorted(xs.contiguous(), mids.contiguous(), right=True)
    first = torch.zeros(cut.shape[0], 1, dtype=cut.dtype, device=cut.device)
    pos = torch.cat([first, cut, first + n], 1)
    return pos, torch.gather(cw, 1, pos[:, 1:]) - torch.gather(cw, 1, pos[:, :-1])


def _lloyd(xs: torch.Tensor, cw: torch.Tensor, cwx: torch.Tensor, c: torch.Tensor, n_iter: int,
           tol: float) -> torch.Tensor:
    """Lloyd iterations on sorted rows (prefix sums ``cw``/``cwx``) from centroids ``c``."""
    span = (xs[:, -1] - xs[:, 0]).clamp_min(torch.finfo(xs.dtype).tiny)
    for _ in range(n_iter):
        pos, w_sum = _cluster_weights(xs, cw, c)
        wx_sum = torch.gather(cwx, 1, pos[:, 1:]) - torch.gather(cwx, 1, pos[:, :-1])
        new = torch.where(w_sum > 0, wx_sum / torch.where(w_sum > 0, w_sum, torch.ones_like(w_sum)), c)
        new = torch.minimum(torch.maximum(new, xs[:, :1]), xs[:, -1:])  # guard prefix-sum rounding
        new, _ = torch.sort(new, dim=1)
        moved = (new - c).abs().amax(1) / span
        c = new
        if bool((moved <= tol).all()):
            break
    return c


def _repair_empty(xs: torch.Tensor, ws: torch.Tensor, cw: torch.Tensor, cwx: torch.Tensor, c: torch.Tensor,
                  n_iter: int, tol: float) -> torch.Tensor:
    """Re-seed empty clusters (duplicate centroids, or centroids no point is nearest to) of rows that hold
    at least ``k`` distinct values of positive weight: each empty centroid moves to the point of largest
    weighted squared error that is not already a centroid, then Lloyd continues; repeated until no cluster
    is empty (at most ``k`` rounds). Rows without an empty cluster are returned unchanged, bit for bit;
    rows with fewer than ``k`` distinct values keep their (necessarily repeated) centroids."""
    k = c.shape[1]
    _, w_sum = _cluster_weights(xs, cw, c)
    bad = (w_sum <= 0).any(1)
    if not bool(bad.any()):
        return c
    c = c.clone()
    for r in torch.nonzero(bad).flatten().tolist():
        x_r, w_r = xs[r : r + 1], ws[r : r + 1]
        if int(torch.unique(x_r[w_r > 0]).numel()) < k:
            continue
        cw_r, cwx_r, c_r = cw[r : r + 1], cwx[r : r + 1], c[r : r + 1]
        for _ in range(k):
            pos, ws_r = _cluster_weights(x_r, cw_r, c_r)
            empty = ws_r[0] <= 0
            n_empty = int(empty.sum())
            if n_empty == 0:
                break
            owner = torch.searchsorted(pos[0, 1:], torch.arange(x_r.shape[1], device=x_r.device), right=True)
            err = w_r[0] * (x_r[0] - c_r[0, owner.clamp_max(k - 1)]) ** 2
            err = torch.where(torch.isin(x_r[0], c_r[0]) | (w_r[0] <= 0), torch.full_like(err, -1.0), err)
            # the largest errors at distinct values (ties of equal values count once)
            order = torch.argsort(err, descending=True, stable=True)
            picks: list[float] = []
            for i in order.tolist():
                if float(err[i]) < 0 or len(picks) == n_empty:
                    break
                v = float(x_r[0, i])
                if v not in picks:
                    picks.append(v)
            if not picks:
                break
            keep = c_r[0][~empty]
            # an empty slot without a pick keeps its old value
            extra = c_r[0][empty][len(picks):]
            new = torch.cat([keep, torch.tensor(picks, dtype=c_r.dtype, device=c_r.device), extra])
            c_r, _ = torch.sort(new.unsqueeze(0), dim=1)
            c_r = _lloyd(x_r, cw_r, cwx_r, c_r, n_iter, tol)
        c[r : r + 1] = c_r
    return c


def distinct_levels(cb: torch.Tensor) -> torch.Tensor:
    """Make every row of a sorted codebook ``[L, k]`` on ``[−1, 1]`` strictly increasing.

    k-means returns repeated centroids only when a row's data hold fewer than ``k`` distinct values (e.g.
    every vector zero or constant); such a row keeps its distinct levels and gets the missing ones by
    repeatedly halving the widest gap of ``[−1, 1]`` between them (deterministic, no wasted duplicate).
    Rows that are already strictly increasing are returned unchanged."""
    dup = (cb[:, 1:] <= cb[:, :-1]).any(1)
    if not bool(dup.any()):
        return cb
    cb = cb.clone()
    k = cb.shape[1]
    for r in torch.nonzero(dup).flatten().tolist():
        levels = sorted(set(float(v) for v in cb[r].tolist()))
        while len(levels) < k:
            edges = [-1.0] + levels + [1.0] if levels else [-1.0, 1.0]
            gaps = [(edges[i + 1] - edges[i], i) for i in range(len(edges) - 1)]
            width, i = max(gaps, key=lambda g: (g[0], -g[1]))
            if width <= 0:
                break
            levels = sorted(levels + [edges[i] + width / 2])
        cb[r] = torch.tensor(levels[:k], dtype=cb.dtype, device=cb.device)
    return cb
