"""Compiled groupwise asymmetric RTN with an integer zero-point, fused with bit packing, and its decode.

One pass per row of a cache-sized block (``zpoint.c``, built on first use by :mod:`kvqbench.numerics.cbuild`)
instead of the ~20 whole-block torch operations of the same arithmetic: group minima and maxima, the
parameters, the codes and their bytes of the packed stream (:func:`kvqbench.numerics.packing.pack_bits`'
layout); decode: unpack, ``scale · (q − z)``. Per group ``x`` of ``g`` values::

    lo, hi = min x, max x                          (include_zero: lo = min(lo, 0), hi = max(hi, 0))
    scale = (hi·clip − lo·clip) / (2^b − 1)
    zero = round(−lo·clip / scale)                 (round half to even)
    scale ≤ 0 (a constant group): scale = |lo|, zero = 1 if lo < 0 else 0
    q = clamp(round(x / s) + zero, 0, 2^b − 1)      (s = scale, or +inf where scale ≤ 0)

each step one fp32 IEEE operation, in this order (no fused multiply-add). These are building blocks: the
caller owns the method's torch code and checks these functions' bits against it before relying on them
(e.g. :mod:`kvqbench.quantizers.quarot`). Both return ``False`` (nothing usable written) where the kernel
is unavailable (no C compiler, ``KVQBENCH_KERNELS=0``: :mod:`kvqbench.numerics.cbuild`) or the inputs are
outside what it handles; :func:`quantize_pack_rows` also where a group's minimum or maximum is a zero (its
sign would depend on the order of the comparisons) or a row holds a NaN or an infinity.
"""

from __future__ import annotations

import ctypes

import torch

from kvqbench.kernels import build as cbuild
from kvqbench.numerics.packing import packed_nbytes

__all__ = ["available", "supports", "quantize_pack_rows", "decode_rows"]


def _lib() -> ctypes.CDLL | None:
    lib = cbuild.load("zpoint.c")
    if lib is not None and not getattr(lib, "_kvq_typed", False):
        vp, lg = ctypes.c_void_p, ctypes.c_long
        lib.zp_quantize_pack.restype = ctypes.c_int
        lib.zp_quantize_pack.argtypes = [vp, lg, lg, lg, ctypes.c_int, ctypes.c_float, ctypes.c_int,
                                         vp, vp, vp, vp, vp, vp]
        lib.zp_decode.restype = ctypes.c_int
        lib.zp_decode.argtypes = [vp, lg, lg, lg, ctypes.c_int, vp, vp, vp, vp]
        lib._kvq_typed = True
    return lib


def available() -> bool:
    """Whether the compiled kernel can be used in this process (:mod:`kvqbench.numerics.cbuild`)."""
    return _lib() is not None


def supports(d: int, g: int, bits: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether rows of ``d`` fp32 values in groups of ``g`` at ``bits`` bits are within the kernel's scope: CPU,
    ``torch.float32``, ``g`` a multiple of 8 (every group starts at a byte of the packed stream) dividing ``d``,
    ``bits`` 1..8."""
    return (device.type == "cpu" and dtype == torch.float32 and 0 < g <= d and g % 8 == 0 and d % g == 0
            and 1 <= bits <= 8)


def _fits(t: torch.Tensor, numel: int, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() and t.numel() == numel


def _ready(t: torch.Tensor, g: int, bits: int, params: tuple[torch.Tensor, ...], packed: torch.Tensor):
    """``(rows, d, lib)`` when the kernels take the contiguous ``[rows, d]`` tensor ``t`` with its per-group
    fp32 ``params`` and ``packed`` bytes, else ``None``."""
    if t.dim() != 2 or not t.is_contiguous() or not supports(int(t.shape[1]), g, bits, t.dtype, t.device):
        return None
    rows, d = (int(n) for n in t.shape)
    ng = rows * (d // g)
    if not (all(_fits(p, ng, torch.float32) for p in params)
            and _fits(packed, packed_nbytes(rows * d, bits), torch.uint8)):
        return None
    lib = _lib()
    return None if lib is None else (rows, d, lib)


def quantize_pack_rows(x: torch.Tensor, g: int, bits: int, *, include_zero: bool, clip: float,
                       lo: torch.Tensor, hi: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                       packed: torch.Tensor) -> bool:
    """Quantize the rows ``x`` ``[rows, d]`` (contiguous fp32, CPU) in groups of ``g`` (module doc) and pack
    the codes. Writes the raw group minima ``lo`` and maxima ``hi``, ``scale`` and ``zero`` (each ``rows·d/g``
    contiguous fp32 values, row-major) and the ``rows·d·bits/8`` bytes of ``packed`` (contiguous ``uint8``).

    Returns ``True`` when done; ``False`` when the kernel does not apply (module doc: nothing usable written;
    the outputs may be partly overwritten, the caller recomputes them)."""
    ready = _ready(x, g, bits, (lo, hi, scale, zero), packed)
    if ready is None:
        return False
    rows, d, lib = ready
    work = torch.empty(d, dtype=torch.uint8)  # held here while the kernel writes to it
    return lib.zp_quantize_pack(x.data_ptr(), rows, d, g, int(bool(include_zero)), ctypes.c_float(clip), bits,
                                lo.data_ptr(), hi.data_ptr(), scale.data_ptr(), zero.data_ptr(), packed.data_ptr(),
                                work.data_ptr()) == 0


def decode_rows(packed: torch.Tensor, g: int, bits: int, scale: torch.Tensor, zero: torch.Tensor,
                out: torch.Tensor) -> bool:
    """``out`` ``[rows, d]`` (contiguous fp32, CPU) ``= (q − zero) · scale`` per group of ``g``, the codes ``q``
    unpacked from the ``rows·d·bits/8`` bytes of ``packed`` (``scale``, ``zero``: ``rows·d/g`` contiguous fp32
    values). Returns ``False`` (``out`` untouched) where the kernel does not apply."""
    ready = _ready(out, g, bits, (scale, zero), packed)
    if ready is None:
        return False
    rows, d, lib = ready
    work = torch.empty(g, dtype=torch.uint8)  # held here while the kernel writes to it
    return lib.zp_decode(packed.data_ptr(), rows, d, g, bits, scale.data_ptr(), zero.data_ptr(), out.data_ptr(),
                         work.data_ptr()) == 0
