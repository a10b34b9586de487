"""Bit packing of integer codes into bytes — the reference (plain torch; the steps :func:`pack_uint8` and
:func:`unpack_uint8` have a fast version in :mod:`kvqbench.kernels.packing`).

Invariant: ``unpack_bits(pack_bits(c, b), b, c.numel()) == c.flatten()`` for every integer code
tensor ``c`` with ``0 <= c < 2**b`` and ``1 <= b <= 8``; the packed tensor holds exactly
``ceil(numel * b / 8)`` bytes.

Bit order (documented, LSB-first bit stream): code ``i`` occupies stream bits ``[i*b, (i+1)*b)``;
within a code, bit ``j`` (value ``2**j``) is stream bit ``i*b + j``; stream bit ``s`` is bit
``s % 8`` (value ``2**(s % 8)``) of byte ``s // 8``. For ``b`` in {1, 2, 4, 8} this is the usual
"first code in the low bits of the byte" layout.
"""

from __future__ import annotations

import functools
import math
import sys

import torch

from kvqbench import steps

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes", "pack_float_codes", "pack_uint8", "unpack_uint8"]


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes needed to hold ``numel`` codes of ``bits`` bits each (``ceil(numel*bits/8)``)."""
    return math.ceil(numel * bits / 8)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"pack_bits supports 1..8 bits per code, got {bits!r}")


#: widths that divide 8 → the integer dtype holding ``8/b`` bytes (one packed byte's codes, one per byte)
_WORD = {1: torch.int64, 2: torch.int32, 4: torch.int16}
#: ``(2^b − 1)`` repeated in every byte of a word: one code per byte, its high bits cleared
_BYTE_MASK = {1: 0x0101010101010101, 2: 0x03030303, 4: 0x0F0F}


def _word_path(flat: torch.Tensor, n: int, bits: int) -> bool:
    """Whether ``n`` codes (one per byte of ``flat``, contiguous) take the word path: ``b`` in {1, 2, 4},
    whole words, a little-endian host (the ``i``-th code of a word is its byte ``i``, bits ``8i …``)."""
    return (bits in _WORD and sys.byteorder == "little" and n > 0 and n % (8 // bits) == 0
            and flat.stride(0) == 1 and flat.storage_offset() % (8 // bits) == 0)


def _check_out(out: torch.Tensor | None, nbytes: int) -> None:
    if out is not None and (out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != nbytes
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous 1-D uint8 tensor of {nbytes} bytes, got "
                         f"{tuple(out.shape)} {out.dtype}")


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
def pack_bits(codes: torch.Tensor, bits: int, *, out: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
    """Pack integer codes into a flat ``uint8`` tensor (LSB-first bit stream, see module doc).

    Widths that divide 8 (1, 2, 4): on a little-endian host the ``8/b`` codes of one packed byte, one per
    byte, are read as one integer word (int64, int32, int16) whose byte ``i`` holds code ``i``; the word
    shifted right by ``i·(8 − b)`` bits brings code ``i`` to stream bits ``i·b …`` of its low byte and
    every other code of the word out of that byte, so OR-ing ``log2(8/b)`` doubling shifts and keeping
    the low byte packs contiguous words in a few passes (otherwise, and for a ragged tail, one
    ``uint8`` shift-or per code slot). 8 bits is a plain cast; 3, 5, 6, 7 assemble 8 codes of ``b`` bits
    into one int64 word (``8·b ≤ 56`` bits) and split it into ``b`` bytes. ``uint8`` codes (what the
    quantizers produce) are never widened; the range check is one reduction. The packing itself is the
    step :func:`pack_uint8` (fast version: :mod:`kvqbench.kernels.packing`).

    Blocks: the packing of codes ``[i, j)`` with ``i·b`` a multiple of 8 is bytes
    ``[i·b/8, ceil(j·b/8))`` of the whole packing, so a caller may pack row blocks into slices of one
    output (``out``).

    Args:
        codes: integer tensor of any shape, values in ``[0, 2**bits)``.
        bits: code width, 1..8.
        out: a contiguous 1-D ``uint8`` tensor of ``ceil(codes.numel() * bits / 8)`` bytes that receives
            the packing (returned); default: a new tensor.
        check: ``False`` skips the range check (the caller guarantees the range, e.g. codes it clamped;
            out-of-range codes then pack to unspecified bytes).

    Returns:
        ``uint8`` tensor of shape ``(ceil(codes.numel() * bits / 8),)`` on ``codes.device``.

    Raises:
        ValueError: if ``bits`` is outside 1..8, a code does not fit in ``bits`` bits (``check``), or
            ``out`` is not a contiguous 1-D ``uint8`` tensor of the packed size.
    """
    _check_bits(bits)
    flat = codes.reshape(-1)
    if check:
        _check_range(flat, bits)
    _check_out(out, packed_nbytes(flat.numel(), bits))
    if flat.dtype != torch.uint8:
        flat = flat.to(torch.uint8)  # in range, so exact
    return pack_uint8(flat, bits, out)


@steps.reference("packing.pack")
@torch.no_grad()
def pack_uint8(flat: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The packing step of :func:`pack_bits`: flat ``uint8`` codes, all below ``2**bits`` (not checked), into
    ``out`` (a contiguous 1-D ``uint8`` tensor of ``ceil(n·bits/8)`` bytes, not checked) or a new tensor."""
    n = flat.numel()
    if bits == 8:  # a new tensor, never a view of the codes
        return torch.empty(n, dtype=torch.uint8, device=flat.device).copy_(flat) if out is None else out.copy_(flat)
    if _word_path(flat, n, bits):
        words = flat.view(_WORD[bits])  # byte i of a word = code i
        step = 8 - bits
        acc = words | (words >> step)
        span = 2
        while span < 8 // bits:  # codes 0..2·span−1 of each word at their stream bits of the low byte
            acc |= acc >> (span * step)
            span *= 2
        acc &= 0xFF  # the low byte; explicit, so that the narrowing cast below never has to wrap
        return acc.to(torch.uint8) if out is None else out.copy_(acc)
    per_byte = 8 // bits if 8 % bits == 0 else 8
    pad = (-n) % per_byte
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if 8 % bits == 0:
        cols = flat.view(-1, per_byte)
        res = cols[:, 0].clone()
        for i in range(1, per_byte):
            res |= cols[:, i] << (i * bits)
        return res if out is None else out.copy_(res)
    cols = flat.view(-1, 8)
    words = cols[:, 0].to(torch.int64)
    for i in range(1, 8):
        words |= cols[:, i].to(torch.int64) << (i * bits)
    byte_shifts = torch.arange(bits, device=flat.device, dtype=torch.int64) * 8
    res = ((words.unsqueeze(1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)[: packed_nbytes(n, bits)]
    return res if out is None else out.copy_(res)


@functools.lru_cache(maxsize=32)
def _byte_weights(row: int, bits: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """``(row, row·b/8)``: column ``k`` holds ``2^(b·i)`` at row ``k·(8/b) + i`` (``i < 8/b``), zeros elsewhere."""
    per_byte = 8 // bits
    w = torch.zeros(row, row // per_byte, dtype=torch.float64)
    for i in range(per_byte):
        w[i::per_byte, :] += torch.eye(row // per_byte, dtype=torch.float64) * float(1 << (bits * i))
    return w.to(dtype=dtype, device=torch.device(device))


@torch.no_grad()
def pack_float_codes(codes: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """:func:`pack_bits` of integer-valued floating codes (``0 ≤ c < 2^b``, e.g. clamped rounded values),
    into ``out``, without casting every code to ``uint8`` first.

    For ``b`` in {1, 2, 4} and a count divisible by 8, the codes are read as rows of ``L`` (32, else 16, 64,
    128 or 8) and multiplied by the fixed ``(L, L·b/8)`` matrix with ``2^(b·i)`` at row ``k·(8/b) + i`` of
    column ``k``: column ``k`` of the product is ``Σ_i c_i·2^(b·i)``, packed byte ``k`` of the row (module
    doc). Exact in any order of additions (every product and partial sum is an integer below 256,
    exactly representable), so the bytes are :func:`pack_bits`' bit for bit; then one cast of
    ``numel·b/8`` values. Other widths and counts: a cast to ``uint8``, then :func:`pack_bits`.

    Args:
        codes: floating tensor of any shape holding integers in ``[0, 2**bits)`` (not checked: other
            values pack to unspecified bytes).
        bits: code width, 1..8.
        out: contiguous 1-D ``uint8`` tensor of ``ceil(codes.numel() * bits / 8)`` bytes (returned).

    Raises:
        ValueError: ``bits`` outside 1..8, or ``out`` not a contiguous 1-D ``uint8`` tensor of that size.
    """
    _check_bits(bits)
    n = codes.numel()
    _check_out(out, packed_nbytes(n, bits))
    if not codes.is_floating_point() or bits not in _WORD or n % 8:
        return pack_bits(codes, bits, out=out, check=False)
    row = next(r for r in (32, 16, 64, 128, 8) if n % r == 0)  # 32: the fastest product here (16–128 within 25 %)
    w = _byte_weights(row, bits, codes.dtype, str(codes.device))
    return out.copy_(torch.mm(codes.reshape(-1, row), w).view(-1))


@functools.lru_cache(maxsize=32)
def _code_table(bits: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """``(256, 8/b)``: the codes of every byte value, in stream order, as ``dtype``."""
    per_byte = 8 // bits
    table = [[(v >> (bits * i)) & ((1 << bits) - 1) for i in range(per_byte)] for v in range(256)]
    return torch.tensor(table, dtype=dtype, device=torch.device(device))


@torch.no_grad()
def unpack_bits(packed: torch.Tensor, bits: int, numel: int, dtype: torch.dtype = torch.int64, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: returns a flat tensor of ``numel`` codes.

    Widths that divide 8 (1, 2, 4), whole words, little-endian host: each byte is widened to an integer
    word of ``8/b`` bytes, ``log2(8/b)`` doubling shift-ors put a copy of it at bit ``i·(8 − b)`` for every
    ``i`` (code ``i``'s stream bits ``i·b …`` then start at bit ``8i``, byte ``i`` of the word), and one
    mask keeps each byte's low ``b`` bits: the word's bytes are the codes, in order. Otherwise one
    shift-and per code slot (the step :func:`unpack_uint8`; fast version: :mod:`kvqbench.kernels.packing`).
    Into a floating ``out`` (1, 2, 4 bits, whole bytes): one look-up per byte in
    a 256-row table of its codes.

    Args:
        packed: the ``uint8`` buffer.
        bits: code width, 1..8.
        numel: number of codes.
        dtype: of the result (default int64; ``torch.uint8`` saves a widening pass).
        out: a tensor of ``numel`` elements (any dtype codes ``< 2^b`` cast to exactly, e.g. ``uint8``
            or a float type) that receives the codes, cast (returned, flattened); default: a new tensor
            of ``dtype``.

    Raises:
        ValueError: if ``bits`` is outside 1..8, ``packed`` is too short for ``numel`` codes, or ``out``
            does not hold ``numel`` elements.
    """
    _check_bits(bits)
    if packed.numel() < packed_nbytes(numel, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {numel} codes of {bits} bits")
    if out is not None and out.numel() != numel:
        raise ValueError(f"out holds {out.numel()} elements, not the {numel} codes")
    if (out is not None and out.is_floating_point() and out.is_contiguous() and bits in _WORD and numel
            and numel % (8 // bits) == 0):  # floating codes: one table look-up per byte
        p = packed.reshape(-1)[: packed_nbytes(numel, bits)]
        table = _code_table(bits, out.dtype, str(out.device))
        torch.index_select(table, 0, p.to(torch.int32), out=out.view(-1, 8 // bits))
        return out.view(-1)
    codes = unpack_uint8(packed.reshape(-1), bits, numel)
    if out is None:
        return codes.to(dtype)
    return out.view(-1).copy_(codes) if out.is_contiguous() else out.copy_(codes.view(out.shape)).reshape(-1)


@steps.reference("packing.unpack")
@torch.no_grad()
def unpack_uint8(p: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The unpacking step of :func:`unpack_bits`: ``numel`` codes of ``bits`` bits from the flat ``uint8``
    buffer ``p`` (at least ``ceil(numel·bits/8)`` bytes, not checked), as a flat ``uint8`` tensor."""
    if bits == 8 or numel == 0:
        return p[:numel]
    return _unpack_torch(p, bits, numel)


def _unpack_torch(p: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """:func:`unpack_uint8` by torch passes (widths below 8)."""
    p = p[: packed_nbytes(numel, bits)]
    if bits in _WORD and sys.byteorder == "little" and numel % (8 // bits) == 0:
        step = 8 - bits
        acc = p.to(_WORD[bits], memory_format=torch.contiguous_format)  # a strided p gives a strided copy
        span = 8 // bits // 2
        while span >= 1:  # copies of the byte at bit i·(8 − b) for every i < 8/b
            acc |= acc << (span * step)
            span //= 2
        acc &= _BYTE_MASK[bits]
        return acc.view(torch.uint8)
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, device=p.device, dtype=torch.uint8)
        codes = (p.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
        return codes.reshape(-1)[:numel]
    p = p.to(torch.int64)
    pad = (-p.numel()) % bits
    if pad:
        p = torch.cat([p, p.new_zeros(pad)])
    byte_shifts = torch.arange(bits, device=p.device, dtype=torch.int64) * 8
    words = (p.view(-1, bits) << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=p.device, dtype=torch.int64) * bits
    codes = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:numel]
