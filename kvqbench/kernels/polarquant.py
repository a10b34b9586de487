"""Fast versions of PolarQuant's per-group steps (:func:`kvqbench.quantizers.polarquant.wrap_angle`,
:func:`~kvqbench.quantizers.polarquant.group_codes` and :func:`~kvqbench.quantizers.polarquant.midpoints`;
``polarquant.c``): the angle fold in one pass in place, the group extremes and the codes of one polar component in
one pass per group, and the midpoints straight from the codes, without the padded group copies.

Each is the reference's fp32 IEEE operations in its order (add, compare; subtract, divide, floor, clamp; add ½,
multiply, add), so the results agree bit for bit on every CPU; ``tests/property/test_kernels_polarquant.py`` states the tolerance.

Scope (otherwise :data:`~kvqbench.steps.DECLINED`): a C compiler, the CPU, fp32, 1..8 bits; ``group_codes``
also declines when a group's minimum or maximum is not finite (an overflowing radius).
"""

from __future__ import annotations

import ctypes
import math

import torch

from kvqbench import steps
from kvqbench.kernels import build

__all__ = ["wrap_angle", "group_codes", "midpoints"]

TWO_PI = 2.0 * math.pi


def _lib() -> ctypes.CDLL | None:
    lib = build.load("polarquant.c")
    if lib is not None and not getattr(lib, "_kvq_typed", False):
        vp, lg, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
        lib.pq_group_codes.restype = i
        lib.pq_group_codes.argtypes = [vp, lg, lg, lg, lg, i, vp, vp, vp, vp]
        lib.pq_wrap_angle.restype = None
        lib.pq_wrap_angle.argtypes = [vp, lg, ctypes.c_float]
        lib.pq_midpoints.restype = None
        lib.pq_midpoints.argtypes = [vp, lg, lg, lg, lg, i, vp, vp, vp]
        lib._kvq_typed = True
    return lib


def _fits(v: torch.Tensor, g: int, bits: int) -> bool:
    return (v.device.type == "cpu" and v.dtype == torch.float32 and v.dim() >= 2 and v.numel() > 0
            and isinstance(g, int) and g > 0 and isinstance(bits, int) and 1 <= bits <= 8)


@steps.fast("polarquant.wrap_angle", when="CPU, fp32, contiguous; a C compiler", tol=steps.EXACT)
def wrap_angle(phi: torch.Tensor):
    """:func:`~kvqbench.quantizers.polarquant.wrap_angle` in place (``phi`` itself is returned)."""
    if not (phi.device.type == "cpu" and phi.dtype == torch.float32 and phi.is_contiguous()):
        return steps.DECLINED
    lib = _lib()
    if lib is None:
        return steps.DECLINED
    lib.pq_wrap_angle(phi.data_ptr(), phi.numel(), TWO_PI)  # ctypes rounds 2π to fp32, as torch does
    return phi


@steps.fast("polarquant.group_codes", when="CPU, fp32, 1..8 bits, finite group extremes; a C compiler",
            tol=steps.EXACT)
def group_codes(v: torch.Tensor, g: int, bits: int):
    """:func:`~kvqbench.quantizers.polarquant.group_codes`: ``(codes, mn, mx)`` of the reference's shapes."""
    if not _fits(v, g, bits):
        return steps.DECLINED
    lib = _lib()
    if lib is None:
        return steps.DECLINED
    t, p = int(v.shape[-2]), int(v.shape[-1])
    lead = tuple(int(s) for s in v.shape[:-2])
    n_mat = v.numel() // (t * p)
    vc = v.contiguous()
    codes = torch.empty(v.shape, dtype=torch.uint8)
    mn = torch.empty(*lead, -(-t // g), 1, p)
    mx = torch.empty_like(mn)
    safe = torch.empty(p)  # work buffer
    rc = lib.pq_group_codes(vc.data_ptr(), n_mat, t, p, g, bits, codes.data_ptr(), mn.data_ptr(), mx.data_ptr(),
                            safe.data_ptr())
    return (codes, mn, mx) if rc == 0 else steps.DECLINED


@steps.fast("polarquant.midpoints", when="CPU, uint8 codes, fp32 extremes of shape (…, ⌈T/g⌉, 1, P), 1..8 bits; "
            "a C compiler", tol=steps.EXACT)
def midpoints(codes: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, g: int, bits: int):
    """:func:`~kvqbench.quantizers.polarquant.midpoints`: an fp32 tensor of ``codes``' shape."""
    if not (_fits(mn, g, bits) and codes.dtype == torch.uint8 and codes.device.type == "cpu"
            and mx.dtype == torch.float32 and mx.device.type == "cpu" and codes.dim() >= 2):
        return steps.DECLINED
    t, p = int(codes.shape[-2]), int(codes.shape[-1])
    want = (*codes.shape[:-2], -(-t // g), 1, p)
    if tuple(mn.shape) != want or tuple(mx.shape) != want:
        return steps.DECLINED
    lib = _lib()
    if lib is None:
        return steps.DECLINED
    cc, lo, hi = codes.contiguous(), mn.contiguous(), mx.contiguous()
    out = torch.empty(codes.shape)
    lib.pq_midpoints(cc.data_ptr(), codes.numel() // (t * p), t, p, g, bits, lo.data_ptr(), hi.data_ptr(),
                     out.data_ptr())
    return out
