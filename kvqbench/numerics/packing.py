"""Bit packing of integer codes into bytes.

Invariant: ``unpack_bits(pack_bits(c, b), b, c.numel()) == c.flatten()`` for every integer code
tensor ``c`` with ``0 <= c < 2**b`` and ``1 <= b <= 8``; the packed tensor holds exactly
``ceil(numel * b / 8)`` bytes.

Bit order (documented, LSB-first bit stream): code ``i`` occupies stream bits ``[i*b, (i+1)*b)``;
within a code, bit ``j`` (value ``2**j``) is stream bit ``i*b + j``; stream bit ``s`` is bit
``s % 8`` (value ``2**(s % 8)``) of byte ``s // 8``. For ``b`` in {1, 2, 4, 8} this is the usual
"first code in the low bits of the byte" layout.
"""

from __future__ import annotations

import math

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes"]


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes needed to hold ``numel`` codes of ``bits`` bits each (``ceil(numel*bits/8)``)."""
    return math.ceil(numel * bits / 8)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"pack_bits supports 1..8 bits per code, got {bits!r}")


def _check_range(flat: torch.Tensor, bits: int) -> None:
    """One reduction over the codes (uint8: their max; other integer dtypes: min and max together)."""
    if not flat.numel():
        return
    if flat.dtype == torch.uint8:
        bad = bits < 8 and int(flat.max()) >= (1 << bits)
    else:
        lo, hi = torch.aminmax(flat)
        bad = int(lo) < 0 or int(hi) >= (1 << bits)
    if bad:
        raise ValueError(f"codes must lie in [0, {1 << bits}) to pack into {bits} bits")


@torch.no_grad()
def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes into a flat ``uint8`` tensor (LSB-first bit stream, see module doc).

    Widths that divide 8 (1, 2, 4) combine ``8/b`` codes into each byte in ``uint8`` arithmetic (one
    shift-or per code slot over ``numel·b/8`` bytes); 8 bits is a plain cast; 3, 5, 6, 7 assemble 8 codes
    of ``b`` bits into one int64 word (``8·b ≤ 56`` bits) and split it into ``b`` bytes. ``uint8`` codes
    (what the quantizers produce) are never widened; the range check is one reduction.

    Args:
        codes: integer tensor of any shape, values in ``[0, 2**bits)``.
        bits: code width, 1..8.

    Returns:
        ``uint8`` tensor of shape ``(ceil(codes.numel() * bits / 8),)`` on ``codes.device``.

    Raises:
        ValueError: if ``bits`` is outside 1..8 or a code does not fit in ``bits`` bits.
    """
    _check_bits(bits)
    flat = codes.reshape(-1)
    _check_range(flat, bits)
    n = flat.numel()
    if bits == 8:
        return flat.to(torch.uint8)
    if flat.dtype != torch.uint8:
        flat = flat.to(torch.uint8)  # in range, so exact
    per_byte = 8 // bits if 8 % bits == 0 else 8
    pad = (-n) % per_byte
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if 8 % bits == 0:
        cols = flat.view(-1, per_byte)
        out = cols[:, 0].clone()
        for i in range(1, per_byte):
            out |= cols[:, i] << (i * bits)
        return out
    cols = flat.view(-1, 8)
    words = cols[:, 0].to(torch.int64)
    for i in range(1, 8):
        words |= cols[:, i].to(torch.int64) << (i * bits)
    byte_shifts = torch.arange(bits, device=flat.device, dtype=torch.int64) * 8
    out = ((words.unsqueeze(1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return out[: packed_nbytes(n, bits)]


@torch.no_grad()
def unpack_bits(packed: torch.Tensor, bits: int, numel: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: returns a flat tensor of ``numel`` codes.

    Args:
        packed: the ``uint8`` buffer.
        bits: code width, 1..8.
        numel: number of codes.
        dtype: of the result (default int64; ``torch.uint8`` saves a widening pass).

    Raises:
        ValueError: if ``bits`` is outside 1..8 or ``packed`` is too short for ``numel`` codes.
    """
    _check_bits(bits)
    if packed.numel() < packed_nbytes(numel, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {numel} codes of {bits} bits")
    p = packed.reshape(-1)
    if bits == 8:
        return p[:numel].to(dtype)
    p = p[: packed_nbytes(numel, bits)]
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, device=p.device, dtype=torch.uint8)
        codes = (p.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
        return codes.reshape(-1)[:numel].to(dtype)
    p = p.to(torch.int64)
    pad = (-p.numel()) % bits
    if pad:
        p = torch.cat([p, p.new_zeros(pad)])
    byte_shifts = torch.arange(bits, device=p.device, dtype=torch.int64) * 8
    words = (p.view(-1, bits) << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=p.device, dtype=torch.int64) * bits
    codes = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:numel].to(dtype)
