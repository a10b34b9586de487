"""Exact power-of-two magnitudes, for scale-free floors and rescaling.

Multiplying or dividing a floating-point number by a power of two is exact (no rounding) as long as the
result stays in the normal range, so a quantizer that rescales its input by ``2^k`` before numerics that
hold absolute constants (a floor such as ``1e-6``, a clip in log space), and undoes the factor on its
output, gives bit for bit ``2^k`` times the result on the rescaled data.

Invariant (tested): ``pow2_floor(t)`` is a power of two with ``pow2_floor(t) <= |t| < 2·pow2_floor(t)``
for every finite non-zero ``t`` (normal or subnormal), and 1 for zero or non-finite ``t``;
``pow2_floor(t·2^k) == pow2_floor(t)·2^k`` whenever both sides are normal.
"""

from __future__ import annotations

import torch

__all__ = ["pow2_floor", "pow2_window"]


def pow2_floor(t: torch.Tensor) -> torch.Tensor:
    """Largest power of two ``<= |t|``, elementwise (1 where ``t`` is 0, NaN or ±Inf).

    Args:
        t: floating tensor of any shape (fp32/fp64; other dtypes are computed in fp32).
    Returns:
        Tensor of ``t``'s shape and (fp32/fp64) dtype holding exact powers of two.
    """
    if t.dtype not in (torch.float32, torch.float64):
        t = t.to(torch.float32)
    _, e = torch.frexp(t)  # t = m·2^e with 0.5 <= |m| < 1
    p = torch.ldexp(torch.ones_like(t), e - 1)
    return torch.where((t != 0) & torch.isfinite(t), p, torch.ones_like(t))


def pow2_window(magnitude: torch.Tensor, lo_exp: int, hi_exp: int) -> torch.Tensor:
    """The power of two ``c`` that brings ``magnitude`` into ``[2^lo_exp, 2^(hi_exp + 1))``.

    ``c = 1`` when ``pow2_floor(magnitude)`` already lies in ``[2^lo_exp, 2^hi_exp]`` (and for a zero
    magnitude); otherwise ``magnitude / c`` has ``pow2_floor`` equal to the nearer edge. Dividing data by
    ``c`` is exact, so numerics with absolute constants see data in the window they were designed for and
    the result is multiplied back by ``c`` exactly.

    Args:
        magnitude: non-negative floating tensor (e.g. a tile's RMS or max |x|).
        lo_exp, hi_exp: window exponents, ``lo_exp <= hi_exp``.
    Returns:
        ``c``, same shape and dtype as :func:`pow2_floor` ``(magnitude)``.
    Raises:
        ValueError: ``lo_exp > hi_exp``.
    """
    if lo_exp > hi_exp:
        raise ValueError(f"lo_exp must be <= hi_exp, got {lo_exp} > {hi_exp}")
    p = pow2_floor(magnitude)
    _, e = torch.frexp(p)  # p = 0.5·2^e
    e = e - 1
    shift = e - torch.clamp(e, lo_exp, hi_exp)
    return torch.ldexp(torch.ones_like(p), shift)
