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


@torch.no_grad()
def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes into a flat ``uint8`` tensor (LSB-first bit stream, see module doc).

    Vectorized by groups of 8 codes: 8 codes of ``b`` bits are exactly ``b`` bytes, assembled in one
    int64 word (``8·b ≤ 56`` bits for ``b ≤ 7``; ``b = 8`` is a plain cast).

    Args:
        codes: integer tensor of any shape, values in ``[0, 2**bits)``.
        bits: code width, 1..8.

    Returns:
        ``uint8`` tensor of shape ``(ceil(codes.numel() * bits / 8),)`` on ``codes.device``.

    Raises:
        ValueError: if ``bits`` is outside 1..8 or a code does not fit in ``bits`` bits.
    """
    _check_bits(bits)
    flat = codes.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= (1 << bits)):
        raise ValueError(f"codes must lie in [0, {1 << bits}) to pack into {bits} bits")
    if bits == 8:
        return flat.to(torch.uint8)
    n = flat.numel()
    pad = (-n) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shifts = torch.arange(8, device=flat.device, dtype=torch.int64) * bits
    words = (flat.view(-1, 8) << shifts).sum(dim=1)  # disjoint bit fields: sum == bitwise or
    byte_shifts = torch.arange(bits, device=flat.device, dtype=torch.int64) * 8
    out = ((words.unsqueeze(1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return out[: packed_nbytes(n, bits)]


@torch.no_grad()
def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: returns a flat ``int64`` tensor of ``numel`` codes.

    Raises:
        ValueError: if ``bits`` is outside 1..8 or ``packed`` is too short for ``numel`` codes.
    """
    _check_bits(bits)
    if packed.numel() < packed_nbytes(numel, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {numel} codes of {bits} bits")
    p = packed.reshape(-1).to(torch.int64)
    if bits == 8:
        return p[:numel]
    p = p[: packed_nbytes(numel, bits)]
    pad = (-p.numel()) % bits
    if pad:
        p = torch.cat([p, p.new_zeros(pad)])
    byte_shifts = torch.arange(bits, device=p.device, dtype=torch.int64) * 8
    words = (p.view(-1, bits) << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=p.device, dtype=torch.int64) * bits
    codes = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:numel]
