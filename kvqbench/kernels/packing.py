"""Fast versions of the packing steps of :mod:`kvqbench.numerics.packing` (``packbits.c``: one pass over the codes
instead of several torch passes; the same LSB-first stream, ``kvq_pack.h``).

Packing is integer work, so a fast version gives the reference's bytes exactly (property test:
``tests/property/test_kernels_packing.py``). Both decline below :data:`MIN_CODES` codes (the call's own cost
outweighs the torch passes there), off the CPU, or without a C compiler.
"""

from __future__ import annotations

import ctypes

import torch

from kvqbench import steps
from kvqbench.kernels import build
from kvqbench.numerics.packing import pack_uint8, packed_nbytes, unpack_uint8

__all__ = ["MIN_CODES", "pack", "unpack"]

#: fewer codes than this run the torch passes
MIN_CODES = 4096


def _lib() -> ctypes.CDLL | None:
    lib = build.load("packbits.c")
    if lib is not None and not getattr(lib, "_kvq_typed", False):
        for fn in (lib.kvq_pack, lib.kvq_unpack):
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p]
        lib._kvq_typed = True
    return lib


@steps.fast("packing.pack", when=f"CPU, at least {MIN_CODES} codes, a C compiler", tol=steps.EXACT)
def pack(flat: torch.Tensor, bits: int, out: torch.Tensor | None = None):
    """:func:`~kvqbench.numerics.packing.pack_uint8` in one pass (the last ``n mod 8`` codes by the reference)."""
    n = flat.numel()
    if flat.device.type != "cpu" or n < MIN_CODES or flat.dtype != torch.uint8:
        return steps.DECLINED
    lib = _lib()
    if lib is None:
        return steps.DECLINED
    flat = flat.contiguous()
    res = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8) if out is None else out
    n8 = n - n % 8  # whole bytes of the stream at every width
    lib.kvq_pack(flat.data_ptr(), n8, bits, res.data_ptr())
    if n8 < n:
        pack_uint8.reference(flat[n8:], bits, res[n8 * bits // 8:])
    return res


@steps.fast("packing.unpack", when=f"CPU, uint8 bytes, at least {MIN_CODES} codes of 1..7 bits, a C compiler",
            tol=steps.EXACT)
def unpack(p: torch.Tensor, bits: int, numel: int):
    """:func:`~kvqbench.numerics.packing.unpack_uint8` in one pass (the last ``numel mod 8`` codes by the
    reference)."""
    if p.device.type != "cpu" or p.dtype != torch.uint8 or numel < MIN_CODES or bits == 8:
        return steps.DECLINED
    lib = _lib()
    if lib is None:
        return steps.DECLINED
    p = p[: packed_nbytes(numel, bits)].contiguous()
    codes = torch.empty(numel, dtype=torch.uint8)
    n8 = numel - numel % 8
    lib.kvq_unpack(p.data_ptr(), n8, bits, codes.data_ptr())
    if n8 < numel:
        codes[n8:] = unpack_uint8.reference(p[n8 * bits // 8:], bits, numel - n8)
    return codes
