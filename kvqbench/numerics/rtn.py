"""Asymmetric round-to-nearest (RTN) quantization with explicit granularity types — the reference.

On a group ``x`` (docs/DESIGN.md §7, "RTN family")::

    lo = min x, hi = max x, scale = (hi - lo) / (2**b - 1)            # choose_qparams_asym
    q  = clamp(round((x - lo) / scale), 0, 2**b - 1)                  # quantize_asym (half to even)
    x̂  = q * scale + lo                                               # dequantize_asym

Invariants kept (and tested):
  * a constant group (``hi == lo``) round-trips exactly: ``scale == 0`` and ``x̂ == lo`` (never NaN);
  * a group with only two distinct values round-trips exactly (they map to codes 0 and 2**b - 1);
  * ``|x̂ - x| <= scale / 2`` elementwise; for data uniform in the group MSE ≈ scale² / 12.

The split follows torchao's ``quant_primitives`` (choose_qparams / quantize / dequantize); granularities are
frozen dataclasses instead of boolean flags. Everything acts on ``(batch, kv_heads, seq_len, head_dim)``
(any leading dims are allowed) and is plain torch. Two steps are declared with
:func:`kvqbench.steps.reference` — :func:`quantize_packed` (RTN followed by bit packing) and
:func:`dequantize_packed` (unpacking followed by the inverse) — and have a fast version in
:mod:`kvqbench.kernels.rtn`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from kvqbench import steps
from kvqbench.numerics.packing import pack_bits, unpack_bits

__all__ = [
    "Granularity",
    "PerTensor",
    "PerToken",
    "PerChannel",
    "compute_dtype",
    "broadcast_shape",
    "to_groups",
    "choose_qparams_asym",
    "quantize_asym",
    "dequantize_asym",
    "rtn_quantize",
    "rtn_dequantize",
    "rtn_roundtrip",
    "quantize_packed",
    "dequantize_packed",
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


def broadcast_shape(*shapes: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """The shape ``shapes`` broadcast to (numpy rules), like :func:`torch.broadcast_shapes` but in plain
    Python (torch's imports sympy on its first call).

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
        x: float tensor (computed in fp32, fp64 in fp64).
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
    x: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """Codes ``clamp(round((x - lo)/scale), 0, 2**b - 1)`` as ``dtype`` (``torch.uint8`` holds every width up
    to 8 bits). A zero scale gives code 0: it divides by ``+inf``, and ``(x − lo)/inf = 0`` for finite ``x``."""
    safe = torch.where(scale > 0, scale, torch.full_like(scale, math.inf))
    q = torch.round((x.to(lo.dtype) - lo) / safe)
    return torch.clamp(q, 0, 2**bits - 1).to(dtype)


def dequantize_asym(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``codes * scale + lo`` in ``lo``'s dtype (the codes widen exactly)."""
    return codes.to(lo.dtype) * scale + lo


def _group_axis(gran: Granularity) -> tuple[int, int | None]:
    if isinstance(gran, PerToken):
        return -1, gran.group_size
    if isinstance(gran, PerChannel):
        return -2, gran.group_size
    raise TypeError(f"unsupported granularity {gran!r}")


@torch.no_grad()
def rtn_quantize(
    x: torch.Tensor, bits: int, granularity: Granularity, *, codes_dtype: torch.dtype = torch.int64,
    **qparam_kwargs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asym RTN of ``x`` ``(batch, kv_heads, seq_len, head_dim)`` at ``granularity``.

    Args:
        x: float tensor (fp32/fp16/bf16 computed in fp32, fp64 in fp64).
        bits: code width, 1..8 for ``uint8`` codes.
        granularity: :class:`PerTensor`, :class:`PerToken` or :class:`PerChannel`.
        codes_dtype: dtype of the returned codes (default int64; ``torch.uint8`` for packing).
        qparam_kwargs: passed to :func:`choose_qparams_asym` (``clip_ratio``, ``include_zero``).

    Returns:
        ``(codes, lo, scale)``: ``codes`` in ``x``'s layout; ``lo``/``scale`` one per group, shaped
        ``(*other_dims, n_groups, 1)`` where ``other_dims`` are ``x``'s dims without the group axis
        (``PerTensor``: shape ``(1,)``).

    Raises:
        TypeError: an unknown granularity. ValueError: a group size that is not a positive int.
    """
    if isinstance(granularity, PerTensor):
        xf = x.to(compute_dtype(x.dtype)).reshape(-1)
        lo, scale = choose_qparams_asym(xf, bits, dim=0, **qparam_kwargs)
        return quantize_asym(xf, lo, scale, bits, codes_dtype).reshape(x.shape), lo, scale
    axis, g = _group_axis(granularity)
    xg, restore = to_groups(x.to(compute_dtype(x.dtype)), axis, g)
    lo, scale = choose_qparams_asym(xg, bits, dim=-1, **qparam_kwargs)
    return restore(quantize_asym(xg, lo, scale, bits, codes_dtype)), lo, scale


@torch.no_grad()
def rtn_dequantize(
    codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, granularity: Granularity
) -> torch.Tensor:
    """Inverse of :func:`rtn_quantize`: ``codes`` (any integer dtype, ``x``'s shape) and its ``lo``/``scale``
    → the reconstruction in ``lo``'s dtype."""
    if isinstance(granularity, PerTensor):
        return dequantize_asym(codes, lo, scale)
    axis, g = _group_axis(granularity)
    cg, restore = to_groups(codes, axis, g)
    return restore(dequantize_asym(cg, lo, scale))


@torch.no_grad()
def rtn_roundtrip(x: torch.Tensor, bits: int, granularity: Granularity, **qparam_kwargs) -> torch.Tensor:
    """Quantize-dequantize ``x`` with asym RTN; returns ``x``'s shape and dtype."""
    codes, lo, scale = rtn_quantize(x, bits, granularity, **qparam_kwargs)
    return rtn_dequantize(codes, lo, scale, granularity).to(x.dtype)


@steps.reference("rtn.quantize_packed")
@torch.no_grad()
def quantize_packed(
    x: torch.Tensor, bits: int, granularity: Granularity
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rtn_quantize` of ``x`` ``(batch, kv_heads, seq_len, head_dim)`` with its codes packed by
    :func:`~kvqbench.numerics.packing.pack_bits` (``bits`` 1..8).

    Returns:
        ``(packed, lo, scale)``: the flat ``uint8`` stream of ``ceil(numel·bits/8)`` bytes, and
        :func:`rtn_quantize`'s ``lo``/``scale``.
    """
    codes, lo, scale = rtn_quantize(x, bits, granularity, codes_dtype=torch.uint8)
    return pack_bits(codes, bits, check=False), lo, scale  # clamped codes: in range


@steps.reference("rtn.dequantize_packed")
@torch.no_grad()
def dequantize_packed(
    packed: torch.Tensor, shape: tuple[int, ...], bits: int, lo: torch.Tensor, scale: torch.Tensor,
    granularity: Granularity,
) -> torch.Tensor:
    """The inverse of :func:`quantize_packed`: the codes of ``shape`` unpacked from ``packed``, then
    :func:`rtn_dequantize` (a tensor of ``shape`` in ``lo``'s dtype).

    Raises:
        ValueError: ``packed`` too short for ``shape`` at ``bits``.
    """
    numel = math.prod(int(s) for s in shape)
    codes = unpack_bits(packed, bits, numel, torch.uint8).view(tuple(shape))
    return rtn_dequantize(codes, lo, scale, granularity)
