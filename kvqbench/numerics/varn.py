"""VarN — alternating row/column variance normalization of a tile (KVarN, arXiv:2606.03458, §3, step 2),
and the asymmetric per-row RTN of the balanced tile (step 3).

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

The functions here are the references (plain torch, the recipe as written); a compiled version of each is
registered in :mod:`kvqbench.kernels.varn` and agrees with them within the tolerance its property test
states (``tests/property/test_kernels_varn.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvqbench import steps

__all__ = ["VarNResult", "varn", "imbalance", "rtn_rows", "balanced_rtn_rows", "STD_CLAMP", "LOG_SCALE_CLIP",
           "MIN_FLOOR", "DEFAULT_ITERS"]

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


def _check(tiles: torch.Tensor, n_iter: int) -> None:
    if tiles.dim() < 2:
        raise ValueError(f"tiles must have shape [..., R, C], got {tuple(tiles.shape)}")
    if not isinstance(n_iter, int) or isinstance(n_iter, bool) or n_iter < 0:
        raise ValueError(f"n_iter must be an int >= 0, got {n_iter!r}")


@steps.reference("varn.iterate")
@torch.no_grad()
def varn(tiles: torch.Tensor, n_iter: int = DEFAULT_ITERS) -> VarNResult:
    """Run VarN on a batch of tiles, as the recipe above: the balanced tile ``B`` is materialized at every
    step and its stds are torch's unbiased ones.

    Args:
        tiles: ``[..., R, C]`` floating tensor (computed in fp32); every leading index is an independent
            tile (e.g. ``[batch, kv_heads, n_tiles, D, G]`` for KVarN's K, ``[..., G, D]`` for V).
        n_iter: iterations (paper: 16; later reference code: 8). ``0`` returns the identity.

    Returns:
        :class:`VarNResult`; the balanced tile is ``tiles / s_col / s_row``.

    Raises:
        ValueError: ``tiles`` has rank < 2 or ``n_iter`` is not an int >= 0.
    """
    _check(tiles, n_iter)
    x = tiles.to(torch.float32)
    lo_std, hi_std = STD_CLAMP
    lo_clip, hi_clip = LOG_SCALE_CLIP
    log_col = x.new_zeros(*x.shape[:-2], 1, x.shape[-1])
    log_row = x.new_zeros(*x.shape[:-1], 1)
    best_col, best_row = log_col.clone(), log_row.clone()
    best_imb = imbalance(x)
    imb0 = best_imb.clone()
    best_iter = torch.zeros(x.shape[:-2], dtype=torch.int64, device=x.device)
    for it in range(1, n_iter + 1):
        b = x / torch.exp(log_col) / torch.exp(log_row)
        log_col = torch.clamp(log_col + torch.log(_std(b, -2).clamp(lo_std, hi_std)), lo_clip, hi_clip)
        b = x / torch.exp(log_col) / torch.exp(log_row)
        log_row = torch.clamp(log_row + torch.log(_std(b, -1).clamp(lo_std, hi_std)), lo_clip, hi_clip)
        cur = imbalance(x / torch.exp(log_col) / torch.exp(log_row))
        better = cur <= best_imb  # ties go to the later iterate
        best_imb = torch.where(better, cur, best_imb)
        best_col = torch.where(better[..., None, None], log_col, best_col)
        best_row = torch.where(better[..., None, None], log_row, best_row)
        best_iter = torch.where(better, it, best_iter)
    return VarNResult(torch.exp(best_row), torch.exp(best_col), best_imb, imb0, best_iter)


def rtn_rows(b: torch.Tensor, bits: int, floor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric RTN of ``b`` ``[..., R, C]`` per row over the last dim (KVarN step 3).

    ``lo, hi`` the row's min and max, ``scale = max((hi − lo)/(2^bits − 1), floor)``,
    ``q = clamp(round_half_even((b − lo)/scale), 0, 2^bits − 1)`` (a constant row gets codes 0 and decodes
    to ``lo``). Returns ``(codes uint8 [..., R, C], lo [..., R, 1], scale [..., R, 1])``.

    Raises:
        ValueError: ``bits`` is not in 1..8.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits!r}")
    lo = b.amin(-1, keepdim=True)
    hi = b.amax(-1, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(floor)
    q = torch.clamp(torch.round((b - lo) / scale), 0, 2**bits - 1).to(torch.uint8)
    return q, lo, scale


@steps.reference("varn.balanced_rtn")
@torch.no_grad()
def balanced_rtn_rows(tiles: torch.Tensor, s_col: torch.Tensor, s_row: torch.Tensor, bits: int,
                      floor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rtn_rows` of the balanced tiles ``B = tiles / s_col / s_row`` (KVarN steps 2–3).

    Args:
        tiles: ``[..., R, C]`` fp32.
        s_col: ``[..., 1, C]`` and s_row: ``[..., R, 1]``, fp32 (a :class:`VarNResult`'s scales).
        bits: code width, 1..8.
        floor: the least RTN scale (KVarN: 1e-10).

    Returns:
        ``(codes uint8 [..., R, C], lo [..., R, 1], scale [..., R, 1])``; ``tiles`` is not modified.

    Raises:
        ValueError: ``bits`` is not in 1..8.
    """
    return rtn_rows(tiles / s_col / s_row, bits, floor)
