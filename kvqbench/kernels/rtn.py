"""Fast versions of the RTN steps of :mod:`kvqbench.numerics.rtn` (``rtnpack.c``): statistics, codes and bit
packing in one pass per group, and the decode straight from the packed bytes.

Each step is the same fp32 IEEE operations in the reference's order (subtract, divide, round half to even,
clamp; multiply, add), so on finite data the results agree with the reference within the tolerance of
``tests/property/test_kernels_rtn.py`` (in practice bit for bit; a code may differ by one step only where
the reference value lies within a few ulps of a rounding boundary).

Scope (otherwise :data:`~kvqbench.steps.DECLINED`): a C compiler, the CPU, fp32/fp16/bf16 input (widened
to fp32 exactly, as the reference does), 1..8 bits, and

* :class:`~kvqbench.numerics.rtn.PerToken` groups that start at whole bytes of the packed stream: a group
  size that is a multiple of 8 and divides ``head_dim``, or at least ``head_dim`` (the whole row);
* :class:`~kvqbench.numerics.rtn.PerChannel` groups of any size with ``head_dim`` a multiple of 8.

The quantize step also declines a tensor where a group holds a NaN or an infinity, its range overflows fp32
(an infinite scale), or its minimum or maximum is a zero that occurs with both signs.
"""

from __future__ import annotations

import ctypes

import torch

from kvqbench import steps
from kvqbench.kernels import build
from kvqbench.numerics.packing import packed_nbytes
from kvqbench.numerics.rtn import Granularity, PerChannel, PerToken

__all__ = ["layout", "quantize_packed", "dequantize_packed"]

#: codes per packing piece of the kernel (``PIECE`` in rtnpack.c): the size of its work buffer
_PIECE = 2048
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
#: agreement of ``rtn.quantize_packed``: a code may differ by one step where the reference's ``(x − lo)/scale``
#: lies within ``tie_ulps`` fp32 ulps of a rounding boundary ``k + ½``; ``lo`` and ``scale`` within relative ``rtol``
QUANTIZE_TOL = {"tie_ulps": 4, "rtol": 2.0**-23}
#: agreement of ``rtn.dequantize_packed``: values from the same bytes within ``rtol·(|lo| + |scale|·(2^b − 1))``
DEQUANTIZE_TOL = {"rtol": 2.0**-23}


def _lib() -> ctypes.CDLL | None:
    lib = build.load("rtnpack.c")
    if lib is not None and not getattr(lib, "_kvq_typed", False):
        vp, lg, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
        lib.rtn_pack_token.restype = i
        lib.rtn_pack_token.argtypes = [vp, lg, lg, lg, i, vp, vp, vp, vp]
        lib.rtn_pack_channel.restype = i
        lib.rtn_pack_channel.argtypes = [vp, lg, lg, lg, lg, i, vp, vp, vp, vp, vp]
        lib.rtn_decode_token.restype = i
        lib.rtn_decode_token.argtypes = [vp, lg, lg, lg, i, vp, vp, vp, vp]
        lib.rtn_decode_channel.restype = i
        lib.rtn_decode_channel.argtypes = [vp, lg, lg, lg, lg, i, vp, vp, vp, vp]
        lib._kvq_typed = True
    return lib


def layout(shape: tuple[int, ...], bits: int, granularity: Granularity) -> tuple[str, int, int, int] | None:
    """``(mode, rows, d, g)`` the kernel takes codes of ``shape`` in (``"token"``: groups of ``g`` values of each of
    ``rows`` rows of ``d``; ``"channel"``: groups of ``g`` consecutive tokens of each ``(seq_len, d)`` matrix, one
    per column, the last one partial where ``g`` does not divide seq_len), or ``None`` outside the scope (module
    doc). A per-token group longer than the row is the row (the reference pads it with copies of its last value)."""
    if len(shape) < 2 or not 1 <= bits <= 8 or any(int(s) <= 0 for s in shape):
        return None
    d = int(shape[-1])
    rows = 1
    for s in shape[:-1]:
        rows *= int(s)
    if type(granularity) is PerToken:
        g = d if granularity.group_size is None else min(int(granularity.group_size), d)
        return ("token", rows, d, g) if 0 < g and g % 8 == 0 and d % g == 0 else None
    if type(granularity) is PerChannel:
        t = int(shape[-2])
        g = t if granularity.group_size is None else int(granularity.group_size)
        return ("channel", rows, d, g) if 0 < g and d % 8 == 0 else None
    return None


@steps.fast("rtn.quantize_packed", when="CPU, fp32/fp16/bf16, 1..8 bits, per-token groups of a multiple of 8 "
            "dividing head_dim (or the whole row) or per-channel groups with head_dim a multiple of 8; finite "
            "groups without mixed-sign zero extremes; a C compiler", tol=QUANTIZE_TOL)
def quantize_packed(x: torch.Tensor, bits: int, granularity: Granularity):
    """:func:`~kvqbench.numerics.rtn.quantize_packed` in one pass per group: ``(packed, lo, scale)``, ``lo`` and
    ``scale`` fp32 of the reference's shapes."""
    lay = layout(tuple(x.shape), bits, granularity)
    if lay is None or x.dtype not in _FLOATS or x.device.type != "cpu":
        return steps.DECLINED
    lib = _lib()
    if lib is None:
        return steps.DECLINED
    mode, rows, d, g = lay
    xf = x.to(torch.float32).contiguous()
    packed = torch.empty(packed_nbytes(rows * d, bits), dtype=torch.uint8)
    if mode == "token":
        lo = torch.empty(*x.shape[:-1], d // g, 1)
        scale = torch.empty_like(lo)
        work = torch.empty(_PIECE, dtype=torch.uint8)  # held here while the kernel writes to it
        rc = lib.rtn_pack_token(xf.data_ptr(), rows, d, g, bits, lo.data_ptr(), scale.data_ptr(),
                                packed.data_ptr(), work.data_ptr())
        return (packed, lo, scale) if rc == 0 else steps.DECLINED
    t = int(x.shape[-2])
    lo = torch.empty(*x.shape[:-2], -(-t // g), 1, d)  # (…, nG, 1, D); returned as the reference's (…, D, nG, 1)
    scale = torch.empty_like(lo)
    work, tmp = torch.empty(d, dtype=torch.uint8), torch.empty(d)
    rc = lib.rtn_pack_channel(xf.data_ptr(), rows // t, t, d, g, bits, lo.data_ptr(), scale.data_ptr(),
                              packed.data_ptr(), work.data_ptr(), tmp.data_ptr())
    if rc != 0:
        return steps.DECLINED
    return packed, lo.movedim(-1, -3), scale.movedim(-1, -3)


@steps.fast("rtn.dequantize_packed", when="the layouts of rtn.quantize_packed's fast version, fp32 lo and "
            "scale of the reference's shapes, a contiguous packed buffer of the exact size; a C compiler",
            tol=DEQUANTIZE_TOL)
def dequantize_packed(packed: torch.Tensor, shape: tuple[int, ...], bits: int, lo: torch.Tensor,
                      scale: torch.Tensor, granularity: Granularity):
    """:func:`~kvqbench.numerics.rtn.dequantize_packed` straight from the packed bytes: an fp32 tensor of
    ``shape``."""
    lay = layout(tuple(shape), bits, granularity)
    on_cpu = packed.device.type == lo.device.type == scale.device.type == "cpu"
    if (lay is None or not on_cpu or lo.dtype != torch.float32 or scale.dtype != torch.float32
            or packed.dtype != torch.uint8 or packed.dim() != 1 or not packed.is_contiguous()):
        return steps.DECLINED
    mode, rows, d, g = lay
    if packed.numel() != packed_nbytes(rows * d, bits):
        return steps.DECLINED
    lib = _lib()
    if lib is None:
        return steps.DECLINED
    lead = tuple(int(s) for s in shape[:-1])
    out = torch.empty(tuple(shape))
    if mode == "token":
        want = (*lead, d // g, 1)
        if tuple(lo.shape) != want or tuple(scale.shape) != want:
            return steps.DECLINED
        lo_c, scale_c, work = lo.contiguous(), scale.contiguous(), torch.empty(_PIECE, dtype=torch.uint8)
        lib.rtn_decode_token(packed.data_ptr(), rows, d, g, bits, lo_c.data_ptr(), scale_c.data_ptr(),
                             out.data_ptr(), work.data_ptr())
        return out
    t = int(shape[-2])
    want = (*lead[:-1], d, -(-t // g), 1)
    if tuple(lo.shape) != want or tuple(scale.shape) != want:
        return steps.DECLINED
    lo_c, scale_c = lo.movedim(-3, -1).contiguous(), scale.movedim(-3, -1).contiguous()  # (…, nG, 1, D)
    work = torch.empty(d, dtype=torch.uint8)
    lib.rtn_decode_channel(packed.data_ptr(), rows // t, t, d, g, bits, lo_c.data_ptr(), scale_c.data_ptr(),
                           out.data_ptr(), work.data_ptr())
    return out
