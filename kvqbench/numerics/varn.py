"""VarN — alternating row/column variance normalization of a tile (KVarN, arXiv:2606.03458, §3, step 2).

Invariant (tested): the returned scales never leave the tile more imbalanced than it was —
``imbalance(tile / s_col / s_row) <= imbalance(tile)`` — because the identity state is the first
candidate of the best-so-far rule.

Algorithm, per tile ``X`` of shape ``[R, C]`` (rows = the rounding axis), all in fp32, log domain::

    log_s_col = 0 [1, C];  log_s_row = 0 [R, 1]
    best = identity state, best_imbalance = imbalance(X)
    repeat n_iter times:
        B = X / exp(log_s_col) / exp(log_s_row)
        log_s_col = clip(log_s_col + log(clamp(std_unbiased(B, over rows), 1e-3, 1e3)), -0.3, 10)
        B = X / exp(log_s_col) / exp(log_s_row)
        log_s_row = clip(log_s_row + log(clamp(std_unbiased(B, over cols), 1e-3, 1e3)), -0.3, 10)
        B = X / exp(log_s_col) / exp(log_s_row)
        imb = max/min(column stds of B) + max/min(row stds of B)     (min floored at 1e-8)
        if imb <= best_imbalance: best = (log_s_col, log_s_row)       (ties go to the later iterate)

No mean is subtracted. A standard deviation over a single sample (a 1-token partial tile) is
undefined; it is taken as 1 (no rescaling along that axis) instead of NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["VarNResult", "varn", "imbalance", "STD_CLAMP", "LOG_SCALE_CLIP", "MIN_FLOOR", "DEFAULT_ITERS"]

STD_CLAMP = (1e-3, 1e3)
LOG_SCALE_CLIP = (-0.3, 10.0)
MIN_FLOOR = 1e-8
DEFAULT_ITERS = 16


class VarNResult(NamedTuple):
    """Scales of the best iterate, batched like the input tiles ``[..., R, C]``.

    Attributes:
        s_row: ``[..., R, 1]`` row scales (``exp(log_s_row)``), fp32.
        s_col: ``[..., 1, C]`` column scales, fp32.
        imbalance: ``[...]`` imbalance of ``tile / s_col / s_row``.
        imbalance_init: ``[...]`` imbalance of the input tile (the identity state).
        best_iter: ``[...]`` int64, the iteration the scales come from (0 = identity, 1..n_iter).
    """

    s_row: torch.Tensor
    s_col: torch.Tensor
    imbalance: torch.Tensor
    imbalance_init: torch.Tensor
    best_iter: torch.Tensor


def _std(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased std over ``dim`` (keepdim); 1 where the axis has a single sample."""
    if x.shape[dim] < 2:
        return torch.ones_like(x.narrow(dim, 0, 1))
    return x.std(dim=dim, unbiased=True, keepdim=True)


def imbalance(tile: torch.Tensor) -> torch.Tensor:
    """``max/min`` of the column stds plus ``max/min`` of the row stds of ``tile`` ``[..., R, C]``
    (unbiased stds, each min floored at 1e-8). Returns ``[...]`` in the tile's dtype."""
    col = _std(tile, -2).squeeze(-2)  # [..., C]
    row = _std(tile, -1).squeeze(-1)  # [..., R]
    return col.amax(-1) / col.amin(-1).clamp_min(MIN_FLOOR) + row.amax(-1) / row.amin(-1).clamp_min(MIN_FLOOR)


def _acc_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _weighted_std(s1: torch.Tensor, s2: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """Unbiased std of ``scale · v`` from ``s1 = Σ v``, ``s2 = Σ v²`` over ``n`` samples (1 if n < 2)."""
    if n < 2:
        return torch.ones_like(s1)
    var = ((s2 - s1 * s1 / n) / (n - 1)).clamp_min(0.0)
    return scale * torch.sqrt(var)


@torch.no_grad()
def varn(tiles: torch.Tensor, n_iter: int = DEFAULT_ITERS) -> VarNResult:
    """Run VarN on a batch of tiles.

    The balanced tile is never materialized: with ``ir = 1/exp(log_s_row)``, ``ic = 1/exp(log_s_col)``
    the column sums of ``tile·ir·ic`` are ``ic ⊙ (irᵀ tile)`` and its row sums ``ir ⊙ (tile · ic)``
    (likewise for squares with ``tile²``), so each iteration costs four batched mat-vecs; the sums are
    accumulated in fp64 (fp32 on devices without fp64), so the stds equal those of the fp32
    rebalanced tile up to rounding. The scales themselves follow the fp32 log-domain recurrence of the
    module docstring.

    Args:
        tiles: ``[..., R, C]`` floating tensor (computed in fp32); every leading index is an
            independent tile (e.g. ``[n_tiles, D, G]`` for KVarN's K, ``[n_tiles, G, D]`` for V).
        n_iter: iterations (paper: 16; later reference code: 8). ``0`` returns the identity.

    Returns:
        :class:`VarNResult`; the balanced tile is ``tiles / s_col / s_row``.

    Raises:
        ValueError: ``tiles`` has rank < 2 or ``n_iter`` is negative.
    """
    if tiles.dim() < 2:
        raise ValueError(f"tiles must have shape [..., R, C], got {tuple(tiles.shape)}")
    if not isinstance(n_iter, int) or isinstance(n_iter, bool) or n_iter < 0:
        raise ValueError(f"n_iter must be an int >= 0, got {n_iter!r}")
    x = tiles.to(torch.float32)
    acc = _acc_dtype(x.device)
    xa = x.to(acc).contiguous()
    xa2 = xa * xa
    lead = x.shape[:-2]
    r, c = x.shape[-2:]
    lo_clip, hi_clip = LOG_SCALE_CLIP
    lo_std, hi_std = STD_CLAMP

    def col_std(log_row: torch.Tensor, log_col: torch.Tensor) -> torch.Tensor:  # [..., 1, C]
        ir = (1.0 / torch.exp(log_row)).to(acc).transpose(-1, -2)  # [..., 1, R]
        ic = (1.0 / torch.exp(log_col)).to(acc)
        return _weighted_std(torch.matmul(ir, xa), torch.matmul(ir * ir, xa2), ic, r).to(torch.float32)

    def row_sums(log_col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [..., R, 1] each
        ic = (1.0 / torch.exp(log_col)).to(acc).transpose(-1, -2)  # [..., C, 1]
        return torch.matmul(xa, ic), torch.matmul(xa2, ic * ic)

    def row_std(sums: tuple[torch.Tensor, torch.Tensor], log_row: torch.Tensor) -> torch.Tensor:
        ir = (1.0 / torch.exp(log_row)).to(acc)
        s1, s2 = sums
        return _weighted_std(s1 * ir, s2 * ir * ir, torch.ones_like(ir), c).to(torch.float32)

    def imb(cs: torch.Tensor, rs: torch.Tensor) -> torch.Tensor:
        cs, rs = cs.flatten(-2), rs.flatten(-2)
        return cs.amax(-1) / cs.amin(-1).clamp_min(MIN_FLOOR) + rs.amax(-1) / rs.amin(-1).clamp_min(MIN_FLOOR)

    log_col = x.new_zeros(*lead, 1, c)
    log_row = x.new_zeros(*lead, r, 1)
    best_col, best_row = log_col.clone(), log_row.clone()
    cs = col_std(log_row, log_col)
    best_imb = imb(cs, row_std(row_sums(log_col), log_row))
    imb0 = best_imb.clone()
    best_iter = torch.zeros(lead, dtype=torch.int64, device=x.device)

    for it in range(1, n_iter + 1):
        log_col = torch.clamp(log_col + torch.log(cs.clamp(lo_std, hi_std)), lo_clip, hi_clip)
        sums = row_sums(log_col)
        log_row = torch.clamp(log_row + torch.log(row_std(sums, log_row).clamp(lo_std, hi_std)), lo_clip, hi_clip)
        cs = col_std(log_row, log_col)  # also the column stds the next iteration starts from
        cur = imb(cs, row_std(sums, log_row))
        better = cur <= best_imb  # ties go to the later iterate
        best_imb = torch.where(better, cur, best_imb)
        best_col = torch.where(better[..., None, None], log_col, best_col)
        best_row = torch.where(better[..., None, None], log_row, best_row)
        best_iter = torch.where(better, torch.full_like(best_iter, it), best_iter)

    return VarNResult(torch.exp(best_row), torch.exp(best_col), best_imb, imb0, best_iter)
