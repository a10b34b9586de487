"""Fast versions of TurboQuant's MSE stage (:func:`kvqbench.quantizers.turboquant.encode` and
:func:`~kvqbench.quantizers.turboquant.decode`; ``turboquant.c``): each fused over blocks of 8 token rows, so a
row is read and written once instead of once per step, with the ``D × D`` rotation product accumulated in
registers (one fused multiply-add per term, in ``k`` order).

The product's summation order differs from the BLAS the reference calls, so values agree at fp32 rounding level
and codes agree except where the rotated value lies within rounding of a threshold
(``tests/property/test_kernels_turboquant.py`` states and measures both).

Scope (otherwise :data:`~kvqbench.steps.DECLINED`): a C compiler, the CPU, fp32 rows and matrices, ``D`` a
multiple of 32 up to 512, at most 255 thresholds (256 centroids); ``decode`` declines codes beyond the codebook
(the reference then raises).
"""

from __future__ import annotations

import ctypes

import torch

from kvqbench import steps
from kvqbench.kernels import build

__all__ = ["encode", "decode"]

#: agreement of ``turboquant.encode`` (``D`` = head_dim): norms within relative ``norm_rtol``, row maxima equal;
#: a code may differ where the reference's rotated value lies within ``(D + 8)·eps`` of a threshold (the forward
#: error bound of a ``D``-term fp32 dot product, plus the norm's last ulps)
ENCODE_TOL = {"norm_rtol": 2.0**-20, "eps": 2.0**-23}
#: agreement of ``turboquant.decode``: every row within ``(D + 2)·eps·‖c[idx]‖·‖x‖``
DECODE_TOL = {"eps": 2.0**-23}


def _lib() -> ctypes.CDLL | None:
    lib = build.load("turboquant.c")
    if lib is not None and not getattr(lib, "_kvq_typed", False):
        vp, lg, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
        lib.tq_encode.restype = None
        lib.tq_encode.argtypes = [vp, lg, i, vp, vp, i, vp, vp, vp]
        lib.tq_decode.restype = ctypes.c_int
        lib.tq_decode.argtypes = [vp, lg, i, vp, vp, vp, vp]
        lib._kvq_typed = True
    return lib


def _fits(d: int, *tensors: torch.Tensor) -> bool:
    return (d % 32 == 0 and 0 < d <= 512
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors))


@steps.fast("turboquant.encode", when="CPU, fp32, head_dim a multiple of 32 up to 512, ≤ 255 thresholds; "
            "a C compiler", tol=ENCODE_TOL)
def encode(x: torch.Tensor, pi_t: torch.Tensor, thresholds: torch.Tensor):
    """:func:`~kvqbench.quantizers.turboquant.encode`: ``(codes uint8 (n, D), ‖x‖ (n, 1), max|x| (n, 1))``."""
    n, d = x.shape
    if not (_fits(d, x, pi_t, thresholds) and pi_t.shape == (d, d) and thresholds.dim() == 1
            and thresholds.numel() <= 255):
        return steps.DECLINED
    lib = _lib()
    if lib is None:
        return steps.DECLINED
    xc, mt, thr = x.contiguous(), pi_t.contiguous(), thresholds.contiguous()
    codes = torch.empty(n, d, dtype=torch.uint8)
    norm, amax = torch.empty(n, 1), torch.empty(n, 1)
    lib.tq_encode(xc.data_ptr(), n, d, mt.data_ptr(), thr.data_ptr(), thr.numel(), codes.data_ptr(),
                  norm.data_ptr(), amax.data_ptr())
    return codes, norm, amax


@steps.fast("turboquant.decode", when="CPU, fp32, head_dim a multiple of 32 up to 512, ≤ 256 centroids; "
            "a C compiler", tol=DECODE_TOL)
def decode(codes: torch.Tensor, norm: torch.Tensor, pi: torch.Tensor, centroids: torch.Tensor):
    """:func:`~kvqbench.quantizers.turboquant.decode`: ``(n, D)`` fp32."""
    n, d = codes.shape
    if not (_fits(d, norm, pi, centroids) and codes.dtype == torch.uint8 and codes.device.type == "cpu"
            and pi.shape == (d, d) and centroids.dim() == 1 and 0 < centroids.numel() <= 256
            and norm.numel() == n):
        return steps.DECLINED
    lib = _lib()
    if lib is None:
        return steps.DECLINED
    table = torch.zeros(256)
    table[: centroids.numel()] = centroids
    cc, nc, mi = codes.contiguous(), norm.contiguous(), pi.contiguous()
    out = torch.empty(n, d)
    top = lib.tq_decode(cc.data_ptr(), n, d, mi.data_ptr(), table.data_ptr(), nc.data_ptr(), out.data_ptr())
    return out if top < centroids.numel() else steps.DECLINED  # a code beyond the codebook: the reference raises
