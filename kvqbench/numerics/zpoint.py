"""Groupwise asymmetric round-to-nearest with a clip ratio and an integer zero-point — the reference.

On a group ``x`` of ``G`` consecutive values along the last dim (a partial last group allowed)::

    lo = min x, hi = max x             (include_zero: lo = min(lo, 0), hi = max(hi, 0))
    lo, hi = c·lo, c·hi                (clip ratio c ∈ (0, 1])
    scale = (hi − lo) / (2^b − 1)
    z = round(−lo / scale)             (integer zero-point)
    q = clamp(round(x / scale) + z, 0, 2^b − 1)
    x̂ = scale · (q − z)

Unlike :mod:`kvqbench.numerics.rtn` (``x̂ = q·scale + lo``), the offset is an integer number of steps, so 0
decodes to exactly 0 whenever it lies inside the clipped range. Invariants kept (and tested): a group whose
clipped range is 0 decodes to its constant exactly (never NaN); ``|x̂ − x| ≤ scale/2`` inside the clipped range.

:func:`quantize_groups` (codes packed) and :func:`dequantize_groups` are the reference steps ``zpoint.quantize``
and ``zpoint.dequantize`` (:func:`kvqbench.steps.reference`); fast versions in :mod:`kvqbench.kernels.zpoint`.
"""

from __future__ import annotations

import torch

from kvqbench import steps
from kvqbench.numerics.packing import pack_bits, unpack_bits
from kvqbench.numerics.rtn import to_groups

__all__ = ["qparams", "quantize_groups", "dequantize_groups"]


def qparams(xg: torch.Tensor, bits: int, *, include_zero: bool, clip_ratio: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The parameters over the last dim of the groups ``xg`` ``[..., G]`` (fp32/fp64), ``bits`` 1..8.
    Returns ``(scale, zero)``, each ``[..., 1]`` in ``xg``'s dtype; ``zero`` holds integers (as floats).

    Constant-group guard: a group whose clipped range is 0 (possible only when ``include_zero`` is False, or for
    an all-zero group) gets ``scale = |c|`` and ``zero = 1`` if ``c < 0`` else ``0``, so that ``x̂ = c`` exactly;
    an all-zero group gets ``scale = 0`` and decodes to 0. Never NaN for finite ``xg``.
    """
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    if include_zero:  # 0 inside the range
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    lo_c, hi_c = lo * clip_ratio, hi * clip_ratio  # clip ratio
    scale = (hi_c - lo_c) / (2**bits - 1)
    degenerate = scale <= 0
    zero = torch.round(-lo_c / torch.where(degenerate, torch.ones_like(scale), scale))
    scale = torch.where(degenerate, lo.abs(), scale)  # constant group c = lo = hi: x̂ = |c|·(q − z) = c
    zero = torch.where(degenerate, (lo < 0).to(zero.dtype), zero)
    return scale, zero


@steps.reference("zpoint.quantize")
def quantize_groups(xr: torch.Tensor, group_size: int, bits: int, *, include_zero: bool, clip_ratio: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``xr`` ``(..., d)`` (fp32/fp64) in groups of ``group_size`` consecutive values along the last
    dim (a partial last group allowed), codes packed.

    Returns ``(packed, scale, zero)``: the ``uint8`` bytes of the codes ``q`` (:func:`~kvqbench.numerics.
    packing.pack_bits`, ``bits`` 1..8, in ``xr``'s element order) and the parameters ``(..., n_groups, 1)``
    in ``xr``'s dtype (:func:`qparams`). A zero scale (an all-zero group) gives ``q = z``."""
    xg, restore = to_groups(xr, -1, group_size)
    scale, zero = qparams(xg, bits, include_zero=include_zero, clip_ratio=clip_ratio)
    safe = torch.where(scale > 0, scale, torch.full_like(scale, float("inf")))  # x/inf = 0: q = z
    q = torch.round(xg / safe).add_(zero).clamp_(0, 2**bits - 1)
    return pack_bits(restore(q).to(torch.uint8), bits), scale, zero


@steps.reference("zpoint.dequantize")
def dequantize_groups(packed: torch.Tensor, shape: tuple[int, ...], group_size: int, bits: int,
                      scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The decode ``scale · (q − z)`` of the codes packed by :func:`quantize_groups` for a tensor of
    ``shape`` ``(..., d)``; returns ``shape`` in ``scale``'s dtype."""
    q = unpack_bits(packed, bits, int(torch.Size(shape).numel()), torch.uint8).view(shape)
    qg, restore = to_groups(q, -1, group_size)
    return restore(scale * (qg.to(scale.dtype) - zero))
