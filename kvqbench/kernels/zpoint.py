"""Fast versions of ``zpoint.quantize`` and ``zpoint.dequantize``: groupwise asymmetric RTN with an integer
zero-point fused with the bit packing of its codes, and its decode
(:func:`kvqbench.numerics.zpoint.quantize_groups` / :func:`~kvqbench.numerics.zpoint.dequantize_groups`).

One pass per row (``c/zpoint.c``) instead of the reference's whole-tensor operations (group minima and
maxima, parameters, divide, round, shift, clamp, cast, bit packing; decode: unpack, shift, scale). The same
IEEE fp32 operations in the same order per element; the group minimum and maximum are taken in any order, so
a zero there may carry the other sign (the same value). Agreement with the reference:
``tests/property/test_kernels_zpoint.py``.
"""

from __future__ import annotations

import ctypes

import torch

from kvqbench import steps
from kvqbench.kernels import build
from kvqbench.numerics.packing import packed_nbytes

#: agreement of ``zpoint.quantize``: a code (and an integer zero-point) may differ by one where the reference's
#: quotient lies within ``tie_ulps`` fp32 ulps of a rounding boundary; scales within relative ``rtol``
QUANTIZE_TOL = {"tie_ulps": 4, "rtol": 1e-6}
#: agreement of ``zpoint.dequantize``: values within ``|scale|·|Δcode| + rtol·|value|``
DEQUANTIZE_TOL = {"rtol": 1e-6}
_WHEN = ("CPU, fp32, contiguous rows of head_dim d, groups of g | d with g a multiple of 8, 1..8 bits, "
         "the C kernel loads")


def _lib() -> ctypes.CDLL | None:
    lib = build.load("zpoint.c")
    if lib is not None and not getattr(lib, "_kvq_typed", False):
        vp, lg = ctypes.c_void_p, ctypes.c_long
        lib.zp_quantize_pack.restype = ctypes.c_int
        lib.zp_quantize_pack.argtypes = [vp, lg, lg, lg, ctypes.c_int, ctypes.c_float, ctypes.c_int,
                                         vp, vp, vp, vp, vp, vp]
        lib.zp_decode.restype = ctypes.c_int
        lib.zp_decode.argtypes = [vp, lg, lg, lg, ctypes.c_int, vp, vp, vp, vp]
        lib._kvq_typed = True
    return lib


def _applies(d: int, g: int, bits: int, t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and d > 0
            and 0 < g <= d and g % 8 == 0 and d % g == 0 and 1 <= bits <= 8)


@steps.fast("zpoint.quantize", when=_WHEN + "; a NaN or an infinity declines", tol=QUANTIZE_TOL)
def quantize_groups(xr: torch.Tensor, group_size: int, bits: int, *, include_zero: bool, clip_ratio: float):
    d = int(xr.shape[-1]) if xr.dim() else 0
    if not _applies(d, group_size, bits, xr) or xr.numel() == 0:
        return steps.DECLINED
    lib = _lib()
    if lib is None:
        return steps.DECLINED
    rows, ng = xr.numel() // d, d // group_size
    lo, hi, scale, zero = (torch.empty(*xr.shape[:-1], ng, 1) for _ in range(4))
    packed = torch.empty(packed_nbytes(xr.numel(), bits), dtype=torch.uint8)
    work = torch.empty(d, dtype=torch.uint8)
    rc = lib.zp_quantize_pack(xr.data_ptr(), rows, d, group_size, int(bool(include_zero)),
                              ctypes.c_float(clip_ratio), bits, lo.data_ptr(), hi.data_ptr(), scale.data_ptr(),
                              zero.data_ptr(), packed.data_ptr(), work.data_ptr())
    return (packed, scale, zero) if rc == 0 else steps.DECLINED


@steps.fast("zpoint.dequantize", when=_WHEN + "; per-group fp32 scale and zero of the codes' shape",
            tol=DEQUANTIZE_TOL)
def dequantize_groups(packed: torch.Tensor, shape: tuple[int, ...], group_size: int, bits: int,
                      scale: torch.Tensor, zero: torch.Tensor):
    d = int(shape[-1]) if len(shape) else 0
    numel = int(torch.Size(shape).numel())
    if not (d and numel and _applies(d, group_size, bits, scale) and _applies(d, group_size, bits, zero)):
        return steps.DECLINED
    per_group = (*shape[:-1], d // group_size, 1)
    if (tuple(scale.shape) != per_group or tuple(zero.shape) != per_group or packed.dtype != torch.uint8
            or packed.device.type != "cpu" or not packed.is_contiguous()
            or packed.numel() != packed_nbytes(numel, bits)):
        return steps.DECLINED
    lib = _lib()
    if lib is None:
        return steps.DECLINED
    out = torch.empty(shape, dtype=torch.float32)
    work = torch.empty(group_size, dtype=torch.uint8)
    rc = lib.zp_decode(packed.data_ptr(), numel // d, d, group_size, bits, scale.data_ptr(), zero.data_ptr(),
                       out.data_ptr(), work.data_ptr())
    return out if rc == 0 else steps.DECLINED
