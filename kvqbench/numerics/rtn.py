"""Asymmetric round-to-nearest (RTN) quantization with explicit granularity types.

On a group ``x`` (METHODS.md notation)::

    lo = min x, hi = max x, scale = (hi - lo) / (2**b - 1)
    q  = clamp(round((x - lo) / scale), 0, 2**b - 1)        # torch.round: half-to-even
    x̂  = q * scale + lo

Invariants kept (and tested):
  * a constant group (``hi == lo``) round-trips exactly: ``scale == 0`` and ``x̂ == lo`` (never NaN);
  * a group with only two distinct values round-trips exactly (they map to codes 0 and 2**b - 1);
  * ``|x̂ - x| <= scale / 2`` elementwise; for data uniform in the group MSE ≈ scale² / 12.

Granularities are frozen dataclasses (torchao style) instead of boolean flags; all act on the
layout ``(batch, kv_heads, seq_len, head_dim)`` (any leading dims are allowed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from kvqbench.numerics import blocks, fused

__all__ = [
    "Granularity",
    "PerTensor",
    "PerToken",
    "PerChannel",
    "to_groups",
    "choose_qparams_asym",
    "quantize_asym",
    "dequantize_asym",
    "rtn_quantize",
    "rtn_roundtrip",
    "compute_dtype",
]


@dataclass(frozen=True)
class Granularity:
    """Base of the granularity types."""


@dataclass(frozen=True)
class PerTensor(Granularity):
    """One (scale, zero-point) for the whole tensor."""


@dataclass(frozen=True)
class PerToken(Granularity):
    """One (scale, zero) per token, over ``head_dim``; ``group_size`` splits head_dim into groups of
    that many consecutive channels (``None`` = the whole head_dim)."""

    group_size: int | None = None


@dataclass(frozen=True)
class PerChannel(Granularity):
    """One (scale, zero) per channel, over tokens; ``group_size`` splits the sequence into groups of
    that many consecutive tokens (``None`` = the whole sequence)."""

    group_size: int | None = None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype quantizer numerics run in: fp64 stays fp64, everything else runs in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_groups(
    x: torch.Tensor, axis: int, group_size: int | None
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Split ``axis`` of ``x`` into consecutive groups and move it last.

    Returns ``(xg, restore)`` with ``xg`` of shape ``(*other_dims, n_groups, G)``; a partial last
    group is padded by repeating its last element (so min/max are unchanged). ``restore(yg)`` maps
    a tensor of ``xg``'s shape back to ``x``'s layout, dropping the padding.

    Raises:
        ValueError: if ``group_size`` is not a positive int.
    """
    axis = axis % x.dim()
    n = x.shape[axis]
    g = n if group_size is None else int(group_size)
    if g <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    g = min(g, n) if group_size is None else g
    xm = x.movedim(axis, -1)
    pad = (-n) % g
    if pad:
        xm = torch.cat([xm, xm[..., -1:].expand(*xm.shape[:-1], pad)], dim=-1)
    lead = xm.shape[:-1]
    xg = xm.reshape(*lead, -1, g)

    def restore(yg: torch.Tensor) -> torch.Tensor:
        ym = yg.reshape(*lead, -1)[..., :n]
        return ym.movedim(-1, axis)

    return xg, restore


def choose_qparams_asym(
    x: torch.Tensor,
    bits: int,
    dim: int | tuple[int, ...] = -1,
    *,
    clip_ratio: float = 1.0,
    include_zero: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max asymmetric parameters over ``dim`` (kept as size-1 dims).

    Args:
        x: float tensor (computed in fp32/fp64).
        bits: code width ``b``; ``2**b - 1`` levels above ``lo``.
        dim: reduction dim(s) of one group.
        clip_ratio: the range ``[lo, hi]`` is multiplied by this (QuaRot uses 0.95).
        include_zero: force 0 into the range (``lo <= 0 <= hi``), as QuaRot's K path.

    Returns:
        ``(lo, scale)``, both in the compute dtype; ``scale == 0`` for a constant group.
    """
    xf = x.to(compute_dtype(x.dtype))
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    if include_zero:
        lo = torch.clamp(lo, max=0.0)
        hi = torch.clamp(hi, min=0.0)
    if clip_ratio != 1.0:
        lo = lo * clip_ratio
        hi = hi * clip_ratio
    scale = (hi - lo) / (2**bits - 1)
    return lo, scale


def quantize_asym(
    x: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, dtype: torch.dtype = torch.int64,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Codes ``clamp(round((x - lo)/scale), 0, 2**b - 1)`` as ``dtype`` (default int64; ``torch.uint8``
    holds every width up to 8 bits and saves a widening pass); a zero scale gives code 0. ``out``: a
    tensor of ``x``'s shape (and ``dtype``) the codes are cast into (no separate codes tensor).

    One temporary: ``x - lo`` is divided, rounded and clamped in place. A zero scale divides by ``+inf``
    (``(x − lo)/inf = 0`` for the finite inputs the quantizers accept), so no full-size mask is built.
    """
    xf = x.to(lo.dtype)
    safe = torch.where(scale > 0, scale, torch.full_like(scale, math.inf))
    if fused.enabled(xf.device.type):  # one compiled loop, bit-identical (KVQBENCH_FUSED=1)
        return fused.quantize_codes(xf, lo, safe, 2**bits - 1, dtype, fused=True)
    q = torch.sub(xf, lo)
    q.div_(safe).round_().clamp_(0, 2**bits - 1)
    return q.to(dtype) if out is None else out.copy_(q)


def broadcast_shape(*shapes: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """The shape ``shapes`` broadcast to (numpy rules), like :func:`torch.broadcast_shapes` but in plain
    Python: torch's imports sympy on its first call (about half a CPU-second per process).

    Raises:
        ValueError: shapes that do not broadcast together.
    """
    n = max((len(s) for s in shapes), default=0)
    out = []
    for dims in zip(*[(1,) * (n - len(s)) + tuple(int(d) for d in s) for s in shapes]):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            raise ValueError(f"shapes {[tuple(s) for s in shapes]} do not broadcast together")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def dequantize_asym(
    codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``codes * scale + lo`` in ``lo``'s dtype (one output buffer, multiplied and shifted in place);
    ``out``: that buffer, of ``codes``' shape and ``lo``'s dtype (the same bits: the codes widen exactly)."""
    if fused.enabled(codes.device.type):  # one compiled loop, bit-identical (KVQBENCH_FUSED=1)
        return fused.dequantize_codes(codes, lo, scale, fused=True)
    if out is not None:
        return out.copy_(codes).mul_(scale).add_(lo)
    shape = broadcast_shape(codes.shape, scale.shape, lo.shape)
    if tuple(codes.shape) != tuple(shape):
        return codes.to(lo.dtype) * scale + lo
    out = codes.to(lo.dtype, copy=True)
    return out.mul_(scale).add_(lo)


def _group_axis(gran: Granularity) -> tuple[int, int | None]:
    if isinstance(gran, PerToken):
        return -1, gran.group_size
    if isinstance(gran, PerChannel):
        return -2, gran.group_size
    raise TypeError(f"unsupported granularity {gran!r}")


def _channel_groups(n: int, g: int | None) -> int | None:
    """Group size along the token axis when it can be taken as a view (no partial group), else None."""
    g = n if g is None else int(g)
    return g if g > 0 and n % g == 0 else None


@torch.no_grad()
def rtn_quantize(
    x: torch.Tensor, bits: int, granularity: Granularity, *, codes_dtype: torch.dtype = torch.int64,
    **qparam_kwargs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asym RTN of ``x`` ``(batch, kv_heads, seq_len, head_dim)`` at ``granularity``.

    On the CPU the work runs over cache-sized blocks (:mod:`kvqbench.numerics.blocks`, one thread): per-token
    groups in blocks of tokens (statistics and codes per block); per-channel groups and a group longer than
    a block (per-tensor) take their statistics in one pass over the whole tensor first, then the codes in
    blocks. Every result is bit-identical to the whole-tensor ops (the statistics are exact minima/maxima
    of the same groups, the codes elementwise; tested).

    Per-channel groups are reduced in place along the token axis (``(…, n_groups, G, head_dim)`` is a view
    of ``x``), so neither ``x`` nor the codes are transposed; only a partial last group takes the padded
    :func:`to_groups` path.

    Args:
        codes_dtype: dtype of the returned codes (default int64; ``torch.uint8`` for packing).

    Returns:
        ``(codes, lo, scale)``: ``codes`` in ``x``'s layout; ``lo``/``scale`` one per group,
        shaped ``(*other_dims, n_groups, 1)`` (``PerTensor``: shape ``(1,)``).
    """
    if not isinstance(granularity, PerTensor) and _blocked(x):
        with blocks.one_cpu_thread(x.device):
            return _quantize_blocked(x, bits, granularity, codes_dtype, qparam_kwargs)
    return _rtn_quantize_whole(x, bits, granularity, codes_dtype=codes_dtype, **qparam_kwargs)


def _rtn_quantize_whole(
    x: torch.Tensor, bits: int, granularity: Granularity, *, codes_dtype: torch.dtype = torch.int64,
    **qparam_kwargs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rtn_quantize` as whole-tensor ops (one pass per op over the full tensor)."""
    if isinstance(granularity, PerTensor):
        xf = x.to(compute_dtype(x.dtype)).reshape(-1)
        lo, scale = choose_qparams_asym(xf, bits, dim=0, **qparam_kwargs)
        return quantize_asym(xf, lo, scale, bits, codes_dtype).reshape(x.shape), lo, scale
    axis, g = _group_axis(granularity)
    xf = x.to(compute_dtype(x.dtype))
    gc = _channel_groups(int(x.shape[-2]), g) if axis == -2 and x.dim() >= 2 else None
    if gc is not None:
        xg = xf.reshape(*xf.shape[:-2], xf.shape[-2] // gc, gc, xf.shape[-1])  # (…, nG, G, D), a view
        lo, scale = choose_qparams_asym(xg, bits, dim=-2, **qparam_kwargs)  # (…, nG, 1, D)
        codes = quantize_asym(xg, lo, scale, bits, codes_dtype).reshape(x.shape)
        return codes, lo.movedim(-1, -3), scale.movedim(-1, -3)  # (…, D, nG, 1) views
    xg, restore = to_groups(xf, axis, g)
    lo, scale = choose_qparams_asym(xg, bits, dim=-1, **qparam_kwargs)
    return restore(quantize_asym(xg, lo, scale, bits, codes_dtype)), lo, scale


def rtn_dequantize(
    codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, granularity: Granularity
) -> torch.Tensor:
    """Inverse of :func:`rtn_quantize` (in the compute dtype of ``lo``); ``codes`` of any integer dtype.

    On the CPU in cache-sized blocks, as :func:`rtn_quantize` (bit-identical: elementwise)."""
    if not isinstance(granularity, PerTensor) and _blocked(codes):
        with blocks.one_cpu_thread(codes.device):
            out = _dequantize_blocked(codes, lo, scale, granularity)
        if out is not None:
            return out
    return _rtn_dequantize_whole(codes, lo, scale, granularity)


def _rtn_dequantize_whole(
    codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, granularity: Granularity
) -> torch.Tensor:
    """:func:`rtn_dequantize` as whole-tensor ops."""
    if isinstance(granularity, PerTensor):
        return dequantize_asym(codes, lo, scale)
    axis, g = _group_axis(granularity)
    gc = _channel_groups(int(codes.shape[-2]), g) if axis == -2 and codes.dim() >= 2 else None
    if gc is not None:
        cg = codes.reshape(*codes.shape[:-2], codes.shape[-2] // gc, gc, codes.shape[-1])
        return dequantize_asym(cg, lo.movedim(-3, -1), scale.movedim(-3, -1)).reshape(codes.shape)
    cg, restore = to_groups(codes, axis, g)
    return restore(dequantize_asym(cg, lo, scale))


def _blocked(t: torch.Tensor) -> bool:
    """Whether :func:`rtn_quantize`/:func:`rtn_dequantize` of ``t`` run in blocks: on the CPU, more than one
    block of elements, not the compiled path (one loop already)."""
    return (t.device.type == "cpu" and t.dim() >= 2 and t.numel() > blocks.BLOCK_ELEMS
            and not fused.enabled(t.device.type))


def _token_layout(d: int, g: int | None) -> tuple[int, int] | None:
    """``(group_size, n_groups)`` of per-token groups over a last dim of ``d`` (``None``: a bad group size,
    left to the whole-tensor path to raise)."""
    gs = d if g is None else int(g)
    return (gs, -(-d // gs)) if gs > 0 else None


def _channel_blocks(n_groups: int, gc: int, d: int) -> list[tuple[slice, slice]]:
    """``(group slice, token slice)`` blocks of per-channel groups ``(n_groups, gc, d)``: whole groups per
    block when one group fits a block, else each group in blocks of tokens."""
    if gc * d <= blocks.BLOCK_ELEMS:
        return [(sl, slice(None)) for sl in blocks.row_blocks(n_groups, gc * d)]
    return [(slice(i, i + 1), ts) for i in range(n_groups) for ts in blocks.row_blocks(gc, d)]


def _quantize_blocked(
    x: torch.Tensor, bits: int, gran: Granularity, codes_dtype: torch.dtype, kw: dict
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rtn_quantize` over cache-sized blocks (same bits as :func:`_rtn_quantize_whole`)."""
    axis, g = _group_axis(gran)
    cd, dev, d = compute_dtype(x.dtype), x.device, int(x.shape[-1])
    if axis == -1:
        layout = _token_layout(d, g)
        if layout is None:
            return _rtn_quantize_whole(x, bits, gran, codes_dtype=codes_dtype, **kw)
        gs, n_g = layout
        rows = x.reshape(-1, d)
        n, lead = rows.shape[0], x.shape[:-1]
        codes = torch.empty(n, d, dtype=codes_dtype, device=dev)
        if n_g * gs <= blocks.BLOCK_ELEMS:  # blocks of tokens: statistics and codes per block
            lo = torch.empty(n, n_g, 1, dtype=cd, device=dev)
            scale = torch.empty_like(lo)
            for sl in blocks.row_blocks(n, n_g * gs):
                if n_g * gs != d:  # a padded partial group
                    codes[sl], lo[sl], scale[sl] = _rtn_quantize_whole(rows[sl], bits, gran,
                                                                       codes_dtype=codes_dtype, **kw)
                    continue
                xg = rows[sl].to(cd).view(-1, n_g, gs)
                lo[sl], scale[sl] = choose_qparams_asym(xg, bits, dim=-1, **kw)
                quantize_asym(xg, lo[sl], scale[sl], bits, codes_dtype, out=codes[sl].view(-1, n_g, gs))
            return codes.view(x.shape), lo.view(*lead, n_g, 1), scale.view(*lead, n_g, 1)
        if n_g > 1 or gs != d:
            return _rtn_quantize_whole(x, bits, gran, codes_dtype=codes_dtype, **kw)
        # one group longer than a block (per-tensor): its statistics in one pass, then codes in blocks
        xf = rows.to(cd)
        lo, scale = choose_qparams_asym(xf.view(*lead, 1, d), bits, dim=-1, **kw)  # (…, 1, 1)
        lo2, scale2 = lo.view(n, 1), scale.view(n, 1)
        for r in range(n):
            for cs in blocks.row_blocks(d, 1):
                quantize_asym(xf[r, cs], lo2[r], scale2[r], bits, codes_dtype, out=codes[r, cs])
        return codes.view(x.shape), lo, scale
    t = int(x.shape[-2])
    gc = _channel_groups(t, g)
    if gc is None:  # a partial group: the padded path
        return _rtn_quantize_whole(x, bits, gran, codes_dtype=codes_dtype, **kw)
    # per-channel groups: statistics in one pass (the same reduction as the whole-tensor path), codes in blocks
    xg = x.to(cd).reshape(*x.shape[:-2], t // gc, gc, d)  # (…, nG, G, D)
    lo, scale = choose_qparams_asym(xg, bits, dim=-2, **kw)  # (…, nG, 1, D)
    x3, lo3, scale3 = xg.reshape(-1, gc, d), lo.reshape(-1, 1, d), scale.reshape(-1, 1, d)
    codes3 = torch.empty(x3.shape, dtype=codes_dtype, device=dev)
    for gsl, ts in _channel_blocks(x3.shape[0], gc, d):
        quantize_asym(x3[gsl, ts], lo3[gsl], scale3[gsl], bits, codes_dtype, out=codes3[gsl, ts])
    return codes3.view(x.shape), lo.movedim(-1, -3), scale.movedim(-1, -3)


def _dequantize_blocked(
    codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, gran: Granularity
) -> torch.Tensor | None:
    """:func:`rtn_dequantize` over cache-sized blocks (same bits as :func:`_rtn_dequantize_whole`); ``None``
    where the layout has no blocked path."""
    axis, g = _group_axis(gran)
    dev, d = codes.device, int(codes.shape[-1])
    if axis == -1:
        layout = _token_layout(d, g)
        if layout is None:
            return None
        gs, n_g = layout
        if tuple(lo.shape) != (*codes.shape[:-1], n_g, 1) or lo.shape != scale.shape:
            return None
        rows = codes.reshape(-1, d)
        n = rows.shape[0]
        out = torch.empty(n, d, dtype=lo.dtype, device=dev)
        lo2, scale2 = lo.reshape(n, n_g, 1), scale.reshape(n, n_g, 1)
        if n_g * gs <= blocks.BLOCK_ELEMS:
            for sl in blocks.row_blocks(n, n_g * gs):
                if n_g * gs != d:  # a padded partial group
                    out[sl] = _rtn_dequantize_whole(rows[sl], lo2[sl], scale2[sl], gran)
                else:
                    dequantize_asym(rows[sl].view(-1, n_g, gs), lo2[sl], scale2[sl], out=out[sl].view(-1, n_g, gs))
            return out.view(codes.shape)
        if n_g > 1 or gs != d:
            return None
        for r in range(n):
            for cs in blocks.row_blocks(d, 1):
                dequantize_asym(rows[r, cs], lo2[r, 0], scale2[r, 0], out=out[r, cs])
        return out.view(codes.shape)
    t = int(codes.shape[-2])
    gc = _channel_groups(t, g)
    if gc is None:
        return None
    lo_c, scale_c = lo.movedim(-3, -1), scale.movedim(-3, -1)  # (…, nG, 1, D)
    if tuple(lo_c.shape) != (*codes.shape[:-2], t // gc, 1, d) or lo_c.shape != scale_c.shape:
        return None
    c3 = codes.reshape(-1, gc, d)
    lo3, scale3 = lo_c.reshape(-1, 1, d), scale_c.reshape(-1, 1, d)
    out3 = torch.empty(c3.shape, dtype=lo.dtype, device=dev)
    for gsl, ts in _channel_blocks(c3.shape[0], gc, d):
        dequantize_asym(c3[gsl, ts], lo3[gsl], scale3[gsl], out=out3[gsl, ts])
    return out3.view(codes.shape)


@torch.no_grad()
def rtn_roundtrip(x: torch.Tensor, bits: int, granularity: Granularity, **qparam_kwargs) -> torch.Tensor:
    """Quantize-dequantize ``x`` with asym RTN; returns ``x``'s shape and dtype."""
    codes, lo, scale = rtn_quantize(x, bits, granularity, **qparam_kwargs)
    return rtn_dequantize(codes, lo, scale, granularity).to(x.dtype)


__all__ += ["rtn_dequantize", "broadcast_shape"]
